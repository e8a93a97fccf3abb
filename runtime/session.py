"""A session: the target model loaded once, a decoder with its KV cache, and run reports."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from offload import LoadedModel, LoadOptions, StreamDecoder, load_model
from offload.planner import PlanError
from spec import DecodeConfig, Decoder, DecodeResult, SamplingConfig
from spec.distill import check_tokenizers_match, default_draft_for, is_draft_folder, load_draft


class UserError(Exception):
    """A problem the user can fix; the CLI prints its message as one line."""


@dataclass(slots=True)
class RuntimeConfig:
    target: str | None = None       # None: the embedded default model
    draft: str | None = None
    no_draft: bool = False
    device: str = "auto"
    dtype: str = "auto"
    max_context: int = 4096
    allow_download: bool = False
    gpu_mem: int | None = None      # bytes; None: free device memory minus a margin
    ram: int | None = None          # bytes; None: available RAM minus a margin
    disk_cold: bool = False

    def __post_init__(self) -> None:
        if self.draft and self.no_draft:
            raise ValueError("--draft and --no-draft exclude each other")
        if self.max_context < 16:
            raise ValueError(f"context must be at least 16 tokens, got {self.max_context}")


def _load_target(options: LoadOptions, on_status) -> LoadedModel:
    """A draft folder runs on its own too (a quick look at its quality); anything else is a model."""
    if options.model and is_draft_folder(Path(options.model).expanduser()):
        return load_draft(options, on_status)
    return load_model(options, on_status)


class Session:
    def __init__(self, config: RuntimeConfig, on_status=None) -> None:
        self.config = config
        options = LoadOptions(config.target, config.device, config.dtype, config.allow_download,
                              gpu_mem=config.gpu_mem, ram=config.ram, max_context=config.max_context,
                              disk_cold=config.disk_cold)
        try:
            self.target = _load_target(options, on_status)
        except PlanError as err:
            raise UserError(str(err)) from None
        self.draft_path = self._resolve_draft(config)
        self.tokenizer = self.target.tokenizer
        self.model_name = self.target.path.name if config.target else "SmolLM2-135M-Instruct"
        decode = DecodeConfig(max_context=config.max_context)
        self.decoder = Decoder(self.target.model, self.target.stop_ids, decode)
        self._streamed_before = 0

    def _resolve_draft(self, config: RuntimeConfig) -> Path | None:
        """The draft a speculative run would use: --draft (checked against the target's tokenizer),
        else the shipped draft of the default target; loaded by the speculative decoder."""
        if config.no_draft:
            return None
        if config.draft is None:
            return default_draft_for(config.target)
        folder = Path(config.draft).expanduser()
        if not (folder / "config.json").exists():
            raise UserError(f"draft model not found: {config.draft} (a draft folder holds config.json)")
        check_tokenizers_match(self.target.path, folder)
        return folder

    def encode(self, messages: list[dict[str, str]] | None = None, raw: str | None = None) -> list[int]:
        if raw is not None:
            return self.tokenizer.encode(raw)
        return self.tokenizer.encode_chat(messages or [])

    def generate(self, prompt_ids: list[int], sampling: SamplingConfig, max_new_tokens: int,
                 on_text=None) -> tuple[str, DecodeResult]:
        stream = StreamDecoder(self.tokenizer)

        def on_tokens(ids: list[int]) -> None:
            delta = stream.push(ids)
            if delta and on_text:
                on_text(delta)

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.decoder.config = DecodeConfig(max_new_tokens, self.config.max_context)
        result = self.decoder.generate(prompt_ids, sampling, on_tokens)
        return self.tokenizer.decode(result.token_ids), result

    def reset(self) -> None:
        self.decoder.reset()

    def close(self) -> None:
        self.target.layers.close()

    def peak_device_bytes(self) -> int:
        if self.target.model.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated())
        # On the CPU the engine accounts for its own device memory: weights, ring buffers, KV cache.
        return self.target.device_bytes + self.decoder.cache.num_bytes

    def engine_stats(self) -> dict:
        plan = self.target.plan
        return {"layers": {t: plan.tier_of.count(t) for t in ("device", "ram", "disk")},
                "ring_size": plan.ring_size, "layer_bytes": plan.request.layer_bytes, "last_pass": self.target.layers.last_pass.as_dict(),
                "total": self.target.layers.total.as_dict()}

    def report(self, text: str, result: DecodeResult) -> dict:
        stats = result.stats
        return {
            "text": text,
            "model": self.model_name,
            "num_prompt_tokens": stats.num_prompt_tokens,
            "num_new_tokens": stats.num_new_tokens,
            "num_target_passes": stats.num_target_passes,
            "tokens_per_pass": round(stats.tokens_per_pass, 3),
            "seconds": round(stats.seconds, 4),
            "first_token_seconds": round(stats.first_token_seconds or 0.0, 4),
            "tokens_per_second": round(stats.tokens_per_second, 3),
            "peak_device_bytes": self.peak_device_bytes(),
            "bytes_streamed": self.target.layers.total.bytes_streamed - self._streamed_before,
            "stop_reason": stats.stop_reason,
            "device": str(self.target.model.device),
            "dtype": str(self.target.model.dtype).removeprefix("torch."),
            "draft": str(self.draft_path) if self.draft_path else None,
            "speculative": False,
            "engine": self.engine_stats(),
        }
