"""The engine worker against a stand-in decoder (one letter per pass per request, no model): requests beyond
the slots wait, beyond the queue are refused, a cancelled request leaves its slot at the next pass, a pass
that raises fails only the requests in it, and stop() ends every request with its reason."""
import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from server.worker import EngineWorker, Failed, Finished, Job, Refused
from spec import DecodeResult, DecodeStats, SamplingConfig


class Letters:
    """A tokenizer whose token t is the character chr(t)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


class StandInDecoder:
    """Decoder's interface as the worker uses it; each pass gives every active request its next letter."""

    def __init__(self, slots: int, fail_on_pass: int | None = None, pass_seconds: float = 0.005) -> None:
        self.config = SimpleNamespace(max_slots=slots)
        self.free, self.active, self.num_passes = list(range(slots)), [], 0
        self.fail_on_pass, self.pass_seconds = fail_on_pass, pass_seconds
        self.thread_ids: set[int] = set()

    def admit(self, request, on_finish) -> bool:
        self.thread_ids.add(threading.get_ident())
        if not self.free:
            return False
        self.active.append((request, self.free.pop(0), []))
        return True

    def step(self, on_finish) -> None:
        self.num_passes += 1
        time.sleep(self.pass_seconds)
        if self.num_passes == self.fail_on_pass:
            raise RuntimeError("a pass went wrong")
        for entry in list(self.active):
            request, slot, ids = entry
            ids.append(ord("a") + len(ids) % 26)
            request.on_tokens(ids[-1:])
            if len(ids) == request.max_new_tokens or (request.stop and request.stop.reached(ids)):
                self.active.remove(entry)
                self.free.append(slot)
                stats = DecodeStats(num_prompt_tokens=len(request.prompt_ids), num_new_tokens=len(ids),
                                    stop_reason="length" if len(ids) == request.max_new_tokens else "stop_string")
                on_finish(request, DecodeResult(ids, stats), None)

    def cancel(self, tag) -> bool:
        for entry in self.active:
            if entry[0].tag is tag:
                self.active.remove(entry)
                self.free.append(entry[1])
                return True
        return False

    def abandon(self) -> None:
        self.free += [slot for _, slot, _ in self.active]
        self.active = []


def job(tokens: int, stop: list[str] | None = None) -> Job:
    return Job([1, 2, 3], SamplingConfig(), tokens, stop or [])


def run(scenario, decoder: StandInDecoder, max_queue: int = 1):
    worker = EngineWorker(decoder, Letters(), max_queue)
    worker.start()
    try:
        return asyncio.run(scenario(worker))
    finally:
        worker.stop("test over")
        worker.join(5)


def test_requests_beyond_the_slots_wait_and_beyond_the_queue_are_refused():
    decoder = StandInDecoder(slots=2)

    async def scenario(worker):
        tickets = [worker.submit(job(5)) for _ in range(3)]
        with pytest.raises(Refused, match="--max-queue") as refused:
            worker.submit(job(5))
        assert refused.value.status == 429
        return [await ticket.outcome() for ticket in tickets]

    outcomes = run(scenario, decoder)
    assert outcomes == [Finished("abcde", "length", 3, 5)] * 3
    assert decoder.num_passes == 10 and decoder.thread_ids != {threading.get_ident()}


def test_text_arrives_as_deltas_and_never_shows_a_stop_string():
    streamed = []

    async def streaming(worker):
        ticket = worker.submit(job(10, stop=["cd"]))
        while isinstance(event := await ticket.events.get(), str):
            streamed.append(event)
        return event

    outcome = run(streaming, StandInDecoder(slots=1))
    assert (outcome.text, outcome.finish_reason) == ("ab", "stop") and "".join(streamed) == "ab"


def test_a_cancelled_request_leaves_its_slot_at_the_next_pass():
    decoder = StandInDecoder(slots=1)

    async def scenario(worker):
        long = worker.submit(job(10_000))
        assert isinstance(await long.events.get(), str)       # running
        waiting = worker.submit(job(3))
        worker.cancel(long)
        return await waiting.outcome(), worker.status()

    outcome, status = run(scenario, decoder)
    assert outcome.text == "abc" and status["running"] == 0 and decoder.num_passes < 50


def test_a_failing_pass_fails_its_requests_and_the_next_one_is_served():
    async def scenario(worker):
        first = await worker.submit(job(5)).outcome()
        return first, await worker.submit(job(2)).outcome()

    first, second = run(scenario, StandInDecoder(slots=2, fail_on_pass=2))
    assert first.status == 500 and "a pass went wrong" in first.message
    assert second == Finished("ab", "length", 3, 2)


def test_stop_ends_running_and_waiting_requests_with_its_reason():
    async def scenario(worker):
        running, waiting = worker.submit(job(10_000)), worker.submit(job(5))
        await running.events.get()
        worker.stop("shutting down")
        outcomes = (await running.outcome(), await waiting.outcome())
        with pytest.raises(Refused) as refused:
            worker.submit(job(1))
        return outcomes, refused.value.status

    outcomes, status = run(scenario, StandInDecoder(slots=1))
    assert outcomes == (Failed(503, "shutting down"), Failed(503, "shutting down")) and status == 503
