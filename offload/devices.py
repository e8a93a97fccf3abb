"""Device and dtype are chosen here, once, at the edge."""
from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEVICE_NAMES = ("auto", "cpu", "cuda")


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
    """auto: fp32 on CPU (CPU half-precision matmuls are slow), bf16 on CUDA where supported."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    check_names("auto", name)
    return DTYPES[name]
