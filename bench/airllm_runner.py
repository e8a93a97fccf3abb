"""AirLLM peer for bench/peers.py. Runs INSIDE .venv-peers (scripts/setup_peers.sh); imports nothing
from this repository, so AirLLM's dependencies never meet ours.

    .venv-peers/bin/python bench/airllm_runner.py --model FOLDER --ids '[1, 2, 3]' \
        --max-new-tokens 16 --threads 2 --shards .cache/peers/airllm

Loads the HF folder with AirLLM on the CPU (AirLLM first splits the checkpoint into one safetensors
file per layer under --shards, once), generates greedily from the given prompt ids, and prints ONE
JSON object on the last stdout line: generated ids, seconds per token (decode steps, prefill
excluded), time to first token, load time. If AirLLM cannot run, the JSON carries `error` with the
exception text and traceback instead of a number.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback


class _Clock:
    """A transformers streamer that only timestamps: put() is called with the prompt, then per token."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.calls = 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:              # the first call carries the prompt ids
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class _GcTimer:
    """Wraps gc.collect (AirLLM calls it after every layer) to report the time it takes; behaviour unchanged."""

    def __init__(self) -> None:
        import gc
        self.seconds, self.calls, self._collect = 0.0, 0, gc.collect
        gc.collect = self

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._collect(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def _disk_read_bytes() -> int | None:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _timed_generate(model, ids: list[int], max_new_tokens: int, gc_timer: _GcTimer | None = None) -> dict:
    import torch

    clock = _Clock()
    gc_before = gc_timer.seconds if gc_timer else 0.0
    io_before = _disk_read_bytes()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             use_cache=True, streamer=clock, return_dict_in_generate=False)
    total = time.perf_counter() - start
    new_ids = out[0, len(ids):].tolist()
    io_after = _disk_read_bytes()
    ttft = clock.times[0] - start if clock.times else total
    steps = len(clock.times) - 1
    per_token = (clock.times[-1] - clock.times[0]) / steps if steps > 0 else None
    return {"token_ids": new_ids, "tokens": len(new_ids), "seconds": round(total, 4),
            "first_token_seconds": round(ttft, 4),
            "seconds_per_token": round(per_token, 5) if per_token is not None else None,
            "gc_collect_seconds": round(gc_timer.seconds - gc_before, 3) if gc_timer else None,
            "gc_collect_calls": gc_timer.calls if gc_timer else None,
            "disk_read_bytes": io_after - io_before if io_before is not None and io_after is not None else None}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="HF model folder (config.json + safetensors)")
    parser.add_argument("--ids", required=True, help="prompt token ids as a JSON list")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shards", required=True, help="folder for AirLLM's per-layer split")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--warmup-tokens", type=int, default=2)
    parser.add_argument("--no-prefetch", action="store_true")
    args = parser.parse_args()
    result: dict = {"engine": "airllm", "device": "cpu"}
    try:
        import torch
        torch.set_num_threads(args.threads)
        import airllm
        from importlib.metadata import version
        result.update(airllm_version=version("airllm"), torch_version=torch.__version__,
                      transformers_version=version("transformers"), threads=torch.get_num_threads())
        ids = json.loads(args.ids)
        start = time.perf_counter()
        model = airllm.AutoModel.from_pretrained(
            args.model, device="cpu", dtype=torch.float32, max_seq_len=args.max_seq_len,
            layer_shards_saving_path=args.shards, prefetching=not args.no_prefetch)
        result["load_seconds"] = round(time.perf_counter() - start, 3)
        result["class"] = type(model).__name__
        result["prefetching"] = bool(getattr(model, "prefetching", False))
        result["streamed_modules"] = len(getattr(model, "_streamed_indices", []))
        result["warmup_tokens"] = args.warmup_tokens
        if args.warmup_tokens > 0:
            _timed_generate(model, ids, args.warmup_tokens)
        result.update(_timed_generate(model, ids, args.max_new_tokens, _GcTimer()))
        if result.get("gc_collect_seconds") is not None and result["tokens"] > 0:
            # informational only: AirLLM runs gc.collect() after every streamed layer by design
            result["seconds_per_token_without_gc_estimate"] = round(
                (result["seconds"] - result["gc_collect_seconds"]) / result["tokens"], 5)
    except BaseException as err:  # report the exact failure; never fake a figure
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-4000:]
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
