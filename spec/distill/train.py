"""The training loop: AdamW on the draft's trainable weights, KL to the target's top-k distribution,
checkpoints every few minutes (atomic), resume from the last one, evaluation on held-out answers."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .batches import BatchStream, make_batch
from .corpus import CorpusSequence
from spec.draft_folder import embedding_fingerprint
from spec.vocab_map import out_of_set_rows
from .checkpoint import CheckpointError, check_fits, read_checkpoint, write_checkpoint
from .draft_model import DraftModel
from .loss import sparse_kl_loss

ProgressCallback = Callable[[dict], None]
CHECKPOINT_NAME = "checkpoint.safetensors"   # format: spec/distill/checkpoint.py


@dataclass(slots=True)
class TrainConfig:
    num_steps: int = 3000
    batch_tokens: int = 8192            # padded tokens per step
    learning_rate: float = 5e-4
    min_learning_rate_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    checkpoint_seconds: float = 300.0
    eval_every: int = 250
    loss_start: int = 0                 # positions before it (a shared chat-template prefix) are not trained
    seed: int = 0
    use_bf16: bool = True               # bf16 autocast (fast on CPUs with AMX and on GPUs)

    def __post_init__(self) -> None:
        for name in ("num_steps", "batch_tokens", "eval_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"training {name} must be positive, got {getattr(self, name)}")
        if not self.learning_rate > 0 or not 0 <= self.min_learning_rate_ratio <= 1:
            raise ValueError(f"learning rate {self.learning_rate} must be > 0 and its floor ratio in [0, 1]")


@dataclass(slots=True)
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)   # evaluations


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to min_learning_rate_ratio x the peak."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.num_steps - config.warmup_steps))
    floor = config.min_learning_rate_ratio
    return config.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    def __init__(self, model: DraftModel, train: list[CorpusSequence], validation: list[CorpusSequence],
                 config: TrainConfig, work_dir: Path, on_checkpoint: Callable[[DraftModel, TrainState], None] | None = None):
        self.model, self.validation, self.config = model, validation, config
        self.stream = BatchStream(train, config.batch_tokens, config.seed, config.loss_start)
        self.device = model.head.device                 # the caller places the model (CPU or GPU)
        self.row_of = out_of_set_rows(model.vocab_map.cpu(), model.config.vocab_size).to(self.device)
        self.optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=config.learning_rate,
                                           weight_decay=config.weight_decay, betas=(0.9, 0.98))
        self.checkpoint_path = Path(work_dir) / CHECKPOINT_NAME
        self.on_checkpoint = on_checkpoint
        self.state = TrainState()
        self.saved_step: int | None = None              # the step the checkpoint on disk holds

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.use_bf16)

    def step(self) -> dict:
        """One optimizer step; returns its loss and agreement."""
        batch = self.stream.batch(self.state.step).to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.config, self.state.step)
        with self._autocast():
            logits = self.model(batch.tokens)                                            # [B, N, K]
        out = sparse_kl_loss(logits, batch.topk_ids, batch.topk_logprobs, self.row_of, batch.weight)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.trainable_parameters(), 1.0)
        self.optimizer.step()
        self.state.step += 1
        self.state.tokens_seen += out.num_scored
        return {"loss": float(out.loss.detach()), "agreement": out.num_agree / max(out.num_scored, 1),
                "num_tokens": out.num_scored}

    @torch.no_grad()
    def evaluate(self, max_sequences: int = 128, batch_size: int = 16) -> dict:
        """Top-1 agreement and KL on held-out answers (teacher-forced, answer positions only)."""
        sequences = self.validation[:max_sequences]
        num_agree = num_scored = num_counted = 0
        kl_sum = 0.0
        for start in range(0, len(sequences), batch_size):
            batch = make_batch(sequences[start:start + batch_size], answers_only=True).to(self.device)
            with self._autocast():
                logits = self.model(batch.tokens)
            out = sparse_kl_loss(logits, batch.topk_ids, batch.topk_logprobs, self.row_of, batch.weight)
            num_agree, num_scored = num_agree + out.num_agree, num_scored + out.num_scored
            kl_sum += float(out.loss) * out.num_counted
            num_counted += out.num_counted
        return {"step": self.state.step, "agreement": num_agree / max(num_scored, 1),
                "kl": kl_sum / max(num_counted, 1), "num_tokens": num_scored}

    def run(self, on_progress: ProgressCallback | None = None) -> TrainState:
        last_checkpoint = time.monotonic()
        started = time.monotonic() - self.state.seconds
        smoothed: dict[str, float] = {}
        while self.state.step < self.config.num_steps:
            result = self.step()
            for key in ("loss", "agreement"):
                smoothed[key] = result[key] if key not in smoothed else 0.95 * smoothed[key] + 0.05 * result[key]
            self.state.seconds = time.monotonic() - started
            event = {"phase": "train", "step": self.state.step, "num_steps": self.config.num_steps,
                     "tokens_seen": self.state.tokens_seen, "seconds": self.state.seconds, **smoothed}
            is_last = self.state.step == self.config.num_steps
            if self.state.step % self.config.eval_every == 0 or is_last:
                self.state.history.append(self.evaluate())
                event["eval"] = self.state.history[-1]
            if is_last or time.monotonic() - last_checkpoint >= self.config.checkpoint_seconds:
                self.save_checkpoint()
                last_checkpoint = time.monotonic()
                event["checkpoint"] = str(self.checkpoint_path)
            if on_progress:
                on_progress(event)
        return self.state

    def save_checkpoint(self) -> None:
        """Trainable weights, optimizer and progress, written atomically; then on_checkpoint exports."""
        self.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                   "state": asdict(self.state), "config": asdict(self.config), "trainable": self.trainable_names(),
                   "target": embedding_fingerprint(self.model.embed)}
        write_checkpoint(payload, self.checkpoint_path)
        self.saved_step = self.state.step
        if self.on_checkpoint:
            self.on_checkpoint(self.model, self.state)

    def trainable_names(self) -> list[str]:
        return [name for name, param in self.model.named_parameters() if param.requires_grad]

    def load_checkpoint(self) -> bool:
        """Continues from the checkpoint in work_dir if there is one; returns whether it did."""
        if not self.checkpoint_path.exists():
            return False
        path = self.checkpoint_path
        payload = read_checkpoint(path)
        trained = payload["trainable"]
        if trained != self.trainable_names():
            raise CheckpointError(f"{path} trained {len(trained)} tensors, this run "
                                  f"{len(self.trainable_names())}: resume with the same --head-only setting")
        check_fits(payload, path, self.model.state_dict(), self.model.trainable_parameters(),
                   embedding_fingerprint(self.model.embed))
        try:
            state = TrainState(**payload["state"])
            self.optimizer.load_state_dict(payload["optimizer"])
        except (TypeError, ValueError, KeyError) as err:
            raise CheckpointError(f"{path}: training state does not fit this run ({err})") from None
        self.model.load_state_dict(payload["model"])
        self.state, self.saved_step = state, state.step
        return True
