"""specstream command line: run, chat, batch. Flags -> config objects -> library calls -> output."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Idle OpenMP workers spin briefly, then sleep (set before torch starts its pool; a user's own
# OMP_WAIT_POLICY or GOMP_SPINCOUNT wins). A decode step is hundreds of small ops back to back: sleeping
# at once (PASSIVE) made a batch-1 draft step 1.6x slower; unbounded spinning starves the layer loader
# thread and neighbours on an oversubscribed machine (10-25x slower there).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"

DEFAULT_MAX_NEW_TOKENS = 256
EXIT_USER_ERROR, EXIT_SKIPPED = 2, 3


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    from offload.devices import DEVICE_NAMES, DTYPE_CHOICES
    group = parser.add_argument_group("model")
    group.add_argument("--target", default=None,
                       help="target model: HF folder, .gguf file or Hub id (default: embedded SmolLM2-135M-Instruct)")
    group.add_argument("--draft", default=None,
                       help="draft for speculative decoding: a distilled draft folder, or any model folder, .gguf or "
                            "Hub id with the target's tokenizer (default: the target's shipped draft, if any)")
    group.add_argument("--no-draft", action="store_true", help="never use a draft model (default: off)")
    group.add_argument("--judge", default=None,
                       help="AutoJudge file or 'default': also accept draft tokens it scores unimportant (lossy: "
                            "the answer may differ from the target's) (default: off, exact)")
    group.add_argument("--judge-threshold", type=float, default=None,
                       help="accept a mismatch when p(important) < this, in [0, 1] (default: the judge's "
                            "row that accepted 5%% of held-out mismatches)")
    group.add_argument("--budget", default="auto",
                       help="tree tokens verified per target pass, 1-8192, or auto: sized from the measured pass "
                            "time and recent acceptance (default: auto)")
    group.add_argument("--device", default="auto", choices=DEVICE_NAMES, help="compute device (default: auto)")
    group.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                       help="compute dtype (default: auto = fp32 on CPU, bf16 on CUDA)")
    group.add_argument("--context", type=int, default=4096, help="KV cache size in tokens (default: 4096)")
    group.add_argument("--gpu-mem", default=None,
                       help="device memory budget, e.g. 24GiB (default: free device memory minus a margin)")
    group.add_argument("--ram", default=None,
                       help="host RAM budget for streamed layers, e.g. 64GiB (default: available minus a margin)")
    group.add_argument("--disk-cold", action="store_true",
                       help="drop the weights' page cache before each pass, to measure SSD streaming (default: off)")
    group.add_argument("--download", action="store_true",
                       help="allow downloading a Hub model that is not in the local cache (default: off)")


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                       help=f"tokens to generate at most (default: {DEFAULT_MAX_NEW_TOKENS})")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy decoding (default: 0)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (default: 0 = off)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x top prob (default: 0 = off)")
    group.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="divide the logits of tokens already in the context by this (> 1 discourages "
                            "repeats; speculation stays exact) (default: 1.0 = off)")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="OpenAI's: subtract this from the logit of every token already in the answer "
                            "(default: 0 = off)")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="OpenAI's: subtract this times the token's count in the answer (default: 0 = off)")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="end the answer before this text (repeatable; default: none)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specstream", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     description="Run large language models on one consumer GPU or a CPU.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="answer one prompt, streaming the text")
    run.add_argument("prompt", help="the user message (or raw text with --raw); - reads it from stdin")
    run.add_argument("--system", default=None, help="add a system turn (default: the template's own)")
    run.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    run.add_argument("--json", action="store_true", help="print one JSON object with text and stats at the end")
    chat = commands.add_parser("chat", help="multi-turn chat (/reset, /system TEXT, /stats, /quit)")
    chat.add_argument("--system", default=None, help="system prompt for the conversation (default: none)")
    batch = commands.add_parser("batch", help="answer every line of a JSONL file, resumable")
    batch.add_argument("input", type=Path, help='JSONL lines {"id", "prompt"} or OpenAI batch lines')
    batch.add_argument("-o", "--output", type=Path, required=True, help="OpenAI batch-output JSONL (appended)")
    for sub in (run, chat, batch):
        _add_model_flags(sub)
        _add_sampling_flags(sub)
    from runtime.tools_cli import add_tool_parsers
    add_tool_parsers(commands)
    return parser


def _sampling(args):
    from runtime.stop import check_stop_strings
    from spec import SamplingConfig
    if args.stop:
        check_stop_strings(args.stop)
    return SamplingConfig(args.temperature, args.top_p, args.top_k, args.min_p, args.seed, args.repetition_penalty,
                          args.presence_penalty, args.frequency_penalty)


def _session(args, console):
    from runtime import RuntimeConfig, Session
    from offload.planner import parse_bytes
    from spec.budget import parse_budget
    gpu_mem = parse_bytes(args.gpu_mem) if args.gpu_mem else None
    ram = parse_bytes(args.ram) if args.ram else None
    config = RuntimeConfig(args.target, args.draft, args.no_draft, args.device, args.dtype, args.context,
                           args.download, gpu_mem, ram, args.disk_cold, parse_budget(args.budget), args.judge,
                           args.judge_threshold)
    session = Session(config, on_status=lambda msg: console.print(f"[dim]{msg}[/dim]", highlight=False),
                      on_warning=lambda msg: console.print(f"[yellow]warning:[/yellow] {msg}", highlight=False),
                      on_progress=ConversionBar(console))
    if session.policy is not None:
        console.print(f"[yellow]lossy decoding:[/yellow] the judge (p(important) < {session.policy.threshold:.4g}) "
                      "accepts draft tokens the target would not choose; answers may differ from the target's",
                      highlight=False)
    return session


class ConversionBar:
    """A rich progress bar over a GGUF import's tensors, shown only while one runs."""

    def __init__(self, console) -> None:
        self.console, self.progress, self.task = console, None, None

    def __call__(self, done: int, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        if self.progress is None:
            columns = (TextColumn("converting tensors"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
            self.progress = Progress(*columns, console=self.console, transient=True)
            self.progress.start()
            self.task = self.progress.add_task("convert", total=total)
        self.progress.update(self.task, completed=done, total=total)
        if done >= total:
            self.progress.stop()
            self.progress = None


def _messages(system: str | None, history: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + history


def cmd_run(args, console) -> int:
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
        if not args.prompt.strip():
            raise ValueError("run -: no prompt on stdin")
    sampling = _sampling(args)
    session = _session(args, console)
    if args.raw:
        prompt_ids = session.encode(raw=args.prompt)
    else:
        prompt_ids = session.encode(_messages(args.system, [{"role": "user", "content": args.prompt}]))
    on_text = None if args.json else (lambda delta: print(delta, end="", flush=True))
    text, result = session.generate(prompt_ids, sampling, args.max_new_tokens, on_text, args.stop)
    if args.json:
        print(json.dumps(session.report(text, result), ensure_ascii=False))
    else:
        print()
        console.print(_footer(session.report(text, result)), style="dim")
    return 0


def _footer(report: dict) -> str:
    speculation = report.get("speculation")
    budget = f" (budget {speculation['budget']['last']})" if speculation else ""
    if report.get("lossy"):
        budget += f" · LOSSY: judge accepted {report['judge_accepted']} tokens"
    return (f"{report['num_new_tokens']} tokens · {report['tokens_per_second']:.1f} tok/s · "
            f"{report['tokens_per_pass']:.2f} tok/pass{budget} · peak {report['peak_device_bytes'] / 2**20:.0f} MiB "
            f"· {report['stop_reason']}")


def cmd_chat(args, console) -> int:
    sampling = _sampling(args)
    session = _session(args, console)
    system, history, last = args.system, [], None
    console.print("[dim]chat: /reset, /system TEXT, /stats, /quit; Ctrl-C stops an answer[/dim]")
    while True:
        try:
            line = console.input("[bold green]you>[/bold green] ")
        except (EOFError, KeyboardInterrupt):
            console.print()
            return 0
        command, _, rest = line.strip().partition(" ")
        if command == "/quit":
            return 0
        if command == "/reset":
            history, last = [], None
            session.reset()
            console.print("[dim]conversation cleared[/dim]")
            continue
        if command == "/system":
            system, history = rest or None, []
            console.print(f"[dim]system prompt {'set' if rest else 'cleared'}; conversation cleared[/dim]")
            continue
        if command == "/stats":
            console.print_json(data=last) if last else console.print("[dim]no answer yet[/dim]")
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        last = _chat_answer(session, sampling, args, _messages(system, history), history, console)


def _chat_answer(session, sampling, args, messages, history, console) -> dict | None:
    pieces: list[str] = []

    def on_text(delta: str) -> None:
        pieces.append(delta)
        print(delta, end="", flush=True)

    try:
        text, result = session.generate(session.encode(messages), sampling, args.max_new_tokens, on_text, args.stop)
    except KeyboardInterrupt:
        print()
        console.print("[dim](answer stopped)[/dim]")
        history.append({"role": "assistant", "content": "".join(pieces)})
        return None
    print()
    report = session.report(text, result)
    console.print(_footer(report), style="dim")
    history.append({"role": "assistant", "content": text})
    return report


def cmd_batch(args, console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from runtime import run_batch
    if not args.input.is_file():
        raise FileNotFoundError(f"batch input not found: {args.input}")
    sampling = _sampling(args)
    session = _session(args, console)

    judged = [0]

    def generate(item, item_sampling, max_tokens):
        text, result = session.generate(session.encode(item.messages), item_sampling, max_tokens,
                                        stop=item.stop if item.stop is not None else args.stop)
        judged[0] += result.stats.policy_accepted
        return text, session.report(text, result)

    columns = (TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("batch", total=None)
        summary = run_batch(args.input, args.output, generate, sampling, args.max_new_tokens, session.model_name,
                            on_progress=lambda done, total: progress.update(task, completed=done, total=total))
    for skipped in summary.skipped_lines:
        console.print(f"[yellow]skipped {skipped}[/yellow]")
    console.print(f"{summary.num_completed} completed, {summary.num_failed} failed, "
                  f"{summary.num_done_before} already done, {len(summary.skipped_lines)} lines skipped"
                  + (f"; lossy: the judge accepted {judged[0]} tokens" if session.policy else ""))
    return 0 if summary.is_clean else EXIT_SKIPPED


COMMANDS = {"run": cmd_run, "chat": cmd_chat, "batch": cmd_batch}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    args = build_parser().parse_args(argv)
    console = Console(stderr=True)
    from runtime.tools_cli import TOOL_COMMANDS
    try:
        return {**COMMANDS, **TOOL_COMMANDS}[args.command](args, console)
    except KeyboardInterrupt:
        console.print("[dim]interrupted[/dim]")
        return 130
    except Exception as err:  # user errors: one clear line; SPECSTREAM_DEBUG=1 shows the traceback
        if os.environ.get("SPECSTREAM_DEBUG") or not _is_user_error(err):
            raise
        console.print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)
        return EXIT_USER_ERROR


def _is_user_error(err: Exception) -> bool:
    from runtime import UserError
    return isinstance(err, (UserError, ValueError, FileNotFoundError, PermissionError, IsADirectoryError))


if __name__ == "__main__":
    sys.exit(main())
