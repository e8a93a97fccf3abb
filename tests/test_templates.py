"""Synthetic chat training prompts: every slot filled, deterministic, distinct, never an evaluation prompt."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from spec.distill.prompts import default_prompt_files, prompts_from_jsonl, seed_task_prompts
from spec.distill.templates import TEMPLATES_FILE, extraction_passages, template_prompts

def _texts(prompts) -> list[str]:
    return [p.messages[0]["content"] for p in prompts]


def test_templates_fill_every_slot_and_cover_every_category():
    prompts = template_prompts(1500, seed=3, passages=["Ann has 3 apples and buys 4 more."])
    texts = _texts(prompts)
    assert len(texts) == 1500 and len(set(texts)) == 1500
    assert not any("{" in t or "}" in t for t in texts)
    categories = set(json.loads(TEMPLATES_FILE.read_text())["templates"])
    assert {p.source.removeprefix("template_") for p in prompts} == categories
    assert all(p.id == f"template.{i}" for i, p in enumerate(prompts))


def test_templates_are_deterministic_per_seed():
    assert _texts(template_prompts(50, 1, ["x y z"])) == _texts(template_prompts(50, 1, ["x y z"]))
    assert _texts(template_prompts(50, 1, ["x y z"])) != _texts(template_prompts(50, 2, ["x y z"]))


def test_templates_do_not_depend_on_the_hash_seed():
    """Slot names are a set: filled in set order, prompts changed from one process to the next."""
    code = ("from spec.distill.templates import template_prompts; "
            "print([p.messages[0]['content'] for p in template_prompts(200, 1, ['x y z'])])")
    repo = Path(__file__).resolve().parents[1]
    outputs = {subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "3")}
    assert len(outputs) == 1 and len(outputs.pop()) > 1000


def test_extraction_templates_need_passages():
    prompts = template_prompts(300, seed=0, passages=[])
    assert prompts and all(p.source != "template_extraction" for p in prompts)


def test_extraction_passages_come_from_training_sets_only():
    files = default_prompt_files()
    seed_tasks = seed_task_prompts(files["seed_tasks"])
    gsm8k = prompts_from_jsonl(files["gsm8k_train"], "gsm8k_train")
    passages = extraction_passages(seed_tasks, gsm8k, max_gsm8k=10)
    assert passages[:10] == _texts(gsm8k[:10]) and len(passages) > 10
    assert all(p and not p.startswith("\n") for p in passages)


FORM_WORDS = set("a an the of to in on for and or with about that this is are what how why write python function "
                 "short your you me my i it explain".split())


def _words(text: str) -> set[str]:
    """Content words: the task and its subject, not the instruction's form (\"write a ... about\")."""
    return set("".join(c if c.isalnum() else " " for c in text.lower()).split()) - FORM_WORDS


def test_templates_never_come_near_an_evaluation_prompt():
    """No template prompt shares half its content words with a chat or MT-Bench prompt (Jaccard < 0.5)."""
    repo = Path(__file__).resolve().parents[1]
    evaluation = [_words(t) for path in (repo / "textdata/chat/prompts.jsonl", repo / "textdata/mt_bench/question.jsonl")
                  for t in _texts(prompts_from_jsonl(path, is_evaluation=True))]
    assert len(evaluation) == 44 + 80
    texts = {t for seed in (0, 1) for t in _texts(template_prompts(8000, seed, ["Ann has 3 apples."]))}
    for text in texts:
        words = _words(text)
        closest = max(len(words & e) / len(words | e) for e in evaluation)
        assert closest < 0.5, text
