"""run, chat and batch: answer prompts with a session (the target, its draft and decoder), streaming text."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .flags import add_model_flags, add_sampling_flags, batch_size, explicit_sampling

EXIT_SKIPPED = 3


def add_parsers(commands) -> None:
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
    batch.add_argument("--batch-size", default="auto", type=batch_size,
                       help="sequences decoded together, sharing every streamed layer: N, or auto: the most whose "
                            "KV cache the plan fits (default: auto)")
    for sub in (run, chat, batch):
        add_model_flags(sub)
        add_sampling_flags(sub, model_defaults=sub is chat)


def _sampling(args):
    from runtime.stop import check_stop_strings
    from spec import SamplingConfig
    if args.stop:
        check_stop_strings(args.stop)
    return SamplingConfig(**explicit_sampling(args))


def check_sampling_flags(args) -> None:
    """chat and serve: bad sampling flags are refused before the model loads."""
    from runtime.sampling_defaults import SamplingDefaults
    from runtime.stop import check_stop_strings
    SamplingDefaults({}).resolve(explicit_sampling(args))
    if args.stop:
        check_stop_strings(args.stop)


def model_sampling(args, session, console):
    """chat and serve: the flags given over the model's stated sampling over specstream's defaults, and one
    status line saying what is in force -> (the defaults, the flags given)."""
    from runtime.sampling_defaults import model_sampling_defaults
    defaults, explicit = model_sampling_defaults(session.target.path), explicit_sampling(args)
    console.print(f"[dim]{defaults.describe(explicit)}[/dim]", highlight=False, soft_wrap=True)
    return defaults, explicit


def open_session(args, console, **batch):
    from runtime import RuntimeConfig, Session
    from offload.byte_units import parse_bytes
    from perf.tree_size import parse_budget
    gpu_mem = parse_bytes(args.gpu_mem) if args.gpu_mem else None
    ram = parse_bytes(args.ram) if args.ram else None
    config = RuntimeConfig(args.target, args.draft, args.no_draft, args.device, args.dtype, args.context,
                           args.download, gpu_mem, ram, args.disk_cold, parse_budget(args.budget), args.judge,
                           args.judge_threshold, gguf_import=args.gguf_import, cpu_kernel=args.cpu_kernel,
                           draft_bits=args.draft_bits,
                           **batch)
    session = Session(config, on_status=lambda msg: console.print(f"[dim]{msg}[/dim]", highlight=False),
                      on_warning=lambda msg: console.print(f"[yellow]warning:[/yellow] {msg}", highlight=False),
                      on_progress=ConversionBar(console))
    if session.policy is not None:
        _print_judge_cost(session.judge_cost, console)
    return session


def _print_judge_cost(cost: dict, console) -> None:
    """One line at start: lossy, and what the judge file's held-out evaluation says it costs; a warning
    line when its ROC-AUC says it does not tell important mismatches from harmless ones."""
    console.print(f"[yellow]lossy decoding:[/yellow] the judge (p(important) < {cost['threshold']:.4g}) accepts "
                  f"draft tokens the target would not choose; {_held_out_figures(cost)}", highlight=False,
                  soft_wrap=True)
    if cost["predicts_importance"] is False:
        console.print(f"[yellow]warning:[/yellow] the judge's held-out ROC-AUC is {cost['evaluation']['roc_auc']:.2f} "
                      "(below 0.6): it does not predict importance for this target, so it changes answers "
                      "without a reliable speed-up", highlight=False, soft_wrap=True)


def _held_out_figures(cost: dict) -> str:
    evaluation, row = cost["evaluation"], cost["at_threshold"]
    if evaluation is None:
        return "no held-out evaluation recorded"
    roc_auc = f"ROC-AUC {evaluation['roc_auc']:.2f}"
    if evaluation["task"] is None:
        return f"held out {roc_auc} over {evaluation['num_problems']} mined problems; answer agreement and " \
               "tokens/pass not measured (`judge eval --record`)"
    figures = f"held out on {evaluation['task']} ({evaluation['num_problems']} problems): {roc_auc}"
    if row is None:
        measured = ", ".join(f"{r['threshold']:.4g}" for r in evaluation["rows"]) or "none"
        return f"{figures}; threshold {cost['threshold']:.4g} not measured (measured: {measured})"
    return (f"{figures}, answer agreement {row['answer_agreement']:.0%} at {row['tokens_per_pass']:.2f} tokens/pass "
            f"(lossless {evaluation['lossless_tokens_per_pass']:.2f})")


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
    with open_session(args, console) as session:      # joins the loader threads on success, error and Ctrl-C
        return _answer(args, session, sampling, console)


def _answer(args, session, sampling, console) -> int:
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
    check_sampling_flags(args)
    with open_session(args, console) as session:
        defaults, explicit = model_sampling(args, session, console)
        return _chat(args, session, defaults.resolve(explicit), console)


def _chat(args, session, sampling, console) -> int:
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
    if not args.input.is_file():
        raise FileNotFoundError(f"batch input not found: {args.input}")
    sampling = _sampling(args)
    with open_session(args, console, batch_size=args.batch_size, max_batch=_count_lines(args.input)) as session:
        return _batch(args, session, sampling, console)


def _count_lines(path: Path) -> int:
    """Non-empty input lines: the most requests a batch can hold at once (auto never plans for more)."""
    with open(path, "rb") as handle:
        return max(1, sum(1 for line in handle if line.strip()))


def _batch(args, session, sampling, console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from runtime import run_batch
    judged = [0]

    def generate(item, item_sampling, max_tokens):
        text, result = session.generate(session.encode(item.messages), item_sampling, max_tokens,
                                        stop=item.stop if item.stop is not None else args.stop)
        judged[0] += result.stats.policy_accepted
        return text, session.report(text, result)

    runner = None
    if session.batch_size > 1:
        from runtime.batch_runner import BatchRunner
        runner = BatchRunner(session, args.stop)
    columns = (TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[flow]}"),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("batch", total=None, flow="")

        def show(done: int | None = None, total: int | None = None) -> None:
            flow = f"{runner.tokens_per_second:.1f} tok/s · {runner.num_in_flight} in flight" if runner else ""
            progress.update(task, **({"completed": done, "total": total} if done is not None else {}), flow=flow)

        if runner:
            runner.on_update = show
        summary = run_batch(args.input, args.output, generate, sampling, args.max_new_tokens, session.model_name,
                            on_progress=show, generate_many=runner.generate_many if runner else None)
    judged[0] += runner.policy_accepted if runner else 0
    for skipped in summary.skipped_lines:
        console.print(f"[yellow]skipped {skipped}[/yellow]")
    console.print(f"{summary.num_completed} completed, {summary.num_failed} failed, "
                  f"{summary.num_done_before} already done, {len(summary.skipped_lines)} lines skipped"
                  + (f"; lossy: the judge accepted {judged[0]} tokens" if session.policy else ""))
    return 0 if summary.is_clean else EXIT_SKIPPED


COMMANDS = {"run": cmd_run, "chat": cmd_chat, "batch": cmd_batch}
