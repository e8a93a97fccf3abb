"""`bench self-draft`: end-to-end decoding with the self-draft against the shipped draft and autoregressive
decoding, the same prompts and tier, rounds in turn (prompt-major: each prompt runs under every draft back to
back, so a shared machine's drift hits each alike), draft time included.

Each draft gets the `--gpu-mem` at which its own plan keeps `--resident-layers` decoder layers and streams the
rest (27 of the default model's 30 at 3): the self-draft's covers its substitutes too. The target is the default
model's dense fp32 import by default (`--gguf-import`): a streamed layer of 14 MB against a 4-bit substitute of
2 MB, as a bf16 checkpoint streams beside its substitutes on a GPU. (A Q4 GGUF run in place streams layers no
larger than 4-bit substitutes: there the planner keeps layers resident instead.)

    specstream bench self-draft --tier disk --prompts 2 --max-new-tokens 48
"""
from __future__ import annotations

import time
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass, field

import textdata
from offload.loader import streaming_device_budget
from runtime import RuntimeConfig, Session
from runtime.session import planned_options
from spec import SamplingConfig, default_draft_for
from spec.distill.prompts import prompts_from_jsonl
from spec.self_draft import SELF_DRAFT, SubstituteConfig

DRAFTS = ("none", "shipped", SELF_DRAFT)


@dataclass(slots=True)
class SelfDraftBenchConfig:
    tier: str = "disk"                 # ram | disk (cold: the page cache dropped before each pass)
    num_prompts: int = 2
    max_new_tokens: int = 48
    resident_layers: int = 3
    draft_bits: int = 4
    max_context: int = 1024
    gguf_import: bool = True
    budget: int | None = None          # tree tokens per pass (None: the auto chooser, as a session runs)
    device: str = "cpu"
    drafts: list[str] = field(default_factory=lambda: list(DRAFTS))

    def __post_init__(self) -> None:
        if self.tier not in ("ram", "disk"):
            raise ValueError(f"--tier must be ram or disk, got {self.tier!r}")
        if self.num_prompts < 1 or self.max_new_tokens < 2 or self.resident_layers < 0:
            raise ValueError("--prompts >= 1, --max-new-tokens >= 2 and --resident-layers >= 0, please")
        SubstituteConfig(self.draft_bits)


def run_self_draft_bench(config: SelfDraftBenchConfig, on_status: Callable[[str], None] = lambda m: None) -> dict:
    prompts = [p.messages for p in prompts_from_jsonl(textdata.path(textdata.CHAT_PROMPTS), is_evaluation=True)]
    prompts = prompts[:config.num_prompts]
    sessions = {draft: _session(config, draft, on_status) for draft in config.drafts}
    runs = {draft: [] for draft in config.drafts}
    try:
        for messages in prompts:
            for draft, session in sessions.items():
                session.reset()
                ids = session.encode(messages)
                started = time.perf_counter()
                _, result = session.generate(ids, SamplingConfig(), config.max_new_tokens)
                runs[draft].append((result, time.perf_counter() - started))
                on_status(f"{draft}: {result.stats.num_new_tokens} tokens, {result.stats.tokens_per_pass:.2f} per "
                          f"pass, {result.stats.num_new_tokens / runs[draft][-1][1]:.2f} tok/s")
        rows = {draft: _row(sessions[draft], runs[draft]) for draft in config.drafts}
    finally:
        for session in sessions.values():
            session.close()
    base = rows.get("none", {}).get("tokens_per_second")
    for row in rows.values():
        row["speedup_vs_autoregressive"] = round(row["tokens_per_second"] / base, 3) if base else None
    return {"bench": "self-draft", "tier": config.tier, "target": "default (fp32 import)" if config.gguf_import
            else "default (GGUF in place)", "num_prompts": len(prompts), "max_new_tokens": config.max_new_tokens,
            "device": config.device, "draft_bits": config.draft_bits, "budget": config.budget or "auto", "rows": rows}


def _session(config: SelfDraftBenchConfig, draft: str, on_status) -> Session:
    named = {"shipped": str(default_draft_for(None)), SELF_DRAFT: SELF_DRAFT}.get(draft)
    runtime = RuntimeConfig(None, named,
                            no_draft=draft == "none", device=config.device, dtype="fp32",
                            max_context=config.max_context,
                            ram=1 if config.tier == "disk" else None, disk_cold=config.tier == "disk",
                            gguf_import=config.gguf_import, cpu_kernel="dense",
                            budget=config.budget if draft != "none" else None,
                            draft_bits=config.draft_bits if draft == SELF_DRAFT else None)
    # the budget that keeps resident_layers on the device beside what the session plans (draft, substitutes)
    runtime.gpu_mem = streaming_device_budget(planned_options(runtime), config.resident_layers)
    on_status(f"{draft}: --gpu-mem {runtime.gpu_mem / 2**20:.0f} MiB")
    return Session(runtime, on_status=on_status)


def _row(session: Session, runs: list) -> dict:
    tokens = sum(result.stats.num_new_tokens for result, _ in runs)
    seconds = sum(elapsed for _, elapsed in runs)
    passes = sum(result.stats.num_target_passes for result, _ in runs)
    steps = [result.stats for result, _ in runs]
    draft_seconds = sum(s.draft_seconds for s in steps)
    plan = session.target.plan
    name = session.draft_name
    return {"draft": Path(name).name if name and not session.draft.is_self else name, "layers": {t: plan.tier_of.count(t) for t in ("device", "ram", "disk")},
            "gpu_mem_bytes": session.config.gpu_mem, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_second": round(tokens / seconds, 3), "tokens_per_pass": round(tokens / max(passes, 1), 3),
            "draft_seconds": round(draft_seconds, 2), "peak_device_bytes": session.peak_device_bytes()}
