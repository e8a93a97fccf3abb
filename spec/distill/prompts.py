"""Training prompts for distillation: where they come from, and the guard against evaluation data.

A draft is trained on the target's own answers, so the prompts decide the domain it learns. Sources:
self-instruct seed tasks, GSM8K train questions, prompts the target writes itself (from the
meta-prompts below), and any JSONL file of prompts given with --data. Evaluation sets are refused.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import textdata
from textdata import read_jsonl

# Files whose prompts are used to evaluate drafts; training on them would inflate every figure.
EVAL_FILES = ("prompts/chat.jsonl",) + textdata.EVALUATION_SETS

TOPICS = (
    "astronomy", "cooking", "gardening", "world history", "personal finance", "climate", "the human body",
    "music theory", "football", "chess", "travel in Japan", "ancient Rome", "electric cars", "sleep",
    "job interviews", "photography", "volcanoes", "the ocean", "birds", "learning a language", "poetry",
    "Python programming", "JavaScript", "databases", "machine learning", "computer networks", "algebra",
    "geometry", "probability", "chemistry", "renewable energy", "architecture", "philosophy", "economics",
    "marketing", "writing a resume", "friendship", "time management", "public speaking", "dogs", "coffee",
    "the Renaissance", "space travel", "recycling", "nutrition", "running", "board games", "movies",
    "mythology", "smartphones", "a small business", "parenting", "meditation", "weather", "bridges",
    "medieval castles", "bees", "the stock market", "video games", "painting", "linux command line",
)
TASKS = (
    "Write one question a curious person might ask an assistant about {topic}.",
    "Write one request asking an assistant to explain something about {topic}.",
    "Write one instruction asking an assistant to write a short story or poem about {topic}.",
    "Write one request asking an assistant for practical tips about {topic}.",
    "Write one request asking an assistant to compare two things related to {topic}.",
    "Write one instruction asking an assistant to write an email or a letter about {topic}.",
    "Write one math word problem about {topic}.",
    "Write one request asking an assistant to write a Python function related to {topic}.",
    "Write one request asking an assistant to summarize the main ideas of {topic}.",
    "Write one question about {topic} that needs step-by-step reasoning to answer.",
)
META_SUFFIX = " Reply with the question or instruction only."


@dataclass(slots=True)
class TrainingPrompt:
    id: str
    source: str
    messages: list[dict[str, str]] = field(default_factory=list)


def refuse_evaluation_file(path: Path) -> None:
    """Raises ValueError when `path` is one of the evaluation sets."""
    resolved = str(Path(path).resolve())
    for name in EVAL_FILES:
        if resolved.endswith(name):
            raise ValueError(f"{path} is evaluation data ({name}); never train a draft on it "
                             f"(use self_instruct/seed_tasks.jsonl, gsm8k/train.jsonl or your own prompts)")


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text.strip()}]


def seed_task_prompts(path: Path) -> list[TrainingPrompt]:
    """Self-instruct seed tasks: instruction, plus the instance input when it has one."""
    prompts = []
    for task in read_jsonl(path):
        for index, instance in enumerate(task["instances"]):
            text = task["instruction"] + (f"\n\n{instance['input']}" if instance.get("input") else "")
            prompts.append(TrainingPrompt(f"{task['id']}.{index}", "seed_tasks", _user(text)))
    return prompts


def prompts_from_jsonl(path: Path, source: str | None = None, is_evaluation: bool = False) -> list[TrainingPrompt]:
    """Lines with `question` (GSM8K), `prompt`, `instruction` [+ `input`] or `turns` (first turn).
    Evaluation sets are refused unless `is_evaluation` (benchmarks read them)."""
    if not is_evaluation:
        refuse_evaluation_file(path)
    source = source or Path(path).stem
    prompts = []
    for number, row in enumerate(read_jsonl(path)):
        text = row.get("question") or row.get("prompt") or (row.get("turns") or [None])[0]
        if text is None and row.get("instruction"):
            text = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        if not text:
            raise ValueError(f"{path}:{number + 1}: no question, prompt, instruction or turns field")
        prompts.append(TrainingPrompt(f"{source}.{number}", source, _user(text)))
    return prompts


def prompt_turns(paths: list[Path], limit: int | None = None, per_file: bool = False) -> list[list[dict[str, str]]]:
    """Benchmarks' chat turns from prompt files (evaluation sets allowed): the first `limit` prompts
    overall, or of each file (`per_file`)."""
    if per_file:
        return [turns for path in paths for turns in prompt_turns([path], limit)]
    return [prompt.messages for path in paths for prompt in prompts_from_jsonl(path, is_evaluation=True)][:limit]


def meta_prompts(count: int, seed: int) -> list[TrainingPrompt]:
    """Prompts that ask the target to write a training prompt (topic x task type, shuffled; past
    len(TOPICS) x len(TASKS) the pairs repeat, and sampling makes the repeats differ)."""
    pairs = [(t, k) for t in TOPICS for k in TASKS]
    random.Random(seed).shuffle(pairs)
    return [TrainingPrompt(f"meta.{i}", "meta", _user(pairs[i % len(pairs)][1].format(topic=pairs[i % len(pairs)][0])
                                                       + META_SUFFIX))
            for i in range(count)]


def clean_self_prompt(text: str) -> str | None:
    """The target's written prompt, unquoted; None when it is too short, too long or not a request."""
    text = text.strip().strip('"').strip()
    for prefix in ("Question:", "Instruction:", "Request:", "Problem:"):
        if text.startswith(prefix):
            text = text[len(prefix):].strip()
    num_words = len(text.split())
    return text if 4 <= num_words <= 80 else None


def interleave(groups: list[list[TrainingPrompt]], seed: int) -> list[TrainingPrompt]:
    """Each group shuffled, then round-robin: any prefix of the result mixes every source."""
    rng = random.Random(seed)
    shuffled = [rng.sample(group, len(group)) for group in groups]
    out: list[TrainingPrompt] = []
    for index in range(max((len(g) for g in shuffled), default=0)):
        out.extend(g[index] for g in shuffled if index < len(g))
    return out


def default_prompt_files() -> dict[str, Path]:
    """The shipped training sets (textdata/, with their licences)."""
    return {"seed_tasks": textdata.path(textdata.SELF_INSTRUCT), "gsm8k_train": textdata.path(textdata.GSM8K_TRAIN)}
