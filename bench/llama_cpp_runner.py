"""llama.cpp peer for `bench all`. Runs INSIDE .venv-peers (scripts/setup_peers.sh --llama-cpp); imports
nothing from this repository, so llama-cpp-python's build never meets ours.

    .venv-peers/bin/python bench/llama_cpp_runner.py --model FILE.gguf --ids '[1, 2, 3]' \
        --max-new-tokens 32 --threads 2

Loads the GGUF file with llama-cpp-python on the CPU, evaluates the given prompt ids (the same ids our
engine decodes from: no second tokenizer in between), decodes greedily (temperature 0, no repetition
penalty) until --max-new-tokens or a stop id, and prints ONE JSON object on the last stdout line:
generated ids, seconds per token (decode steps, prefill excluded: (t(last) - t(first)) / (tokens - 1)),
time to first token, load time. With --prefill-ids, then one timed evaluation of those ids from an empty
cache in chunks of --batch (prefill tokens per second). If llama.cpp cannot run, the JSON carries `error`
instead of a number.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback


def timed_generate(llm, ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> dict:
    """One greedy decode from an empty cache; a timestamp per token as llama.cpp yields it."""
    times, new_ids = [], []
    start = time.perf_counter()
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        new_ids.append(int(token))
        if token in stop_ids or len(new_ids) >= max_new_tokens:
            break
    steps = len(times) - 1
    per_token = (times[-1] - times[0]) / steps if steps > 0 else None
    return {"token_ids": new_ids, "tokens": len(new_ids), "seconds": round(times[-1] - start, 4),
            "first_token_seconds": round(times[0] - start, 4),
            "seconds_per_token": round(per_token, 5) if per_token is not None else None,
            "tokens_per_second": round(1 / per_token, 3) if per_token else None}


def timed_prefill(llm, ids: list[int]) -> dict:
    """One evaluation of `ids` from an empty cache (llama.cpp's n_batch tokens per decode call)."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    seconds = time.perf_counter() - start
    return {"prefill_tokens": len(ids), "prefill_seconds": round(seconds, 4),
            "prefill_tokens_per_second": round(len(ids) / seconds, 3)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--ids", required=True, help="prompt token ids as a JSON list")
    parser.add_argument("--stop-ids", default="[]", help="token ids that end the answer, as a JSON list")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--warmup-tokens", type=int, default=4)
    parser.add_argument("--ignore-eos", action="store_true", help="stop on --stop-ids only (random weights)")
    parser.add_argument("--prefill-ids", default=None, help="then time one evaluation of these ids (a JSON list)")
    parser.add_argument("--batch", type=int, default=512, help="tokens per llama.cpp decode call (n_batch)")
    args = parser.parse_args()
    result: dict = {"engine": "llama.cpp", "device": "cpu"}
    try:
        import llama_cpp
        result.update(llama_cpp_python_version=llama_cpp.__version__, threads=args.threads)
        start = time.perf_counter()
        llm = llama_cpp.Llama(model_path=args.model, n_ctx=args.context, n_threads=args.threads,
                              n_threads_batch=args.threads, n_batch=args.batch, n_ubatch=args.batch,
                              n_gpu_layers=0, seed=0, verbose=False)
        result["load_seconds"] = round(time.perf_counter() - start, 3)
        ids = json.loads(args.ids)
        stop_ids = set(json.loads(args.stop_ids)) | (set() if args.ignore_eos else {llm.token_eos()})
        if args.warmup_tokens > 0:
            timed_generate(llm, ids, args.warmup_tokens, stop_ids)
        result.update(timed_generate(llm, ids, args.max_new_tokens, stop_ids))
        result["warmup_tokens"] = args.warmup_tokens
        if args.prefill_ids:
            result.update(timed_prefill(llm, json.loads(args.prefill_ids)))
    except BaseException as err:  # report the exact failure; never fake a figure
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-4000:]
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
