"""Decoding one decoder layer's packed weights on the compute device, against the link: SpQR w4 (the fused
Triton kernel and the torch path), GGUF Q4_K and Q6_K (Triton kernels and the torch block decoder); and a
self-draft's low-bit substitutes of such a layer multiplied by a draft round's rows (the fused Triton product,
the torch unpack-and-dequantize path, the dense bf16 layer's product).

A packed layer streams its packed bytes, then decodes them; it pays off where transfer + decode of the
packed layer beats the transfer of the dense one (or where decoding hides under the next layer's copy).
Each result gives the ms per path (best of 3 after a warm-up, which also compiles Triton kernels), the
link's ms for the packed bytes and for the dense bf16 bytes, both at the measured pinned rate.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from offload.bandwidth import timed_seconds
from offload.model.config import ModelConfig
from quant.checkpoint import matrix_shapes
from quant.packbits import packed_bytes
from quant.spqr_format import FUSED, STATS_RUN, SpqrMatrix

DENSE_BYTES = 2      # bf16, what the layer would stream unpacked


def best_ms(run: Callable[[], object], device: torch.device, repeats: int = 4) -> float:
    """Best of repeats - 1 timed calls after a warm-up (which also compiles a Triton kernel)."""
    timings = [timed_seconds(run, device) for _ in range(repeats)]
    return round(1e3 * min(timings[1:]), 3)


def _link_figures(params: int, num_bytes: int, link_gbps: float) -> dict:
    return {"params": params, "packed_bytes": num_bytes,
            "transfer_ms": round(1e3 * num_bytes / (link_gbps * 1e9), 3),
            "dense_transfer_ms": round(1e3 * params * DENSE_BYTES / (link_gbps * 1e9), 3)}


def _random_spqr(shape: tuple[int, int], bits: int, device: torch.device) -> SpqrMatrix:
    """A packed matrix of random codes (any byte is valid) and statistics, no outliers."""
    out, inp = shape
    groups, runs, stats_bits = inp // 16, -(-out // STATS_RUN), 3
    index = torch.int16 if max(out, inp) <= torch.iinfo(torch.int16).max else torch.int32

    def random_bytes(count: int) -> torch.Tensor:
        return torch.randint(0, 256, (count,), dtype=torch.uint8, device=device)

    params = (torch.rand(runs, groups, 4, device=device) * torch.tensor([1e-3, 4.0, 0.5, 2.0], device=device)).half()
    return SpqrMatrix(shape, bits, 16, stats_bits, random_bytes(packed_bytes(out * inp, bits)),
                      random_bytes(packed_bytes(out * groups, stats_bits)),
                      random_bytes(packed_bytes(out * groups, stats_bits)), params,
                      torch.randperm(inp, device=device).to(index), torch.zeros(out + 1, dtype=index, device=device),
                      torch.zeros(0, dtype=index, device=device), torch.zeros(0, dtype=torch.float16, device=device))


def spqr_check(config: ModelConfig, device: torch.device, link_gbps: float) -> dict:
    """One layer's matrices at w4: ms to dequantize with each path vs ms to transfer the packed bytes."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    matrices = [_random_spqr(shape, 4, device) for shape in matrix_shapes(config).values()]
    paths = {"torch": False}
    if device.type == "cuda" and FUSED.module is not None:
        paths["fused"] = True
    result = {**_link_figures(sum(m.shape[0] * m.shape[1] for m in matrices), sum(m.num_bytes for m in matrices),
                              link_gbps), "fused_available": "fused" in paths}
    for name, fused in paths.items():
        result[f"{name}_ms"] = best_ms(lambda: [m.dequantize(dtype, permuted=True, fused=fused) for m in matrices],
                                       device)
    if "fused" in paths:
        first = matrices[0]
        result["fused_equals_torch"] = bool(torch.allclose(first.dequantize(dtype, fused=True).float(),
                                                           first.dequantize(dtype, fused=False).float(),
                                                           rtol=1e-2, atol=1e-3))
    return result


def gguf_check(config: ModelConfig, device: torch.device, link_gbps: float, type_name: str = "Q4_K") -> dict:
    """One layer's matrices in Q4_K or Q6_K (random valid blocks; a Q4_K_M file holds both): ms to decode with the
    Triton kernel (CUDA) and the torch decoder (offload/weights/gguf_blocks.py) vs ms to transfer the packed bytes."""
    from gguf import GGMLQuantizationType

    from offload.weights import gguf_blocks
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    qtype, generator = GGMLQuantizationType[type_name], np.random.default_rng(0)
    shapes = list(matrix_shapes(config).values())
    raws = [torch.from_numpy(gguf_blocks.random_blocks(qtype, shape, generator)).to(device) for shape in shapes]
    paths = {"torch": lambda raw, shape, out_dtype: gguf_blocks.dequantize(raw, qtype, shape, out_dtype)}
    if device.type == "cuda":
        from offload.weights import gguf_triton
        paths["triton"] = getattr(gguf_triton, gguf_blocks.FUSED_TYPES[qtype])
    result = {**_link_figures(sum(a * b for a, b in shapes), sum(r.numel() for r in raws), link_gbps),
              "triton_available": "triton" in paths}
    for name, decode in paths.items():
        result[f"{name}_ms"] = best_ms(lambda: [decode(r, s, dtype) for r, s in zip(raws, shapes)], device)
    if "triton" in paths:          # bit-exact in float32, by construction
        result["triton_equals_torch"] = bool(torch.equal(paths["triton"](raws[0], shapes[0], torch.float32),
                                                         paths["torch"](raws[0], shapes[0], torch.float32)))
    return result


LOWBIT_ROWS = (1, 16, 64)      # a draft round's rows


def _random_lowbit(shape: tuple[int, int], bits: int, device: torch.device):
    """A substitute of random codes, scales and offsets (quantizing a 70B layer here would cost the step's time)."""
    from quant.lowbit import LowBitMatrix, LowBitWeight
    out, inp = shape
    codes = torch.randint(0, 1 << bits, (out, inp), dtype=torch.uint8, device=device)
    scale = (torch.rand(out, inp // 32, device=device) * 1e-2).half()
    return LowBitWeight(LowBitMatrix(codes, scale, -scale * (1 << (bits - 1)), bits, 32), device)


def lowbit_check(config: ModelConfig, device: torch.device, link_gbps: float) -> dict:
    """One layer's matrices as 2-, 3- and 4-bit substitutes: ms per draft round of 1/16/64 rows through the fused
    kernel and the torch path, beside the dense bf16 layer's product and the link's time for the dense bytes (what
    a streamed layer costs the target's pass)."""
    from quant import lowbit
    shapes = list(matrix_shapes(config).values())
    params = sum(a * b for a, b in shapes)
    result: dict = {"params": params, "fused_available": device.type == "cuda" and lowbit.FUSED.usable,
                    "dense_transfer_ms": round(1e3 * params * DENSE_BYTES / (link_gbps * 1e9), 3), "rows": {}}
    dense = [torch.randn(shape, device=device, dtype=torch.bfloat16) * 0.02 for shape in shapes]
    for rows in LOWBIT_ROWS:
        xs = [torch.randn(rows, shape[1], device=device, dtype=torch.bfloat16) for shape in shapes]
        figures = {"dense_bf16_ms": best_ms(lambda: [x @ w.T for x, w in zip(xs, dense)], device)}
        for bits in (2, 3, 4):
            weights = [_random_lowbit(shape, bits, device) for shape in shapes]
            figures[f"w{bits}_torch_ms"] = best_ms(lambda: [w.dense_matmul(x) for x, w in zip(xs, weights)], device)
            if result["fused_available"]:
                figures[f"w{bits}_fused_ms"] = best_ms(lambda: [w.matmul(x) for x, w in zip(xs, weights)], device)
                first = weights[0]
                figures[f"w{bits}_fused_equals_torch"] = bool(torch.allclose(
                    first.matmul(xs[0]).float(), first.dense_matmul(xs[0]).float(), rtol=2e-2, atol=2e-2))
        result["rows"][str(rows)] = figures
    result["fused_failures"] = lowbit.FUSED.failures[:1]
    return result
