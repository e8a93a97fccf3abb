"""Moving a tensor dict to the compute device and dtype (resident weights)."""
from __future__ import annotations

import torch
from torch import Tensor



def to_device(tensors: dict[str, Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """Floating tensors are cast to the compute dtype; packed (integer) tensors keep theirs."""
    return {name: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
            for name, t in tensors.items()}

