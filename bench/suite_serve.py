"""`bench all`'s server row: `bench serve`'s own function on the suite's private copy of the default model and
its shipped draft, the suite's client counts and answer length, one chat prompt per client of the largest row."""
from __future__ import annotations


def run_serve(ctx) -> dict:
    import textdata
    from bench.serve_bench import ServeBenchConfig, run_serve_bench
    from spec.distill.prompts import prompt_turns
    from spec.draft import default_draft_for
    c = ctx.config
    # the target is the suite's private copy of the default model: its shipped draft is named explicitly
    config = ServeBenchConfig(str(ctx.model_folder), str(default_draft_for(None)), clients=list(c.serve_clients),
                              max_new_tokens=c.max_new_tokens)
    prompts = prompt_turns([textdata.path(textdata.CHAT_PROMPTS)], max(c.serve_clients))
    return run_serve_bench(config, prompts, ctx.status)
