"""Teacher passes over raw text (code, prose): the target's top-k next-token log-probabilities at every
position, computed in large batches through DecoderModel.forward (so an offloaded target streams)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from offload import DecoderModel, LoadedModel
from .corpus import append_shard, done_ids
from .generate import NO_TARGET, GeneratedSequence, GenerationConfig, topk_logprobs

TEXT_TAG = "text"


def teacher_topk(model: DecoderModel, rows: list[list[int]], top_k: int, chunk: int) -> list[tuple[Tensor, Tensor]]:
    """rows of token ids (right-padded into one batch; causal attention never sees the padding)
    -> per row (ids [T, k] int32, log-probabilities [T, k] float16); the last position has NO_TARGET."""
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        tokens[index, :len(row)] = torch.tensor(row)
    cache = model.new_cache(width, len(rows))
    ids = torch.empty(len(rows), width, top_k, dtype=torch.int32)
    logprobs = torch.empty(len(rows), width, top_k, dtype=torch.float16)
    for start in range(0, width, chunk):
        logits = model.forward(tokens[:, start:start + chunk], cache).logits             # [B, n, V]
        cache.commit()
        ids[:, start:start + chunk], logprobs[:, start:start + chunk] = topk_logprobs(logits, top_k)
    out = []
    for index, row in enumerate(rows):
        row_ids = ids[index, :len(row)].clone()
        row_ids[-1] = NO_TARGET
        out.append((row_ids, logprobs[index, :len(row)].clone()))
    return out


def text_chunks(target: LoadedModel, path: Path, max_tokens: int) -> list[tuple[str, list[int]]]:
    """(record id, tokens) pieces of at most max_tokens, each starting with BOS when the model has one."""
    ids = target.tokenizer.encode(Path(path).read_text(errors="replace"))
    bos = [target.config.bos_token_id] if target.config.bos_token_id is not None else []
    step = max_tokens - len(bos)
    return [(f"text.{Path(path).name}.{i // step}", bos + ids[i:i + step]) for i in range(0, len(ids), step)
            if len(ids[i:i + step]) > 16]


def collect_text(target: LoadedModel, files: list[Path], corpus_dir: Path, config: GenerationConfig,
                 on_progress: Callable[[dict], None] | None = None) -> int:
    """Adds every not-yet-recorded chunk of `files` to the corpus; returns how many were added."""
    done = done_ids(corpus_dir, TEXT_TAG)
    chunks = [c for path in files for c in text_chunks(target, path, config.max_prompt_tokens) if c[0] not in done]
    for start in range(0, len(chunks), config.batch_size):
        batch = chunks[start:start + config.batch_size]
        tables = teacher_topk(target.model, [ids for _, ids in batch], config.top_k, config.prefill_chunk)
        sequences = [GeneratedSequence(ids, len(ids), table[0], table[1], "text")
                     for (_, ids), table in zip(batch, tables)]
        append_shard(corpus_dir, TEXT_TAG, [{"id": cid, "source": TEXT_TAG} for cid, _ in batch], sequences,
                     ["" for _ in batch])
        if on_progress:
            on_progress({"phase": "text", "done": len(done) + start + len(batch), "total": len(done) + len(chunks)})
    return len(chunks)
