"""TorchTPU's compile of a captured step: one XLA program per step, its collectives inside, the
state it updates donated.

The captured step (graph/capture.py) is a flat ATen graph traced with make_fx: forward, loss,
backward, clipping and AdamW, SimpleFSDP's all-gathers and reduce-scatters as `_c10d_functional`
nodes. torch-tpu 0.2.0 compiles a graph in three layers (torch_tpu/_internal/compile):

* `TpuBackend`, the Dynamo backend "tpu": AOTAutograd, then the next layer;
* `SplitCompiler`: cuts the graph before and after every collective that is not marked SPMD-safe
  and compiles each piece as a program of its own; the collectives run between the programs
  through the process group, so XLA never sees them and cannot hide an all-gather behind a matmul;
* `StaticCompiler`: FX -> StableHLO (`export.fx_to_mlir`, TorchTPU's FX-tracing mode) -> a PJRT
  executable. The only layer that takes `donated_inputs` ("intended to be used directly after
  tracing with make_fx"); the layers above pass none.

`compile_for_torchtpu` calls the last two itself, as TorchTPU's `SingleTraceTrainer` hands its
make_fx graph to a compile function without AOTAutograd (the graph already holds its backward):

* every node is marked SPMD-safe, `node.meta["custom"]["spmd_safe"] = True`, which is what
  `torch.tpu.distributed.spmd_safe` writes under compile and what `SplitCompiler` reads: the
  collectives stay in the one program. Our step is SPMD: every rank runs the same ops and the same
  collectives in the same order with the same shapes (constants such as a tensor-parallel rank's
  vocabulary offset differ; each process compiles its own program);
* the parameters and both AdamW moments (a micro-batch program: its gradient sums) are donated,
  by the placeholder names of the program `SplitCompiler` hands down: XLA writes their new values
  into their buffers, and the step's peak counts them once. The old tensors are invalid after the
  call; GraphStep makes the model's and the optimizer's tensors hold the new ones (`rebind`);
* the StableHLO text of each program is kept (`TpuCompileDebug`), so a run can log the
  fingerprint of what it handed XLA (graph/fingerprint.py).

TorchTPU's other way to one program, its collective handshake (`TORCH_TPU_SPMD_HANDSHAKE_STAGE`
= COMPILE_STAGE or DISPATCH_STAGE: the ranks compare the graph's fingerprint, and a match turns
the split off), is not used: 0.2.0 handshakes only when every collective of a graph is on the
world group (`handshake.should_handshake`), so dp_shard alone but not dp_shard x tp, and only
across real ranks.

Written against torch-tpu 0.2.0 and checked on a CPU (tests/tpu/test_torchtpu_lowering.py: the
names and signatures, one program for a multi-rank step, the donated arguments); it has not run
on a TPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["DONATED_GROUPS", "compile_for_torchtpu", "donated_inputs", "mark_spmd_safe", "owner", "program_texts",
           "rebind"]

# Input groups (graph/step_layout.py StepLayout) a program returns updated and the trainer never reads
# again in their old form: each is donated where the program also has it as an output group.
DONATED_GROUPS = ("params", "exp_avg", "exp_avg_sq", "grads")


def donated_inputs(layout) -> list[int]:
    """The flat input indices a program of `layout` donates: the groups of DONATED_GROUPS that are
    both its inputs and its outputs (the whole step: parameters and moments; a micro-batch
    program: the gradient sums; the update: parameters and moments; evaluation: none)."""
    inputs, outputs = layout.input_slices(), layout.output_slices()
    return [i for group in DONATED_GROUPS if group in inputs and group in outputs
            for i in range(inputs[group].start, inputs[group].stop)]


def mark_spmd_safe(gm: torch.fx.GraphModule) -> int:
    """Every node of `gm` and of its subgraphs (scan bodies) annotated as TorchTPU's `spmd_safe`
    annotates a traced region; returns how many nodes were marked."""
    from torch_tpu._internal.distributed.spmd_util import SPMD_SAFE_METADATA_KEY

    count = 0
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                # A new dict: a copied graph shares its nodes' annotation dicts with the original.
                node.meta["custom"] = {**node.meta.get("custom", {}), SPMD_SAFE_METADATA_KEY: True}
                count += 1
    return count


def compile_for_torchtpu(gm: torch.fx.GraphModule, example_inputs: Sequence[Tensor], *,
                         donated: Sequence[int] = ()) -> Callable[..., list[Tensor]]:
    """`gm` (a captured program; marked SPMD-safe here, in place) compiled by TorchTPU's
    SplitCompiler over its StaticCompiler, as one program whose inputs `donated` (flat indices) are
    donated. example_inputs: fake tensors on the TPU, with the graph's shapes. Returns TorchTPU's
    executable: called with the flat inputs, it returns the flat outputs; `program_texts(it)` reads
    the StableHLO of each program it holds."""
    from torch_tpu._internal.compile.split_compiler import SplitCompiler

    mark_spmd_safe(gm)
    placeholders = [node.name for node in gm.graph.find_nodes(op="placeholder")]
    executable = SplitCompiler(_donating_static_compiler(frozenset(placeholders[i] for i in donated)))(
        gm, example_inputs)
    programs = len(executable.compiled_executables)
    if donated and programs != 1:
        # An input donated to one piece would be gone for the pieces after it.
        raise AssertionError(f"TorchTPU split the SPMD-safe step into {programs} programs")
    return executable


def _donating_static_compiler(donated_names: frozenset[str]):
    """TorchTPU's StaticCompiler, recording each program's StableHLO, that donates the arguments
    named `donated_names`: SplitCompiler calls it with the piece it cut (one piece here), whose
    placeholders keep the names of the step's inputs and are ordered by first use."""
    from torch_tpu._internal.compile.compiler import StaticCompiler
    from torch_tpu._internal.compile.debug import TpuCompileDebug

    class _DonatingStaticCompiler(StaticCompiler):
        def __call__(self, graph_module, example_inputs, is_fwd=True, module_name=None):
            names = [node.name for node in graph_module.graph.find_nodes(op="placeholder")]
            donated = [i for i, name in enumerate(names) if name in donated_names]
            return super().__call__(graph_module, example_inputs, is_fwd, donated_inputs=donated,
                                    module_name=module_name)

    return _DonatingStaticCompiler(debug=TpuCompileDebug())


def program_texts(executable) -> list[str]:
    """The StableHLO text of each program of a `compile_for_torchtpu` executable, as TorchTPU
    serialized the module it compiled (with source locations; graph/fingerprint.py drops them)."""
    return [text for text in executable.mlir_texts if text]


def owner(t: Tensor) -> Tensor:
    """The tensor object the model or optimizer holds for `t`: a DTensor's local tensor itself (not
    a detached alias of it), so that pointing it at a new buffer is seen through the DTensor."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


@torch.no_grad()
def rebind(dst: Sequence[Tensor], src: Sequence[Tensor]) -> None:
    """Each tensor of `dst` made to hold its new value `src` without a copy (`Tensor.set_`: its
    storage becomes the new one's): after a donated call the old buffers are gone, so a copy into
    them is not possible and not needed."""
    for d, s in zip(dst, src, strict=True):
        d.set_(s)
