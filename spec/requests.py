"""What the decode loop is asked and what it answers: its configuration, a request, a result, the tree-size
policies it consults, and the rule that cuts a step's tokens where one-token decoding would have stopped."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .grow import MAX_CHILDREN, MAX_DEPTH, GrowthConfig
from .sampling import SamplingConfig
from .stats import DecodeStats


@dataclass(slots=True)
class DecodeConfig:
    max_new_tokens: int = 256       # `generate`'s answer length (a request carries its own)
    max_context: int = 4096         # per sequence
    max_pass_tokens: int = 512      # all sequences' tokens in one pass (prefill chunks, trees): the engine's workspace
    max_width: int | None = None    # tree growth (see GrowthConfig)
    max_children: int = MAX_CHILDREN
    max_depth: int = MAX_DEPTH
    max_slots: int = 1              # sequences decoded together (KV cache slots)
    # Growth scores at the request's temperature, and at this one for a greedy request (None: the draft's own
    # log-probabilities, temperature 1): a self-draft's (spec/self_speculator.py).
    greedy_growth_temperature: float | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max-new-tokens must be positive, got {self.max_new_tokens}")
        if self.max_context <= 1:
            raise ValueError(f"context size must be > 1, got {self.max_context}")
        if self.max_slots <= 0:
            raise ValueError(f"batch size must be positive, got {self.max_slots}")
        if self.max_pass_tokens < self.max_slots:
            raise ValueError(f"a pass of {self.max_pass_tokens} tokens cannot hold one token of each of "
                             f"{self.max_slots} sequences")

    def growth(self, budget: int, remaining: int, sampling: SamplingConfig | None = None) -> GrowthConfig:
        """A step's tree with `remaining` tokens left to emit: no deeper than remaining - 1 (the target
        adds one token after the accepted path)."""
        temperature = 1.0
        if self.greedy_growth_temperature is not None:
            greedy = sampling is None or sampling.temperature == 0
            temperature = self.greedy_growth_temperature if greedy else sampling.temperature
        return GrowthConfig(budget, self.max_width, self.max_children, min(self.max_depth, remaining - 1),
                            temperature=temperature)


class StopCondition(Protocol):
    """Ends an answer at the first token after which it holds (e.g. the text contains a stop string)."""

    def reached(self, answer_ids: list[int]) -> bool: ...


TokenCallback = Callable[[list[int]], None]


@dataclass(slots=True)
class DecodeRequest:
    prompt_ids: list[int]
    sampling: SamplingConfig
    max_new_tokens: int
    stop: StopCondition | None = None
    on_tokens: TokenCallback | None = None
    tag: object = None               # the caller's handle (a batch item, an index)
    keep_cache: bool = False         # reuse a slot's committed prefix and keep the answer's keys (multi-turn chat)


@dataclass(slots=True)
class DecodeResult:
    token_ids: list[int] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)


FinishCallback = Callable[[DecodeRequest, "DecodeResult | None", "str | None"], None]


def request_problem(request: DecodeRequest, max_context: int) -> str | None:
    """Why a request cannot run (one line), or None."""
    if not request.prompt_ids:
        return "the prompt is empty"
    if len(request.prompt_ids) >= max_context:
        return f"prompt has {len(request.prompt_ids)} tokens; the context holds {max_context}"
    if request.max_new_tokens <= 0:
        return f"max tokens must be positive, got {request.max_new_tokens}"
    return None


class BudgetPolicy(Protocol):
    """Sizes each tree when `num_sequences` trees share a pass of at most max_pass_tokens tokens, and learns
    from what the steps accepted and what passes cost."""

    def split(self, num_sequences: int, max_pass_tokens: int) -> int: ...

    def observe(self, tree_size: int, path_ranks: list[int], draft_seconds: float,
                overhead_seconds: float, target_seconds: float | None = None) -> None: ...

    def observe_pass(self, num_tokens: int, seconds: float) -> None: ...


@dataclass(slots=True)
class FixedBudget:
    """A fixed number of tree tokens per pass, split evenly between the sequences (--budget N); one sequence
    gets all of it."""
    budget: int

    def split(self, num_sequences: int, max_pass_tokens: int) -> int:
        return max(1, min(self.budget, max_pass_tokens) // max(num_sequences, 1))

    def observe(self, tree_size: int, path_ranks: list[int], draft_seconds: float,
                overhead_seconds: float, target_seconds: float | None = None) -> None:
        return None

    def observe_pass(self, num_tokens: int, seconds: float) -> None:
        return None


@dataclass(slots=True)
class FixedTree(FixedBudget):
    """The same tree size for every sequence whatever the batch (trees, hence seeded samples, do not depend
    on the batch's composition), within the pass."""

    def split(self, num_sequences: int, max_pass_tokens: int) -> int:
        return max(1, min(self.budget, max_pass_tokens // max(num_sequences, 1)))


def cut_answer(emitted: list[int], answer: list[int], stop_ids: set[int], stop: StopCondition | None,
               max_new_tokens: int) -> tuple[int, str]:
    """How many of a step's `emitted` tokens follow `answer`, and why generation stops there ("" if it goes
    on): token by token in order, so exactly where one-token decoding would stop."""
    for index, token in enumerate(emitted, start=1):
        if token in stop_ids:
            return index, "eos"
        if stop is not None and stop.reached(answer + emitted[:index]):
            return index, "stop_string"
        if len(answer) + index >= max_new_tokens:
            return index, "length"
    return len(emitted), ""


def common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count
