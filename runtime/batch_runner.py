"""Many requests at once through a session's target, draft, budget and acceptance policy: the batched
decoder's slots, and the text, stop strings and report of each answer (what run_batch's generate_many
needs)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from spec import DecodeRequest
from .batch import BatchItem, Job
from .session import Session
from .stop import StopStrings

OnDone = Callable[[BatchItem, "tuple[str, dict] | str"], None]


class BatchRunner:
    def __init__(self, session: Session, default_stop: list[str] | None = None) -> None:
        self.session, self.default_stop = session, default_stop
        self.decoder = session.decoder
        self.num_new_tokens = 0
        self.policy_accepted = 0          # tokens a lossy acceptance policy (the judge) took against the target
        self.started = time.perf_counter()
        self.on_update: Callable[[], None] | None = None     # called at most twice a second while decoding
        self._updated = 0.0

    @property
    def num_in_flight(self) -> int:
        return self.decoder.num_in_flight

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / max(time.perf_counter() - self.started, 1e-9)

    def generate_many(self, jobs: list[Job], on_done: OnDone) -> None:
        """Answers every job, its line written by on_done as it ends; a job whose prompt cannot be encoded
        or run gets its error message."""
        self.started = time.perf_counter()

        def finish(request: DecodeRequest, result, error: str | None) -> None:
            item, stops = request.tag
            if error is not None:
                on_done(item, error)
                return
            self.policy_accepted += result.stats.policy_accepted
            text = self.session.tokenizer.decode(result.token_ids)
            text = stops.trim(text) if stops else text
            on_done(item, (text, self.session.report(text, result)))

        self.decoder.run(self._requests(jobs, on_done), finish)

    def _requests(self, jobs: list[Job], on_done: OnDone) -> Iterator[DecodeRequest]:
        for item, sampling, max_tokens in jobs:
            strings = item.stop if item.stop is not None else self.default_stop
            try:
                prompt_ids = self.session.encode(item.messages)
                stops = StopStrings(self.session.tokenizer, strings) if strings else None
            except ValueError as err:
                on_done(item, str(err))
                continue
            yield DecodeRequest(prompt_ids, sampling, max_tokens, stops, self._count, tag=(item, stops))

    def _count(self, ids: list[int]) -> None:
        self.num_new_tokens += len(ids)
        if self.on_update and time.perf_counter() - self._updated > 0.5:
            self._updated = time.perf_counter()
            self.on_update()

