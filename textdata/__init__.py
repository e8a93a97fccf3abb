"""textdata/: the text sets the project ships (prompts, calibration and training text), one module that
every package reads them through. Evaluation sets (GSM8K test, MT-Bench, the chat prompts) are never
training or calibration text; each folder keeps its licence."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from .jsonl import jsonl_lines, read_jsonl

GSM8K_TRAIN = "gsm8k/train.jsonl"            # 7,473 problems: mining, calibration, distillation prompts
GSM8K_TEST = "gsm8k/test.jsonl"              # 1,000 problems: evaluation only
SELF_INSTRUCT = "self_instruct/seed_tasks.jsonl"   # 175 instructions: distillation prompts, calibration
MT_BENCH = "mt_bench/question.jsonl"         # 80 two-turn questions: evaluation only
CHAT_PROMPTS = "chat/prompts.jsonl"          # 44 chat prompts in four categories: evaluation only
EVALUATION_SETS = (GSM8K_TEST, MT_BENCH, CHAT_PROMPTS)


def path(name: str) -> Path:
    """The file of a shipped set (one of the names above)."""
    found = Path(str(resources.files(__name__).joinpath(name)))
    if not found.is_file():
        raise FileNotFoundError(f"shipped data set {name} is missing from this install ({found})")
    return found


def records(name: str) -> list[dict]:
    return read_jsonl(path(name))


__all__ = ["GSM8K_TRAIN", "GSM8K_TEST", "SELF_INSTRUCT", "MT_BENCH", "CHAT_PROMPTS", "EVALUATION_SETS", "path",
           "records", "jsonl_lines", "read_jsonl"]
