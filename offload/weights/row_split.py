"""A pass's prompt rows computed the fast way beside its packed rows.

A model on the CPU's int4 kernel attends in float64 (layers.py: a tree row then gets a one-token pass's bits),
and float64 attention over a long prompt chunk costs 2.6x fp32's (1.36 s vs 0.52 s of a 1,024-token pass of the
default model). Prompt rows need no such guarantee: their keys and values come from the same passes in a
speculative run and a one-token one, and only a chunk's last row has logits. So a prompt chunk of
`attention_rows` or more attends in the compute dtype, over its own keys, and one of `dense_rows` or more also
multiplies the layer decoded dense once per pass instead of the packed codes; tree rows and one-token rows keep both
bitwise. Measured on the default model, every layer resident, a pass of N prompt tokens, 2 cores, the ways in
turn (`python cli.py bench cpu-kernel --parts prefill --repeats 6`, bench/results/cpu_prefill_routing.json),
all-packed pass time over:

    N                                     64    128   256   512   1,024  2,048  4,096
    prompt rows attending in fp32         1.04  1.06  1.10  1.19  1.38   1.63   1.90
    ... and multiplying dense             0.35  0.53  0.76  1.03  1.39   1.67   1.99
    the dense fp32 model (for scale)      0.70  0.89  1.05  1.26  1.54   1.79   2.05

Float64 attention was the cost: the products take about the same time either way (int4 1.31 s vs sgemm 1.19 s
in a 1,024-token pass) and decoding the 30 layers adds ~0.1 s a pass, so dense products pay only from a few
thousand rows (+2% at 2,048, +5% at 4,096 over fp32 attention alone).
The price: a long prompt's keys and values agree with an all-packed pass's to rounding, not bitwise: where a
batch cuts a long prompt into other chunks than a lone run does, a near-tie may part their answers (a prompt
of fewer than `attention_rows` tokens, or one chunk in both, keeps its bits)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from offload.weights.packed_linear import FUSED

NEVER = 1 << 62


Chunk = tuple[int, int]       # a prompt chunk's rows [first, end) among the pass's tokens


@dataclass(frozen=True, slots=True)
class PromptRouting:
    """From how many rows a prompt chunk takes each fast way (NEVER: not at all). Decided chunk by chunk, never
    by the pass: a short prompt answered in a batch gets the bits it gets alone."""
    attention_rows: int = 64      # attend in the compute dtype (1.04x at 64 rows, measured above)
    dense_rows: int = 3072        # multiply the layer decoded dense (1.0x at 2,048, 1.05x at 4,096)

    def __post_init__(self) -> None:
        if self.attention_rows < 1 or self.dense_rows < 1:
            raise ValueError(f"prompt routing thresholds must be >= 1 row, got {self.attention_rows}, {self.dense_rows}")

    def fast(self, chunks: list[Chunk] | None) -> tuple[list[Chunk], list[Chunk]]:
        """(the chunks that attend in the compute dtype, those that also multiply dense)."""
        chunks = chunks or []
        return ([c for c in chunks if c[1] - c[0] >= self.attention_rows],
                [c for c in chunks if c[1] - c[0] >= self.dense_rows])


@dataclass(slots=True)
class RowSplitWeight:
    """A packed weight whose rows in `chunks` multiply the dense matrices instead (stacked along N as the packed
    weight stacks them), chunk by chunk: a chunk's products do not depend on the rows beside it."""
    packed: object               # has matmul(x [..., K]) -> [..., N]
    dense: list[Tensor]          # [N_i, K] each, sum N_i = N
    chunks: list[Chunk]          # rows computed dense, in order, disjoint
    is_row_exact = True          # the packed rows are; the dense rows are prompt rows, never verified

    def matmul(self, x: Tensor) -> Tensor:
        """x [B, T, K] -> [B, T, N]: the chunks' rows by fp32 products, the others by the packed kernel."""
        parts, row = [], 0
        for first, end in self.chunks:
            if first > row:
                parts.append(self.packed.matmul(x[:, row:first]))
            parts.append(torch.cat([F.linear(x[:, first:end], weight) for weight in self.dense], dim=-1))
            row = end
        if row < x.shape[1]:
            parts.append(self.packed.matmul(x[:, row:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


@dataclass(slots=True)
class WholeRowsWeight:
    """A weight that multiplies a few rows a call to keep every row's bits (ggml_linear's K-quants), its prompt
    chunks' rows in one call each: prompt rows need no one-token pass's bits (above)."""
    weight: object               # has matmul and matmul_whole (x [..., K]) -> [..., N]
    chunks: list[Chunk]          # rows in one call, in order, disjoint
    is_row_exact = True          # the rows outside the chunks are

    def matmul(self, x: Tensor) -> Tensor:
        """x [B, T, K] -> [B, T, N]."""
        parts, row = [], 0
        for first, end in self.chunks:
            if first > row:
                parts.append(self.weight.matmul(x[:, row:first]))
            parts.append(self.weight.matmul_whole(x[:, first:end]))
            row = end
        if row < x.shape[1]:
            parts.append(self.weight.matmul(x[:, row:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def whole_rows(layer: dict, chunks: list[Chunk]) -> dict:
    """A layer's weights that cut rows for their bits (those with matmul_whole) wrapped to take `chunks` whole."""
    if not chunks:
        return layer
    return {name: WholeRowsWeight(value, chunks) if hasattr(value, "matmul_whole") else value
            for name, value in layer.items()}


def split_rows(packed: dict, dense: dict[str, Tensor], chunks: list[Chunk]) -> dict:
    """A layer's packed weights, each wrapped to multiply the rows of `chunks` by its dense matrices; tensors and
    weights with no dense counterpart as they are."""
    layer = dict(packed)
    for name, value in packed.items():
        if isinstance(value, Tensor):
            continue
        parts = FUSED.get(name, (name,))
        if all(part in dense for part in parts):
            layer[name] = RowSplitWeight(value, [dense[part] for part in parts], chunks)
    return layer
