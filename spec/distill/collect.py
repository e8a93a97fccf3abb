"""Collecting training data from the target: prompts it writes itself, and its answers (resumable)."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from offload import LoadedModel
from offload.weights.disk_errors import append_text
from .corpus import append_shard, done_ids
from .generate import GenerationConfig, generate_batch, length_sorted_batches
from textdata import read_jsonl
from .prompts import TrainingPrompt, clean_self_prompt, meta_prompts

ProgressCallback = Callable[[dict], None]
SELF_PROMPTS_FILE = "self_prompts.jsonl"


def collect_answers(target: LoadedModel, prompts: list[TrainingPrompt], corpus_dir: Path, tag: str,
                    config: GenerationConfig, on_progress: ProgressCallback | None = None) -> int:
    """Generates the target's answers to every prompt not yet recorded under `tag`; returns how many
    sequences were added. Prompts longer than config.max_prompt_tokens are skipped."""
    done = done_ids(corpus_dir, tag)
    encoded = [(p, target.tokenizer.encode_chat(p.messages)) for p in prompts if p.id not in done]
    encoded = [(p, ids) for p, ids in encoded if len(ids) <= config.max_prompt_tokens]
    generator = torch.Generator().manual_seed(config.seed + len(done)) if config.temperature > 0 else None
    num_added, num_tokens, start = 0, 0, time.perf_counter()
    for batch in length_sorted_batches(encoded, lambda item: len(item[1]), config.batch_size):
        sequences = generate_batch(target.model, [ids for _, ids in batch], target.stop_ids, config, generator)
        answers = [target.tokenizer.decode(s.answer_ids) for s in sequences]
        records = [{"id": p.id, "source": p.source, "temperature": config.temperature} for p, _ in batch]
        append_shard(corpus_dir, tag, records, sequences, answers)
        num_added += len(batch)
        num_tokens += sum(len(s.answer_ids) for s in sequences)
        if on_progress:
            seconds = time.perf_counter() - start
            on_progress({"phase": "generate", "tag": tag, "done": len(done) + num_added,
                         "total": len(done) + len(encoded), "answer_tokens": num_tokens,
                         "tokens_per_second": num_tokens / seconds})
    return num_added


def collect_self_prompts(target: LoadedModel, corpus_dir: Path, count: int, config: GenerationConfig,
                         on_progress: ProgressCallback | None = None) -> list[TrainingPrompt]:
    """Asks the target (sampling) to write `count` training prompts from topic x task meta-prompts;
    returns the usable ones (resumable through self_prompts.jsonl)."""
    path = Path(corpus_dir) / SELF_PROMPTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = read_jsonl(path) if path.exists() else []
    done = {row["meta_id"] for row in rows}
    todo = [(p, target.tokenizer.encode_chat(p.messages)) for p in meta_prompts(count, config.seed)
            if p.id not in done]
    generator = torch.Generator().manual_seed(config.seed + len(done))
    for batch in length_sorted_batches(todo, lambda item: len(item[1]), config.batch_size):
        sequences = generate_batch(target.model, [ids for _, ids in batch], target.stop_ids, config, generator)
        new_rows = [{"meta_id": p.id, "text": clean_self_prompt(target.tokenizer.decode(s.answer_ids))}
                    for (p, _), s in zip(batch, sequences)]
        append_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in new_rows))
        rows += new_rows
        if on_progress:
            on_progress({"phase": "self_prompts", "done": len(rows), "total": count})
    return [TrainingPrompt(f"self.{row['meta_id']}", "self_written", [{"role": "user", "content": row["text"]}])
            for row in rows if row["text"]]
