"""The distillation corpus on disk: generated sequences with the target's top-k log-probabilities.

Layout of a corpus folder (resumable: a record line is written only after its shard):
    records-<tag>.jsonl           one line per sequence: id, source, shard, row, lengths, answer text
    shards/<tag>-<n>.safetensors  tokens [T] int32, offsets [S+1] int64, prompt_lengths [S] int32,
                                  topk_ids [T, k] int32, topk_logprobs [T, k] float16
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from offload.weights.disk_errors import append_text
from offload.weights.safetensors_io import SafetensorsFile, write_safetensors
from .generate import GeneratedSequence
from textdata import read_jsonl

CORPUS_FORMAT = {"format": "specstream-distill-corpus", "version": "1"}


@dataclass(slots=True)
class CorpusSequence:
    token_ids: Tensor        # [T] int64
    topk_ids: Tensor         # [T, k] int32 target ids, -1 where nothing follows
    topk_logprobs: Tensor    # [T, k] float16
    num_prompt_tokens: int
    source: str
    prompt_id: str = ""

    def __len__(self) -> int:
        return self.token_ids.shape[0]


def done_ids(corpus_dir: Path, tag: str) -> set[str]:
    path = Path(corpus_dir) / f"records-{tag}.jsonl"
    if not path.exists():
        return set()
    return {row["id"] for row in read_jsonl(path)}


def append_shard(corpus_dir: Path, tag: str, records: list[dict], sequences: list[GeneratedSequence],
                 answers: list[str]) -> Path:
    """Writes one shard, then its record lines (so a crash never leaves records without data)."""
    shard_dir = Path(corpus_dir) / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    index = 1 + max((int(p.stem.rsplit("-", 1)[1]) for p in shard_dir.glob(f"{tag}-*.safetensors")), default=-1)
    path = shard_dir / f"{tag}-{index:05d}.safetensors"
    lengths = torch.tensor([0] + [len(s.token_ids) for s in sequences])
    write_safetensors(path, {
        "tokens": torch.tensor([t for s in sequences for t in s.token_ids], dtype=torch.int32),
        "offsets": lengths.cumsum(0),
        "prompt_lengths": torch.tensor([s.num_prompt_tokens for s in sequences], dtype=torch.int32),
        "topk_ids": torch.cat([s.topk_ids for s in sequences]),
        "topk_logprobs": torch.cat([s.topk_logprobs for s in sequences]),
    }, CORPUS_FORMAT)
    lines = [{**record, "shard": path.name, "row": row, "num_prompt_tokens": seq.num_prompt_tokens,
              "num_answer_tokens": len(seq.answer_ids), "stop": seq.stop_reason, "answer": answer}
             for row, (record, seq, answer) in enumerate(zip(records, sequences, answers))]
    append_text(Path(corpus_dir) / f"records-{tag}.jsonl", "".join(json.dumps(line, ensure_ascii=False) + "\n"
                                                                   for line in lines))
    return path


def read_records(corpus_dir: Path) -> list[dict]:
    records = []
    for path in sorted(Path(corpus_dir).glob("records-*.jsonl")):
        records += read_jsonl(path)
    return records


def load_corpus(corpus_dir: Path) -> list[CorpusSequence]:
    """Every recorded sequence, in record order (shards without records are ignored)."""
    shards: dict[str, dict[str, Tensor]] = {}
    out = []
    for record in read_records(corpus_dir):
        if record["shard"] not in shards:
            opened = SafetensorsFile(Path(corpus_dir) / "shards" / record["shard"])
            shards[record["shard"]] = {name: opened.tensor(name).clone() for name in opened.entries}
        shard, row = shards[record["shard"]], record["row"]
        start, end = int(shard["offsets"][row]), int(shard["offsets"][row + 1])
        out.append(CorpusSequence(shard["tokens"][start:end].long(), shard["topk_ids"][start:end],
                                  shard["topk_logprobs"][start:end], int(shard["prompt_lengths"][row]),
                                  record.get("source", ""), record["id"]))
    return out


def token_counts(sequences: list[CorpusSequence], vocab_size: int) -> Tensor:
    """[V] int64: how often each target token occurs as a token or as the target's top-1 next token."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(seq.token_ids, minlength=vocab_size)
        top1 = seq.topk_ids[:, 0].long()
        counts += torch.bincount(top1[top1 >= 0], minlength=vocab_size)
    return counts


def source_summary(sequences: list[CorpusSequence]) -> dict[str, int]:
    """Tokens per source."""
    counts: Counter = Counter()
    for seq in sequences:
        counts[seq.source] += len(seq)
    return dict(counts)
