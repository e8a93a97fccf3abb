"""quantize and eval ppl: SpQR-quantize a model layer by layer (resumable); perplexity of any model."""
from __future__ import annotations

import json
from pathlib import Path

from .flags import add_gguf_import, add_target


def add_parsers(commands) -> None:
    quantize = commands.add_parser("quantize", help="SpQR-quantize a model layer by layer (resumable)")
    add_target(quantize, "model to quantize (default: embedded model)")
    add_gguf_import(quantize)
    quantize.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    quantize.add_argument("--bits", type=int, default=4, help="bits per weight: 3 or 4 (default: 4)")
    quantize.add_argument("--groupsize", type=int, default=None,
                          help="input columns per group; 32 cuts w4 to ~4.36 bits (default: 16; 32 for a source "
                               "on a GGUF Q4_1 grid at 4 bits)")
    quantize.add_argument("--stats-bits", type=int, default=None,
                          help="bits of the group statistics (default: 3; 8 for a source on a GGUF Q4_1 grid)")
    quantize.add_argument("--outlier-threshold", type=float, default=None,
                          help="SpQR's tau; 'inf' keeps no outliers (default: 8 at 4 bits, 3 at 3 bits)")
    order = quantize.add_mutually_exclusive_group()
    order.add_argument("--act-order", dest="act_order", action="store_const", const=True, default=None,
                       help="sort columns by Hessian diagonal before quantizing (default: on; off for a source on "
                            "a GGUF Q4_1 grid, whose groups then keep to the file's blocks)")
    order.add_argument("--no-act-order", dest="act_order", action="store_const", const=False,
                       help="keep the input column order; no permutation is stored or gathered at run time")
    quantize.add_argument("--calib", type=Path, nargs="*", default=[], help="extra calibration text files")
    quantize.add_argument("--nsamples", type=int, default=128, help="calibration sequences (default: 128)")
    quantize.add_argument("--seqlen", type=int, default=512, help="tokens per calibration sequence (default: 512)")
    quantize.add_argument("--resume", action="store_true", help="continue a killed run in --out (default: off)")
    evaluate = commands.add_parser("eval", help="evaluations (print JSON)").add_subparsers(dest="eval", required=True)
    ppl = evaluate.add_parser("ppl", help="perplexity of a model on a text file")
    add_target(ppl, "model, SpQR checkpoints included (default: embedded model)")
    ppl.add_argument("--text", type=Path, required=True, help="a UTF-8 text file")
    ppl.add_argument("--window", type=int, default=512, help="tokens per window (default: 512)")
    ppl.add_argument("--stride", type=int, default=256, help="tokens between window starts (default: 256)")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens (default: all)")
    ppl.add_argument("--json", action="store_true", help="print only JSON")


def cmd_quantize(args, console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from quant.quantize import QuantizeConfig, quantize
    config = QuantizeConfig(args.target, args.out, args.bits, args.groupsize, args.stats_bits, args.outlier_threshold,
                            list(args.calib), args.nsamples, args.seqlen, args.resume, act_order=args.act_order,
                            gguf_import=args.gguf_import)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("calibrating", total=None)

        def on_progress(event: dict) -> None:
            progress.update(task, completed=event["layer"] + 1, total=event["num_layers"],
                            description=f"layer {event['layer']}: error {event['error']:.2e}, "
                                        f"{event['bits_per_param']:.2f} bits, outliers {event['outlier_share']:.2%}")
            console.print(f"[dim]layer {event['layer']}: relative error {event['error']:.3e}, "
                          f"{event['bits_per_param']:.3f} bits per parameter, {event['seconds']:.0f} s[/dim]")

        summary = quantize(config, on_progress, lambda hint: console.print(f"[yellow]hint:[/yellow] {hint}",
                                                                            highlight=False))
    console.print(f"{summary['layers']} layers, {summary['bits_per_param']:.3f} bits per parameter (from the bytes "
                  f"written), outliers {summary['outlier_share']:.3%}, mean relative error {summary['mean_error']:.2e}")
    print(json.dumps({k: v for k, v in summary.items() if k != "layer_reports"}))
    return 0


def cmd_eval(args, console) -> int:
    from offload import LoadOptions
    from runtime.models import load_model
    from quant.bits import bits_per_param
    from quant.perplexity import PerplexityConfig, perplexity
    config = PerplexityConfig(args.window, args.stride, args.max_tokens)
    if not args.text.is_file():
        raise FileNotFoundError(f"text file not found: {args.text}")
    try:
        text = args.text.read_text()
    except UnicodeDecodeError as err:
        raise ValueError(f"{args.text} is not UTF-8 text ({err})") from None
    model = load_model(LoadOptions(args.target), on_status=lambda m: console.print(f"[dim]{m}[/dim]"))
    result = {**perplexity(model, text, config), "bits_per_param": round(bits_per_param(model), 4),
              "model": model.path.name, "text": args.text.name}
    if not args.json:
        console.print(f"perplexity {result['perplexity']:.4f} over {result['tokens']} tokens (window "
                      f"{config.window}, stride {config.stride}), {result['bits_per_param']:.3f} bits per parameter")
    print(json.dumps(result))
    return 0


COMMANDS = {"quantize": cmd_quantize, "eval": cmd_eval}
