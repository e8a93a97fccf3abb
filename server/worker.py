"""The engine worker: one thread owns the session's decoder. It takes requests from a bounded queue, admits
each when a slot is free, runs one target pass over every active request while any is active (continuous
batching: a request joins the running batch between passes), and hands each request's text to its HTTP
handler through the handler's asyncio queue (loop.call_soon_threadsafe: the worker never waits on HTTP).
A request whose client went away is cancelled between passes, so its slot is free within one pass."""
from __future__ import annotations

import asyncio
import threading
import traceback
from collections import deque
from dataclasses import dataclass, field

from spec import Decoder, DecodeRequest, DecodeResult, SamplingConfig
from runtime.stop import HeldBackText, StopStrings
from offload import StreamDecoder, Tokenizer

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length", "context": "length"}


@dataclass(slots=True)
class Job:
    prompt_ids: list[int]
    sampling: SamplingConfig
    max_tokens: int
    stop: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Finished:
    text: str                   # the whole answer, ending before its first stop string
    finish_reason: str          # OpenAI's: "stop" or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Failed:
    status: int                 # the HTTP status a response not yet started gets
    message: str


class Refused(Exception):
    """A request the worker does not queue: 429 (the queue is full) or 503 (the server is stopping)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Ticket:
    """One request's way back to its handler: text deltas (str), then one Finished or Failed, on an asyncio
    queue of the handler's event loop. Events are put from the worker thread."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        self.job, self.loop = job, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.is_done = False
        self.text: TextStream | None = None

    def post(self, event: str | Finished | Failed) -> None:
        if isinstance(event, (Finished, Failed)):
            self.is_done = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:        # the loop is closed: the server has stopped and nobody waits for this
            return

    async def outcome(self) -> Finished | Failed:
        """Waits past the deltas for the end (a non-streamed response reads only this)."""
        while not isinstance(event := await self.events.get(), (Finished, Failed)):
            pass
        return event


class TextStream:
    """A request's answer as text increments: complete UTF-8 only, never a stop string or its start."""

    def __init__(self, tokenizer: Tokenizer, ticket: Ticket) -> None:
        self.tokenizer, self.ticket = tokenizer, ticket
        self.stops = StopStrings(tokenizer, ticket.job.stop) if ticket.job.stop else None
        self.decoder = StreamDecoder(tokenizer)
        self.shown = HeldBackText(self.stops.strings if self.stops else [], self._post)

    def _post(self, delta: str) -> None:
        if delta:
            self.ticket.post(delta)

    def push(self, ids: list[int]) -> None:
        self.shown.push(self.decoder.push(ids))

    def finish(self, result: DecodeResult) -> Finished:
        text = self.tokenizer.decode(result.token_ids)
        text = self.stops.trim(text) if self.stops else text
        self.shown.finish(text)
        stats = result.stats
        return Finished(text, FINISH_REASONS.get(stats.stop_reason, "stop"), stats.num_prompt_tokens,
                        stats.num_new_tokens)


class EngineWorker:
    def __init__(self, decoder: Decoder, tokenizer: Tokenizer, max_queue: int) -> None:
        self.decoder, self.tokenizer, self.max_queue = decoder, tokenizer, max_queue
        self.waiting: deque[Ticket] = deque()
        self.cancelled: list[Ticket] = []
        self.running: set[Ticket] = set()
        self.stopping = ""                 # why the worker stops ("" while it runs)
        self.changed = threading.Condition()
        self.num_steps = self.num_step_tokens = self.num_requests = 0
        self.thread = threading.Thread(target=self._loop, name="specstream-engine", daemon=True)

    # --- the HTTP side (the event loop's thread) ---------------------------------------------------------
    def submit(self, job: Job) -> Ticket:
        """Queues a request -> its ticket; Refused when max_queue requests already wait for a slot."""
        ticket = Ticket(job, asyncio.get_running_loop())
        with self.changed:
            if self.stopping:
                raise Refused(503, self.stopping)
            slots = self.decoder.config.max_slots
            if len(self.waiting) + len(self.running) >= slots + self.max_queue:
                raise Refused(429, f"all {slots} slots are busy and {self.max_queue} requests wait for one (the "
                                   "server's --max-queue); retry later")
            self.waiting.append(ticket)
            self.changed.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: a waiting request leaves the queue, a running one its slot after this pass."""
        with self.changed:
            if ticket in self.waiting:
                self.waiting.remove(ticket)
            elif not ticket.is_done:
                self.cancelled.append(ticket)
                self.changed.notify()

    def stop(self, reason: str) -> None:
        """Every waiting and running request ends with `reason` (503) after the pass in progress."""
        with self.changed:
            self.stopping = self.stopping or reason
            self.changed.notify()

    def status(self) -> dict:
        with self.changed:
            return {"slots": self.decoder.config.max_slots, "running": len(self.running),
                    "waiting": len(self.waiting), "max_queue": self.max_queue, "requests": self.num_requests,
                    "tokens_per_pass": round(self.num_step_tokens / self.num_steps, 3) if self.num_steps else None}

    # --- the engine thread -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.changed:
                while not (self.stopping or self.waiting or self.cancelled or self.running):
                    self.changed.wait()
                if self.stopping:
                    break
                cancelled, self.cancelled = self.cancelled, []
                admitted = [self.waiting.popleft() for _ in range(min(len(self.waiting), len(self.decoder.free)))]
                self.running.update(admitted)
            for ticket in cancelled:
                if self.decoder.cancel(ticket):
                    self.running.discard(ticket)
            for ticket in admitted:
                self._admit(ticket)
            if self.running:
                self._step()
        self._fail_all(Failed(503, self.stopping))

    def _admit(self, ticket: Ticket) -> None:
        job = ticket.job
        try:
            ticket.text = TextStream(self.tokenizer, ticket)
            request = DecodeRequest(job.prompt_ids, job.sampling, job.max_tokens, ticket.text.stops,
                                    ticket.text.push, tag=ticket)
            self.decoder.admit(request, self._finish)
        except Exception as err:    # this request fails, not the engine thread
            traceback.print_exc()
            self.running.discard(ticket)
            ticket.post(Failed(500, f"the request could not start: {type(err).__name__}: {err}"))

    def _finish(self, request: DecodeRequest, result: DecodeResult | None, error: str | None) -> None:
        ticket = request.tag
        self.running.discard(ticket)
        if error is not None:
            ticket.post(Failed(400, error))
            return
        self.num_requests += 1
        self.num_steps += result.stats.num_steps
        self.num_step_tokens += max(result.stats.num_new_tokens - 1, 0)
        ticket.post(ticket.text.finish(result))

    def _step(self) -> None:
        try:
            self.decoder.step(self._finish)
        except Exception as err:    # one bad pass fails the requests in it; the server keeps serving
            traceback.print_exc()
            self.decoder.abandon()
            failed, self.running = self.running, set()
            for ticket in failed:
                ticket.post(Failed(500, f"the engine failed during a pass: {type(err).__name__}: {err}"))

    def _fail_all(self, failure: Failed) -> None:
        self.decoder.abandon()
        with self.changed:
            tickets = list(self.waiting) + list(self.running)
            self.waiting.clear()
        self.running = set()
        for ticket in tickets:
            ticket.post(failure)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)
