"""Tokens per pass of greedy tree speculation at any budget, from draft work alone.

Greedy verification accepts exactly the longest root path of the tree that follows the target's own
greedy continuation, then adds the target's next token. So once the target's greedy answers are known
(decoded once, one token per pass), every budget's tokens per pass follows from growing the same trees
with the real growth code and matching them against those answers: no target pass over the tree."""
from __future__ import annotations

import torch

from offload import DecoderModel
from offload.cache_sizes import draft_slot_tokens
from offload.model.masks import causal_mask
from offload.model.slots import SlotCache
from .decoding import DecodeConfig, Decoder
from .draft import Draft
from .sampling import SamplingConfig
from .grow import MAX_DEPTH
from .self_speculator import SelfSpeculator
from .speculator import Proposal, Speculator
from .tree import Tree
from .verify import accepted_path

# Bumped whenever growth or a draft's scoring changes what a simulated pass accepts: a resumed run's finished work
# (bench/tree_simulation.py's checkpoint) counts only under the version that made it. 2: a self-draft scores with an
# 8-bit head on a CPU, a round expands no node grow.NEGLIGIBLE_RATIO times less likely than the best open one and
# takes the best nodes that fit the draft cache rows left (it stopped); 3: a quarter of the rows left; 4: the last
# rows kept for the best open node's line to reach the depth cap.
SIMULATION_VERSION = 4


def greedy_answers(decoder: Decoder, prompts: list[list[int]]) -> list[list[int]]:
    """The target's greedy answers, one token per pass (the reference speculation must reproduce)."""
    answers = []
    for prompt_ids in prompts:
        decoder.reset()
        answers.append(decoder.generate(prompt_ids, SamplingConfig()).token_ids)
    return answers


def simulate(draft: Draft, prompt_ids: list[int], answer: list[int], budget: int, max_new_tokens: int,
             max_context: int = 4096) -> int:
    """-> the number of target passes greedy speculation at `budget` takes to emit `answer` (its first
    token comes from the prefill, as in Decoder; every later pass yields its accepted path and the
    target's next token, cut where the answer ends)."""
    speculator = Speculator(draft, max_context, budget)
    committed, position, passes = list(prompt_ids), 0, 0       # answer[position] is the root
    while position < len(answer) - 1:
        growth = DecodeConfig(max_new_tokens).growth(budget, max_new_tokens - (position + 1))
        [(tree, rows)] = speculator.propose([Proposal(0, committed, answer[position], growth)])   # as Decoder grows
        path = _followed_path(tree, answer, position)
        speculator.accept(0, tree, rows, path)
        committed += [answer[position + i] for i in range(len(path))]
        position += len(path)            # the accepted nodes and the target's token after them
        passes += 1
    return passes


def _followed_path(tree: Tree, answer: list[int], position: int) -> list[int]:
    """The path verification accepts when the target's choice after each node is the answer's next token:
    a node at depth d is right when it holds answer[position + d]."""
    depths = tree.depths.tolist()
    right = [d == 0 or (position + d < len(answer) and token == answer[position + d])
             for d, token in zip(depths, tree.tokens.tolist())]
    return accepted_path(tree, torch.tensor(right))


def simulate_self(draft: Draft, target: DecoderModel, prompt_ids: list[int], answer: list[int], budget: int,
                  max_new_tokens: int, max_depth: int = MAX_DEPTH, greedy_growth_temperature: float | None = None) -> int:
    """simulate() for a self-draft: it drafts in the target's own cache, so the target writes the committed keys
    (a prefill, then each step's accepted tokens: a few tokens per step, never the tree)."""
    cache = SlotCache(target.config, 1, len(prompt_ids) + len(answer) + draft_slot_tokens(1, budget), target.device,
                      target.cache_dtype)
    speculator = SelfSpeculator(draft, budget, priced=False)      # trees grow to their budget
    speculator.bind(cache)
    _commit(target, cache, prompt_ids)
    committed, position, passes = list(prompt_ids), 0, 0
    while position < len(answer) - 1:
        growth = DecodeConfig(max_new_tokens, max_depth=max_depth, greedy_growth_temperature=greedy_growth_temperature
                              ).growth(budget, max_new_tokens - (position + 1))
        [(tree, _)] = speculator.propose([Proposal(0, committed, answer[position], growth)])
        path = _followed_path(tree, answer, position)
        accepted = [answer[position + i] for i in range(len(path))]
        _commit(target, cache, accepted)
        committed += accepted
        position += len(path)
        passes += 1
    return passes


def _commit(target: DecoderModel, cache: SlotCache, tokens: list[int]) -> None:
    """The target's exact keys of `tokens`, appended to slot 0's committed rows."""
    cache.begin([(0, len(tokens))])
    length = cache.lengths[0]
    target.forward(torch.tensor([tokens]), cache, torch.arange(length, length + len(tokens))[None],
                   causal_mask(length, len(tokens), target.device), rows=torch.tensor([len(tokens) - 1]))
    cache.commit(0)
