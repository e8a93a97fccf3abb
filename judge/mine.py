"""Mining which draft/target mismatches matter (AutoJudge's semi-greedy search), many problems at once.

Per problem: the target's greedy response is the reference and its outcome (parsed answer, or
pass/fail) the label source. Walk the positions where the draft's argmax differs from the current
response, in order: substitute the draft's token, let the target continue greedily to the end, and
compare the outcome with the reference. Unchanged: the mismatch is unimportant and the continuation
becomes the current response; changed: important, and the current response stays. Each record keeps
the target's final-norm hidden state at the mismatch (the state that predicted the token there).

The cost is the continuations: every round runs one continuation for each active problem as one
left-padded batch through the engine. A problem's records are written when it is finished, so a
killed run resumes with the problems not yet in the file.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from offload import LoadedModel
from spec import Draft
from spec.distill.generate import GenerationConfig, generate_batch
from textdata import jsonl_lines
from .tasks import Problem

MINED_FORMAT = "specstream-judge-mined"


@dataclass(slots=True)
class MineConfig:
    max_new_tokens: int = 256
    batch_size: int = 16
    max_mismatches: int = 32          # per problem, a bound on the walk

    def __post_init__(self) -> None:
        if min(self.max_new_tokens, self.batch_size, self.max_mismatches) <= 0:
            raise ValueError("mining limits must be positive")


@dataclass(slots=True)
class _Walk:
    problem: Problem
    prompt: list[int]
    reference_outcome: object
    response: list[int]               # current response (answer tokens)
    position: int = 0                 # next answer position to test
    records: list[dict] = field(default_factory=list)
    pending: tuple[int, int] | None = None   # (position, draft token) under test
    guesses: list[int] | None = None         # the draft's guess after each prefix of prompt + response
    hidden: torch.Tensor | None = None       # [S, H] the target's hidden state there


def mine(target: LoadedModel, draft: Draft, task, problems: list[Problem], out: Path, config: MineConfig,
         on_progress: Callable[[dict], None] | None = None) -> dict:
    done = finished_problems(out)
    todo = [p for p in problems if p.id not in done]
    counts = {"important": 0, "unimportant": 0, "problems": len(done)}
    generation = GenerationConfig(batch_size=config.batch_size, max_new_tokens=config.max_new_tokens, top_k=1)
    for start in range(0, len(todo), config.batch_size):
        walks = _references(target, task, todo[start:start + config.batch_size], generation)
        while active := [w for w in walks if _advance(target, draft, w, config)]:
            _continue(target, task, active, generation)
        for walk in walks:
            _write(out, walk)
            counts["problems"] += 1
            for record in walk.records:
                counts["important" if record["label"] else "unimportant"] += 1
        if on_progress:
            on_progress({**counts, "total": len(problems)})
    return counts


def finished_problems(out: Path) -> set[str]:
    if not out.exists():
        return set()
    done = set()
    for _, line in jsonl_lines(out):
        try:
            row = json.loads(line)
        except ValueError:          # a line torn by a crash: its problem is mined again
            continue
        if row.get("done"):
            done.add(row["problem"])
    return done


def _references(target: LoadedModel, task, problems: list[Problem], generation: GenerationConfig) -> list[_Walk]:
    prompts = [target.tokenizer.encode_chat([{"role": "user", "content": p.prompt}]) for p in problems]
    answers = generate_batch(target.model, prompts, target.stop_ids, generation)
    walks = []
    for problem, prompt, answer in zip(problems, prompts, answers):
        outcome = task.outcome(problem, target.tokenizer.decode(answer.answer_ids))
        walks.append(_Walk(problem, prompt, outcome, answer.answer_ids))
    return walks


@torch.inference_mode()
def _advance(target: LoadedModel, draft: Draft, walk: _Walk, config: MineConfig) -> bool:
    """Finds the walk's next mismatch (records its hidden state); False when the walk is over."""
    if walk.pending is not None or len(walk.records) >= config.max_mismatches:
        return walk.pending is not None
    if walk.guesses is None:
        walk.guesses, walk.hidden = _read_response(target, draft, walk.prompt + walk.response)
    base = len(walk.prompt) - 1
    for position in range(walk.position, len(walk.response)):
        guess = walk.guesses[base + position]
        if guess != walk.response[position]:
            walk.pending = (position, guess)
            walk.records.append({"problem": walk.problem.id, "position": position,
                                 "target_token": walk.response[position], "draft_token": guess,
                                 "features": [round(x, 5) for x in walk.hidden[base + position].tolist()]})
            return True
    return False


def _read_response(target: LoadedModel, draft: Draft, sequence: list[int]) -> tuple[list[int], torch.Tensor]:
    """The draft's next-token guess after every prefix of `sequence` [S] (target ids) and the target's
    final-norm hidden state there [S, H]: one pass of each per response, shared by all its mismatches."""
    tokens = torch.tensor([sequence])
    guesses = draft.vocab_map[draft.log_probs(tokens, draft.model.new_cache(len(sequence))).argmax(-1)]
    out = target.model.forward(tokens, target.model.new_cache(len(sequence)), return_hidden=True)
    return guesses.tolist(), out.hidden[0].float().cpu()


def _continue(target: LoadedModel, task, walks: list[_Walk], generation: GenerationConfig) -> None:
    """One batch: each walk's pending substitution continued greedily to the end, then labelled."""
    prompts = [w.prompt + w.response[:w.pending[0]] + [w.pending[1]] for w in walks]
    longest = max(generation.max_new_tokens - w.pending[0] - 1 for w in walks)
    if longest > 0:
        results = generate_batch(target.model, prompts, target.stop_ids, replace(generation, max_new_tokens=longest))
        continuations = [result.answer_ids for result in results]
    else:
        continuations = [[] for _ in walks]
    for walk, continuation in zip(walks, continuations):
        position, token = walk.pending
        continuation = [] if token in target.stop_ids else continuation
        candidate = (walk.response[:position] + [token] + continuation)[:generation.max_new_tokens]
        changed = task.outcome(walk.problem, target.tokenizer.decode(candidate)) != walk.reference_outcome
        walk.records[-1]["label"] = int(changed)
        if not changed:
            walk.response, walk.guesses, walk.hidden = candidate, None, None
        walk.position, walk.pending = position + 1, None


def _write(out: Path, walk: _Walk) -> None:
    """A problem's records, then its done marker, appended and fsynced together."""
    lines = [json.dumps(record) for record in walk.records if "label" in record]
    lines.append(json.dumps({"problem": walk.problem.id, "done": True, "format": MINED_FORMAT,
                             "reference_outcome": str(walk.reference_outcome)}))
    with open(out, "a") as handle:
        handle.write("\n".join(lines) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
