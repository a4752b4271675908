"""Functional AdamW, gradient clipping and the learning-rate schedule.

Everything here except the `AdamW` convenience class is a pure function of tensors: no Python-side
state and no Python branch on tensor values. That lets the graph trainer trace forward, backward,
clipping and the optimizer update into one graph with make_fx, with parameters, optimizer state,
`step` and `lr` all as graph inputs.

Optimizer state layout: {"exp_avg": {name: Tensor}, "exp_avg_sq": {name: Tensor}}. The moments
have the same dtype, device and shape as their parameter (so with fp32 parameters they are fp32;
with lower-precision parameters they are lower precision too; mixed precision is expected to keep
fp32 master parameters, as on CPU by default).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from titan_tpu.config import OptimizerConfig

__all__ = [
    "AdamW",
    "adamw_init",
    "adamw_update",
    "adamw_update_",
    "clip_grad_norm",
    "clip_grad_norm_",
    "grad_norm",
    "lr_at",
    "trained_parameters",
    "update_buffers",
    "validate_lr_schedule",
    "weight_decay_mask",
]

DECAY_TYPES = ("linear", "cosine", "none")


# ---------------------------------------------------------------------------------------------
# AdamW
# ---------------------------------------------------------------------------------------------


def trained_parameters(model: torch.nn.Module) -> dict[str, Tensor]:
    """The parameters the optimizer updates: those that take gradients (all of them, or under LoRA
    the adapters; a vision-language model's frozen tower is not among them)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def weight_decay_mask(named_params: Iterable[tuple[str, Tensor]], *,
                      layer_stacked: Collection[str] = ()) -> dict[str, bool]:
    """Which parameters get weight decay: every tensor with 2 or more dims (linear weights and
    embeddings, as TorchTitan does), none of the 1-D ones (norm weights, biases), whose decay
    would only pull their scale toward zero. Names in `layer_stacked` carry an extra leading
    layer axis (scan-over-layers), which does not count."""
    return {name: p.dim() - (name in layer_stacked) >= 2 for name, p in named_params}


def adamw_init(params: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """Zero first and second moments, same dtype/device/shape as each parameter."""
    return {
        "exp_avg": {name: torch.zeros_like(p) for name, p in params.items()},
        "exp_avg_sq": {name: torch.zeros_like(p) for name, p in params.items()},
    }


def _group_names(names: list[str], params: dict[str, Tensor], extra_key=None) -> list[list[str]]:
    """Split names into groups sharing device, dtype and, for DTensors, mesh (one foreach call
    needs them equal; expert parallelism puts the experts on a mesh of their own), and optionally
    `extra_key(name)` too."""
    groups: dict[tuple, list[str]] = {}
    for name in names:
        p = params[name]
        key = (p.device, p.dtype, getattr(p, "device_mesh", None), extra_key(name) if extra_key else None)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def adamw_update_(
    params: dict[str, Tensor],
    grads: dict[str, Tensor],
    state: dict,
    *,
    step: int | Tensor,
    lr: float | Tensor,
    beta1: float = 0.9,
    beta2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    decay: dict[str, bool],
) -> None:
    """One AdamW step applied in place to `params` and `state` (the eager path).

    `step` is the 1-based number of this update (for bias correction) and `lr` its learning rate;
    either may be a Python number or a 0-dim tensor (for tracing). Weight decay is decoupled,
    p <- p * (1 - lr * weight_decay), and applied only where `decay[name]` is True. The arithmetic
    follows torch.optim.AdamW (foreach) op for op. Parameters with no entry in `grads` are left
    unchanged and keep their state, as torch.optim does for params whose .grad is None.
    """
    extra = set(grads) - set(params)
    if extra:
        raise ValueError(f"grads has names that are not parameters: {sorted(extra)[:5]}")
    names = [n for n in params if n in grads]
    apply_decay = weight_decay != 0

    # Scalars shared by all tensors. With tensor step/lr these are 0-dim tensors (traceable);
    # with Python numbers they stay Python floats, which foreach ops take fastest.
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    step_size = lr / bias_correction1
    decay_factor = 1 - lr * weight_decay

    for group in _group_names(names, params, extra_key=lambda n: apply_decay and decay.get(n, False)):
        p = [params[n] for n in group]
        g = [grads[n] for n in group]
        m = [state["exp_avg"][n] for n in group]
        v = [state["exp_avg_sq"][n] for n in group]

        # m <- beta1 m + (1 - beta1) g ;  v <- beta2 v + (1 - beta2) g^2
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)

        # denom = sqrt(v) / sqrt(bias_correction2) + eps
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)

        # Decoupled weight decay on the old parameter value (as torch does), then
        # p <- p - step_size * m / denom.
        if apply_decay and decay.get(group[0], False):
            torch._foreach_mul_(p, decay_factor)
        if isinstance(step_size, Tensor):
            # Traced path: addcdiv only takes a Python scalar as `value`, so scale explicitly
            # (a compiler fuses these into one kernel anyway).
            update = torch._foreach_div(m, denom)
            torch._foreach_mul_(update, step_size)
            torch._foreach_sub_(p, update)
        else:
            torch._foreach_addcdiv_(p, m, denom, value=-step_size)


def adamw_update(
    params: dict[str, Tensor], grads: dict[str, Tensor], state: dict, **hparams
) -> tuple[dict[str, Tensor], dict]:
    """One AdamW step, out of place: returns (new_params, new_state); inputs are never mutated.

    The same update as `adamw_update_` (keyword arguments as there), applied to fresh copies. This
    is the form the graph trainer traces: parameters and state are graph inputs, their updated
    values graph outputs, and the compiler turns copy-then-update into one fused write.
    """
    new_params = {n: p.clone() if n in grads else p for n, p in params.items()}
    new_state = {key: {n: t.clone() if n in grads else t for n, t in state[key].items()}
                 for key in ("exp_avg", "exp_avg_sq")}
    adamw_update_(new_params, grads, new_state, **hparams)
    return new_params, new_state


def update_buffers(*, out_of_place: bool) -> int:
    """Parameter-sized buffers a step's update holds beside the parameters, the gradients and the
    moments at its peak (the planner's optimizer moment): one, `adamw_update_`'s sqrt(v)
    temporary (`denom`), in place (the eager path); out of place (`adamw_update`, the form the
    graph trainer traces) also the fresh parameters and both fresh moments it returns, which the
    compiled step writes before `GraphStep` copies them back."""
    return 1 + (3 if out_of_place else 0)


def grad_norm(grads: dict[str, Tensor]) -> Tensor:
    """Global L2 norm of all gradients, accumulated in fp32 whatever the grad dtype."""
    names = list(grads)
    if not names:
        return torch.zeros(())
    norms_by_mesh: dict[object, list[Tensor]] = {}
    for group in _group_names(names, grads):
        mesh = getattr(grads[group[0]], "device_mesh", None)
        norms_by_mesh.setdefault(mesh, []).extend(
            torch._foreach_norm([grads[n] for n in group], 2, dtype=torch.float32))
    first_device = grads[names[0]].device
    totals = []
    for norms in norms_by_mesh.values():  # one mesh unless expert parallelism adds the experts' own
        total_norm = torch.linalg.vector_norm(torch.stack([t.to(first_device) for t in norms]), 2)
        if hasattr(total_norm, "full_tensor"):  # DTensor grads: a sharded norm must be reduced
            total_norm = total_norm.full_tensor()
        totals.append(total_norm)
    return totals[0] if len(totals) == 1 else torch.linalg.vector_norm(torch.stack(totals), 2)


def _scale_grads(grads: dict[str, Tensor], coef: Tensor, *, inplace: bool) -> dict[str, Tensor]:
    scaled = dict(grads)
    for group in _group_names(list(grads), grads):
        g = [grads[n] for n in group]
        c = coef.to(g[0].device)
        if inplace:
            torch._foreach_mul_(g, c)
        else:
            scaled.update(zip(group, torch._foreach_mul(g, c)))
    return scaled


def _clip_coef(total_norm: Tensor, max_norm: float) -> Tensor:
    # A tensor clamp, not a Python branch on the norm's value, so this traces into a graph.
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def clip_grad_norm(grads: dict[str, Tensor], max_norm: float) -> tuple[dict[str, Tensor], Tensor]:
    """Global L2 gradient norm and grads scaled by min(1, max_norm / (norm + 1e-6)). Pure.

    With max_norm <= 0 the grads come back unchanged (the norm is still returned, for logging).
    Matches torch.nn.utils.clip_grad_norm_.
    """
    total_norm = grad_norm(grads)
    if max_norm <= 0 or not grads:
        return dict(grads), total_norm
    return _scale_grads(grads, _clip_coef(total_norm, max_norm), inplace=False), total_norm


def clip_grad_norm_(grads: dict[str, Tensor], max_norm: float) -> Tensor:
    """`clip_grad_norm` scaling the gradient tensors in place (the eager path); returns the norm."""
    total_norm = grad_norm(grads)
    if max_norm > 0 and grads:
        _scale_grads(grads, _clip_coef(total_norm, max_norm), inplace=True)
    return total_norm


class AdamW:
    """Eager AdamW holding its own state; updates nn.Parameters in place via `adamw_update_`."""

    def __init__(
        self,
        named_params: dict[str, Tensor],
        *,
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        layer_stacked: Collection[str] = (),
    ):
        self.params = dict(named_params)
        self.hparams = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        self.decay = weight_decay_mask(self.params.items(), layer_stacked=layer_stacked)
        with torch.no_grad():
            self.state = adamw_init({n: p.detach() for n, p in self.params.items()})
        self.step_count = 0

    @classmethod
    def from_config(cls, named_params: dict[str, Tensor], optimizer: OptimizerConfig, *,
                    layer_stacked: Collection[str] = ()) -> AdamW:
        """The [optimizer] section's AdamW (its lr goes to `step`, through the schedule)."""
        return cls(named_params, beta1=optimizer.beta1, beta2=optimizer.beta2, eps=optimizer.eps,
                   weight_decay=optimizer.weight_decay, layer_stacked=layer_stacked)

    @torch.no_grad()
    def step(self, grads: dict[str, Tensor], *, lr: float) -> None:
        """Apply one update with these grads at this learning rate."""
        self.step_count += 1
        plain = {n: p.detach() for n, p in self.params.items()}
        adamw_update_(plain, grads, self.state, step=self.step_count, lr=lr, decay=self.decay, **self.hparams)

    def state_dict(self) -> dict:
        """{"step": int, "exp_avg": {...}, "exp_avg_sq": {...}} (tensors by reference)."""
        return {
            "step": self.step_count,
            "exp_avg": dict(self.state["exp_avg"]),
            "exp_avg_sq": dict(self.state["exp_avg_sq"]),
        }

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Restore step count and moments (copied into the existing tensors, keeping placement)."""
        for key in ("step", "exp_avg", "exp_avg_sq"):
            if key not in sd:
                raise ValueError(f"optimizer state dict is missing {key!r}; was it saved by titan_tpu AdamW?")
        for key in ("exp_avg", "exp_avg_sq"):
            if set(sd[key]) != set(self.state[key]):
                missing = sorted(set(self.state[key]) - set(sd[key]))[:5]
                unexpected = sorted(set(sd[key]) - set(self.state[key]))[:5]
                raise ValueError(
                    f"optimizer {key} names do not match the model: missing {missing}, unexpected {unexpected}"
                )
            # The state dict can hold references to our own tensors (DCP loads in place).
            self.state[key] = {n: t.clone().copy_(sd[key][n]) for n, t in self.state[key].items()}
        self.step_count = int(sd["step"])


# ---------------------------------------------------------------------------------------------
# Learning-rate schedule: warmup - stable - decay
# ---------------------------------------------------------------------------------------------


def validate_lr_schedule(
    *, base_lr: float, warmup_steps: int, total_steps: int, decay_ratio: float, decay_type: str, min_lr_ratio: float
) -> None:
    """Raise ValueError naming the config key if a schedule setting is out of range."""
    if total_steps < 1:
        raise ValueError(f"training.steps must be >= 1, got {total_steps}")
    if base_lr < 0:
        raise ValueError(f"optimizer.lr must be >= 0, got {base_lr}")
    if warmup_steps < 0:
        raise ValueError(f"lr_scheduler.warmup_steps must be >= 0, got {warmup_steps}")
    if warmup_steps > total_steps:
        raise ValueError(f"lr_scheduler.warmup_steps ({warmup_steps}) must be <= training.steps ({total_steps})")
    if not 0.0 <= decay_ratio <= 1.0:
        raise ValueError(f"lr_scheduler.decay_ratio must be in [0, 1], got {decay_ratio}")
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"lr_scheduler.decay_type must be one of {', '.join(DECAY_TYPES)}, got {decay_type!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"lr_scheduler.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")


def lr_at(
    step: int,
    *,
    base_lr: float,
    warmup_steps: int,
    total_steps: int,
    decay_ratio: float,
    decay_type: str = "linear",
    min_lr_ratio: float = 0.0,
) -> float:
    """Learning rate for update number `step` (1-based) of a warmup-stable-decay schedule.

    * warmup: base_lr * step / warmup_steps for steps 1..warmup_steps (reaches base_lr at the end);
    * stable: base_lr;
    * decay over the last round(decay_ratio * total_steps) steps, from base_lr down to
      min_lr_ratio * base_lr at step total_steps, "linear" or "cosine" ("none" stays at base_lr).
      The decay window is shortened so it never overlaps warmup: decay_ratio 1.0 with cosine is the
      classic warmup + cosine schedule.
    Steps past total_steps stay at the final value; after warmup the lr never goes below
    min_lr_ratio * base_lr.
    """
    validate_lr_schedule(
        base_lr=base_lr,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        decay_ratio=decay_ratio,
        decay_type=decay_type,
        min_lr_ratio=min_lr_ratio,
    )
    if step < 1:
        raise ValueError(f"lr_at step is 1-based (the update number), got {step}")
    if step <= warmup_steps:
        return base_lr * step / warmup_steps

    min_lr = base_lr * min_lr_ratio
    decay_steps = min(round(decay_ratio * total_steps), total_steps - warmup_steps)
    decay_start = total_steps - decay_steps  # last step at base_lr
    if decay_type == "none" or decay_steps == 0 or step <= decay_start:
        return base_lr
    progress = min(1.0, (step - decay_start) / decay_steps)  # in (0, 1]; 1 at total_steps
    if decay_type == "linear":
        factor = 1.0 - progress
    else:  # cosine
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(min_lr, min_lr + (base_lr - min_lr) * factor)
