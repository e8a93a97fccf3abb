"""`bench serve`: the OpenAI-compatible server under N concurrent streamed clients (1, 4, 8, 16), its decoder
layers streamed from RAM and from a cold disk, against the same requests sent one after another.

Per tier one session loads (planned for the most clients: a KV cache slot each) and one server (server/) runs
in this process on a free port; the clients are plain HTTP threads. Every request is a greedy chat turn of
max_new_tokens tokens; the one-after-another baseline runs through the same server (the same slots, the same
tree-size chooser), so the ratio is what sharing passes gives a user. Each concurrent answer is checked against
its answer alone. Tiers as `bench batch` sets them: ram, every decoder layer streams from host memory; disk,
DISK_COLD_RESIDENT_LAYERS layers stay on the device, no RAM tier, the page cache dropped before each pass.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.batch_bench import TIERS, check_tiers
from bench.serve_clients import figures, one_after_another, together
from bench.spec_bench import DISK_COLD_RESIDENT_LAYERS

WARMUP_TOKENS = 2
GOAL_DISK_8 = 5.0           # issue 38: 8 clients from a cold disk, against one after another
Status = Callable[[str], None]


@dataclass(slots=True)
class ServeBenchConfig:
    target: str | None = None           # None: the embedded default model
    draft: str | None = None            # None: the target's shipped draft
    no_draft: bool = False
    clients: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    tiers: list[str] = field(default_factory=lambda: list(TIERS))
    max_new_tokens: int = 32
    budget: int | None = None           # tree tokens per pass; None: auto, as `serve` runs by default
    device: str = "auto"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if not self.clients or min(self.clients) <= 0:
            raise ValueError(f"--clients needs positive counts, e.g. 1,4,8; got {self.clients}")
        check_tiers(self.tiers)
        if self.max_new_tokens <= 0:
            raise ValueError(f"--max-new-tokens must be positive, got {self.max_new_tokens}")


def run_serve_bench(config: ServeBenchConfig, prompts: list[list[dict[str, str]]],
                    on_status: Status = lambda message: None) -> dict:
    """Rows per tier and client count (see the module docstring), and the summary."""
    if len(prompts) < max(config.clients):
        raise ValueError(f"{max(config.clients)} clients need as many prompts; got {len(prompts)}")
    prompts = prompts[:max(config.clients)]
    rows, tiers = [], {}
    for tier in config.tiers:
        tiers[tier], tier_rows = _run_tier(config, tier, prompts, on_status)
        rows += tier_rows
    return {"bench": "serve", "clients": config.clients, "max_new_tokens": config.max_new_tokens,
            "budget": config.budget if config.budget is not None else "auto", "tiers": tiers, "rows": rows,
            "summary": _summary(rows)}


def _run_tier(config: ServeBenchConfig, tier: str, prompts: list, on_status: Status) -> tuple[dict, list[dict]]:
    from runtime import Session
    from server import ServeConfig, SpecstreamServer
    session = Session(_runtime_config(config, tier, prompts), on_status=on_status)
    layers = session.engine_stats()["layers"]
    if not layers[tier]:
        session.close()
        raise RuntimeError(f"the {tier} tier holds no decoder layer in this plan: nothing would stream from it")
    on_status(f"{tier}: {layers[tier]} of {sum(layers.values())} layers stream from {tier}, "
              f"{session.batch_size} slots")
    server = SpecstreamServer(session, ServeConfig(port=0, max_new_tokens=config.max_new_tokens,
                                                   max_queue=max(config.clients), quiet=True))
    thread = server.start_in_thread()
    try:
        port, model = server.port, session.model_name
        one_after_another(port, model, prompts[:1], WARMUP_TOKENS)
        alone, rows = one_after_another(port, model, prompts, config.max_new_tokens), []
        for count in config.clients:
            began = time.perf_counter()
            answers = together(port, model, prompts[:count], config.max_new_tokens)
            rows.append(_row(tier, count, answers, time.perf_counter() - began, alone[:count]))
            on_status(f"{tier}, {count} clients: {rows[-1]['together']['tokens_per_second']:.2f} tok/s, "
                      f"x{rows[-1]['speedup']:.2f} against one after another")
        return {"layers": layers, "slots": session.batch_size,
                "tokens_per_pass": server.worker.status()["tokens_per_pass"]}, rows
    finally:
        server.stop()
        thread.join(60)
        session.close()


def _runtime_config(config: ServeBenchConfig, tier: str, prompts: list):
    """The session `serve` would open, with the device budget that streams the tier's layers: the plan
    request the session makes (its largest tree, the draft's footprint, a slot per client)."""
    from offload import LoadOptions
    from offload.loader import streaming_device_budget
    from offload.weights.resolve import resolve_model
    from offload.weights.tokenizer import Tokenizer
    from runtime import RuntimeConfig, weight_formats
    from runtime.session import MIN_PASS_TOKENS
    from runtime.speculation import choose_draft, draft_dtype_bytes, estimated_draft_footprint, max_budget_for
    spec = choose_draft(config.target, config.draft, config.no_draft).spec
    draft = estimated_draft_footprint(spec, draft_dtype_bytes(spec, config.device))
    probe = Tokenizer(resolve_model(config.target))
    max_context = max(len(probe.encode_chat(messages)) for messages in prompts) + config.max_new_tokens + 128
    max_budget = max_budget_for(config.budget, config.device) if spec else 1
    options = LoadOptions(config.target, config.device, config.dtype, max_context=max_context,
                          max_pass_tokens=max(MIN_PASS_TOKENS, max_budget), num_sequences=max(config.clients),
                          draft_bytes=draft.weight_bytes, draft_kv_token_bytes=draft.kv_token_bytes,
                          formats=weight_formats())
    resident = DISK_COLD_RESIDENT_LAYERS if tier == "disk" else 0
    return RuntimeConfig(config.target, config.draft, config.no_draft, config.device, config.dtype, max_context,
                         gpu_mem=streaming_device_budget(options, resident), ram=1 if tier == "disk" else None,
                         disk_cold=tier == "disk", budget=config.budget, batch_size=max(config.clients))


def _row(tier: str, count: int, answers: list, wall: float, alone: list) -> dict:
    concurrent = figures(answers, wall)
    sequential = figures(alone, sum(a.ended - a.sent for a in alone))
    return {"tier": tier, "clients": count, "together": concurrent, "one_after_another": sequential,
            "speedup": round(concurrent["tokens_per_second"] / sequential["tokens_per_second"], 3),
            "identical": [a.text for a in answers] == [a.text for a in alone]}


def _summary(rows: list[dict]) -> dict:
    speedups = {f"{row['tier']}_{row['clients']}_clients": row["speedup"] for row in rows}
    return {"speedup_vs_one_after_another": speedups, "all_identical": all(row["identical"] for row in rows),
            "goal": {"disk_8_clients": GOAL_DISK_8}}


def summary_line(result: dict) -> str:
    parts = [f"{row['tier']} x{row['clients']}: {row['together']['tokens_per_second']:.1f} tok/s "
             f"({row['speedup']:.2f}x)" for row in result["rows"]]
    same = "identical" if result["summary"]["all_identical"] else "NOT identical"
    return f"bench serve: {'; '.join(parts)}; answers {same} to each alone"
