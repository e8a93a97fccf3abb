"""Context lookup: children a trimmed draft cannot propose, taken from the conversation itself.

A trimmed draft gives zero probability to every target token outside its K vocabulary rows (on chat
text about 9% of the default target's tokens, and about half of the places where a step's accepted path
ends). Text repeats itself (names, numbers, identifiers), so the token that followed the same two
tokens most recently in the context is a fair guess there: growth adds it as one extra child with a
fixed probability. Proposals never touch exactness; verification alone decides what is accepted.
"""
from __future__ import annotations

import math

from torch import Tensor

LOOKUP_LOGPROB = math.log(0.25)      # the draft-side probability a lookup child is ranked with


class ContextLookup:
    """(a, b) -> the token that most recently followed a, b in the indexed ids, for tokens outside the
    draft's vocabulary only."""

    def __init__(self, vocab_map: Tensor) -> None:
        self._in_vocab = set(vocab_map.tolist())
        self._next: dict[tuple[int, int], int] = {}
        self._ids: list[int] = []

    def in_vocab(self, token: int) -> bool:
        return token in self._in_vocab

    def sync(self, ids: list[int]) -> None:
        """Indexes `ids` (the committed sequence); re-indexes from scratch when it is not an extension
        of what was indexed (a new conversation)."""
        known = len(self._ids)
        if known > len(ids) or ids[max(known - 3, 0):known] != self._ids[max(known - 3, 0):]:
            self._next, self._ids, known = {}, [], 0
        for i in range(max(known, 2), len(ids)):
            token = ids[i]
            if not self.in_vocab(token):
                self._next[(ids[i - 2], ids[i - 1])] = token
        self._ids.extend(ids[known:])

    def children(self, previous: list[int], last: list[int]) -> list[int | None]:
        """For nodes whose context ends with (previous[i], last[i]): the looked-up out-of-vocabulary
        child, or None."""
        return [self._next.get((a, b)) for a, b in zip(previous, last)]
