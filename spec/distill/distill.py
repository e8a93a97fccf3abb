"""`distill`: collect the target's answers, pick the draft vocabulary, train, export the draft folder.

Every phase resumes: answers are recorded per batch, the vocabulary is fixed by the first run
(out/training/vocab_map.safetensors), and training continues from out/training/checkpoint.safetensors
(formats: spec/distill/checkpoint.py). The draft folder in `out_dir` is re-exported at each checkpoint, so
it always holds the latest usable draft. A full disk stops the run with one line saying what is saved.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from offload import LoadedModel, LoadOptions, load_model
from offload.weights.resolve import is_default_model
from offload.weights.disk_errors import write_text_atomic, writing
from offload.weights.formats import dense_source
from .batches import is_validation
from .checkpoint import read_vocab_map, refuse_pickled, write_vocab_map
from .collect import collect_answers, collect_self_prompts
from .corpus import load_corpus, source_summary, token_counts
from spec.draft_folder import DraftInfo, embedding_fingerprint, read_draft_info
from .init_draft import draft_from_draft, draft_vocab, freeze_all_but_head, init_draft_recipe, widened_vocab
from .draft_io import save_draft
from .draft_model import DRAFT_KINDS, DraftModel, choose_vocab, draft_from_target, init_layer_indices
from .generate import GenerationConfig
from .prompts import (TrainingPrompt, default_prompt_files, interleave, prompts_from_jsonl, refuse_evaluation_file,
                      seed_task_prompts)
from .templates import extraction_passages, template_prompts
from .text import collect_text
from .revocab import revocab_checkpoint
from .train import CHECKPOINT_NAME, TrainConfig, Trainer

ProgressCallback = Callable[[dict], None]
VOCAB_FILE = "vocab_map.safetensors"


@dataclass(slots=True)
class DistillConfig:
    target: str | None                      # None: the embedded default model
    out_dir: Path                           # the draft folder; training state in out_dir/training
    kind: str = "small"                     # "small" (all layers trained) | "early-exit"
    num_layers: int = 3
    num_frozen: int = 0                     # early-exit: first target layers kept frozen
    vocab_top: int = 4096
    data: list[Path] = field(default_factory=list)   # extra prompt JSONL files or raw text/code files
    corpus_dir: Path | None = None          # default out_dir/training/corpus
    num_steps: int = 1000
    batch_tokens: int = 4096
    learning_rate: float = 2e-3
    resume: bool = False
    revocab: bool = False                   # on resume: re-choose the vocabulary on the grown corpus
    num_self_prompts: int = 2480            # prompts the target writes itself
    num_template_prompts: int = 8000        # synthetic chat prompts (spec/distill/templates.py)
    max_gsm8k_prompts: int = 1000
    max_prompts: int | None = None          # cap on all prompts answered greedily (None: every one)
    num_sampled_prompts: int = 600          # prompts also answered with sampling (temperature 0.8)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    device: str = "auto"
    dtype: str = "auto"                     # target dtype (collecting) and autocast (training); bf16 is
                                            # ~6x faster than fp32 on CPUs with AMX
    checkpoint_seconds: float = 300.0
    seed: int = 0
    init_draft: Path | None = None          # start from this trained draft (its layers, kept head rows)
    head_only: bool = False                 # with init_draft: train only the head rows and biases
    formats: tuple = ()                     # packed weight formats the target may be in (runtime.weight_formats)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"draft kind must be one of {', '.join(DRAFT_KINDS)}, got {self.kind!r}")
        if self.kind == "early-exit" and not 0 < self.num_frozen < self.num_layers:
            raise ValueError(f"an early-exit draft reuses 1..{self.num_layers - 1} frozen target layers, "
                             f"got {self.num_frozen}")
        if self.kind == "small" and self.num_frozen:
            raise ValueError("--reuse-layers needs --kind early-exit")
        if min(self.num_template_prompts, self.num_self_prompts, self.num_sampled_prompts) < 0:
            raise ValueError("prompt counts must be >= 0")
        if self.revocab and not self.resume:
            raise ValueError("--revocab re-chooses the vocabulary of a run being resumed: add --resume")
        if self.num_steps < 0 or self.batch_tokens <= 0 or self.learning_rate <= 0:
            raise ValueError(f"need steps >= 0, batch tokens > 0 and a positive learning rate, got "
                             f"{self.num_steps}, {self.batch_tokens}, {self.learning_rate}")
        if self.num_layers <= 0 or self.vocab_top < 16:
            raise ValueError(f"layers must be > 0 and vocab-top >= 16, got {self.num_layers}, {self.vocab_top}")
        if self.head_only and self.init_draft is None:
            raise ValueError("--head-only trains the head of an existing draft: add --init-draft DIR")
        if self.init_draft is not None:
            self.init_draft = Path(self.init_draft).expanduser()
            read_draft_info(self.init_draft)        # a clear error for a folder that is not a draft
        for path in self.data:
            if not Path(path).exists():
                raise FileNotFoundError(f"training data file not found: {path}")
            refuse_evaluation_file(Path(path))

    @property
    def work_dir(self) -> Path:
        return self.out_dir / "training"


def training_prompts(config: DistillConfig, target: LoadedModel, corpus_dir: Path,
                     on_progress: ProgressCallback | None) -> list[TrainingPrompt]:
    """Seed tasks, chat templates, prompts the target writes, GSM8K train questions and --data JSONL
    prompts, mixed. Extraction templates work on GSM8K train questions and seed-task inputs."""
    files = default_prompt_files()
    meta = GenerationConfig(batch_size=config.generation.batch_size, max_new_tokens=80, temperature=1.0,
                            seed=config.seed + 1)
    seed_tasks = seed_task_prompts(files["seed_tasks"])
    gsm8k = prompts_from_jsonl(files["gsm8k_train"], "gsm8k_train")
    passages = extraction_passages(seed_tasks, gsm8k)
    groups = [seed_tasks, template_prompts(config.num_template_prompts, config.seed, passages),
              collect_self_prompts(target, corpus_dir, config.num_self_prompts, meta, on_progress),
              gsm8k[:config.max_gsm8k_prompts]]
    groups += [prompts_from_jsonl(p) for p in config.data if Path(p).suffix == ".jsonl"]
    return interleave([g for g in groups if g], config.seed)[:config.max_prompts]


def collect(config: DistillConfig, target: LoadedModel, on_progress: ProgressCallback | None = None) -> Path:
    """Fills the corpus (resumable): greedy answers to every prompt, sampled answers to the first
    num_sampled_prompts, and teacher log-probabilities over raw text files."""
    corpus_dir = config.corpus_dir or config.work_dir / "corpus"
    prompts = training_prompts(config, target, corpus_dir, on_progress)
    collect_answers(target, prompts, corpus_dir, "greedy", config.generation, on_progress)
    sampled = replace(config.generation, temperature=0.8, seed=config.seed + 2)
    collect_answers(target, prompts[:config.num_sampled_prompts], corpus_dir, "sampled", sampled, on_progress)
    text_files = [p for p in config.data if Path(p).suffix != ".jsonl"]
    if text_files:
        collect_text(target, text_files, corpus_dir, config.generation, on_progress)
    return corpus_dir


def template_prefix_length(target: LoadedModel) -> int:
    """Tokens every chat prompt shares (system turn and template header): not worth training on."""
    first = target.tokenizer.encode_chat([{"role": "user", "content": "alpha"}])
    second = target.tokenizer.encode_chat([{"role": "user", "content": "omega 12"}])
    return next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), 0)


def _vocab_map(config: DistillConfig, target: LoadedModel, sequences) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(vocabulary to train, the previous one when --revocab replaces it, else None)."""
    path = config.work_dir / VOCAB_FILE
    old_map = read_vocab_map(path) if path.exists() else None
    if old_map is not None and not config.revocab:
        return old_map, None
    top = old_map.numel() if old_map is not None else config.vocab_top
    counts = token_counts(sequences, target.config.vocab_size)
    if config.init_draft is not None:
        kept = draft_vocab(config.init_draft)
        vocab_map = widened_vocab(counts, kept, top, set(target.stop_ids))
    else:
        vocab_map = choose_vocab(counts, top, target.stop_ids)
    if old_map is None:
        write_vocab_map(path, vocab_map)
    return vocab_map, old_map


def build_trainer(config: DistillConfig, target: LoadedModel, corpus_dir: Path) -> tuple[Trainer, DraftInfo]:
    sequences = load_corpus(corpus_dir)
    train = [s for s in sequences if not is_validation(s.prompt_id)]
    validation = [s for s in sequences if is_validation(s.prompt_id) and s.source != "text"]
    config.work_dir.mkdir(parents=True, exist_ok=True)
    vocab_map, old_map = _vocab_map(config, target, sequences)
    source = dense_source(target.path, target.config)   # a GGUF target: decoded layer by layer
    if config.init_draft is not None:
        model = draft_from_draft(config.init_draft, source, vocab_map)
        if config.head_only:
            freeze_all_but_head(model)
    else:
        model = draft_from_target(source, config.kind, config.num_layers, config.num_frozen, vocab_map)
    checkpoint = config.work_dir / CHECKPOINT_NAME
    if old_map is not None:
        if checkpoint.exists():
            revocab_checkpoint(checkpoint, model, old_map, vocab_map)
        write_vocab_map(config.work_dir / VOCAB_FILE, vocab_map)
    model.to(target.model.device)       # trains where the target runs (weights stay float32)
    target_name = "default" if is_default_model(config.target) else \
        str(Path(config.target).resolve() if Path(config.target).exists() else config.target)
    fingerprint = embedding_fingerprint(source.global_tensors()["embed"])
    if config.init_draft is not None:
        start = read_draft_info(config.init_draft)
        info = DraftInfo(start.kind, start.target_layers_reused, vocab_map.numel(), target_name, fingerprint,
                         start.init_layers)
    else:
        info = DraftInfo(config.kind, config.num_frozen, vocab_map.numel(), target_name, fingerprint,
                         init_layer_indices(config.kind, config.num_layers, config.num_frozen, target.config.num_layers))
    train_config = TrainConfig(num_steps=config.num_steps, batch_tokens=config.batch_tokens,
                               learning_rate=config.learning_rate, checkpoint_seconds=config.checkpoint_seconds,
                               loss_start=template_prefix_length(target), seed=config.seed,
                               use_bf16=target.model.dtype == torch.bfloat16)
    info.training = {"corpus_tokens": source_summary(train), "num_sequences": len(train)}
    if config.init_draft is not None:
        info.training.update(init_draft_recipe(config.init_draft), head_only=config.head_only)

    def export(model: DraftModel, state) -> None:
        last = state.history[-1] if state.history else {}
        info.training.update(steps=state.step, tokens_seen=state.tokens_seen, seconds=round(state.seconds),
                             validation_agreement=round(last.get("agreement", 0.0), 4))
        save_draft(config.out_dir, model, info, target.path)

    return Trainer(model, train, validation, train_config, config.work_dir, export), info


def distill(config: DistillConfig, on_progress: ProgressCallback | None = None) -> dict:
    """Builds (or continues building, with config.resume) a draft for config.target in config.out_dir."""
    refuse_pickled(config.work_dir, config.out_dir)
    checkpoint = config.work_dir / CHECKPOINT_NAME
    if checkpoint.exists() and not config.resume:
        raise ValueError(f"{config.out_dir} already holds a training run; pass --resume to continue it "
                         f"or choose another --out")
    start = time.monotonic()
    max_pass = config.generation.batch_size * config.generation.prefill_chunk
    target = load_model(LoadOptions(config.target, config.device, config.dtype,
                                    max_context=config.generation.max_prompt_tokens + config.generation.max_new_tokens,
                                    max_pass_tokens=max_pass, formats=config.formats))
    trainer: Trainer | None = None

    def saved() -> str:     # asked only when a write fails for lack of space
        step = trainer.saved_step if trainer is not None else None
        return (f"the answers collected in {config.corpus_dir or config.work_dir / 'corpus'}"
                + ("" if step is None else f" and the training checkpoint at step {step}"))

    with writing(config.out_dir, saved, f"rerun `specstream distill --out {config.out_dir} --resume` with the "
                                        "same flags"):
        corpus_dir = collect(config, target, on_progress)
        trainer, info = build_trainer(config, target, corpus_dir)
        trainer.load_checkpoint()
        if on_progress:
            on_progress({"phase": "train_start", "resumed_at": trainer.state.step, "num_steps": config.num_steps,
                         "corpus": info.training["corpus_tokens"], "vocab_top": info.vocab_top})
        state = trainer.run(on_progress)
        summary = {"out_dir": str(config.out_dir), "steps": state.step, "tokens_seen": state.tokens_seen,
                   "train_seconds": round(state.seconds), "seconds_this_run": round(time.monotonic() - start),
                   "validation": state.history[-1] if state.history else None, "draft": info.as_dict()}
        write_text_atomic(config.work_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
