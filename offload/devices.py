"""Device and dtype are chosen here, once, at the edge."""
from __future__ import annotations

import functools
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
DEVICE_NAMES = ("auto", "cpu", "cuda")
DTYPE_CHOICES = ("auto", *DTYPES)      # what every --dtype flag accepts


def check_names(device: str, dtype: str) -> None:
    """Raises ValueError for a device or dtype name this runtime does not know."""
    if device not in DEVICE_NAMES:
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, bf16, fp16 or fp32, got {dtype!r}")


def choose_device(name: str = "auto", require_available: bool = True) -> torch.device:
    """require_available=False names a device this machine lacks (planning for another machine)."""
    check_names(name, "auto")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and require_available and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA GPU is available (use auto or cpu)")
    return torch.device(name)


def choose_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: fp32 on CPU (the reference precision: a target's tokens match transformers' fp32 forward),
    bf16 on CUDA where supported."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    check_names("auto", name)
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The CLI name of a dtype: torch.bfloat16 -> "bf16"."""
    return _DTYPE_NAMES[dtype]


def choose_draft_dtype(name: str, device: torch.device) -> torch.dtype:
    """A draft's precision changes how many of its tokens the target accepts, never the output, so auto
    takes the cheaper dtype: on CPU bf16 where it measures faster than fp32 on this machine."""
    if name != "auto" or device.type != "cpu":
        return choose_dtype(name, device)
    return torch.bfloat16 if cpu_bf16_speedup() >= MIN_BF16_SPEEDUP else torch.float32


MIN_BF16_SPEEDUP = 1.1
_PROBE_SHAPE = (1536, 576)      # a small model's MLP matrix
_PROBE_MATRICES = 18            # 64 MB in fp32: more than a CPU cache holds, as a decode step's weights are


@functools.cache
def cpu_bf16_speedup() -> float:
    """fp32 time / bf16 time of one-token matmuls over cache-cold weights on this CPU (measured once,
    ~0.1 s): how much faster a memory-bound decode step runs in bf16."""
    return _matvec_seconds(torch.float32) / _matvec_seconds(torch.bfloat16)


@torch.inference_mode()
def _matvec_seconds(dtype: torch.dtype, rounds: int = 4) -> float:
    weights = [torch.full(_PROBE_SHAPE, 0.01, dtype=dtype) for _ in range(_PROBE_MATRICES)]
    x = torch.ones(1, _PROBE_SHAPE[1], dtype=dtype)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for weight in weights:
            torch.nn.functional.linear(x, weight)
        best = min(best, time.perf_counter() - start)
    return best
