"""Training batches from corpus sequences: length-grouped, right-padded, with the positions that count."""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

from .corpus import CorpusSequence
from .generate import NO_TARGET


@dataclass(slots=True)
class Batch:
    tokens: Tensor          # [B, N] int64
    topk_ids: Tensor        # [B, N, k] int32
    topk_logprobs: Tensor   # [B, N, k] float16
    weight: Tensor          # [B, N] bool: positions whose next-token distribution is trained on

    @property
    def num_tokens(self) -> int:
        return int(self.weight.sum())

    def to(self, device: torch.device) -> "Batch":
        return Batch(self.tokens.to(device), self.topk_ids.to(device), self.topk_logprobs.to(device),
                     self.weight.to(device))


def is_validation(prompt_id: str, every: int = 20) -> bool:
    """A stable 1-in-`every` split by prompt (greedy and sampled answers of a prompt stay together)."""
    return zlib.crc32(prompt_id.encode()) % every == 0


def make_batch(sequences: list[CorpusSequence], loss_start: int = 0, answers_only: bool = False) -> Batch:
    """Right-pads to the longest sequence. Counted positions: from `loss_start` (skipping a shared
    chat-template prefix), or from the last prompt token when `answers_only`, up to the last token
    that has a next token."""
    width = max(len(s) for s in sequences)
    k = sequences[0].topk_ids.shape[1]
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)
    topk_ids = torch.full((len(sequences), width, k), NO_TARGET, dtype=torch.int32)
    topk_logprobs = torch.zeros(len(sequences), width, k, dtype=torch.float16)
    weight = torch.zeros(len(sequences), width, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        length = len(seq)
        tokens[row, :length] = seq.token_ids
        topk_ids[row, :length] = seq.topk_ids
        topk_logprobs[row, :length] = seq.topk_logprobs
        first = seq.num_prompt_tokens - 1 if answers_only else min(loss_start, length)
        weight[row, first:length] = True
    weight &= topk_ids[..., 0] != NO_TARGET
    return Batch(tokens, topk_ids, topk_logprobs, weight)


def epoch_plan(lengths: list[int], batch_tokens: int, seed: int, epoch: int, window: int = 32) -> list[list[int]]:
    """Sequence indices per batch for one epoch: shuffled, then sorted by length inside windows of
    `window` x (sequences per batch) so that a batch wastes little padding; batches shuffled again.
    A batch holds at most `batch_tokens` padded tokens (at least one sequence)."""
    rng = random.Random(seed * 100_003 + epoch)
    order = rng.sample(range(len(lengths)), len(lengths))
    batches: list[list[int]] = []
    mean = max(1, sum(lengths) // max(len(lengths), 1))
    span = max(1, window * batch_tokens // mean)
    for start in range(0, len(order), span):
        current: list[int] = []
        for index in sorted(order[start:start + span], key=lambda i: lengths[i]):
            if current and (len(current) + 1) * lengths[index] > batch_tokens:
                batches.append(current)
                current = []
            current.append(index)
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return batches


class BatchStream:
    """Step -> batch, deterministic given (corpus, seed): a resumed run sees the same batches."""

    def __init__(self, sequences: list[CorpusSequence], batch_tokens: int, seed: int, loss_start: int) -> None:
        if not sequences:
            raise ValueError("the training corpus is empty")
        self.sequences, self.batch_tokens, self.seed, self.loss_start = sequences, batch_tokens, seed, loss_start
        self._lengths = [len(s) for s in sequences]
        self._epoch, self._plan = -1, []
        self._num_batches: list[int] = []     # per epoch, computed once

    def batch(self, step: int) -> Batch:
        epoch, index = self._locate(step)
        plan = self._plan_for(epoch)
        return make_batch([self.sequences[i] for i in plan[index]], self.loss_start)

    def _locate(self, step: int) -> tuple[int, int]:
        epoch, first = 0, 0
        while True:
            while len(self._num_batches) <= epoch:
                self._num_batches.append(len(self._plan_for(len(self._num_batches))))
            if step < first + self._num_batches[epoch]:
                return epoch, step - first
            first += self._num_batches[epoch]
            epoch += 1

    def _plan_for(self, epoch: int) -> list[list[int]]:
        if epoch != self._epoch:
            self._epoch, self._plan = epoch, epoch_plan(self._lengths, self.batch_tokens, self.seed, epoch)
        return self._plan
