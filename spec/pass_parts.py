"""One pass of the decode loop: each decoding sequence's tree (grown by the speculator, or its root alone) and
prompt chunks of joining sequences, packed into one target pass; then per sequence what a one-token decoder
would do with its rows: the target's choices, the accepted path, the commits in both caches and the tokens,
cut where one-token decoding would stop."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from offload.host_sync import send
from offload.model.masks import causal_mask
from offload.model.slots import block_mask
from offload import DecoderModel
from offload.model.slots import SlotCache
from .grow import HOST
from .penalties import Penalties
from .requests import BudgetPolicy, DecodeConfig, DecodeRequest, DecodeResult, cut_answer
from .sampling import PositionDraws, sample_first
from .speculator import Proposal, Speculator
from .tree import Tree
from .verify import AcceptancePolicy, Verdict, accepted_path, matches_target, target_choices


@dataclass(slots=True)
class Sequence:
    request: DecodeRequest
    slot: int
    draws: PositionDraws | None
    started: float
    cached_ids: list[int]             # committed in the target's slot (the decoder's list for that slot)
    result: DecodeResult = field(default_factory=DecodeResult)
    num_prefilled: int = 0
    logit_level: float = 0.0          # the target's last log-sum-exp (see Draft.log_probs)
    is_finished: bool = False

    @property
    def is_decoding(self) -> bool:
        return self.num_prefilled == len(self.request.prompt_ids)


@dataclass(slots=True)
class Part:
    """One sequence's share of a pass: a tree to verify or a prompt chunk to prefill."""
    sequence: Sequence
    tokens: Tensor          # [n]
    positions: Tensor       # [n]
    mask: Tensor            # [n, filled + n]
    tree: Tree | None = None
    draft_rows: Tensor | None = None
    penalties: Penalties | None = None
    budget: int = 1


class LoopState(Protocol):
    """What a pass reads of the decode loop (the Decoder)."""
    target: DecoderModel
    cache: SlotCache
    config: DecodeConfig
    speculator: Speculator | None
    budget: BudgetPolicy
    policy: AcceptancePolicy
    stop_ids: set[int]


class PassBuilder:
    def __init__(self, decoder: LoopState) -> None:
        self.decoder, self.cache, self.config = decoder, decoder.cache, decoder.config
        self.mask_device = HOST         # a packed pass's block mask is assembled on the host

    def run(self, active: list[Sequence]) -> None:
        began = time.perf_counter()
        decoding = [s for s in active if s.is_decoding]
        prefilling = [s for s in active if not s.is_decoding]
        if len(active) == 1:            # one sequence: its own mask is the pass's, built where it is used
            self.mask_device = self.decoder.target.device
        parts, draft_seconds = self._trees(decoding, bool(prefilling))
        room = self.config.max_pass_tokens - sum(part.tokens.numel() for part in parts)
        for sequence in prefilling:
            if room <= 0:
                break
            parts.append(self._prompt_chunk(sequence, room))
            room -= parts[-1].tokens.numel()
        verified = time.perf_counter()
        logits, hidden = self._forward(parts)
        target_seconds = time.perf_counter() - verified
        num_tokens = sum(part.tokens.numel() for part in parts)
        self.decoder.budget.observe_pass(num_tokens, target_seconds)
        if self.decoder.speculator:
            self.decoder.speculator.observe_pass(num_tokens, target_seconds)
        offset, num_trees = 0, max(len(decoding), 1)
        for part in parts:
            count = part.tokens.numel() if part.tree is not None else 1
            rows = slice(offset, offset + count)
            offset += count
            if part.tree is None:
                part.sequence.result.stats.num_target_passes += 1
                self._prefilled(part, logits[rows])
                continue
            overhead = (time.perf_counter() - began - draft_seconds - target_seconds) / num_trees
            self._verified(part, logits[rows], hidden[rows] if hidden is not None else None,
                           draft_seconds / num_trees, target_seconds, overhead)

    def _trees(self, decoding: list[Sequence], is_prefill_waiting: bool) -> tuple[list[Part], float]:
        """Each decoding sequence's tree for this pass (the root alone at budget 1) -> (parts, draft seconds)."""
        if not decoding:
            return [], 0.0
        speculator = self.decoder.speculator
        room = self.config.max_pass_tokens
        if is_prefill_waiting:         # leave a joining prompt half the pass, so it is never starved
            room = max(len(decoding), room // 2)
        share = self.decoder.budget.split(len(decoding), room) if speculator else 1
        parts, proposals = [], []
        for sequence in decoding:
            answer, sampling = sequence.result.token_ids, sequence.request.sampling
            penalties = Penalties.before(sampling, sequence.cached_ids, answer[:-1], sequence.logit_level)
            budget = max(1, min(share, self.config.max_context - 1 - self.cache.lengths[sequence.slot]))
            part = Part(sequence, torch.empty(0), torch.empty(0), torch.empty(0), penalties=penalties, budget=budget)
            parts.append(part)
            if budget > 1 and speculator:
                remaining = sequence.request.max_new_tokens - sequence.result.stats.num_new_tokens
                proposals.append((part, Proposal(sequence.slot, sequence.cached_ids, answer[-1],
                                                 self.config.growth(budget, remaining, sampling), penalties)))
            else:
                part.tree = Tree.root_only(answer[-1])
        draft_seconds = 0.0
        if proposals:
            grown = speculator.propose([proposal for _, proposal in proposals])
            for (part, _), (tree, rows) in zip(proposals, grown):
                part.tree, part.draft_rows = tree, rows
            draft_seconds = speculator.forward_seconds
        for part in parts:
            length = self.cache.lengths[part.sequence.slot]
            part.tokens, part.positions = part.tree.tokens, part.tree.positions(length)[0]
            part.mask = part.tree.attention_mask(length, self.mask_device)
        return parts, draft_seconds

    def _prompt_chunk(self, sequence: Sequence, room: int) -> Part:
        prompt, start = sequence.request.prompt_ids, sequence.num_prefilled
        chunk = prompt[start:start + room]
        length = self.cache.lengths[sequence.slot]
        return Part(sequence, torch.tensor(chunk), torch.arange(length, length + len(chunk)),
                    causal_mask(length, len(chunk), self.mask_device))

    def _forward(self, parts: list[Part]) -> tuple[Tensor, Tensor | None]:
        """One packed target pass -> logits [R, V] (every tree node, each prompt chunk's last token) and
        hidden states [R, H] when the policy asks for them."""
        rows, offset, chunks = [], 0, []
        for part in parts:
            count = part.tokens.numel()
            rows.extend(range(offset, offset + count) if part.tree is not None else [offset + count - 1])
            if part.tree is None:
                chunks.append((offset, offset + count))
            offset += count
        self.cache.begin([(part.sequence.slot, part.tokens.numel()) for part in parts])
        mask = parts[0].mask if len(parts) == 1 else block_mask([p.mask for p in parts])
        target = self.decoder.target
        output = target.forward(torch.cat([p.tokens for p in parts])[None], self.cache,
                                torch.cat([p.positions for p in parts])[None], mask,
                                return_hidden=self.decoder.policy.needs_hidden,
                                rows=None if offset == len(rows) else torch.tensor(rows), prompt_chunks=chunks)
        target.synchronize()      # the choices' read would wait anyway; here it is timed as the pass
        return output.logits[0], output.hidden[0] if output.hidden is not None else None

    def _prefilled(self, part: Part, logits: Tensor) -> None:
        """Commits a prompt chunk; after the prompt's last chunk, samples the answer's first token."""
        sequence = part.sequence
        self.cache.commit(sequence.slot)
        sequence.cached_ids.extend(part.tokens.tolist())
        sequence.num_prefilled += part.tokens.numel()
        if not sequence.is_decoding:
            return
        logits, sampling = logits[-1], sequence.request.sampling                            # [V]
        if sampling.repetition_penalty != 1.0:
            sequence.logit_level = float(logits.logsumexp(-1))
        penalties = Penalties.before(sampling, sequence.cached_ids, [])
        if penalties:
            logits = penalties.apply(logits[None], torch.empty(1, 0, dtype=torch.long))[0]
        self._emit(sequence, [int(sample_first(logits, sampling, sequence.draws))])

    def _verified(self, part: Part, logits: Tensor, hidden: Tensor | None, draft_seconds: float,
                  target_seconds: float, overhead_seconds: float) -> None:
        """The sequence's own choices over its tree's rows [n, V], the accepted path, commits and tokens."""
        sequence, tree = part.sequence, part.tree
        stats, sampling = sequence.result.stats, sequence.request.sampling
        if part.penalties:
            logits = part.penalties.apply(logits, send(tree.path_tokens(), logits.device))
        choices = target_choices(logits, sampling, sequence.draws, tree, len(sequence.result.token_ids))
        choices = choices.to(tree.tokens.device)                    # the step's one read of the device
        path = accepted_path(tree, self.decoder.policy.accept(tree, Verdict(choices, hidden)))
        if sampling.repetition_penalty != 1.0:       # the level at the newest position, for the next tree
            sequence.logit_level = float(logits[path[-1]].logsumexp(-1))
        path_tokens = torch.cat((tree.tokens[path], choices[path[-1:]])).tolist()
        yielded = path_tokens[1:]
        if not self.decoder.policy.is_lossless:      # accepted tokens that are not the target's own choice
            stats.policy_accepted += int((~matches_target(tree, choices))[path[1:]].sum())
        self.cache.commit(sequence.slot, path)
        sequence.cached_ids.extend(path_tokens[:-1])
        if part.draft_rows is not None:
            self.decoder.speculator.accept(sequence.slot, tree, part.draft_rows, path)
        stats.record_step(part.budget, tree.num_nodes, len(yielded), draft_seconds, target_seconds, overhead_seconds)
        self.decoder.budget.observe(tree.num_nodes, path[1:], draft_seconds, overhead_seconds)
        self._emit(sequence, yielded)

    def _emit(self, sequence: Sequence, emitted: list[int]) -> None:
        result, request = sequence.result, sequence.request
        count, result.stats.stop_reason = cut_answer(emitted, result.token_ids, self.decoder.stop_ids,
                                                     request.stop, request.max_new_tokens)
        result.token_ids.extend(emitted[:count])
        result.stats.num_new_tokens += count
        if result.stats.first_token_seconds is None:
            result.stats.first_token_seconds = time.perf_counter() - sequence.started
        if request.on_tokens:
            request.on_tokens(emitted[:count])
        if not result.stats.stop_reason and self.cache.lengths[sequence.slot] + 1 >= self.config.max_context:
            result.stats.stop_reason = "context"
        sequence.is_finished = bool(result.stats.stop_reason)
