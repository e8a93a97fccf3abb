"""The decode loop, for one sequence and for many: every target pass packs, back to back into one [1, N] pass,
each decoding sequence's tree (its last token alone without a draft: autoregressive decoding) and chunks of
joining prompts, within max_pass_tokens. The slot cache and a block mask keep each token to its own sequence's
keys, so a sequence's answer does not depend on its neighbours (the same position-keyed draws from its own seed,
the same penalties, stop checks token by token). Finished sequences leave after the pass that ends them and
waiting requests take their slots (continuous batching). One sequence is a batch of one: `generate` runs a
single request through the same loop, on a slot that keeps its keys for the next turn (prefix reuse).
"""
from __future__ import annotations

import time
from collections.abc import Iterable

from offload import DecoderModel
from offload.model.slots import SlotCache
from .pass_parts import PassBuilder, Sequence
from .requests import (BudgetPolicy, DecodeConfig, DecodeRequest, DecodeResult, FinishCallback, FixedBudget,
                       StopCondition, TokenCallback, common_prefix, request_problem)
from .sampling import SamplingConfig, make_draws
from .speculator import Speculator
from .verify import AcceptancePolicy, ExactMatch


class Decoder:
    def __init__(self, target: DecoderModel, stop_ids: set[int], config: DecodeConfig,
                 speculator: Speculator | None = None, budget: BudgetPolicy | None = None,
                 policy: AcceptancePolicy | None = None) -> None:
        self.target, self.stop_ids, self.config = target, set(stop_ids), config
        self.speculator, self.budget = speculator, budget or FixedBudget(1)
        self.policy = policy or ExactMatch()
        rows = config.max_context + (speculator.shared_cache_rows if speculator else 0)
        self.cache = SlotCache(target.config, config.max_slots, rows, target.device, target.cache_dtype)
        if speculator:
            speculator.bind(self.cache)
        self.slot_ids: list[list[int]] = [[] for _ in range(config.max_slots)]   # committed tokens per slot
        self.active: list[Sequence] = []
        self.free = list(range(config.max_slots))
        self.num_passes = 0

    @property
    def num_in_flight(self) -> int:
        return len(self.active)

    def reset(self) -> None:
        """Forgets every slot's kept keys (the next prompt is prefilled whole)."""
        for slot in range(self.config.max_slots):
            self._clear(slot)

    # --- one sequence -----------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], sampling: SamplingConfig, on_tokens: TokenCallback | None = None,
                 stop: StopCondition | None = None) -> DecodeResult:
        """The answer to `prompt_ids` (config.max_new_tokens at most): it ends at a stop token, at `stop`, at
        max_new_tokens or at the end of the context, exactly where one-token decoding would end it. The slot
        keeps its keys: a next prompt that extends this one prefills only what is new."""
        request = DecodeRequest(prompt_ids, sampling, self.config.max_new_tokens, stop, on_tokens, keep_cache=True)
        answers: list[tuple[DecodeResult | None, str | None]] = []
        self.run([request], lambda _, result, error: answers.append((result, error)))
        result, error = answers[0]
        if error is not None:
            raise ValueError(error)
        return result

    # --- many sequences ---------------------------------------------------------------------------------
    def run(self, requests: Iterable[DecodeRequest], on_finish: FinishCallback) -> None:
        """Answers every request; on_finish(request, result, None) as each ends (in completion order), or
        on_finish(request, None, message) for a request that cannot run (nothing generated). Ctrl-C (or any
        error) mid-pass leaves every slot holding committed tokens only."""
        waiting = iter(requests)
        try:
            while True:
                while self.free and (request := next(waiting, None)) is not None:
                    self.admit(request, on_finish)
                if not self.active:
                    return
                self.step(on_finish)
        except BaseException:
            self.abandon()
            raise

    def admit(self, request: DecodeRequest, on_finish: FinishCallback) -> bool:
        """Starts `request` in a free slot -> False if none is free; a request that cannot run is answered
        with its problem at once (and True: it took no slot)."""
        problem = request_problem(request, self.config.max_context)
        if problem:
            on_finish(request, None, problem)
            return True
        if not self.free:
            return False
        slot = self._choose_slot(request)
        self.free.remove(slot)
        reused = self._reuse(slot, request.prompt_ids) if request.keep_cache else self._clear(slot)
        sequence = Sequence(request, slot, make_draws(request.sampling), time.perf_counter(), self.slot_ids[slot])
        sequence.num_prefilled = reused
        stats = sequence.result.stats
        stats.num_prompt_tokens, stats.num_reused_tokens = len(request.prompt_ids), reused
        stats.speculative = self.speculator is not None
        self.active.append(sequence)
        return True

    def step(self, on_finish: FinishCallback) -> None:
        """One target pass over every active sequence; the sequences it finishes leave (on_finish each)."""
        PassBuilder(self).run(self.active)
        self.num_passes += 1
        for sequence in [s for s in self.active if s.is_finished]:
            self.active.remove(sequence)
            self.free.append(sequence.slot)
            if not sequence.request.keep_cache:
                self._clear(sequence.slot)
            sequence.result.stats.seconds = time.perf_counter() - sequence.started
            on_finish(sequence.request, sequence.result, None)

    def cancel(self, tag: object) -> bool:
        """Ends the active request with this tag between passes (a client that went away) -> found."""
        for sequence in self.active:
            if sequence.request.tag is tag:
                self.active.remove(sequence)
                self.free.append(sequence.slot)
                self._clear(sequence.slot)
                return True
        return False

    def abandon(self) -> None:
        """After an interrupted pass: every active sequence stops; slots keep committed tokens only (where an
        interrupt fell between a commit and its bookkeeping, the slot starts over)."""
        for sequence in self.active:
            sequence.result.stats.stop_reason = "interrupted"
            sequence.result.stats.seconds = time.perf_counter() - sequence.started
            slot = sequence.slot
            if len(self.slot_ids[slot]) != self.cache.lengths[slot] or not sequence.request.keep_cache:
                self._clear(slot)
            else:
                self.cache.truncate(slot, self.cache.lengths[slot])
                if self.speculator:
                    self.speculator.discard_pending(slot)
            self.free.append(slot)
        self.active = []
        self.free.sort()

    # --- slots ------------------------------------------------------------------------------------------
    def _choose_slot(self, request: DecodeRequest) -> int:
        """The free slot whose kept tokens share the longest prefix with a prompt that reuses them, else the
        first free one."""
        if not request.keep_cache:
            return self.free[0]
        return max(self.free, key=lambda slot: (common_prefix(self.slot_ids[slot], request.prompt_ids), -slot))

    def _reuse(self, slot: int, prompt_ids: list[int]) -> int:
        """Keeps the slot's longest committed prefix of the prompt -> its length (at least one prompt token is
        left to pass, for the logits of the answer's first token)."""
        common = min(common_prefix(self.slot_ids[slot], prompt_ids), len(prompt_ids) - 1)
        self.cache.truncate(slot, common)
        del self.slot_ids[slot][common:]
        return common

    def _clear(self, slot: int) -> int:
        self.cache.truncate(slot, 0)
        self.slot_ids[slot].clear()
        if self.speculator:
            self.speculator.release(slot)
        return 0
