"""The fingerprint of a program handed to XLA: what ties a run to the program `titan-tpu compile`
certified.

A program is identified by its module text as handed to XLA (StableHLO, from our lowering through
JAX or from TorchTPU's), with source locations taken out: they name files and lines of the
process that traced it, not what the program computes. Two processes that trace the same step
for the same devices print the same fingerprint, wherever the code and its environment are
installed; any change of an op, a shape, a sharding, a donation or a collective changes it.

Source locations hide in two places. The module's own ops end in `loc(...)`. A Pallas kernel
(splash attention, megablox's gmm) is a custom call whose backend config carries the kernel's
Mosaic module as base64 MLIR bytecode, and that bytecode holds its locations too: the absolute
path of the installed kernel file (".../site-packages/jax/experimental/pallas/ops/tpu/...").
So each kernel body counts by the hash of its ops printed without debug info, which needs JAX's
MLIR bindings (only a JAX-lowered text holds such a body).
"""

from __future__ import annotations

import base64
import hashlib
import re

__all__ = ["program_fingerprint"]

_LOCATION = re.compile(r"\s*loc\((?:[^()]|\([^()]*\))*\)")  # an op's trailing loc(...), one level of nesting
_LOCATION_ALIAS = re.compile(r"^#loc\d*\s*=.*$\n?", re.M)  # "#loc3 = loc(...)" definitions
# A Mosaic kernel's body in a custom call's backend config, as the module text quotes it.
_KERNEL_BODY = re.compile(r'(\\22body\\22: \\22)([A-Za-z0-9+/=]+)(\\22)')


def program_fingerprint(module_text: str) -> str:
    """16 hex digits of the SHA-256 of the module text without its source locations."""
    text = _LOCATION_ALIAS.sub("", _LOCATION.sub("", module_text))
    text = _KERNEL_BODY.sub(lambda m: m.group(1) + _kernel_ops_hash(m.group(2)) + m.group(3), text)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _kernel_ops_hash(body_base64: str) -> str:
    """The SHA-256 of a Mosaic kernel's ops, printed from its bytecode without source locations."""
    from jax._src.lib import tpu
    from jax._src.lib.mlir import ir

    with ir.Context() as context:
        context.allow_unregistered_dialects = True  # Mosaic's serialized ops are versioned names
        tpu.register_dialect(context)
        module = ir.Module.parse(base64.b64decode(body_base64))
        ops = module.operation.get_asm(enable_debug_info=False)
    return hashlib.sha256(ops.encode()).hexdigest()
