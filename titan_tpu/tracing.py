"""Is a tracer recording ops right now? Model and kernel code ask to pick graph-friendly formulations.

It sits in the lowest layer (docs/architecture.md, "Layers") because kernels/ and models/ both ask.
"""

import torch

__all__ = ["is_tracing"]


def is_tracing() -> bool:
    """True while a make_fx-style tracer records ops (a proxy dispatch mode is active): the graph
    trainer's capture, or torch's scan op tracing its body; and while Dynamo compiles (the decode
    step of titan_tpu/generate), which cannot trace the dispatch-mode query and answers first."""
    if torch.compiler.is_compiling():
        return True
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None
