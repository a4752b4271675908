"""What a Transformers-backend model keeps for its backward, measured on fake tensors: the planner's
activation terms of an hf model (plan/hf_terms.py), beside the model as the native model's formulas
are (models/common/activation_memory.py).

transformers' layers are not ours, so instead of a formula per module the base model's forward is
run once on fake tensors (torch's FakeTensorMode: shapes, dtypes and devices, no memory, no
compute) under autograd's saved-tensor hooks, and the bytes of the distinct storages autograd keeps
are summed, parameters and buffers left out (the layout's terms count the weights). Fake tensors on
the CPU device, not the meta device: transformers skips its data-dependent checks on fake tensors
(`is_tracing`), and the kernels are the CPU's (SDPA's flash form, which keeps what a TPU's splash
kernel keeps: q, k, v, the output and a log-sum-exp per head).

One forward without activation checkpointing gives every mode (`LayerSaved`): forward pre-hooks and
hooks on the decoder layers (`HFCausalLM.decoder_layers`, the units the model checkpoints) attribute
each saved storage to the layer whose forward first saved it, and record each layer's input (what a
fully checkpointed layer keeps) and the outputs of the ops selective checkpointing keeps
(activation_checkpoint.SAVED_OPS) and of those a traced checkpointed layer keeps in every mode (ops
that may draw random numbers: SDPA). A FLOP counter gives each layer's forward FLOPs, which full
checkpointing runs again in the backward. Under LoRA, the up-projection of each adapter (B's matmul,
`B (A x)`, as wide as the layer's output) is counted apart (`adapter_outputs`): checkpointing keeps it
as it keeps any matmul's output, but a step XLA compiles whole keeps the sum it is added into
(qwen2_5_vl_7b_tpu with LoRA: one fused `convolution_add` per projection), not it as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from titan_tpu.models.common.activation_checkpoint import SAVED_OPS

if TYPE_CHECKING:
    from titan_tpu.data.batch import ImageInputs
    from titan_tpu.models.hf.model import HFCausalLM

__all__ = ["LayerSaved", "SavedBytes", "measure_saved_bytes"]


@dataclass(frozen=True)
class LayerSaved:
    """Bytes of one decoder layer's forward on the measured batch."""

    saved: int  # what autograd keeps for the layer's backward without checkpointing
    layer_input: int  # the hidden state it reads: what a fully checkpointed layer keeps
    matmul_outputs: int  # outputs of SAVED_OPS (matmuls, attention): selective checkpointing keeps them and the input
    adapter_outputs: int  # LoRA's up-projections' outputs B (A x), SAVED_OPS too (the module docstring)
    seeded_outputs: int  # outputs of ops that may draw random numbers (SDPA): kept by a traced checkpointed layer
    forward_flops: int  # what a recomputation under full checkpointing runs again


@dataclass(frozen=True)
class SavedBytes:
    """What the base model's forward keeps for its backward on the measured batch (`measure_saved_bytes`)."""

    layers: tuple[LayerSaved, ...]
    outside: int  # kept outside the decoder layers: token ids, embeddings, the vision tower and projector, final norm
    hidden: int  # the final hidden state the loss reads


class _LayerOps(TorchDispatchMode):
    """While a decoder layer runs (`layer` not None), by layer: the bytes of the outputs of the ops
    a checkpointed layer keeps, and the FLOPs torch's FlopCounterMode counts for each op."""

    def __init__(self, n_layers: int):
        super().__init__()
        self.layer: int | None = None
        self.matmul = [0] * n_layers
        self.adapter = [0] * n_layers
        self.seeded = [0] * n_layers
        self.flops = [0] * n_layers
        self.up_projections: set[int] = set()  # storages of LoRA's B matrices (fake, set while measured)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.layer is None:
            return out
        seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        if func in SAVED_OPS or seeded:
            nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            up = any(_storage_key(t) in self.up_projections for t in tree_leaves(args) if isinstance(t, torch.Tensor))
            (self.seeded if seeded else self.adapter if up else self.matmul)[self.layer] += nbytes
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops[self.layer] += count(*args, **kwargs, out_val=out)
        return out


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@contextlib.contextmanager
def _as_fake(model: nn.Module, mode) -> Iterator[None]:
    """Inside: every meta parameter of `model` is a fake CPU tensor of its shape (tied parameters
    stay one), requires_grad kept; the buffers are the CPU's (their values, computed at construction)."""
    cpu = torch.device("cpu")
    fakes: dict[int, nn.Parameter] = {}
    stored = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in fakes:
                fake = mode.fake_tensor_converter.from_meta_and_device(mode, p.data, cpu)
                fakes[id(p)] = nn.Parameter(fake, requires_grad=p.requires_grad)
            stored.append((module, name, p))
    for module, name, p in stored:
        module._parameters[name] = fakes[id(p)]
    model.init_buffers(cpu)
    try:
        yield
    finally:
        for module, name, p in stored:
            module._parameters[name] = p


@contextlib.contextmanager
def _plain_rows() -> Iterator[None]:
    """Inside: transformers takes the measured rows for what they are, one sequence each. On fake
    tensors it cannot read the position ids and assumes packed sequences (`is_tracing`), which
    would materialise a mask that the real run, eager or captured, never builds."""
    from transformers import masking_utils

    found = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = found


def measure_saved_bytes(model: HFCausalLM, tokens_BS: torch.Tensor, images: ImageInputs | None = None) -> SavedBytes:
    """What `model`'s base model keeps for its backward on `tokens_BS` (and a vision-language
    model's `images`), measured on fake tensors (the module docstring). `model` is built on the
    meta device without activation checkpointing, its trained parameters marked (requires_grad);
    they are fake tensors only while it runs. The output projection and the loss are not run: the
    planner counts them with the loss kernel's terms."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_tpu.models.hf.flops import _on_meta
    from titan_tpu.models.lora import lora_modules

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    layers = model.decoder_layers
    ops = _LayerOps(len(layers))
    current: list[int | None] = [None]
    inputs = [0] * len(layers)
    packed: list[tuple[int | None, torch.Tensor]] = []

    def enter(i: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            inputs[i] = hidden.numel() * hidden.element_size()
            current[0] = ops.layer = i
        return hook

    def leave(*_):
        current[0] = ops.layer = None

    handles = [h for i, layer in enumerate(layers)
               for h in (layer.register_forward_pre_hook(enter(i), with_kwargs=True),
                         layer.register_forward_hook(leave))]
    try:
        with model.hooks_context(), _as_fake(model, mode), _plain_rows(), mode:
            ops.up_projections = {_storage_key(linear.lora_B) for linear in lora_modules(model).values()}
            fake_tokens_BS = mode.from_tensor(tokens_BS)
            fake_images = None if images is None else _fake_images(_on_meta(images), mode)
            with ops, torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append((current[0], t)) or t,
                                                               lambda t: t):
                # The vision tower runs here too: it merges the image features into the embeddings.
                kwargs = model._model_kwargs(fake_tokens_BS, None, fake_images)
                hidden_BSD = model.hf_model.base_model(**kwargs)[0]
            # The parameters are fake already; the buffers were converted when an op read them (memoised).
            own = {_storage_key(p) for p in model.parameters()} | \
                {_storage_key(mode.from_tensor(b)) for b in model.buffers()}
    finally:
        for handle in handles:
            handle.remove()
    first: dict[int, tuple[int | None, int]] = {}
    for layer, t in packed:
        key = _storage_key(t)
        if key not in own and key not in first:
            first[key] = (layer, t.untyped_storage().nbytes())
    saved = [0] * len(layers)
    outside = 0
    for layer, nbytes in first.values():
        if layer is None:
            outside += nbytes
        else:
            saved[layer] += nbytes
    return SavedBytes(layers=tuple(LayerSaved(saved=saved[i], layer_input=inputs[i], matmul_outputs=ops.matmul[i],
                                              adapter_outputs=ops.adapter[i], seeded_outputs=ops.seeded[i],
                                              forward_flops=ops.flops[i])
                                   for i in range(len(layers))),
                      outside=outside, hidden=hidden_BSD.numel() * hidden_BSD.element_size())


def _fake_images(images: ImageInputs, mode) -> ImageInputs:
    """`images` (on the meta device) as fake CPU tensors."""
    import dataclasses

    cpu = torch.device("cpu")

    def faked(value):
        if isinstance(value, torch.Tensor):
            return mode.fake_tensor_converter.from_meta_and_device(mode, value, cpu)
        if isinstance(value, dict):
            return {key: faked(v) for key, v in value.items()}
        return value

    return dataclasses.replace(images, **{f.name: faked(getattr(images, f.name)) for f in dataclasses.fields(images)})
