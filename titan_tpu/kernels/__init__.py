"""Hot ops with per-backend implementations behind one registry (see registry.py).

Ops: ``attention`` (causal, optionally document-masked; attention.py), ``chunk_attention`` (a
chunk of queries over the keys up to its end: context parallelism's; attention.py), ``loss`` (output
projection + cross-entropy, chunked so the logits are never whole; loss.py) and ``grouped_mm``
(mixture-of-experts expert matmuls; grouped_mm.py). TPU variants live in tpu.py, the only kernel
module that calls torch_tpu; the JAX functions it hands to TorchTPU's jax_op are in tpu_jax.py.

`KernelConfig` is the ``[kernels]`` config section and what a model is built with: the choice
per op ("auto" or an implementation name). Model code asks it for the implementation to run on
the device its tensors are on; `describe()` is what ``titan-tpu kernels`` prints.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

from titan_tpu.kernels import tpu as _tpu  # noqa: F401 - registers the TPU variants
from titan_tpu.kernels.attention import ATTENTION, CHUNK_ATTENTION, document_ids_from_positions
from titan_tpu.kernels.grouped_mm import GROUPED_MM
from titan_tpu.kernels.loss import IGNORED_LABELS, LOSS
from titan_tpu.kernels.registry import Impl, Op, device_type_as, kernel_device_type

__all__ = ["ATTENTION", "CHUNK_ATTENTION", "GROUPED_MM", "LOSS", "NOT_AS_ON_TPU", "OPS", "Impl", "KernelConfig", "Op",
           "describe", "device_type_as", "document_ids_from_positions", "jax_kernel_device", "kernel_device_type"]

OPS: dict[str, Op] = {"attention": ATTENTION, "chunk_attention": CHUNK_ATTENTION, "loss": LOSS,
                      "grouped_mm": GROUPED_MM}

DOCUMENTS = frozenset({"documents"})

# What `auto` tries, in order, per device type ("<device>+documents" when the call has document
# masks). Measured choices are explained in docs/kernels.md. On TPU, auto prefers the jax_op
# variants (splash, gmm), whose JAX kernels are checked numerically in TPU interpret mode
# (make tpu-check), over TorchTPU's native ops, whose signatures only are checked; neither has
# been timed on a TPU (docs/tpu.md).
ATTENTION.preference = {
    "cpu": ["sdpa", "reference"],
    "cuda": ["sdpa", "reference"],
    "cuda+documents": ["flex", "sdpa", "reference"],
    "tpu": ["splash", "splash_sdpa", "reference"],
    "tpu+documents": ["splash", "reference"],
    # "jax": a step captured on CPU and lowered to JAX for XLA's TPU compiler (`titan-tpu
    # compile`): the TPU's JAX kernels, else what the CPU runs (traced as its ATen ops).
    "jax": ["splash", "sdpa", "reference"],
}
# Chunk attention (context parallelism): on CUDA flex, whose block mask skips the causally masked
# blocks without a per-element mask (sdpa would build a [Q, S] mask of each chunk: gigabytes at
# long contexts); on CPU sdpa with the mask.
CHUNK_ATTENTION.preference = {
    "cpu": ["sdpa", "reference"],
    "cuda": ["flex", "sdpa", "reference"],
    "tpu": ["splash", "reference"],
    "jax": ["splash", "sdpa", "reference"],
}
GROUPED_MM.preference = {
    "cpu": ["torch", "reference"],
    "cuda": ["torch", "reference"],
    "tpu": ["gmm", "ragged_dot", "reference"],
    "jax": ["gmm", "torch", "reference"],
}
LOSS.preference = {
    "cpu": ["chunked", "reference"],
    "cuda": ["chunked", "reference"],
    "tpu": ["tokamax", "chunked", "reference"],
    "jax": ["tokamax", "chunked", "reference"],
}


# Kernels whose JAX form in a step captured on this CPU is not the one a TPU runs, and what stands in
# (`KernelConfig.on_jax` says so). tokamax's Mosaic kernel checks, when traced, that the default device
# is a local TPU of v5 or later (its `supported_on` reads `pltpu.get_tpu_info()`), which a compile-only
# client has not: the step holds tokamax's own plain-XLA implementation of the same call instead
# (kernels/jax_traced.py).
NOT_AS_ON_TPU = {"tokamax": "its plain-XLA implementation: the Mosaic kernel asks for a local TPU chip when "
                            "traced, so it cannot be lowered without one"}


def jax_kernel_device(platform: str) -> str:
    """The device type the kernel registry answers for in a step captured for the JAX path on
    `platform`: the TPU's JAX kernels ("jax", kernels/jax_traced.py) or the CPU's."""
    return "jax" if platform == "tpu" else "cpu"


@dataclass
class KernelConfig:
    # Implementation per op: auto picks the best one that runs on the device (titan-tpu kernels
    # lists them); a name forces one (an error if it cannot run here).
    attention: str = "auto"  # auto, reference, sdpa, flex, splash, splash_sdpa
    # Context parallelism's attention (each rank's sequence chunks over the gathered keys):
    # auto, reference, sdpa, flex, splash.
    chunk_attention: str = "auto"
    loss: str = "auto"  # auto, reference, chunked, tokamax
    # Tokens per chunk of the chunked loss; 0 = about 64M logits per chunk (one chunk for small vocabularies).
    loss_chunk_tokens: int = 0
    grouped_mm: str = "auto"  # mixture-of-experts expert matmuls: auto, reference, torch, gmm, ragged_dot

    def validate(self) -> None:
        """Config-time checks that need no device: known names, sane sizes."""
        ATTENTION.check_name(self.attention)
        CHUNK_ATTENTION.check_name(self.chunk_attention)
        LOSS.check_name(self.loss)
        GROUPED_MM.check_name(self.grouped_mm)
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"kernels.loss_chunk_tokens = {self.loss_chunk_tokens} must be >= 0 (0 = auto)")

    def check_device(self, device_type: str, *, documents: bool) -> None:
        """Fail early (one line) when a chosen implementation cannot run on `device_type`."""
        _resolve(ATTENTION, self.attention, device_type, DOCUMENTS if documents else frozenset())
        _resolve(LOSS, self.loss, device_type, frozenset())
        _resolve(GROUPED_MM, self.grouped_mm, device_type, frozenset())

    def for_ignored_labels(self, device_type: str) -> KernelConfig:
        """This config with its loss kernel one that skips ignored labels (chat data): auto becomes
        the best such kernel on `device_type`; a named kernel without it is a one-line error."""
        return replace(self, loss=_resolve(LOSS, self.loss, device_type, IGNORED_LABELS).name)

    def on_jax(self, platform: str, *, tp: int = 1) -> tuple[KernelConfig, dict[str, str]]:
        """(this config with each op's kernel named, what each op runs as) in a step captured for the
        JAX path on `platform` ("tpu" or "cpu"): the choice (auto: the platform's pick). On a TPU
        splash, tokamax and megablox's gmm enter the program as their own JAX functions (Mosaic custom
        calls); a choice with no form there (TorchTPU's native ops on a TPU, the TPU's kernels on a
        CPU) is replaced by the op's pick for the platform, and the entry says so. Under tensor
        parallelism (tp > 1) the loss is the chunked kernel's vocabulary-parallel form, on a TPU too
        (parallel/tensor_parallel.py); tokamax has none."""
        device_type = jax_kernel_device(platform)
        kernels, used = self, {}
        for field, op in OPS.items():
            choice = getattr(kernels, field)
            if field == "loss" and tp > 1 and choice in ("auto", "chunked"):
                used[field] = "chunked (vocabulary-parallel under tp)"
                kernels = replace(kernels, loss="chunked")
                continue
            try:
                used[field] = op.resolve(choice, device_type).name
            except ValueError:
                used[field] = (f"{op.resolve('auto', device_type).name} (in place of the recipe's {choice}, which has "
                               f"no {'JAX' if platform == 'tpu' else platform} form)")
            name = used[field].split()[0]
            if platform == "tpu" and name in NOT_AS_ON_TPU:
                used[field] = f"{name} ({NOT_AS_ON_TPU[name]})"
            kernels = replace(kernels, **{field: name})
        return kernels, used

    def grouped_mm_fn(self, device_type: str) -> Callable:
        """(x_TD, w_EDF, group_sizes_E) -> y_TF, rows sorted by group (kernels/grouped_mm.py)."""
        return _resolve(GROUPED_MM, self.grouped_mm, device_type, frozenset()).fn

    def attention_impl(self, device_type: str, *, documents: bool) -> Impl:
        return _resolve(ATTENTION, self.attention, device_type, DOCUMENTS if documents else frozenset())

    def chunk_attention_impl(self, device_type: str, *, documents: bool) -> Impl:
        """Context parallelism's kernel; resolved only by runs with --parallelism.cp > 1."""
        return _resolve(CHUNK_ATTENTION, self.chunk_attention, device_type, DOCUMENTS if documents else frozenset())

    def loss_fn(self, device_type: str) -> Callable:
        """(h_ND, w_VD, labels_N) -> summed cross-entropy, with this config's chunk size."""
        impl = _resolve(LOSS, self.loss, device_type, frozenset())
        return functools.partial(impl.fn, chunk_tokens=self.loss_chunk_tokens)


def _resolve(op: Op, choice: str, device_type: str, needs: frozenset[str]) -> Impl:
    return _resolve_cached(op, choice, kernel_device_type(device_type), needs)


@functools.cache
def _resolve_cached(op: Op, choice: str, device_type: str, needs: frozenset[str]) -> Impl:
    return op.resolve(choice, device_type, needs)  # cached: model code resolves on every call


def describe(device_type: str) -> str:
    """Per op: what auto picks on a machine of this device type with its packages installed (a TPU
    VM with torch-tpu, jax and tokamax; a CUDA machine), what it picks in this process, and every
    implementation with whether it runs here (and why not)."""
    lines = []
    for name, op in OPS.items():
        lines.append(f"{op.config_key}:")
        needs_variants = [frozenset(), DOCUMENTS] if name.endswith("attention") else [frozenset()]
        for needs in needs_variants:
            on_device, here = (_auto_pick(op, device_type, needs, installed=flag) for flag in (True, False))
            label = "auto" + (" (documents)" if needs else "")
            where = "a TPU VM" if device_type == "tpu" else f"a {device_type.upper()} machine"
            pick = on_device if on_device == here else f"{on_device} on {where}; here: {here}"
            lines.append(f"  {label:<18} -> {pick}")
        for impl in op.impls.values():
            reason = impl.why_not(device_type)
            status = "available" if reason is None else f"not here: {reason}"
            lines.append(f"  {impl.name:<18} {status}; {impl.description}")
    return "\n".join(lines)


def _auto_pick(op: Op, device_type: str, needs: frozenset[str], *, installed: bool) -> str:
    try:
        return op.resolve("auto", device_type, needs, installed=installed).name
    except ValueError:
        return "none"
