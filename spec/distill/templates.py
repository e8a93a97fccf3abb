"""Synthetic chat-style training prompts: category templates filled with topics, roles and code tasks.

Drafts learn the domain of their training prompts (a draft trained on math answers agrees far better
on math than on explanations or writing), so this source covers what users ask a chat assistant:
explanations, advice, comparisons, writing, role-play, code, STEM, humanities, reasoning and
extraction over a passage. Categories are drawn uniformly, then a template, then its slots.
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

from .prompts import TrainingPrompt

TEMPLATES_FILE = Path(__file__).resolve().parent / "data" / "chat_templates.json"
SLOT_LISTS = {"topic": "topics", "topic2": "topics", "stem_topic": "stem_topics",
              "humanities_topic": "humanities_topics", "role": "roles", "code_task": "code_tasks",
              "language": "languages", "audience": "audiences"}


def _slots(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def _fill(template: str, table: dict, passages: list[str], rng: random.Random) -> str:
    values: dict[str, str] = {}
    for slot in sorted(_slots(template)):      # sorted: set order varies with PYTHONHASHSEED
        if slot == "passage":
            values[slot] = rng.choice(passages)
        elif slot == "n":
            values[slot] = str(rng.randint(3, 12))
        else:
            values[slot] = rng.choice(table[SLOT_LISTS[slot]])
    while values.get("topic2") is not None and values["topic2"] == values.get("topic"):
        values["topic2"] = rng.choice(table["topics"])
    return template.format(**values)


def template_prompts(count: int, seed: int, passages: list[str],
                     path: Path = TEMPLATES_FILE) -> list[TrainingPrompt]:
    """`count` distinct prompts (fewer if the templates cannot make that many). Extraction templates
    need `passages` (texts to summarise or mine); without any they are skipped."""
    table = json.loads(Path(path).read_text())
    categories = {name: [t for t in group if passages or "passage" not in _slots(t)]
                  for name, group in table["templates"].items()}
    categories = {name: group for name, group in categories.items() if group}
    rng = random.Random(seed)
    seen: set[str] = set()
    prompts: list[TrainingPrompt] = []
    for _ in range(count * 20):
        if len(prompts) == count:
            break
        category = rng.choice(sorted(categories))
        text = _fill(rng.choice(categories[category]), table, passages, rng)
        if text not in seen:
            seen.add(text)
            prompts.append(TrainingPrompt(f"template.{len(prompts)}", f"template_{category}",
                                          [{"role": "user", "content": text}]))
    return prompts


def extraction_passages(seed_tasks: list[TrainingPrompt], gsm8k: list[TrainingPrompt],
                        max_gsm8k: int = 2000) -> list[str]:
    """Texts for the extraction templates: GSM8K train questions and the inputs of seed tasks."""
    passages = [p.messages[0]["content"] for p in gsm8k[:max_gsm8k]]
    return passages + [p.messages[0]["content"].split("\n\n", 1)[1] for p in seed_tasks
                       if "\n\n" in p.messages[0]["content"]]
