"""`bench all`'s batched row: `bench batch`'s own function (bench/batch_summary.batch_report) on the suite's
private copy of the default model and its shipped draft, the suite's batch sizes and answer length, one chat
prompt per slot of the largest batch."""
from __future__ import annotations


def run_batch(ctx) -> dict:
    import textdata
    from bench.batch_bench import BatchBenchConfig
    from bench.batch_summary import batch_report
    from spec.distill.prompts import prompt_turns
    from spec.draft import default_draft_for
    c = ctx.config
    # the target is the suite's private copy of the default model: its shipped draft is named explicitly
    config = BatchBenchConfig(str(ctx.model_folder), str(default_draft_for(None)), list(c.batch_sizes),
                              max_new_tokens=c.max_new_tokens)
    prompts = prompt_turns([textdata.path(textdata.CHAT_PROMPTS)], max(c.batch_sizes))
    return batch_report(config, prompts, ctx.status)
