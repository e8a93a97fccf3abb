"""The target drafts for itself (SubSpec, arXiv 2509.18344): every layer the plan keeps on the device is used as it
is (one copy), every streamed layer is replaced by a low-bit substitute kept on the device (quant/lowbit.py: made
from the layer's own weights at the first start, cached in the model cache), and the embeddings, final norm and LM
head are the target's (on a CPU the head multiplies packed: draft_head). The draft attends to the target's own KV
cache (spec/speculator.SelfSpeculator), so it has no cache and no prefill of its own: a draft step is one forward of
the whole model that streams nothing.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from offload import DecoderModel, LoadedModel
from offload.model.config import ModelConfig
from offload.weights.gguf_import import cache_root
from offload.weights.safetensors_io import CorruptCheckpointError
from offload.weights.packed_linear import Int4Head, draft_head_copy_bytes
from quant.lowbit import REFINE_ROUNDS, LowBitMatrix, from_tensors, int8_head, quantize_matrix, relative_error, \
    substitute_bytes, substitute_weight, to_tensors
from .draft import Draft

SELF_DRAFT = "self"
SUBSTITUTE_BITS = (2, 3, 4)
CACHE_FORMAT, CACHE_VERSION = "specstream-substitutes", 2   # 2: each file records its relative error
MATRICES = ("q", "k", "v", "o", "gate", "up", "down")
STACKED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}      # products over one input: one product each


@dataclass(frozen=True, slots=True)
class SubstituteConfig:
    bits: int = 4
    group: int = 32

    def __post_init__(self) -> None:
        if self.bits not in SUBSTITUTE_BITS:
            raise ValueError(f"--draft-bits must be one of {', '.join(map(str, SUBSTITUTE_BITS))}, got {self.bits}")
        if self.group not in (32, 64, 128):
            raise ValueError(f"substitute group must be 32, 64 or 128, got {self.group}")


def matrix_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each decoder-layer matrix's [out, in]."""
    q, kv, hidden, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.hidden_size, config.intermediate_size
    return {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q),
            "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}


def substitute_layer_bytes(config: ModelConfig, settings: SubstituteConfig, device_is_cpu: bool) -> int:
    """One layer's substitute on the device: its matrices at `bits`, norms and biases as the target keeps them."""
    params = sum(rows * cols for rows, cols in matrix_shapes(config).values())
    return substitute_bytes(params, settings.bits, settings.group, device_is_cpu) + \
        (config.layer_param_count - params) * 4


class SubstituteLayers:
    """The self-draft's LayerProvider: the target's resident layers as the target decodes them, a substitute for
    every streamed one. Nothing streams, so a pass has no ring to run."""

    def __init__(self, target: LoadedModel, substitutes: dict[int, dict]) -> None:
        self.target_layers, self.substitutes = target.layers, substitutes

    def begin_pass(self, num_tokens: int) -> None:
        pass

    def get(self, index: int) -> dict:
        if index in self.substitutes:
            return self.substitutes[index]
        return self.target_layers.decode(index, self.target_layers.resident[index])

    def release(self, index: int) -> None:
        pass

    def end_pass(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def num_substitutes(self) -> int:
        return len(self.substitutes)

    @property
    def device_bytes(self) -> int:
        """The substitutes alone (the resident layers are the target's, counted there)."""
        return sum(w.nbytes for layer in self.substitutes.values() for w in layer.values())


def load_self_draft(target: LoadedModel, settings: SubstituteConfig, on_status=None,
                    layers: list[int] | None = None) -> Draft:
    """The target's self-draft: substitutes for the layers its plan streams, or for `layers` (none: a ValueError,
    the draft would be the target)."""
    streamed = [i for i, tier in enumerate(target.plan.tier_of) if tier != "device"] if layers is None else layers
    if not streamed:
        raise ValueError("every layer is resident: a self-draft would cost what the target costs")
    model = target.model
    cache = SubstituteCache(target, settings)
    substitutes = cache.load(streamed, on_status)
    layers = SubstituteLayers(target, substitutes)
    head = draft_head(model.lm_head, model.device)
    draft_model = DecoderModel(target.config, {"embed": model.embed, "norm": model.norm, "lm_head": head},
                               layers, model.device, model.dtype)
    draft_model.cache_dtype = model.cache_dtype
    own_head = 0 if head is model.lm_head or isinstance(model.lm_head, Int4Head) else head.nbytes   # a copy's bytes
    loaded = LoadedModel(target.path, target.config, target.tokenizer, draft_model, layers, target.plan,
                         target.stop_ids, global_bytes=own_head)
    return Draft(loaded, target.config.vocab_size, is_self=True,
                 growth_temperature=growth_temperature(cache.mean_error))


def draft_head(head, device: torch.device):
    """The output matrix the self-draft scores with: on a CPU the int4 kernel's product (the target's own packed
    head without its exact recomputation of the top logits, or an 8-bit copy of a dense float head: the largest
    single product of a small model's step, 9.7 of a 26 ms draft round of the default model in fp32); elsewhere the
    target's. The draft's logits only order the tree; verification reads the target's."""
    if isinstance(head, Int4Head):
        return head.weight
    if isinstance(head, Tensor) and head.is_floating_point() and draft_head_copy_bytes(tuple(head.shape), False, device):
        return int8_head(head)                       # the copy the plan counted (offload/loader.py)
    return head


def growth_temperature(weight_error: float | None) -> float:
    """The temperature a self-draft's trees grow at for a greedy target (GrowthConfig.temperature), by its
    substitutes' mean relative weight error. Measured on the default model (`python cli.py bench tree-simulation
    --draft self --draft-bits B --growth-temperature T --max-new-tokens 128 --limit 2 --budgets 64`, tokens per
    pass, bench/results/growth_temperature_sweep.json): 4-bit substitutes of its Q4_1 grid (error 0.000) 7.89 /
    14.38 / 24.45 / 34.93 at temperatures 1 / 0.5 / 0.25 / 0.1; 3-bit (error 0.139) 5.49 / 6.04 / 5.20 at 1 / 0.5 /
    0.25. A draft that is nearly the target follows its argmax chain; a rougher one needs its siblings."""
    if weight_error is None or weight_error >= 0.2:
        return 1.0
    return 0.1 if weight_error < 0.02 else 0.5


class SubstituteCache:
    """Substitutes kept in the model cache, one safetensors file per layer, keyed by the target's files and the
    settings; a file that fails its checks is made again."""

    def __init__(self, target: LoadedModel, settings: SubstituteConfig) -> None:
        self.target, self.settings = target, settings
        self.source = target.source
        self.device = target.model.device
        self.folder = cache_root() / "substitutes" / f"{target.path.name}-{self._key()}"
        self.shapes = matrix_shapes(target.config)
        self.mean_error: float | None = None

    def _key(self) -> str:
        files = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in self.source.file_paths()]
        key = json.dumps([files, self.settings.bits, self.settings.group, REFINE_ROUNDS, CACHE_VERSION])
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def load(self, layers: list[int], on_status=None) -> dict[int, dict]:
        """Each layer's substitute on the device (made and cached where missing); sets mean_error, the mean
        relative weight error over them (None where a cached file predates its record)."""
        started, made, errors, read_errors = time.perf_counter(), 0, [], []
        out = {}
        for index in layers:
            matrices, rest, error = self._read(index)
            if matrices is None:
                matrices, rest, error = self._make(index)
                errors.append(error)
                made += 1
            read_errors.append(error)
            out[index] = self._on_device(matrices, rest)
        self.mean_error = None if None in read_errors else sum(read_errors) / max(len(read_errors), 1)
        if made and on_status:
            on_status(f"self-draft: {made} substitute layers made at {self.settings.bits} bits in "
                      f"{time.perf_counter() - started:.1f} s (cached for the next start; mean relative weight error "
                      f"{sum(errors) / len(errors):.3f})")
        return out

    def _path(self, index: int) -> Path:
        return self.folder / f"layer_{index:03d}.safetensors"

    def _read(self, index: int) -> tuple[dict[str, LowBitMatrix] | None, dict[str, Tensor], float | None]:
        from safetensors import SafetensorError, safe_open
        path = self._path(index)
        if not path.is_file():
            return None, {}, None
        try:
            with safe_open(path, "pt") as opened:          # one open: the tensors and the recorded error
                tensors = {name: opened.get_tensor(name) for name in opened.keys()}
                error = (opened.metadata() or {}).get("relative_error")
            matrices = {name: from_tensors(tensors, name, shape, self.settings.bits, self.settings.group)
                        for name, shape in self.shapes.items()}
            error = float(error) if error is not None else None
        except (OSError, ValueError, KeyError, SafetensorError, CorruptCheckpointError):
            return None, {}, None     # unreadable or stale: made again
        rest = {name.removeprefix("rest."): t for name, t in tensors.items() if name.startswith("rest.")}
        return matrices, rest, error

    def _make(self, index: int) -> tuple[dict[str, LowBitMatrix], dict[str, Tensor], float]:
        from safetensors.torch import save_file
        dense = {name: t.to(self.device) for name, t in dense_layer(self.source, index).items()}   # a GPU quantizes
        matrices = {name: _to_host(quantize_matrix(dense[name], self.settings.bits, self.settings.group))
                    for name in MATRICES}
        error = sum(relative_error(dense[name], m) for name, m in matrices.items()) / len(matrices)
        rest = {name: t.float().cpu().contiguous() for name, t in dense.items() if name not in MATRICES}
        tensors = {k: v.contiguous() for name, m in matrices.items() for k, v in to_tensors(m, name).items()}
        tensors.update({f"rest.{name}": t for name, t in rest.items()})
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self._path(index).with_suffix(".partial")
        save_file(tensors, partial, metadata={"format": CACHE_FORMAT, "version": str(CACHE_VERSION),
                                              "relative_error": repr(error)})
        partial.replace(self._path(index))
        return matrices, rest, error

    def _on_device(self, matrices: dict[str, LowBitMatrix], rest: dict[str, Tensor]) -> dict:
        dtype = self.target.model.dtype
        layer = {name: t.to(self.device, dtype) for name, t in rest.items()}
        for name, parts in STACKED.items():
            stacked = _stack([matrices.pop(part) for part in parts])
            layer[name] = substitute_weight(stacked, self.device)
        layer.update({name: substitute_weight(m, self.device) for name, m in matrices.items()})
        return layer


def _to_host(matrix: LowBitMatrix) -> LowBitMatrix:
    return LowBitMatrix(matrix.codes.cpu(), matrix.scale.cpu(), matrix.offset.cpu(), matrix.bits, matrix.group)


def _stack(parts: list[LowBitMatrix]) -> LowBitMatrix:
    """Matrices over the same input, stacked along their outputs."""
    first = parts[0]
    return LowBitMatrix(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                        torch.cat([p.offset for p in parts]), first.bits, first.group)


def dense_layer(source, index: int) -> dict[str, Tensor]:
    """A layer's weights as float32 tensors on the host, whatever the source's format."""
    cpu = torch.device("cpu")
    if hasattr(source, "dense_layer"):                   # GGUF: blocks decoded
        return source.dense_layer(index, cpu, torch.float32)
    decoded = source.decode_layer(index, source.layer(index), torch.float32)
    return {name: (value if isinstance(value, Tensor) else value.dense()).float() for name, value in decoded.items()}
