"""A stand-in for `torch.tpu.pallas.jax_op` that runs the JAX function on this CPU.

The real jax_op (torch_tpu 0.2.0) turns a JAX function into a torch custom op: parameters
annotated `jax.Array` become tensors, the others static arguments, and the op returns a tensor or
a tuple of tensors. This stand-in keeps that calling convention and does the work on CPU instead:
torch tensors -> JAX arrays through DLPack (no copy), the function jitted with the same static
arguments, the results back to torch through DLPack. Pallas TPU kernels inside it run in
interpret mode when the caller holds `pltpu.force_tpu_interpret_mode()`.

What it does not stand in for: the real op's registration with the dispatcher and its fake
(meta) kernel; test_api.py registers our functions with the real jax_op to check those.
"""

from __future__ import annotations

import inspect

import jax
import torch


def _is_array(annotation) -> bool:
    return annotation is jax.Array or annotation == "jax.Array"


def _to_jax(value):
    if isinstance(value, torch.Tensor):
        # DLPack wants a dense tensor; the torch side passes contiguous ones already.
        return jax.dlpack.from_dlpack(value.detach().contiguous())
    return value


def _to_torch(value):
    if isinstance(value, (tuple, list)):
        return tuple(_to_torch(v) for v in value)
    return torch.utils.dlpack.from_dlpack(value)


def jax_op(name, fn=None, /, **kwargs):
    """Same call as torch.tpu.pallas.jax_op(name, fn): returns a callable on torch tensors."""
    if kwargs:
        raise NotImplementedError(f"the CPU stand-in takes no jax_op options, got {sorted(kwargs)}")
    if fn is None:
        return lambda f: jax_op(name, f)
    assert "::" in name, name
    signature = inspect.signature(inspect.unwrap(fn), eval_str=True)
    static = tuple(i for i, p in enumerate(signature.parameters.values()) if not _is_array(p.annotation))
    jitted = jax.jit(fn, static_argnums=static)

    def op(*args):
        return _to_torch(jitted(*(_to_jax(a) for a in args)))

    op.__name__ = name
    return op
