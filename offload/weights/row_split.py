"""A pass's prompt rows computed the fast way beside its packed rows.

A model on the CPU's int4 kernel attends in float64 (layers.py: a tree row then gets a one-token pass's bits),
and float64 attention over a long prompt chunk costs 2.6x fp32's (1.36 s vs 0.52 s of a 1,024-token pass of the
default model). Prompt rows need no such guarantee: their keys and values come from the same passes in a
speculative run and a one-token one, and only a chunk's last row has logits. So from `attention_rows`
prompt rows in a pass they attend in the compute dtype, and from `dense_rows` they also multiply the
layer decoded dense once per pass instead of the packed codes; tree rows and one-token rows keep both
bitwise. Measured on the default model, every layer resident, a pass of N prompt tokens, 2 cores, the ways in
turn (`python -m bench.cpu_kernel_bench --parts prefill --repeats 6`, bench/results/cpu_prefill_routing.json),
all-packed pass time over:

    N                                     64    128   256   512   1,024  2,048  4,096
    prompt rows attending in fp32         1.04  1.06  1.10  1.19  1.38   1.63   1.90
    ... and multiplying dense             0.35  0.53  0.76  1.03  1.39   1.67   1.99
    the dense fp32 model (for scale)      0.70  0.89  1.05  1.26  1.54   1.79   2.05

Float64 attention was the cost: the products take about the same time either way (int4 1.31 s vs sgemm 1.19 s
in a 1,024-token pass) and decoding the 30 layers adds ~0.1 s a pass, so dense products pay only from a few
thousand rows (+2% at 2,048, +5% at 4,096 over fp32 attention alone).
The price: a long prompt's keys and values agree with an all-packed pass's to rounding, not bitwise, so where
a batch chunks a long prompt otherwise than a lone run, a near-tie may part their answers."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from offload.weights.packed_linear import FUSED

NEVER = 1 << 62


@dataclass(frozen=True, slots=True)
class PromptRouting:
    """From how many prompt rows in a pass they take each fast way (NEVER: not at all)."""
    attention_rows: int = 64      # attend in the compute dtype (1.04x at 64 rows, measured above)
    dense_rows: int = 3072        # multiply the layer decoded dense (1.0x at 2,048, 1.05x at 4,096)

    def __post_init__(self) -> None:
        if self.attention_rows < 1 or self.dense_rows < 1:
            raise ValueError(f"prompt routing thresholds must be >= 1 row, got {self.attention_rows}, {self.dense_rows}")


@dataclass(slots=True)
class RowSplitWeight:
    """A packed weight whose rows from `start` on multiply the dense matrices instead (stacked along N as
    the packed weight stacks them)."""
    packed: object               # has matmul(x [..., K]) -> [..., N]
    dense: list[Tensor]          # [N_i, K] each, sum N_i = N
    start: int                   # first row (along the pass's tokens) computed dense
    is_row_exact = True          # the packed rows are; the dense rows are prompt rows, never verified

    def matmul(self, x: Tensor) -> Tensor:
        """x [B, T, K] -> [B, T, N]: rows [:start] by the packed kernel, [start:] by fp32 products."""
        tail = torch.cat([F.linear(x[:, self.start:], weight) for weight in self.dense], dim=-1)   # [B, T-s, N]
        if self.start == 0:
            return tail
        return torch.cat([self.packed.matmul(x[:, :self.start]), tail], dim=1)


def split_rows(packed: dict, dense: dict[str, Tensor], start: int) -> dict:
    """A layer's packed weights, each wrapped to multiply rows from `start` by its dense matrices; tensors and
    weights with no dense counterpart as they are."""
    layer = dict(packed)
    for name, value in packed.items():
        if isinstance(value, Tensor):
            continue
        parts = FUSED.get(name, (name,))
        if all(part in dense for part in parts):
            layer[name] = RowSplitWeight(value, [dense[part] for part in parts], start)
    return layer
