"""A long benchmark's finished rows, one JSON line each, so a run that is killed resumes where it stopped.

The journal's name is a fingerprint of the settings that decide a row's result (those that differ from
their defaults, models as the user named them), and a row's key names its prompt (token ids and seed), so
`--resume` picks up only rows of the same benchmark, and a run over more prompts reuses those it shares.
The first line holds the fingerprint; every later line is {"key": [...], "value": {...}}; a torn last line
(a kill mid-write) is ignored.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import MISSING, fields
from pathlib import Path

from offload.weights.disk_errors import append_text, write_text_atomic, writing
from offload.weights.gguf_import import cache_root
from spec import DecodeResult
from spec.stats import DecodeStats

JOURNAL_FORMAT = "specstream-bench-journal-1"


def fingerprint(settings) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def changed_fields(instance) -> dict:
    """A dataclass's fields that differ from their defaults: a settings fingerprint that a new field with
    a default leaves unchanged, so a run journaled by an older version still resumes."""
    changed = {}
    for item in fields(instance):
        default = item.default if item.default is not MISSING else (
            item.default_factory() if item.default_factory is not MISSING else MISSING)
        if getattr(instance, item.name) != default:
            changed[item.name] = getattr(instance, item.name)
    return changed


def read_journal(path: Path) -> tuple[dict, dict[tuple, dict]]:
    """A journal file's header and its rows by key (a torn last line is skipped)."""
    lines = path.read_text().splitlines()
    header = json.loads(lines[0]) if lines else {}
    rows = {}
    for line in lines[1:]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue                                   # the line a kill cut short
        rows[tuple(record["key"])] = record["value"]
    return header, rows


class BenchJournal:
    """Rows by key (a tuple of strings and ints); `resume=False` starts the journal afresh; `read_only`
    takes the rows and never writes."""

    def __init__(self, bench: str, settings: dict, resume: bool, folder: Path | None = None,
                 read_only: bool = False) -> None:
        key = fingerprint(settings)
        self.path = (folder or cache_root() / "bench_journal") / f"{bench}-{key}.jsonl"
        self.rows: dict[tuple, dict] = self._read(key) if resume or read_only else {}
        self.resumed, self.read_only, self.bench = 0, read_only, bench
        if not self.rows and not read_only:
            with self._writing():
                self.path.parent.mkdir(parents=True, exist_ok=True)
                write_text_atomic(self.path, json.dumps({"format": JOURNAL_FORMAT, "fingerprint": key}) + "\n")

    def _writing(self):
        """A full disk: one line naming the journal, its rows and the command that takes them up."""
        return writing(self.path, f"{len(self.rows)} finished rows in {self.path}",
                       f"rerun the same `specstream bench {self.bench}` command with --resume")

    def _read(self, key: str) -> dict[tuple, dict]:
        if not self.path.is_file():
            return {}
        header, rows = read_journal(self.path)
        return rows if header == {"format": JOURNAL_FORMAT, "fingerprint": key} else {}

    def get(self, *key) -> dict | None:
        value = self.rows.get(tuple(key))
        self.resumed += value is not None
        return value

    def put(self, value: dict, *key) -> None:
        if self.read_only:
            raise RuntimeError("a read-only journal takes no rows")
        with self._writing():
            append_text(self.path, json.dumps({"key": list(key), "value": value}) + "\n")
        self.rows[tuple(key)] = value


def result_to_dict(result: DecodeResult) -> dict:
    stats = {f.name: getattr(result.stats, f.name) for f in fields(DecodeStats)}   # asdict would mangle Counters
    stats.update(budgets=dict(stats["budgets"]), yields=dict(stats["yields"]), depth_reached=list(stats["depth_reached"]))
    return {"token_ids": list(result.token_ids), "stats": stats}


def result_from_dict(value: dict) -> DecodeResult:
    raw = value["stats"]
    stats = DecodeStats(**{f.name: raw[f.name] for f in fields(DecodeStats) if f.name in raw})
    stats.budgets = Counter({int(k): n for k, n in raw["budgets"].items()})   # JSON keys are strings
    stats.yields = Counter({int(k): n for k, n in raw["yields"].items()})
    return DecodeResult(list(value["token_ids"]), stats)
