"""Is a tracer recording ops right now? Model and kernel code ask to pick graph-friendly formulations.
And is the step being captured as one program for every rank (`one_program_for_every_rank`)?

It sits in the lowest layer (docs/architecture.md, "Layers") because kernels/, models/ and
parallel/ ask.
"""

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["is_one_program", "is_tracing", "one_program_for_every_rank"]

_ONE_PROGRAM = [False]


def is_tracing() -> bool:
    """True while a make_fx-style tracer records ops (a proxy dispatch mode is active): the graph
    trainer's capture, or torch's scan op tracing its body; and while Dynamo compiles (the decode
    step of titan_tpu/generate), which cannot trace the dispatch-mode query and answers first."""
    if torch.compiler.is_compiling():
        return True
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


@contextlib.contextmanager
def one_program_for_every_rank() -> Iterator[None]:
    """Inside the block a step is captured as one program that every device runs (the JAX
    lowering, kernels/jax_traced.py): the parallel plans read their rank as a value of the step
    (parallel/group_rank.py), and no shape may depend on the rank."""
    previous, _ONE_PROGRAM[0] = _ONE_PROGRAM[0], True
    try:
        yield
    finally:
        _ONE_PROGRAM[0] = previous


def is_one_program() -> bool:
    """Inside `one_program_for_every_rank()`."""
    return _ONE_PROGRAM[0]
