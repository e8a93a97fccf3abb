"""`judge eval`: lossless speculation and the judge at every threshold on the same problems, same budget.

Per setting: tokens per pass, agreement of the final outcome with the target's own greedy response
(which lossless speculation reproduces exactly), accuracy against the gold answer, tokens per second."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from offload import LoadedModel
from spec import DecodeConfig, Decoder, FixedBudget, SamplingConfig, Speculator
from spec.draft import Draft
from .classifier import Judge
from .policy import JudgePolicy
from .tasks import Problem


@dataclass(slots=True)
class EvalConfig:
    budget: int = 16
    max_new_tokens: int = 256
    max_context: int = 2048

    def __post_init__(self) -> None:
        if self.budget < 1 or self.max_new_tokens < 1:
            raise ValueError("budget and max-new-tokens must be positive")


def evaluate_judge(target: LoadedModel, draft: Draft, judge: Judge, task, problems: list[Problem],
                   thresholds: list[float], config: EvalConfig,
                   on_status: Callable[[str], None] = print) -> dict:
    prompts = [target.tokenizer.encode_chat([{"role": "user", "content": p.prompt}]) for p in problems]
    on_status(f"lossless speculation on {len(problems)} problems")
    lossless, reference = _run(target, draft, None, task, problems, prompts, None, config)
    rows = []
    for threshold in thresholds:
        on_status(f"judge threshold {threshold:.4f}")
        row, _ = _run(target, draft, JudgePolicy(judge, threshold), task, problems, prompts, reference, config)
        rows.append({"threshold": threshold, **row})
    lossless.pop("judge_accepted", None)
    return {"task": task.name, "problems": len(problems), "budget": config.budget, "lossless": lossless,
            "thresholds": rows, "roc_auc": judge.roc_auc}


def _run(target, draft, policy, task, problems, prompts, reference, config: EvalConfig) -> tuple[dict, list]:
    decoder = Decoder(target.model, target.stop_ids, DecodeConfig(config.max_new_tokens, config.max_context),
                      Speculator(draft, config.max_context, config.budget), FixedBudget(config.budget), policy)
    outcomes, correct, new_tokens, steps, accepted, started = [], 0, 0, 0, 0, time.perf_counter()
    for problem, prompt in zip(problems, prompts):
        decoder.reset()
        result = decoder.generate(prompt, SamplingConfig())
        text = target.tokenizer.decode(result.token_ids)
        outcomes.append(task.outcome(problem, text))
        correct += task.is_correct(problem, text)
        new_tokens += result.stats.num_new_tokens
        steps += result.stats.num_steps
        accepted += result.stats.policy_accepted
    seconds = time.perf_counter() - started
    reference = reference or outcomes
    agreement = sum(a == b for a, b in zip(outcomes, reference)) / len(problems)
    row = {"tokens_per_pass": round((new_tokens - len(problems)) / max(steps, 1), 4),
           "answer_agreement": round(agreement, 4), "accuracy": round(correct / len(problems), 4),
           "tokens_per_second": round(new_tokens / seconds, 3), "judge_accepted": accepted}
    return row, outcomes
