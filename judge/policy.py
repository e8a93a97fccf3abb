"""The judge as an acceptance policy for tree verification: a draft child the target disagrees with is
still accepted when the judge scores the mismatch unimportant (p(important) < threshold), and
acceptance continues down that branch. Lossy by design; the decoder counts what it accepted."""
from __future__ import annotations

from pathlib import Path

from torch import Tensor

from spec.draft_folder import embedding_fingerprint
from spec.tree import Tree
from spec.verify import Verdict, matches_target
from .classifier import Judge, JudgeFormatError

DEFAULT_JUDGE = Path(__file__).resolve().parent / "data" / "smollm2-135m-instruct.judge.safetensors"


class JudgePolicy:
    is_lossless = False
    needs_hidden = True

    def __init__(self, judge: Judge, threshold: float) -> None:
        check_threshold(threshold)
        self.judge, self.threshold = judge, threshold

    def accept(self, tree: Tree, verdict: Verdict) -> Tensor:
        exact = matches_target(tree, verdict.choices)
        at_parent = verdict.hidden[tree.parents.clamp(min=0).to(verdict.hidden.device)]       # [N, H]
        unimportant = self.judge.important_probability(at_parent).to(exact.device) < self.threshold
        return exact | unimportant                   # the root stays accepted: matches_target marks it


def check_threshold(threshold: float) -> None:
    if not 0 <= threshold <= 1:
        raise ValueError(f"judge thresholds must lie in [0, 1], got {threshold}")


def judge_path(spec: str) -> Path:
    """`spec`: a judge file or "default" (the shipped judge of the embedded pair)."""
    return DEFAULT_JUDGE if spec == "default" else Path(spec).expanduser()


def load_judge_for(spec: str, target_embed: Tensor, hidden_size: int) -> Judge:
    """`spec`: a judge file or "default" (the shipped judge of the embedded pair); refused when it was
    mined for another target."""
    path = judge_path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"judge file not found: {path}" + (" (no judge ships with this build)"
                                                                    if spec == "default" else ""))
    judge = Judge.load(path)
    if judge.hidden_size != hidden_size:
        raise JudgeFormatError(f"{path} scores hidden states of size {judge.hidden_size}; the target's are {hidden_size}")
    fingerprint = embedding_fingerprint(target_embed)
    if judge.target_fingerprint != fingerprint:
        raise JudgeFormatError(f"{path} was trained for another target (fingerprint {judge.target_fingerprint}, "
                               f"this target {fingerprint}); mine and train a judge for it with `judge mine`")
    return judge.to(target_embed.device)


DEFAULT_SHARE = 0.05    # the most conservative row (README, AutoJudge: on the default pair every row costs agreement)


def default_threshold(judge: Judge) -> float:
    """The threshold that accepted DEFAULT_SHARE of the validation mismatches (the nearest row)."""
    shares = judge.thresholds[:, 0]
    return float(judge.thresholds[(shares - DEFAULT_SHARE).abs().argmin(), 1])
