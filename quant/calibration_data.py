"""Calibration text for every domain the model sees, never the evaluation text.

    math   GSM8K train problems with their worked answers (shipped with the distillation data)
    chat   self-instruct seed instructions with their answers (shipped likewise)
    code   Python standard-library modules (CALIBRATION_MODULES; the evaluation uses others)
    prose  the odd-numbered topics of Python's own documentation (pydoc_data; the evaluation uses the
           even-numbered ones)
Windows of `seqlen` tokens are drawn with a fixed seed, an equal share from each domain, plus any
--calib files as a further domain.
"""
from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import torch
from torch import Tensor

import textdata
from offload.weights.tokenizer import Tokenizer

CALIBRATION_MODULES = ("textwrap.py", "heapq.py", "bisect.py", "functools.py", "dataclasses.py", "string.py",
                       "csv.py", "queue.py", "argparse.py")
EVALUATION_MODULES = ("statistics.py", "fractions.py", "difflib.py", "shlex.py", "pprint.py", "calendar.py")


def stdlib_code(names: tuple[str, ...]) -> str:
    folder = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((folder / name).read_text() for name in names if (folder / name).exists())


def documentation_prose(parity: int) -> str:
    """Python's documentation topics in sorted order, every other one (parity 1: calibration)."""
    from pydoc_data.topics import topics
    names = sorted(topics)
    return "\n\n".join(topics[name] for name in names[parity::2])


def _math() -> str:
    rows = textdata.records(textdata.GSM8K_TRAIN)[:3000]
    return "\n\n".join(f"{row['question']}\n{row['answer']}" for row in rows)


def _chat() -> str:
    rows = textdata.records(textdata.SELF_INSTRUCT)
    parts = []
    for row in rows:
        for instance in row.get("instances", []):
            task = row["instruction"] + (f"\n{instance['input']}" if instance.get("input") else "")
            parts.append(f"{task}\n{instance['output']}")
    return "\n\n".join(parts)


def calibration_texts(extra: list[Path]) -> dict[str, str]:
    texts = {"math": _math(), "chat": _chat(), "code": stdlib_code(CALIBRATION_MODULES),
             "prose": documentation_prose(1)}
    for path in extra:
        try:
            texts[f"file:{path.name}"] = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"cannot read calibration file {path}: {err}") from None
    return texts


def calibration_windows(tokenizer: Tokenizer, extra: list[Path], nsamples: int, seqlen: int, seed: int) -> Tensor:
    """[nsamples, seqlen] token windows, an equal share from each domain."""
    rng = random.Random(seed)
    domains = [tokenizer.encode(text) for text in calibration_texts(extra).values()]
    windows = []
    for sample in range(nsamples):
        tokens = domains[sample % len(domains)]
        if len(tokens) <= seqlen:
            raise ValueError(f"calibration text of {len(tokens)} tokens is shorter than --seqlen {seqlen}")
        start = rng.randrange(len(tokens) - seqlen)
        windows.append(tokens[start:start + seqlen])
    return torch.tensor(windows)
