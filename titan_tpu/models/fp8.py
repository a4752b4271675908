"""Float8 linears (docs/fp8.md): a targeted ``nn.Linear`` computes its three matmuls in float8.

Forward out = x W^T, backward grad_input = g W and grad_weight = g^T x, each operand quantised
with a dynamic scale (kernels/fp8.py: amax per tensor under tensorwise scaling, per row of the
left operand and per column of the right, along the contracted dimension, under rowwise) and the
product dequantised in the input's dtype. Weights and activations are e4m3; the output's
gradient is e5m2 under tensorwise scaling (its range matters more than its precision) and e4m3
under rowwise (per-row scales give it the range; `torch._scaled_mm`'s rowwise path takes e4m3).
The bias is added in the compute dtype; the master weights stay fp32 (or whatever the model
keeps); every other op is unchanged.

A converted linear keeps its parameters and names: its class is swapped for `Float8Linear` (a
subclass of nn.Linear), so state dicts, checkpoints, the HF adapter and SimpleFSDP's
parametrization (a subclass of the module's class) see the same module. The matmuls are one
autograd.Function calling `kernels.fp8.scaled_mm`, so a captured step (make_fx, graph mode)
records `aten._scaled_mm.default` (or, emulated, its fp32 dequantise-matmul) with the quantisation
as plain aten ops. The backward quantises the saved high-precision x and W again (no float8
copies kept between forward and backward).

With `experts`, an MoE layer's experts (`GroupedExperts`, whose three matmuls are grouped matmuls
over the tokens sorted by expert) become `Float8GroupedExperts` the same way, by class swap: same
parameters, same names. Their grouped matmuls, forward and both backward ones, run through
kernels/fp8_grouped_mm.py with per-expert scales: rowwise, one per row of the left operand and
one per expert and column of its right operand, along the contracted dimension (for the weight
gradient, whose contracted dimension is an expert's rows, one per expert and column of each);
tensorwise, one for the activation (or gradient) and one per expert for its weight.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titan_tpu.kernels import kernel_device_type
from titan_tpu.kernels.fp8 import E4M3, E5M2, quantize, scaled_mm
from titan_tpu.kernels.fp8_grouped_mm import quantize_groups, scaled_grouped_mm, scaled_grouped_mm_weight_grad
from titan_tpu.models.common.moe import GroupedExperts

__all__ = ["Float8GroupedExperts", "Float8Linear", "Float8Settings", "convert_experts_to_float8", "convert_to_float8",
           "float8_grouped_linear", "float8_modules"]

_STATE = "_fp8"  # a Float8Linear's Float8Settings, in its __dict__
MULTIPLE = 16  # float8 matmuls take in/out features that are multiples of 16


@dataclass(frozen=True)
class Float8Settings:
    rowwise: bool
    emulate: bool = False

    @property
    def grad_fp8(self) -> torch.dtype:
        return E4M3 if self.rowwise else E5M2


class _Float8MM(torch.autograd.Function):
    """x [M, K] @ w[N, K]^T in float8, both backward matmuls in float8 too. forward and setup_context
    apart, as torch.func asks: scanned layers with full checkpointing take each layer's vector-Jacobian
    product with torch.func.vjp (models/common/scan.py)."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, settings: Float8Settings) -> torch.Tensor:
        return _mm(x, w.t(), E4M3, settings, x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # separate from forward: functorch transforms need it
        x, w, settings = inputs
        ctx.save_for_backward(x, w)
        ctx.settings = settings

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        s = ctx.settings
        grad_x = _mm(g, w, s.grad_fp8, s, x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = _mm(g.t(), x, s.grad_fp8, s, w.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def _mm(a: torch.Tensor, b: torch.Tensor, a_fp8: torch.dtype, s: Float8Settings,
        out_dtype: torch.dtype) -> torch.Tensor:
    qa, sa = quantize(a, a_fp8, 1 if s.rowwise else None)
    qb, sb = quantize(b, E4M3, 0 if s.rowwise else None)
    return scaled_mm(qa, qb, sa, sb, out_dtype, emulate=s.emulate)


class _Float8GroupedMM(torch.autograd.Function):
    """Per expert e, x_e [T_e, D] @ w[e]^T (w stored [E, F, D], nn.Linear's layout) in float8, and both
    backward grouped matmuls in float8 too; forward and setup_context apart, as `_Float8MM`."""

    @staticmethod
    def forward(x_TD: torch.Tensor, w_EFD: torch.Tensor, group_sizes_E: torch.Tensor,
                settings: Float8Settings) -> torch.Tensor:
        return _grouped(x_TD, w_EFD.transpose(1, 2), group_sizes_E, E4M3, settings, x_TD.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x_TD, w_EFD, group_sizes_E, settings = inputs
        ctx.save_for_backward(x_TD, w_EFD, group_sizes_E)
        ctx.settings = settings

    @staticmethod
    def backward(ctx, g_TF: torch.Tensor):
        x_TD, w_EFD, group_sizes_E = ctx.saved_tensors
        s = ctx.settings
        g_TF = g_TF.contiguous()  # a loss's gradient can be an expanded view
        grad_x = _grouped(g_TF, w_EFD, group_sizes_E, s.grad_fp8, s, x_TD.dtype) if ctx.needs_input_grad[0] else None
        grad_w = (_grouped_weight_grad(g_TF, x_TD, group_sizes_E, s.grad_fp8, s, w_EFD.dtype)
                  if ctx.needs_input_grad[1] else None)
        return grad_x, grad_w, None, None


def _grouped(a_TK: torch.Tensor, b_EKN: torch.Tensor, group_sizes_E: torch.Tensor, a_fp8: torch.dtype,
             s: Float8Settings, out_dtype: torch.dtype) -> torch.Tensor:
    """a's rows of group e @ b[e]: a scaled per row (rowwise) or once; b per expert and column along K
    (rowwise) or per expert."""
    (T, _), (E, _, N) = a_TK.shape, b_EKN.shape
    qa, sa = quantize(a_TK, a_fp8, 1 if s.rowwise else None)
    qb, sb = quantize(b_EKN, E4M3, 1 if s.rowwise else (1, 2))
    return scaled_grouped_mm(qa, qb, sa.expand(T, 1), sb.expand(E, 1, N), group_sizes_E, out_dtype, emulate=s.emulate)


def _grouped_weight_grad(a_TM: torch.Tensor, b_TN: torch.Tensor, group_sizes_E: torch.Tensor, a_fp8: torch.dtype,
                         s: Float8Settings, out_dtype: torch.dtype) -> torch.Tensor:
    """[E, M, N]: per group a_g^T @ b_g, contracted over the group's rows: scaled per group and column
    (rowwise) or once each."""
    E, M, N = group_sizes_E.shape[0], a_TM.shape[1], b_TN.shape[1]
    if s.rowwise:
        (qa, sa), (qb, sb) = quantize_groups(a_TM, a_fp8, group_sizes_E), quantize_groups(b_TN, E4M3, group_sizes_E)
        sa, sb = sa.unsqueeze(2), sb.unsqueeze(1)
    else:
        (qa, sa), (qb, sb) = quantize(a_TM, a_fp8), quantize(b_TN, E4M3)
    return scaled_grouped_mm_weight_grad(qa, qb, sa.expand(E, M, 1), sb.expand(E, 1, N), group_sizes_E, out_dtype,
                                         emulate=s.emulate)


def float8_grouped_linear(x_TD: torch.Tensor, w_EFD: torch.Tensor, group_sizes_E: torch.Tensor, *,
                          settings: Float8Settings) -> torch.Tensor:
    """x's rows of expert e @ w[e]^T, the weights as stored: GroupedExperts' matmul in float8. On
    TorchTPU (the kernels of device type "tpu") through jax_op, quantised on the JAX side."""
    if kernel_device_type(x_TD.device.type) == "tpu" and not settings.emulate:
        from titan_tpu.kernels.tpu import jax_op_fp8_grouped_linear

        return jax_op_fp8_grouped_linear(x_TD, w_EFD.to(x_TD.dtype), group_sizes_E, rowwise=settings.rowwise)
    return _Float8GroupedMM.apply(x_TD, w_EFD.to(x_TD.dtype), group_sizes_E, settings)


class Float8GroupedExperts(GroupedExperts):
    """GroupedExperts whose grouped matmuls run in float8 (module docstring); made by class swap."""

    def grouped_linear(self, kernels, device_type: str) -> Callable:
        return functools.partial(float8_grouped_linear, settings=self.__dict__[_STATE])


class Float8Linear(nn.Linear):
    """nn.Linear whose matmuls run in float8 (module docstring); made by class swap."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        settings: Float8Settings = self.__dict__[_STATE]
        w = self.weight
        out = _Float8MM.apply(x.reshape(-1, x.shape[-1]), w.to(x.dtype), settings)
        out = out.reshape(*x.shape[:-1], w.shape[0])
        return out if self.bias is None else out + self.bias.to(out.dtype)


def float8_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The Float8 linear layers and Float8 experts of `model` by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (Float8Linear, Float8GroupedExperts))}


def _check_dims(name: str, weight: torch.Tensor) -> None:
    out_f, in_f = weight.shape[-2], weight.shape[-1]
    if in_f % MULTIPLE or out_f % MULTIPLE:
        raise ValueError(f"fp8: layer {name} ({in_f} -> {out_f}) has a side that is not a multiple of {MULTIPLE}; "
                         f"leave it out of fp8.target_modules or change the model's dims")


def _swap(linear: nn.Module, settings: Float8Settings) -> None:
    assert type(linear) is nn.Linear, f"fp8 converts plain nn.Linear layers, not {type(linear).__name__}"
    linear.__class__ = Float8Linear
    linear.__dict__[_STATE] = settings


def convert_to_float8(model: nn.Module, *, scaling: str, target_modules: list[str],
                      emulate: bool = False, experts: bool = False) -> list[str]:
    """Make the linear layers of `model` that `target_modules` selects (models/lora.py's patterns;
    empty: the attention and MLP projections, not the output projection nor an MoE router) Float8
    linears, in place (any device, the meta device too), and the same layers of the block
    templates that activation checkpointing and scan-over-layers run; with `experts`, its MoE
    experts too (`convert_experts_to_float8`); returns their names."""
    from titan_tpu.models.common.transformer import Transformer
    from titan_tpu.models.lora import layers_in_every_block, lora_modules, target_names

    if scaling not in ("tensorwise", "rowwise"):
        raise ValueError(f"fp8.scaling = {scaling!r}: use tensorwise or rowwise")
    settings = Float8Settings(rowwise=scaling == "rowwise", emulate=emulate)
    names = target_names(model, target_modules, section="fp8")
    adapted = lora_modules(model)
    for name in names:
        if name in adapted:
            raise ValueError(f"fp8: layer {name} carries LoRA adapters; keep it out of fp8.target_modules or "
                             "lora.target_modules (e.g. --fp8.target_modules w1,w2,w3 with LoRA on wq,wv)")
        _check_dims(name, model.get_submodule(name).weight)
    scanned = isinstance(model, Transformer) and model.scan_layers
    stacks = model.stacks() if scanned else []
    for name in names:
        stack = next(((n, s) for n, s in stacks if name.startswith(n + ".")), None)
        if stack is None:
            _swap(model.get_submodule(name), settings)
        else:  # a scanned stack only stores [L, out, in] weights: its block template computes
            _swap(stack[1]._block_fn.template.get_submodule(name[len(stack[0]) + 1:]), settings)
    templates = model.block_templates() if isinstance(model, Transformer) and not scanned else []
    relative = layers_in_every_block(model, names, section="fp8") if templates else []
    for template in templates:
        for rel in relative:
            _swap(template.get_submodule(rel), settings)
    return names + (convert_experts_to_float8(model, settings) if experts else [])


def convert_experts_to_float8(model: nn.Module, settings: Float8Settings) -> list[str]:
    """Make every `GroupedExperts` of `model` (and of its block templates: a scanned stack's experts
    live in its template) Float8 experts, in place; returns their names. Refuses a model without
    any, and experts whose sides are not multiples of 16, in one line."""
    from titan_tpu.models.common.transformer import Transformer

    templates = model.block_templates() if isinstance(model, Transformer) else []
    found = {id(m): (name, m) for name, m in model.named_modules() if type(m) is GroupedExperts}
    for template in templates:
        found.update({id(m): (name, m) for name, m in template.named_modules()
                      if type(m) is GroupedExperts and id(m) not in found})
    if not found:
        raise ValueError("fp8.experts = true, but the model has no native MoE experts (GroupedExperts; the "
                         "Transformers backend's experts are not converted); set --fp8.experts false")
    for name, experts in found.values():
        hidden, dim = experts.w1.shape[-2:]
        if hidden % MULTIPLE or dim % MULTIPLE:
            raise ValueError(f"fp8: experts {name} (dim {dim}, hidden {hidden}) have a side that is not a multiple of "
                             f"{MULTIPLE}; set --fp8.experts false or change the model's dims")
    for _, experts in found.values():
        experts.__class__ = Float8GroupedExperts
        experts.__dict__[_STATE] = settings
    return [name for name, m in model.named_modules() if isinstance(m, Float8GroupedExperts)]
