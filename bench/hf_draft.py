"""The transformers peer of `bench spec`: our distilled draft rebuilt as a transformers model, and
transformers' assisted generation (target + that assistant) timed and counted on the same prompts.

The rebuilt draft is a LlamaForCausalLM with the draft's config (its 3 layers), the target's token
embedding, the draft's layers and norm, and a head that computes the K-row logits + head_bias and
scatters them into a full-vocabulary tensor filled with -inf: the same function as
DraftDecoderModel.forward, so its greedy picks are our draft's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from offload.model.config import ModelConfig
from offload.weights.resolve import resolve_model
from offload.weights.source import HF_GLOBAL_NAMES, HF_LAYER_NAMES
from spec import SamplingConfig
from spec.draft_folder import is_draft_folder, read_draft_tensors
from spec.vocab_map import expand_to_target_vocab


class TrimmedHead(nn.Module):
    """hidden [B, N, H] -> logits [B, N, V]: K rows computed, the other V - K tokens at -inf."""

    def __init__(self, weight: Tensor, bias: Tensor, vocab_map: Tensor, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)      # [K, H]
        self.bias = nn.Parameter(bias.float(), requires_grad=False)          # [K]
        self.register_buffer("vocab_map", vocab_map.long(), persistent=False)  # [K] target ids
        self.vocab_size = vocab_size

    def trimmed(self, hidden: Tensor) -> Tensor:
        """hidden [B, N, H] -> [B, N, K] float32 logits over the draft's rows."""
        return nn.functional.linear(hidden.float(), self.weight) + self.bias

    def forward(self, hidden: Tensor) -> Tensor:
        return expand_to_target_vocab(self.trimmed(hidden), self.vocab_map, self.vocab_size)


def build_hf_draft(folder: str | Path, embed: Tensor) -> nn.Module:
    """A transformers LlamaForCausalLM (fp32, eval) computing what our draft folder computes.
    `embed` [V, H] is the target's token embedding (shared, not copied, when already fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = Path(folder)
    config = ModelConfig.from_file(folder)
    if config.family != "llama":
        raise ValueError(f"draft {folder} is a {config.family} model; the transformers rebuild covers llama drafts")
    layers, stored = read_draft_tensors(folder, config)
    hf_config = LlamaConfig.from_pretrained(folder)
    hf_config.tie_word_embeddings = False
    model = LlamaForCausalLM(hf_config).float().eval()
    state = {f"model.layers.{i}.{HF_LAYER_NAMES[name]}": tensor.float()
             for i, layer in enumerate(layers) for name, tensor in layer.items()}
    state[HF_GLOBAL_NAMES["norm"]] = stored["norm"].float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = set(missing) - {HF_GLOBAL_NAMES["embed"], HF_GLOBAL_NAMES["lm_head"]}
    if left or unexpected:
        raise ValueError(f"draft {folder}: transformers model lacks {sorted(unexpected)} or was not given {sorted(left)}")
    model.model.embed_tokens.weight = nn.Parameter(embed.float(), requires_grad=False)
    model.lm_head = TrimmedHead(stored["lm_head"], stored["head_bias"], stored["vocab_map"], config.vocab_size)
    return model


def load_hf_pair(target_folder: Path, draft_spec: str | Path) -> tuple[nn.Module, nn.Module]:
    """(target, assistant) as transformers models, fp32 on the CPU. A distilled draft folder is rebuilt
    (build_hf_draft); any other draft is an ordinary transformers model folder."""
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32).eval()
    if is_draft_folder(draft_spec):
        return target, build_hf_draft(draft_spec, target.get_input_embeddings().weight.detach())
    return target, AutoModelForCausalLM.from_pretrained(draft_spec, dtype=torch.float32).eval()


@dataclass(slots=True)
class PeerRun:
    """One prompt through transformers' generate: tokens, target forwards, seconds."""
    token_ids: list[int]
    num_target_forwards: int
    seconds: float


@dataclass(slots=True)
class ForwardCounter:
    """Counts a module's forward calls (a pre-hook: every call, whatever generate passes)."""
    count: int = 0
    handle: RemovableHandle | None = None

    def attach(self, module: nn.Module) -> None:
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.count += 1


def assistant_schedule(assistant: nn.Module) -> dict:
    """The assisted-generation settings transformers will use: the assistant's generation config over
    transformers' global defaults (what AssistedCandidateGenerator reads)."""
    from transformers.utils import is_sklearn_available
    config = assistant.generation_config
    defaults = config._get_default_generation_params()
    pick = {name: getattr(config, name, None) if getattr(config, name, None) is not None else defaults.get(name)
            for name in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
    pick["confidence_threshold_adapts"] = bool(is_sklearn_available() and pick["assistant_confidence_threshold"])
    return pick


@torch.inference_mode()
def run_generate(target: nn.Module, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int],
                 sampling: SamplingConfig, seed: int, assistant: nn.Module | None = None) -> PeerRun:
    """transformers' generate on one prompt (assisted when `assistant` is given), counting target forwards."""
    counter = ForwardCounter()
    counter.attach(target)
    input_ids = torch.tensor([prompt_ids])                                     # [1, P]
    options = {"do_sample": False} if sampling.is_greedy else {
        "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}
    if sampling.repetition_penalty != 1.0:
        options["repetition_penalty"] = sampling.repetition_penalty
    torch.manual_seed(seed)
    try:
        start = time.perf_counter()
        output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=assistant,
                                 max_new_tokens=max_new_tokens, eos_token_id=sorted(stop_ids),
                                 pad_token_id=min(stop_ids), **options)
        seconds = time.perf_counter() - start
    finally:
        counter.handle.remove()
    return PeerRun(output[0, len(prompt_ids):].tolist(), counter.count, seconds)


@dataclass(slots=True)
class Peer:
    """transformers' target and assistant, run plain and assisted on one prompt at a time."""
    target: nn.Module
    assistant: nn.Module
    stop_ids: set[int]
    max_new_tokens: int
    sampling: SamplingConfig

    def warm_up(self, prompt_ids: list[int]) -> None:
        for model in (None, self.assistant):
            run_generate(self.target, prompt_ids, 4, self.stop_ids, self.sampling, 0, model)

    def run(self, prompt_ids: list[int], seed: int, assisted: bool) -> PeerRun:
        return run_generate(self.target, prompt_ids, self.max_new_tokens, self.stop_ids, self.sampling, seed,
                            self.assistant if assisted else None)

    def report(self, plain: list[PeerRun], assisted: list[PeerRun], reference: list[list[int]] | None) -> dict:
        return peer_report(plain, assisted, reference, assistant_schedule(self.assistant))


def open_peer(target_folder: Path, draft_spec: str, stop_ids: set[int], max_new_tokens: int,
              sampling: SamplingConfig, on_status=None) -> Peer | str:
    """transformers' pair for `bench spec`, or why it cannot run (a missing package), which the report
    says instead of raising."""
    try:
        from transformers.utils import logging
        logging.set_verbosity_error()
        logging.disable_progress_bar()
        draft_folder = draft_spec if is_draft_folder(draft_spec) else resolve_model(draft_spec, on_status=on_status, gguf_import=True)
        return Peer(*load_hf_pair(target_folder, draft_folder), stop_ids, max_new_tokens, sampling)
    except ImportError as err:
        return f"transformers' assisted generation needs a missing package: {err}"


def peer_report(plain: list[PeerRun], assisted: list[PeerRun], reference: list[list[int]] | None,
                schedule: dict) -> dict:
    new = sum(len(r.token_ids) for r in assisted)
    forwards = sum(r.num_target_forwards for r in assisted)
    following = sum(max(len(r.token_ids) - 1, 0) for r in assisted)
    plain_tps = sum(len(r.token_ids) for r in plain) / sum(r.seconds for r in plain)
    tps = new / sum(r.seconds for r in assisted)
    report = {"engine": "transformers generate, fp32, cpu", "settings": schedule,
              "new_tokens": new, "target_forwards": forwards,
              "tokens_per_target_forward": round(following / max(forwards - len(assisted), 1), 4),
              "new_tokens_per_target_forward": round(new / max(forwards, 1), 4),
              "tokens_per_second": round(tps, 3), "seconds": round(sum(r.seconds for r in assisted), 3),
              "transformers_autoregressive_tokens_per_second": round(plain_tps, 3),
              "speedup_vs_transformers_autoregressive": round(tps / plain_tps, 3)}
    if reference is not None:
        report["identical_to_autoregressive"] = sum(r.token_ids == ids for r, ids in zip(assisted, reference))
        report["transformers_autoregressive_identical"] = sum(r.token_ids == ids for r, ids in zip(plain, reference))
    return report
