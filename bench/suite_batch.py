"""`bench all`'s batched row: runs `bench batch` when this build's parser has it (looked up in the parser
each run, so the suite picks the command up as soon as it lands), passing the suite's settings through
whichever of its flags exist; otherwise the row is skipped with the reason."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys


def bench_subcommand(name: str) -> argparse.ArgumentParser | None:
    """The `bench NAME` parser of this build, or None."""
    from commands import build_parser
    return _subparsers(_subparsers(build_parser()).get("bench") or argparse.ArgumentParser()).get(name)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def batch_argv(parser: argparse.ArgumentParser, settings: dict[str, list[str]]) -> list[str]:
    """`bench batch` and those of the suite's settings whose flags the command has."""
    flags = {flag for action in parser._actions for flag in action.option_strings}
    argv = ["bench", "batch"]
    for flag, values in settings.items():
        if flag in flags:
            argv += [flag, *values]
    return argv


def run_batch(ctx) -> dict:
    import textdata
    parser = bench_subcommand("batch")
    if parser is None:
        return {"skipped": "this build has no `bench batch` command yet (the suite runs it once the bench parser "
                           "has it)"}
    from spec.draft import default_draft_for
    c = ctx.config
    # the target is the suite's private copy of the default model: its shipped draft is named explicitly
    settings = {"--target": [str(ctx.model_folder)], "--draft": [str(default_draft_for(None))], "--prompts": [str(textdata.path(textdata.CHAT_PROMPTS))],
                "--limit": [str(max(c.batch_sizes))], "--max-new-tokens": [str(c.max_new_tokens)],
                "--batch-sizes": [",".join(map(str, c.batch_sizes))], "--threads": [str(c.threads)],
                "--json": []}
    flags = {flag for action in parser._actions for flag in action.option_strings}
    if "--batch-sizes" not in flags and "--batch-size" in flags:      # one size per call
        runs = [_run(batch_argv(parser, {**settings, "--batch-size": [str(size)]}), ctx) for size in c.batch_sizes]
        failed = next((r for r in runs if "error" in r), None)
        return failed or {"bench": "batch", "runs": runs, "batch_sizes": list(c.batch_sizes)}
    return _run(batch_argv(parser, settings), ctx)


def _run(argv: list[str], ctx) -> dict:
    from bench.suite import ROOT
    ctx.status("specstream " + " ".join(a if len(a) < 40 else "..." for a in argv))
    proc = subprocess.run([sys.executable, "-m", "cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    found = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not found:
        return {"error": f"`specstream {' '.join(argv[:2])}` exited {proc.returncode}: "
                         f"{(proc.stderr.strip().splitlines() or ['no output'])[-1][:400]}"}
    return json.loads(found[-1])
