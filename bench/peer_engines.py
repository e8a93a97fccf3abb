"""The engines bench/peers.py compares, each run in its own child process (`peers.py --child ENGINE`):
our streamed decoding in every tier, and transformers + accelerate's offloading (AirLLM runs apart, in
bench/airllm_runner.py). Each child loads its engine, warms up, times one greedy decode and prints one
JSON line: the tokens, seconds per token after the first, and what it streamed."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache/peers"
if not __package__ and str(ROOT) not in sys.path:   # imported by bench/peers.py run as a script (each child)
    sys.path.insert(0, str(ROOT))
from offload.host_io import drop_page_cache, process_read_bytes  # noqa: E402

OURS = ("ours_ram", "ours_disk_warm", "ours_disk_cold", "ours_resident")
HF = ("accelerate_disk_warm", "accelerate_disk_cold", "accelerate_cpu", "transformers_resident")
ENGINES = OURS + HF + ("airllm",)

WHAT = {
    "ours_ram": "specstream, planned at --gpu-mem with the default host budget: the device-tier layers stay "
                "resident, every other decoder layer streams from a packed host-RAM buffer through the "
                "2-slot prefetch ring (on this CPU-only machine the 'device' is the CPU, so a stream is a memcpy)",
    "ours_disk_warm": "specstream, same device budget, ram=1 byte: every streamed layer is read (pread) from "
                      "model.safetensors for each token; the file is in the OS page cache",
    "ours_disk_cold": "specstream as ours_disk_warm with disk_cold=True: the engine evicts the checkpoint from the "
                      "page cache (posix_fadvise DONTNEED) before each pass, so streamed layers come from the disk",
    "ours_resident": "reference, not at the budget: specstream with a device budget (8 GiB) that keeps every layer "
                     "resident (no streaming): our forward's own speed, to compare with transformers_resident",
    "accelerate_disk_warm": "transformers from_pretrained(device_map=..., offload_folder=...): globals and the same "
                            "resident layers as ours on 'cpu' (the main device on a CPU-only machine), every other "
                            "decoder layer on 'disk'; accelerate AlignDevicesHooks load each weight from disk before "
                            "its module runs and drop it after; page cache warm",
    "accelerate_disk_cold": "as accelerate_disk_warm, with a forward pre-hook that evicts the weight files from the "
                            "page cache (posix_fadvise DONTNEED) before every forward pass, like ours_disk_cold",
    "accelerate_cpu": "transformers model loaded in RAM, then accelerate.cpu_offload(layer, execution_device=cpu) on "
                      "each layer we stream: accelerate's cpu-offload hooks swap each weight in from the offloaded "
                      "CPU state dict before the module runs and back to meta after. With the execution device "
                      "being the CPU no bytes move (a device_map with layers on 'cpu' would attach no offload at "
                      "all when the main device is the CPU), so this measures accelerate's cpu-offload machinery "
                      "only, not a host-to-device transfer",
    "transformers_resident": "reference, not at the budget: the plain transformers model with every weight in RAM "
                             "(no offload, no hooks)",
    "airllm": "AirLLM (own venv, .venv-peers) on device='cpu', fp32: its AirLLMBaseModel splits the checkpoint into "
              "one safetensors file per layer once, then for every forward loads each decoder layer (and the final "
              "norm) from its file, runs it, moves it back to meta and calls gc.collect(); the tied embedding stays "
              "resident. It has no device budget knob: it always streams every layer (0 resident vs our 3)",
}


# ------------------------------------------------------------------------------------------------
# timing helpers (children)
# ------------------------------------------------------------------------------------------------
class TokenClock:
    """Timestamps each new token. As a transformers streamer: put() gets the prompt first, then tokens."""

    def __init__(self, skip_first_put: bool) -> None:
        self.times: list[float] = []
        self._skip = skip_first_put

    def put(self, value) -> None:
        if self._skip:
            self._skip = False
            return
        self.times.append(time.perf_counter())

    def on_tokens(self, tokens: list[int]) -> None:
        now = time.perf_counter()
        self.times.extend([now] * len(tokens))

    def end(self) -> None:
        pass

    def summary(self, start: float, end: float, token_ids: list[int]) -> dict:
        steps = len(self.times) - 1
        per_token = (self.times[-1] - self.times[0]) / steps if steps > 0 else None
        return {"token_ids": token_ids, "tokens": len(token_ids), "seconds": round(end - start, 4),
                "first_token_seconds": round(self.times[0] - start, 4) if self.times else None,
                "seconds_per_token": round(per_token, 5) if per_token is not None else None}


def _evict(paths: list[Path]) -> None:
    for path in paths:
        drop_page_cache(path)


def prewarm(paths: list[Path]) -> None:
    """Reads the files once so they sit in the page cache (a previous cold engine may have evicted them)."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


# ------------------------------------------------------------------------------------------------
# children
# ------------------------------------------------------------------------------------------------
def child_ours(engine: str, cfg: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from offload import LoadOptions
    from runtime.models import load_model
    from spec import DecodeConfig, Decoder, SamplingConfig

    disk = engine in ("ours_disk_warm", "ours_disk_cold")
    gpu_mem = 8 * 2**30 if engine == "ours_resident" else cfg["gpu_mem"]
    start = time.perf_counter()
    loaded = load_model(LoadOptions(cfg["model_path"], device="cpu", dtype="fp32", gpu_mem=gpu_mem,
                                    ram=1 if disk else None, max_context=cfg["max_context"],
                                    disk_cold=engine == "ours_disk_cold"))
    load_seconds = time.perf_counter() - start
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": cfg["prompt"]}])
    warmup = Decoder(loaded.model, loaded.stop_ids, DecodeConfig(cfg["warmup_tokens"], cfg["max_context"]))
    warmup.generate(ids, SamplingConfig(), None)           # warm-up (allocators, the loader thread, caches)
    del warmup
    decoder = Decoder(loaded.model, loaded.stop_ids, DecodeConfig(cfg["max_new_tokens"], cfg["max_context"]))
    if engine == "ours_disk_warm":
        prewarm(weight_files(loaded.path))
    before, io_before = _snapshot(loaded.layers.total), process_read_bytes()
    clock = TokenClock(skip_first_put=False)
    start = time.perf_counter()
    result = decoder.generate(ids, SamplingConfig(), clock.on_tokens)
    out = clock.summary(start, time.perf_counter(), result.token_ids)
    after, io_after = _snapshot(loaded.layers.total), process_read_bytes()
    tiers = {t: loaded.plan.tier_of.count(t) for t in ("device", "ram", "disk")}
    out.update(prompt_ids=ids, model_path=str(loaded.path), load_seconds=round(load_seconds, 3), tiers=tiers,
               tier_of=loaded.plan.tier_of, engine_device_bytes=loaded.device_bytes,
               disk_read_bytes=_delta(io_before, io_after),
               stream={k: round(after[k] - before[k], 5) if isinstance(after[k], float) else after[k] - before[k]
                       for k in after})
    loaded.layers.close()
    return out


def _snapshot(total) -> dict:
    return {"pass_seconds": total.seconds, "wait_seconds": total.wait_seconds,
            "transfer_seconds": total.transfer_seconds, "bytes_ram": total.bytes_by_tier["ram"],
            "bytes_disk": total.bytes_by_tier["disk"], "passes_tokens": total.num_tokens}


def _delta(a: int | None, b: int | None) -> int | None:
    return b - a if a is not None and b is not None else None


def child_hf(engine: str, cfg: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    folder, resident = Path(cfg["model_path"]), cfg["resident_layers"]
    num_layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    offload_dir = CACHE / "accelerate-offload"
    start = time.perf_counter()
    notes = {}
    if engine.startswith("accelerate_disk"):
        offload_dir.mkdir(parents=True, exist_ok=True)
        device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
        device_map.update({f"model.layers.{i}": "cpu" if i < resident else "disk" for i in range(num_layers)})
        model = AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, offload_folder=str(offload_dir),
                                                     dtype=torch.float32)
        notes["device_map_values"] = {v: list(device_map.values()).count(v) for v in set(device_map.values())}
        notes["offload_store"] = portable(_offload_store(model))
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if engine == "accelerate_cpu":
            from accelerate import cpu_offload
            for i in range(resident, num_layers):
                cpu_offload(model.model.layers[i], execution_device=torch.device("cpu"))
            notes["cpu_offloaded_layers"] = num_layers - resident
    model.eval()
    load_seconds = time.perf_counter() - start
    files = weight_files(folder) + sorted(p for p in offload_dir.glob("*") if p.is_file())
    if engine == "accelerate_disk_cold":
        model.register_forward_pre_hook(lambda module, args: _evict(files))
    ids = torch.tensor([cfg["prompt_ids"]])

    def generate(n: int, streamer=None):
        with torch.inference_mode():
            return model.generate(ids, max_new_tokens=n, do_sample=False, streamer=streamer)

    generate(cfg["warmup_tokens"])                            # warm-up
    if engine == "accelerate_disk_warm":
        prewarm(files)
    io_before = process_read_bytes()
    clock = TokenClock(skip_first_put=True)
    start = time.perf_counter()
    output = generate(cfg["max_new_tokens"], clock)
    out = clock.summary(start, time.perf_counter(), output[0, ids.shape[1]:].tolist())
    out.update(load_seconds=round(load_seconds, 3), disk_read_bytes=_delta(io_before, process_read_bytes()), **notes)
    return out


def portable(path: str | None) -> str | None:
    """A path as the report shows it: relative to the repository (a report holds no machine's paths)."""
    if path is None:
        return None
    return path.replace(str(ROOT) + os.sep, "") if path.startswith(str(ROOT) + os.sep) else Path(path).name


def _offload_store(model) -> str:
    """Where accelerate's disk-offloaded weights actually live (transformers 5 may point at the checkpoint)."""
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        weights = getattr(hook, "weights_map", None)
        dataset = getattr(weights, "dataset", None)
        index = getattr(dataset, "index", None)
        if index:
            entry = next(iter(index.values()))
            return entry.get("safetensors_file") or f"{getattr(dataset, 'save_folder', '?')} (.dat memmaps)"
    return "unknown"


def run_child(engine: str, cfg: dict) -> None:
    import torch
    torch.set_num_threads(cfg["threads"])
    try:
        out = child_ours(engine, cfg) if engine in OURS else child_hf(engine, cfg)
        out["threads"] = torch.get_num_threads()
    except BaseException as err:  # the parent reports it; never a made-up figure
        import traceback
        out = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    print(json.dumps(out), flush=True)
