"""The training loop.

One optimizer step is described once, by the *step contract*::

    step_fn(micro_batches, lr) -> StepResult(loss, grad_norm, num_tokens)

It consumes ``training.grad_accum_steps`` micro-batches, and afterwards the model parameters and
optimizer state hold their updated values. ``EagerStep`` implements it with ordinary autograd;
the Graph Trainer and the sharded trainer provide other implementations of the same contract, so
the loop around it (data, schedule, validation, metrics, checkpoints) is shared.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from titan_tpu.config import Config
from titan_tpu.device import Backend, get_backend
from titan_tpu.models.registry import build_model, flops_per_token, get_model_args
from titan_tpu.train.checkpoint import Checkpointer, load_checkpoint, rng_state, set_rng_state
from titan_tpu.train.metrics import MetricsLogger
from titan_tpu.train.optim import AdamW, clip_grad_norm_, lr_at

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cross_entropy_sum(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy in fp32; callers divide by the token count they choose."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten(), reduction="sum")


@dataclass
class StepResult:
    loss: float  # mean cross-entropy per token over the step's micro-batches
    grad_norm: float  # global gradient norm before clipping
    num_tokens: int


class EagerStep:
    """The step contract with plain autograd: accumulate, clip, AdamW, all in place.

    The in-place forms of clipping and AdamW run the same arithmetic as the pure functions the
    graph trainer traces, without allocating a second copy of gradients, weights and moments.
    """

    def __init__(self, model: torch.nn.Module, optimizer: AdamW, *, max_norm: float):
        self.model = model
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.params = dict(model.named_parameters())

    def __call__(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        # Normalise by the tokens of the whole step, so k micro-batches of b sequences give the same
        # gradient as one batch of k*b sequences.
        num_tokens = sum(labels.numel() for _, labels in micro_batches)
        loss_sum = torch.zeros((), device=micro_batches[0][0].device)
        for inputs, labels in micro_batches:
            loss = cross_entropy_sum(self.model(inputs), labels) / num_tokens
            loss.backward()
            loss_sum += loss.detach()
        grads = {name: p.grad for name, p in self.params.items()}
        grad_norm = clip_grad_norm_(grads, self.max_norm)
        self.optimizer.step(grads, lr=lr)
        for p in self.params.values():
            p.grad = None
        return StepResult(loss=loss_sum.item(), grad_norm=grad_norm.item(), num_tokens=num_tokens)


def default_cache_dir() -> Path:
    return Path(os.environ.get("TITAN_TPU_CACHE") or Path.home() / ".cache" / "titan_tpu")


class Trainer:
    def __init__(self, cfg: Config):
        from titan_tpu.data.loader import TokenLoader
        from titan_tpu.data.shards import prepare_dataset

        self.cfg = cfg
        self.run_dir = cfg.run_dir
        t = cfg.training
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        self.backend: Backend = get_backend(t.device)
        torch.manual_seed(t.seed)

        self.model_args = get_model_args(cfg.model.name, cfg.model.flavor)
        self.tokenizer, shards = prepare_dataset(
            source=None if cfg.data.source == "stdlib" else cfg.data.source,
            text_field=cfg.data.text_field,
            max_bytes=cfg.data.max_bytes or None,
            tokenizer_path=cfg.data.tokenizer_path or None,
            vocab_size=self.model_args.vocab_size,
            cache_dir=cfg.data.cache_dir or default_cache_dir(),
        )
        loader_kwargs = dict(seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed,
                             val_fraction=cfg.data.val_fraction)
        self.train_loader = TokenLoader(shards, split="train", **loader_kwargs)
        self.val_loader = TokenLoader(shards, split="val", **loader_kwargs) if cfg.validation.enabled else None

        # The RoPE table only needs the training length (a published 128K table is ~134 MB for 8B);
        # checkpoints keep the flavor's own args so exports carry the real max_seq_len.
        self.model = build_model(dataclasses.replace(self.model_args, max_seq_len=t.seq_len),
                                 device=self.backend.device, dtype=DTYPES[cfg.model.dtype], seed=t.seed)
        o = cfg.optimizer
        self.optimizer = AdamW(dict(self.model.named_parameters()), beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                               weight_decay=o.weight_decay)
        self.step_fn = EagerStep(self.model, self.optimizer, max_norm=t.max_norm)
        self.step = 0
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep_latest_k=cfg.checkpoint.keep_latest_k)
        self.flops_per_token = flops_per_token(self.model_args, t.seq_len)

    # ------------------------------------------------------------------------------------------
    # state

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "data": self.train_loader.state_dict(),
            "rng": rng_state(),
            "model_name": self.cfg.model.name,
            "model_args": dataclasses.asdict(self.model_args),
        }

    def load_state_dict(self, state: dict, *, source: Path) -> None:
        expected = dataclasses.asdict(self.model_args)
        if state.get("model_name") != self.cfg.model.name or state.get("model_args") != expected:
            raise ValueError(f"checkpoint {source} holds a {state.get('model_name')} model with other dimensions than "
                             f"{self.cfg.model.name}/{self.cfg.model.flavor}; use another --output_dir or the "
                             "matching --model.name/--model.flavor")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.train_loader.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        self.step = state["step"]

    def maybe_resume(self) -> None:
        if not self.cfg.checkpoint.resume:
            return
        latest = self.checkpointer.latest()
        if latest is not None:
            self.load_state_dict(load_checkpoint(latest), source=latest)
            print(f"resumed from {latest} at step {self.step}")
        elif self.cfg.checkpoint.initial_load_path:
            self.load_initial_weights(self.cfg.checkpoint.initial_load_path)

    def load_initial_weights(self, path: str | Path) -> None:
        """Start from the weights of a checkpoint or a Hugging Face directory (fine-tuning)."""
        from titan_tpu.convert import resolve_checkpoint
        from titan_tpu.models.hf_checkpoint import load_hf_checkpoint

        path = Path(path)
        if (path / "config.json").is_file():
            _, _, weights = load_hf_checkpoint(path)
        else:
            weights = load_checkpoint(resolve_checkpoint(path))["model"]
        own = self.model.state_dict()
        for key, value in own.items():
            if key not in weights or weights[key].shape != value.shape:
                got = tuple(weights[key].shape) if key in weights else "nothing"
                raise ValueError(f"checkpoint.initial_load_path {path} does not fit {self.cfg.model.name}/"
                                 f"{self.cfg.model.flavor}: {key} should be {tuple(value.shape)}, found {got}")
        extra = sorted(set(weights) - set(own))
        if extra:
            raise ValueError(f"checkpoint.initial_load_path {path} has tensors the model lacks, e.g. {extra[0]}")
        self.model.load_state_dict(weights)
        print(f"initial weights loaded from {path}")

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.step, self.state_dict())

    # ------------------------------------------------------------------------------------------
    # loop

    def lr(self, step: int) -> float:
        s, t = self.cfg.lr_scheduler, self.cfg.training
        return lr_at(step, base_lr=self.cfg.optimizer.lr, warmup_steps=s.warmup_steps, total_steps=t.steps,
                     decay_ratio=s.decay_ratio, decay_type=s.decay_type, min_lr_ratio=s.min_lr_ratio)

    def _micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        device = self.backend.device
        batches = []
        for _ in range(self.cfg.training.grad_accum_steps):
            inputs, labels = self.train_loader.next_batch()
            batches.append((inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)))
        return batches

    def train_step(self) -> StepResult:
        self.step += 1
        return self.step_fn(self._micro_batches(), self.lr(self.step))

    @torch.no_grad()
    def validate(self) -> float:
        assert self.val_loader is not None
        self.model.eval()
        loss_sum, tokens = 0.0, 0
        for inputs, labels in self.val_loader.val_batches(self.cfg.validation.steps):
            logits = self.model(inputs.to(self.backend.device))
            loss_sum += cross_entropy_sum(logits, labels.to(self.backend.device)).item()
            tokens += labels.numel()
        self.model.train()
        return loss_sum / tokens

    def train(self) -> dict:
        """Run to ``training.steps``; returns a summary with the paths of the run's outputs."""
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        if self.tokenizer.path is not None:  # travels with the run, e.g. into an HF export
            shutil.copyfile(self.tokenizer.path, self.run_dir / "tokenizer.json")
        self.maybe_resume()
        peak = self.backend.peak_flops()
        print(f"model {cfg.model.name}/{cfg.model.flavor}: {sum(p.numel() for p in self.model.parameters()):,} "
              f"params, {self.flops_per_token / 1e6:.1f} MFLOP/token at seq_len {cfg.training.seq_len}; "
              f"MFU peak: {self.backend.peak_description()}")

        last_val = None
        with MetricsLogger(output_dir=self.run_dir, tensorboard=cfg.metrics.tensorboard,
                           console=cfg.metrics.console, total_steps=cfg.training.steps) as logger:
            # Throughput counts only time spent in training steps (each ends in a host sync when its
            # loss is read), not validation or checkpointing.
            window_tokens, window_seconds = 0, 0.0
            self.backend.reset_peak_memory()
            while self.step < cfg.training.steps:
                start = time.perf_counter()
                result = self.train_step()
                window_seconds += time.perf_counter() - start
                window_tokens += result.num_tokens
                done = self.step == cfg.training.steps
                if self.step % cfg.metrics.log_freq == 0 or done or self.step == 1:
                    tokens_per_s = window_tokens / window_seconds
                    flops = tokens_per_s * self.flops_per_token
                    row = {"loss": result.loss, "lr": self.lr(self.step), "grad_norm": result.grad_norm,
                           "tokens_per_s": tokens_per_s, "tflops": flops / 1e12, "mfu": 100.0 * flops / peak}
                    row.update(self.backend.memory_stats())
                    logger.log(self.step, row)
                    window_tokens, window_seconds = 0, 0.0
                if self.val_loader is not None and (self.step % cfg.validation.freq == 0 or done):
                    last_val = self.validate()
                    logger.log(self.step, {"val_loss": last_val})
                if cfg.checkpoint.enabled and (self.step % cfg.checkpoint.interval == 0 or done):
                    self.save_checkpoint()

        latest = self.checkpointer.latest() if cfg.checkpoint.enabled else None
        summary = {"step": self.step, "metrics": str(self.run_dir / "metrics.jsonl"),
                   "checkpoint": str(latest) if latest else None, "val_loss": last_val}
        print(f"done: step {self.step}; metrics: {summary['metrics']}; checkpoint: {summary['checkpoint']}")
        return summary
