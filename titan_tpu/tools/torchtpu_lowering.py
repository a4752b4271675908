"""TorchTPU's own lowering of the captured step, compiled by XLA's TPU compiler on a CPU beside ours.

`titan-tpu compile` lowers the captured step with our own FX -> JAX table (graph/jax_lowering.py).
A TPU run through `compile.backend tpu` does not run that program: the trainer hands the captured
graph to TorchTPU (graph/torchtpu.py), which lowers it to StableHLO with its FX-tracing mode and
compiles it with libtpu. This module makes TorchTPU's StableHLO on a machine without a TPU and
compiles it with libtpu's compile-only client for a TPU topology, as `titan-tpu compile` does
ours, so the programs' memory and FLOPs can be compared (bench/torchtpu_lowering.py). Two ways
TorchTPU can run the step, each a `runtime`:

* "one_program": as the trainer calls it now (graph/torchtpu.py `compile_for_torchtpu`): every
  node SPMD-safe, so TorchTPU's SplitCompiler keeps the collectives in one program, and the
  parameters and moments donated through its StaticCompiler;
* "split": torch-tpu 0.2.0's Dynamo backend as it is (`TpuBackend()(graph, inputs)`): AOTAutograd,
  then a program for each piece between two collectives and one for each collective, nothing
  donated.

How, in a child process where torch-tpu is loaded (`import torch` auto-loads it; `titan-tpu
compile` turns that off):
* `torch_tpu._loader._init_device("tpu")` registers the device without a PJRT client; the captured
  graph's factory calls that name the CPU are pointed at it.
* The step is captured as `titan-tpu compile` captures rank 0 of the run (components/program.py,
  under a fake process group). Lowering a collective needs the process group's backend for the
  TPU device: TorchTPU's is `tpu_distributed.create_process_group`, which needs a PJRT client
  ("failed to retrieve the PjRt client: TPU initialization failed: No jellyfish device found"),
  and the fake group has none ("No backend type associated with device type tpu"). So every
  process group the graph names is registered again as a stand-in (`StandInGroup`): its
  collectives write outputs of the real shapes with local ops (an all-gather concatenates its
  input with itself, a reduce-scatter sums the input's chunks, an all-reduce keeps its input),
  each input and output behind an optimization barrier so that XLA holds them as buffers, as it
  holds a collective's. The programs are TorchTPU's lowering of everything but the collectives
  themselves; XLA's numbers for them leave out what a collective costs beyond its buffers (and
  its scheduling: XLA cannot move a stand-in earlier, as its latency-hiding scheduler moves an
  all-gather).
* TorchTPU's `fx_to_mlir` is replaced by its core: `EagerLikeFxInterpreter` under
  `set_eager_mode(EagerMode._INTERNAL_COMPILE_FX_GRAPH)`, `_process_fx_outputs`,
  `tpu_torch_compile.build_mlir`. TorchTPU's own reads `torch.tpu.default_generators` and then
  compiles on the chip; both need the PJRT client. `traverse_and_compile`, which would build the
  module with its donations, aborts the process without one ("Check failed: context.ok() Failed
  to create default compilation context"). So donated arguments are marked here as TorchTPU
  marks them (`jax.buffer_donor`, the attribute its AnnotateBufferDonations writes), and the
  module is parsed back with `tpu_torch_compile.parse_mlir_text`, which StaticCompiler then
  serializes (`serialize_mlir_text`) as on a TPU: the text `program_texts` reads, fingerprinted
  by graph/fingerprint.py.

The parent compiles each program for one chip of the topology with `topology.devices[0].client
.compile(module, ...)`, as JAX does for a compile-only client, and reads XLA's memory and cost.
One program per chip is what TorchTPU runs: each process compiles its own. For the split runtime
the step's peak is modelled from the programs' (`split_step_peak`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

__all__ = ["RUNTIMES", "Lowering", "Program", "compare", "compile_stablehlo", "lower_step",
           "lower_with_torchtpu", "main", "split_step_peak", "stand_in_group", "stand_in_groups"]

GiB = 1024**3
META_FILE = "torchtpu.json"
RUNTIMES = ("one_program", "split")


@dataclass
class Program:
    """One program TorchTPU hands XLA for a step.

    text: its StableHLO as StaticCompiler serializes it (donated arguments marked). arguments and
    outputs: the names of the values it takes and returns in the graph that calls the programs (a
    step input's placeholder name, or a value between two programs of the split runtime), with
    their sizes in bytes. donated:
    argument positions marked `jax.buffer_donor`. collective: it holds one of the step's
    collectives (a stand-in here; the split runtime's programs of one collective each)."""

    text: str
    arguments: list[str]
    argument_bytes: list[int]
    outputs: list[str]
    output_bytes: list[int]
    donated: list[int]
    collective: bool
    fingerprint: str


@dataclass
class Lowering:
    """A step as one runtime of TorchTPU runs it: its programs in the order they run. step_inputs:
    the names the programs give the captured step's inputs, in its flat input order; step_outputs:
    the names of the values the step returns (held by the trainer once made). seconds: the
    lowering's time. scan_bodies: modules made for scan bodies (inlined into while loops).
    texts_match: the texts `graph/torchtpu.py program_texts` reads from the executable (what a run
    fingerprints) are the programs' texts (None where not read: the split runtime)."""

    runtime: str
    programs: list[Program]
    step_inputs: list[str]
    step_outputs: list[str]
    seconds: float
    scan_bodies: int
    texts_match: bool | None = None


# -- in the process with torch-tpu ------------------------------------------------------------

def stand_in_group(size: int):
    """A torch ProcessGroup of `size` ranks whose collectives are local TorchTPU ops of the real
    shapes (see the module docstring), for TorchTPU to trace where its `tpu_dist` backend cannot
    start; this process is its rank 0. The class is made here: its base is torch.distributed's."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _create_work_from_future
    from torch.futures import Future

    def done(tensors):
        future = Future()
        future.set_result(tensors)
        return _create_work_from_future(future)

    def held(t):
        (t,) = torch.tpu.ops.optimization_barrier([t])
        return t

    class StandInGroup(dist.ProcessGroup):
        """A process group of `size` ranks that runs each collective as local ops of the same shapes,
        for TorchTPU to trace on a machine without its `tpu_dist` backend (this process is rank 0)."""

        def __init__(self, size: int):
            super().__init__(0, size)
            self._size = size

        def size(self) -> int:
            return self._size

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return "stand-in"

        def all_gather_single_coalesced(self, outputs, inputs, opts=None):
            for out, x in zip(outputs, inputs):
                out.copy_(held(torch.cat([held(x)] * self._size)))
            return done(outputs)

        def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
            for out, x in zip(outputs, inputs):
                # The chunks added as slices of the input, in its own layout: a reshape to
                # [ranks, ...] would have XLA re-tile a flat bucket, which a reduce-scatter does not.
                x, rows = held(x), out.shape[0]
                out.copy_(held(sum(x.narrow(0, i * rows, rows) for i in range(self._size))))
            return done(outputs)

        def allreduce(self, tensors, opts=None):
            for t in tensors:
                t.copy_(held(t))
            return done(tensors)

        def all_to_all_single(self, output, x, output_split_sizes, input_split_sizes, opts=None):
            output.copy_(held(x))
            return done([output])

        def broadcast(self, tensors, opts=None):
            return done(tensors)

        def barrier(self, opts=None):
            return done([])

    return StandInGroup(size)


@contextlib.contextmanager
def stand_in_groups(step) -> Iterator[dict[str, int]]:
    """Every process group `step` (a DeviceStep) names registered under its name as a
    `stand_in_group` of its size while active (the fake groups of the capture are gone by then); yields {name: size}."""
    import math

    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

    sizes = {name: math.prod(step.axis_sizes[a] for a in axes) for name, axes in step.group_axes.items()}
    groups = {name: stand_in_group(size) for name, size in sizes.items()}  # kept alive while registered
    for name, group in groups.items():
        _register_process_group(name, group)
    try:
        yield sizes
    finally:
        for name in groups:
            _unregister_process_group(name)


def lower_step(step, runtime: str) -> Lowering:
    """TorchTPU's programs for a captured step (a DeviceStep of graph/spmd.py, not changed)
    as `runtime` runs it. Needs torch-tpu loaded (see the module docstring)."""
    import copy

    import torch
    import torch.utils._pytree as pytree
    import torch_tpu._loader
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_tpu.graph.torchtpu import compile_for_torchtpu, donated_inputs, program_texts

    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r}: one of {', '.join(RUNTIMES)}")
    captured = step.captured
    tpu = torch_tpu._loader._init_device("tpu")
    gm = copy.deepcopy(captured.graph_module)
    _point_factories_at(gm, tpu)
    with FakeTensorMode():
        inputs = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=tpu) for x in captured.example_inputs]
    start = time.perf_counter()
    texts_match = None
    with stand_in_groups(step), _module_builder() as built, torch.no_grad():
        if runtime == "one_program":
            step_inputs = [node.name for node in gm.graph.find_nodes(op="placeholder")]
            executable = compile_for_torchtpu(gm, inputs, donated=donated_inputs(captured.layout))
            texts_match = program_texts(executable) == [p.text for p in built["programs"]]
        else:
            from torch_tpu._internal.compile import TpuBackend

            # AOTAutograd names the flat inputs arg<i>_1, which the split keeps.
            step_inputs = [f"arg{i}_1" for i in range(len(inputs))]
            TpuBackend()(gm, inputs, options={"serializable": False})
    (split,) = built["split_graphs"]
    _name_values(built["programs"], split)
    (output,) = split.graph.find_nodes(op="output")
    step_outputs = sorted({node.name for node in pytree.tree_leaves(output.args) if isinstance(node, torch.fx.Node)})
    return Lowering(runtime=runtime, programs=built["programs"], step_inputs=step_inputs, step_outputs=step_outputs,
                    seconds=time.perf_counter() - start, scan_bodies=len(built["scan_bodies"]),
                    texts_match=texts_match)


def _name_values(programs: list[Program], split) -> None:
    """Each program's arguments and outputs named as the graph that calls the programs names them
    (a program's own placeholders carry the names of the nodes they stood for before the split);
    in place. The programs were compiled in the order that graph calls them."""
    import operator

    calls = [node for node in split.graph.nodes if node.op == "call_module"]
    assert len(calls) == len(programs), (len(calls), len(programs))
    for call, program in zip(calls, programs):
        assert len(call.args) == len(program.arguments), (call.name, len(call.args), len(program.arguments))
        program.arguments = [arg.name for arg in call.args]
        items = {user.args[1]: user.name for user in call.users
                 if user.op == "call_function" and user.target is operator.getitem}
        program.outputs = ([items.get(i, f"{call.name}.{i}") for i in range(len(program.outputs))]
                           if items else [call.name] * len(program.outputs))


def _point_factories_at(gm, device) -> None:
    """Factory calls in the graph (and its scan bodies) that name the CPU, where the step was
    captured, made to name `device`: TorchTPU traces only its own tensors."""
    import torch

    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            named = node.kwargs.get("device")
            if named is not None and torch.device(named).type == "cpu":
                node.kwargs = {**node.kwargs, "device": device}
        module.recompile()


@contextlib.contextmanager
def _module_builder() -> Iterator[dict]:
    """TorchTPU's `fx_to_mlir` replaced by `_fx_to_module` while active: in the compiler
    (`torch_tpu._internal.export.fx_to_mlir`, the programs) and in the scan op
    (`torch_tpu._internal.export.export.fx_to_mlir`, the loop bodies); SplitCompiler's
    `split_module` recorded. Yields what was built: {"programs": [Program], "scan_bodies": [module],
    "split_graphs": [the graph calling the programs]}."""
    import torch_tpu._internal.export
    import torch_tpu._internal.export.export
    from torch_tpu._internal.compile import split_compiler

    built = {"programs": [], "scan_bodies": [], "split_graphs": []}
    package, module = torch_tpu._internal.export, torch_tpu._internal.export.export
    saved = package.fx_to_mlir, module.fx_to_mlir, split_compiler.split_module

    def split_module(*args, **kwargs):  # the graph that calls the programs, kept to name their values
        split = saved[2](*args, **kwargs)
        built["split_graphs"].append(split)
        return split

    package.fx_to_mlir = lambda gm, args, **options: _fx_to_module(gm, args, options, programs=built["programs"])
    module.fx_to_mlir = lambda gm, args, **options: _fx_to_module(gm, args, options, bodies=built["scan_bodies"])
    split_compiler.split_module = split_module
    try:
        yield built
    finally:
        package.fx_to_mlir, module.fx_to_mlir, split_compiler.split_module = saved


def _fx_to_module(gm, args: Sequence, options: dict, *, programs: list | None = None, bodies: list | None = None):
    """`fx_to_mlir` without the RNG generators and without compiling: TorchTPU's interpreter in
    its FX-compile mode, its de-duplication of the outputs, `build_mlir`, the donated arguments
    marked; returns its `ExportedMlir` with the module and no executable. Appends the `Program` to
    `programs`, or a scan body's module to `bodies`."""
    import torch
    import torch.utils._pytree as pytree
    from torch_tpu._internal import execution_mode
    from torch_tpu._internal.compile import tpu_torch_compile
    from torch_tpu._internal.distributed import collective_ops
    from torch_tpu._internal.export import export

    from titan_tpu.graph.fingerprint import program_fingerprint

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    with execution_mode.set_eager_mode(execution_mode.EagerMode._INTERNAL_COMPILE_FX_GRAPH):
        # Cloned as fx_to_mlir does, so that in-place updates do not write the placeholders.
        outputs = export.EagerLikeFxInterpreter(gm).run(*[a.clone() if isinstance(a, torch.Tensor) else a
                                                          for a in args])
        results, rebuild, dynamic, unique = export._process_fx_outputs(gm, outputs,
                                                                       dynamic_outputs=options.get("dynamic_outputs"))
        module = tpu_torch_compile.build_mlir(result_tensors=results, argument_tensors=tensors)
    donated = list(options.get("donated_inputs") or [])
    if donated:
        module = tpu_torch_compile.parse_mlir_text(mark_donated(tpu_torch_compile.serialize_mlir_text(module),
                                                                donated))
    if bodies is not None:
        bodies.append(module)
    else:
        text = tpu_torch_compile.serialize_mlir_text(module, enable_debug_info=True)  # as StaticCompiler in debug
        placeholders = [node.name for node in gm.graph.find_nodes(op="placeholder")]
        values = pytree.tree_leaves(outputs)  # named by `_name_values` from the graph that calls the program
        programs.append(Program(
            text=text, arguments=placeholders, argument_bytes=[_nbytes(a) for a in args],
            outputs=[f"output{i}" for i in range(len(values))], output_bytes=[_nbytes(v) for v in values],
            donated=donated,
            collective=any(collective_ops.is_collective_op(node.target) for node in gm.graph.nodes
                           if node.op == "call_function"),
            fingerprint=program_fingerprint(text)))
    return export.ExportedMlir(module=module, executable=None, mlir_result_tensors=results,
                               reconstruct_fx_outputs_fn=rebuild, updates_default_generator_state=False,
                               dynamic_outputs=dynamic, unique_output_indices=unique)


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if hasattr(t, "element_size") else 0


def mark_donated(text: str, donated: Sequence[int]) -> str:
    """A StableHLO module's text with the @main arguments at positions `donated` marked
    `{jax.buffer_donor = true}` (XLA may write an output of the same shape into the buffer)."""
    header = re.search(r"func\.func (?:public )?@main\((.*?)\)\s*->", text, re.S)
    if header is None:
        raise ValueError("the StableHLO module has no function @main")
    arguments = header.group(1)
    for j in sorted(set(donated), reverse=True):
        match = re.search(rf"%arg{j}: tensor<[^<>]*>( \{{[^{{}}]*\}})?", arguments)
        assert match is not None and match.group(1) is None, (j, arguments[:200])
        arguments = arguments[:match.end()] + " {jax.buffer_donor = true}" + arguments[match.end():]
    return text[:header.start(1)] + arguments + text[header.end(1):]


def main(argv: list[str] | None = None) -> int:
    """The child process: capture a config's step as rank 0 of `--world` ranks does, lower it with
    TorchTPU in each runtime, and write each program's StableHLO and META_FILE to --out."""
    parser = argparse.ArgumentParser(prog="python -m titan_tpu.tools.torchtpu_lowering")
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--runtimes", default=",".join(RUNTIMES))
    args, overrides = parser.parse_known_args(argv)
    try:
        from titan_tpu.config import build_config
        from titan_tpu.run.setup import prepare_run

        setup = prepare_run(build_config(args.config, overrides))
        start = time.perf_counter()
        step = _torchtpu_capture(setup, world=args.world)
        capture_seconds = time.perf_counter() - start
        lowerings = [lower_step(step, runtime) for runtime in args.runtimes.split(",")]
    except (ValueError, RuntimeError) as e:
        print(f"error: {type(e).__name__}: {' '.join(str(e).split())[:600]}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"capture_seconds": capture_seconds, "graph_nodes": len(step.captured.graph_module.graph.nodes),
            "input_groups": {name: [s.start, s.stop] for name, s in step.captured.input_slices().items()},
            "collectives": dict(step.captured.collective_counts()), "lowerings": []}
    for lowering in lowerings:
        record = asdict(lowering)
        for k, program in enumerate(record["programs"]):
            path = out / f"{lowering.runtime}.{k:03d}.stablehlo.mlir"
            path.write_text(program.pop("text"))
            program["file"] = path.name
        meta["lowerings"].append(record)
    (out / META_FILE).write_text(json.dumps(meta, indent=1))
    return 0


# -- in the JAX process ----------------------------------------------------------------------

def lower_with_torchtpu(config: str, overrides: Sequence[str], out_dir: Path, *, world: int = 1,
                        runtimes: Sequence[str] = RUNTIMES, timeout: float | None = None
                        ) -> tuple[dict[str, Lowering], dict]:
    """TorchTPU's programs for `config` with `overrides` as rank 0 of `world` ranks captures it, in
    each runtime, made in a child process where torch-tpu loads (this one may have turned that
    off); returns {runtime: Lowering} and the child's META_FILE."""
    env = {**os.environ, "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
           "PYTHONWARNINGS": "ignore:<TorchTpu/Performance/TcMalloc/"}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)  # TorchTPU's lowering needs torch-tpu loaded
    command = [sys.executable, "-m", "titan_tpu.tools.torchtpu_lowering", "--config", config, "--out", str(out_dir),
               "--world", str(world), "--runtimes", ",".join(runtimes), *overrides]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        said = [line for line in lines if line.startswith("error: ")]
        raise ValueError("TorchTPU's lowering failed: " + (said[-1][len("error: "):] if said else
                                                           f"exit {result.returncode}: {(lines or ['?'])[-1]}"))
    meta = json.loads((out_dir / META_FILE).read_text())
    lowerings = {}
    for record in meta["lowerings"]:
        programs = [Program(text=(out_dir / p.pop("file")).read_text(), **p) for p in record.pop("programs")]
        lowerings[record["runtime"]] = Lowering(programs=programs, **record)
    return lowerings, meta


def compile_stablehlo(text: str, topology_name: str, *, donated: Sequence[int] = (), name: str | None = None) -> dict:
    """A StableHLO module compiled for the first device of a TPU topology with libtpu's
    compile-only client, as JAX compiles for one (jax._src.compiler.backend_compile_and_load):
    XLA's memory by kind (the keys of `titan-tpu compile`'s report), its peak, FLOPs, bytes
    accessed, the optimized program's instruction counts and the main function's signature.
    donated: argument indices to mark `jax.buffer_donor` besides those the text marks. name: the
    module's name (XLA's dump files carry it)."""
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    from titan_tpu.graph.jax_devices import tpu_topology
    from titan_tpu.xla.numbers import xla_numbers

    device = tpu_topology(topology_name).devices[0]
    if donated:
        text = mark_donated(text, donated)
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        if name is not None:
            module.operation.attributes["sym_name"] = ir.StringAttr.get(name)
        options = compiler.get_compile_options(num_replicas=1, num_partitions=1, device_assignment=[device])
        start = time.perf_counter()
        executable = device.client.compile(module, executable_devices=xla_client.DeviceList((device,)),
                                           compile_options=options)
        seconds = time.perf_counter() - start
    arguments, results = stablehlo_signature(text)
    kinds, peak, cost = xla_numbers(executable.get_compiled_memory_stats(), executable.cost_analysis())
    return {"topology": topology_name, "memory_per_chip_bytes": kinds, "peak_per_chip_bytes": peak,
            "flops_per_chip": cost.get("flops"), "bytes_accessed_per_chip": cost.get("bytes accessed"),
            "stablehlo": stablehlo_counts(text), "hlo": _optimized_counts(executable), "compile_seconds": seconds,
            "argument_types": arguments, "result_types": results}


def _optimized_counts(executable) -> dict[str, int] | None:
    """hlo_counts of the compiled program, or None where libtpu cannot print it (0.0.52: a
    RET_CHECK on the async-update of a scatter it offloads to the SparseCore, as it does with
    our program's embedding gradient)."""
    try:
        return hlo_counts(executable.hlo_modules()[0].to_string())
    except Exception:  # noqa: BLE001 - libtpu's own error type
        return None


def stablehlo_counts(text: str) -> dict[str, int]:
    """Op counts of a StableHLO module before XLA's passes: every op (a function called from
    several places counted once), calls, and some ops by name."""
    ops = re.findall(r'(?m)(?:^\s*|= |")(?:stablehlo|chlo)\.(\w+)', text)
    counts = {"ops": len(ops), "functions": len(re.findall(r"\bfunc\.func\b", text)),
              "calls": len(re.findall(r"\b(?:func\.)?call @", text))}
    for name in ("dot_general", "while", "custom_call", "scatter", "gather", "convert", "transpose", "reshape",
                 "broadcast_in_dim", "optimization_barrier"):
        counts[name] = ops.count(name)
    return counts


def hlo_counts(hlo_text: str) -> dict[str, int]:
    """Instruction counts of an optimized HLO module: outside fusions (what the TPU schedules),
    the fusions, and some opcodes anywhere (while loops, copies, custom calls, dots)."""
    scheduled, anywhere, fused, fused_computations = 0, {}, False, 0
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():  # a computation's header: "%fused_computation.3 (...) -> ... {"
            fused = line.lstrip("%").startswith("fused")
            fused_computations += fused
            continue
        match = re.search(r" = .*?[\]})] ([a-z][\w-]*)\(", line)
        if match is None:
            continue
        opcode = match[1]
        scheduled += not fused
        anywhere[opcode] = anywhere.get(opcode, 0) + 1
    return {"instructions_outside_fusions": scheduled, "fusions": fused_computations,
            "while": anywhere.get("while", 0), "copy": anywhere.get("copy", 0) + anywhere.get("copy-start", 0),
            "custom-call": anywhere.get("custom-call", 0),
            "dot": anywhere.get("dot", 0) + anywhere.get("convolution", 0)}


def split_step_peak(lowering: Lowering, compiled: Sequence[dict]) -> tuple[float, int, float]:
    """(the step's peak bytes per chip, the program it is reached in, what is held outside that
    program) when TorchTPU runs the step as `lowering`'s programs one after another, each compiled
    as `compiled` (compile_stablehlo's reports, in order).

    While program k runs, the chip holds its XLA peak (arguments, outputs, temporaries, its code)
    and every value alive outside it: the step's inputs (the trainer holds them for the whole
    step), values an earlier program made that a later one reads, and the step's outputs an
    earlier program made (held by the trainer). Programs run one at a time, nothing of one overlaps
    another. Not counted: the other programs' code, which stays on the chip if their executables
    stay loaded (`_runtime_report` gives its sum)."""
    programs = lowering.programs
    size, made, last_read = {}, {}, {}
    for k, program in enumerate(programs):
        for name, nbytes in zip(program.arguments, program.argument_bytes):
            size.setdefault(name, nbytes)
            last_read[name] = k
        for name, nbytes in zip(program.outputs, program.output_bytes):
            size.setdefault(name, nbytes)
            made.setdefault(name, k)
    inputs, outputs = set(lowering.step_inputs), set(lowering.step_outputs)
    best = (0.0, 0, 0.0)
    for k, (program, report) in enumerate(zip(programs, compiled)):
        if "refused" in report:
            continue
        own = set(program.arguments) | set(program.outputs)
        outside = sum(nbytes for name, nbytes in size.items() if name not in own and (
            name in inputs or made.get(name, k) < k and (last_read.get(name, -1) > k or name in outputs)))
        total = report["peak_per_chip_bytes"] + outside
        if total > best[0]:
            best = (total, k, outside)
    return best


def _runtime_report(lowering: Lowering, topology_name: str) -> dict:
    """Each of a runtime's programs compiled for one chip; the step's numbers (the split runtime:
    summed over its programs, its peak by `split_step_peak`)."""
    compiled = [_compiled_or_refused(p.text, topology_name, name=f"torchtpu_{lowering.runtime}_{k}")
                for k, p in enumerate(lowering.programs)]
    refused = [c["refused"] for c in compiled if "refused" in c]
    report = {"programs": len(lowering.programs), "collective_programs": sum(p.collective for p in lowering.programs),
              "donated_arguments": sum(len(p.donated) for p in lowering.programs),
              "lowering_seconds": lowering.seconds, "scan_bodies": lowering.scan_bodies,
              "texts_match": lowering.texts_match,
              "fingerprints": [p.fingerprint for p in lowering.programs],
              "compile_seconds": sum(c.get("compile_seconds", 0.0) for c in compiled)}
    if refused:
        return {**report, "refused": refused[0], "stablehlo": compiled[0]["stablehlo"], "hlo": None,
                "result_types": compiled[0]["result_types"]}
    if len(compiled) == 1:
        return {**report, **compiled[0]}
    peak, at, outside = split_step_peak(lowering, compiled)
    return {**report, "peak_per_chip_bytes": peak, "peak_program": at, "held_outside_bytes": outside,
            "code_all_programs_bytes": sum(c["memory_per_chip_bytes"]["code"] for c in compiled),
            "memory_per_chip_bytes": compiled[at]["memory_per_chip_bytes"],
            "flops_per_chip": sum(c["flops_per_chip"] or 0.0 for c in compiled),
            "bytes_accessed_per_chip": sum(c["bytes_accessed_per_chip"] or 0.0 for c in compiled),
            "stablehlo": {key: sum(c["stablehlo"][key] for c in compiled) for key in compiled[0]["stablehlo"]},
            "hlo": None, "result_types": None}


def _torchtpu_capture(setup, *, world: int):
    """Rank 0's step of the run on `world` TPU devices as TorchTPU's Dynamo backend is handed it: the
    run's own resolution and assembly (components/program.py) on a fake world, its kernels traced as the
    CPU runs them (the config names ATen kernels: `_aten_kernels`), captured per rank (graph/capture.py),
    not as the JAX path's one program for every rank."""
    import torch

    from titan_tpu.components.program import fake_rank
    from titan_tpu.components.resolve import resolve
    from titan_tpu.device import Backend
    from titan_tpu.graph.capture import capture_train_step
    from titan_tpu.graph.spmd import device_step, mesh_axis_sizes
    from titan_tpu.run.resolved import Target

    # A TPU's facts (device.py), its kernels traced as this CPU runs them: the config names ATen ones.
    tpu = Backend(name="tpu", device=torch.device("cpu"), process_group_backend="gloo", compile_backend="tpu")
    target = replace(Target.of_backend(tpu, world), kernel_device_type="cpu")
    run = resolve(setup, target)
    with fake_rank(run) as (program, place):
        captured = capture_train_step(program.model, max_norm=run.cfg.training.max_norm,
                                      adamw_hparams=program.optimizer.hparams, decay=program.optimizer.decay,
                                      example_batch=program.example_batch, dp_size=run.batch_split().dp_size,
                                      scalar_dtype=torch.float32, objective=program.objective)
        return device_step(captured, mesh_axis_sizes(place.mesh, run.dims))


def compare(config: str, overrides: Sequence[str], topology_name: str, work_dir: Path, *,
            runtimes: Sequence[str] = RUNTIMES, xla_dump: Path | None = None) -> dict:
    """The step of `config` for a slice of `topology_name` (as rank 0 of one rank per chip
    captures it) through TorchTPU's lowering in each runtime (child process) and through ours
    (`titan-tpu compile`'s core); TorchTPU's programs compiled for one chip of the topology, ours
    for the slice. Returns {"runtimes": {runtime: its report}, "jax": ours, "kernels", "devices",
    "outputs_match" (one chip only), ...}; the compile reports as `compile_stablehlo`'s. xla_dump:
    the directory XLA_FLAGS=--xla_dump_to names in this process (set before JAX started), from
    whose optimized HLO the instruction counts come where libtpu cannot print the compiled program."""
    from titan_tpu.components.resolve import resolve
    from titan_tpu.config import build_config
    from titan_tpu.device import jax_backend
    from titan_tpu.graph.jax_devices import tpu_topology
    from titan_tpu.plan.hardware import HARDWARE
    from titan_tpu.run.resolved import Target
    from titan_tpu.run.setup import prepare_run
    from titan_tpu.tools.compile_cmd import compile_step_for_tpu

    setup = prepare_run(build_config(config, list(overrides)))
    cfg = setup.cfg
    p = cfg.parallelism
    unsupported = {key: getattr(p, key) for key in ("cp", "ep") if getattr(p, key) > 1}
    if unsupported:
        raise ValueError(f"TorchTPU's lowering is compared for data and tensor parallelism, {config} has "
                         + ", ".join(f"{k} {v}" for k, v in unsupported.items()) + "; add "
                         + " ".join(f"--parallelism.{k} 1" for k in unsupported))
    if setup.cfg.training.grad_accum_steps > 1 or cfg.training.global_batch_tokens:
        raise ValueError("TorchTPU's lowering is compared for one program per step; add --training.grad_accum_steps 1")
    devices = len(tpu_topology(topology_name).devices)
    # Our JAX path's resolution of the run on this slice (components/resolve.py): its kernels and re-sharding.
    run = resolve(setup, Target.of_backend(jax_backend("tpu"), devices),
                  hardware=HARDWARE.get(topology_name.split(":")[0]))
    kernels, reshard, documents = _aten_kernels(run), run.reshard_after_forward, run.documents
    # Both captures with what our capture for JAX resolved, named: the kernels and the re-sharding.
    named = [*(f"--kernels.{op}={name}" for op, name in kernels.items()),
             f"--parallelism.reshard_after_forward={str(reshard).lower()}"]
    lowerings, meta = lower_with_torchtpu(config, [*overrides, *named], work_dir / "torchtpu", world=devices,
                                          runtimes=runtimes)
    report = {"config": " ".join([config, *overrides]), "topology": topology_name, "devices": devices,
              "kernels": kernels, "reshard_after_forward": reshard, "documents": documents,
              "collectives": meta["collectives"], "torchtpu_capture_seconds": meta["capture_seconds"],
              "runtimes": {runtime: _runtime_report(lowering, topology_name)
                           for runtime, lowering in lowerings.items()}}
    dump = work_dir / "jax"
    cfg = prepare_run(build_config(config, [*overrides, *named])).cfg
    try:
        ours = compile_step_for_tpu(cfg, topology_name, dump)
    except Exception as e:  # noqa: BLE001 - XLA's RESOURCE_EXHAUSTED is a JaxRuntimeError
        report["jax"] = {"refused": _refusal(e), "stablehlo": None, "hlo": None, "result_types": None}
    else:
        stablehlo = (dump / "step.stablehlo.mlir").read_text()
        _, results = stablehlo_signature(stablehlo)
        optimized = dump / "step.optimized.hlo"
        report["jax"] = {**ours, "stablehlo": stablehlo_counts(stablehlo),
                         "hlo": hlo_counts(optimized.read_text()) if optimized.exists() else None,
                         "result_types": results}
    # On one chip ours gives each value as it is, but a scalar stacked over the mesh ([1]); on
    # several, ours are the global arrays and TorchTPU's one rank's.
    one = report["runtimes"].get("one_program", {}).get("result_types")
    report["outputs_match"] = (None if devices > 1 or one is None or report["jax"]["result_types"] is None
                               else _same_results(one, report["jax"]["result_types"]))
    if xla_dump is not None:
        dumped = hlo_counts_from_dump(xla_dump)
        for runtime, r in report["runtimes"].items():
            if r.get("hlo") is None and "refused" not in r and r["programs"] == 1:
                r["hlo"] = dumped.get(f"torchtpu_{runtime}_0")
        if report["jax"]["hlo"] is None and "refused" not in report["jax"]:
            report["jax"]["hlo"] = dumped.get("jax")
    return report


def _compiled_or_refused(text: str, topology_name: str, **options) -> dict:
    """compile_stablehlo's report, or where XLA refuses the program because it does not fit the
    chip's HBM (RESOURCE_EXHAUSTED at compile time), {"refused": its message} with the program's
    StableHLO counts and signature; any other error is raised."""
    try:
        return compile_stablehlo(text, topology_name, **options)
    except Exception as e:  # noqa: BLE001 - XLA's RESOURCE_EXHAUSTED is a JaxRuntimeError
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        arguments, results = stablehlo_signature(text)
        return {"refused": _refusal(e), "stablehlo": stablehlo_counts(text), "hlo": None,
                "argument_types": arguments, "result_types": results}


def _refusal(error: Exception) -> str:
    """XLA's out-of-memory message in one line, without its link; the error itself otherwise."""
    if "RESOURCE_EXHAUSTED" not in str(error):
        raise error
    return " ".join(str(error).split("See https://")[0].split())


def hlo_counts_from_dump(dump_dir: Path) -> dict[str, dict[str, int]]:
    """hlo_counts of each TPU program in an XLA dump directory (`*.after_optimizations.txt` beside a
    `tpu_comp_env.txt`), by module name; the largest other TPU program is "jax" (ours: JAX names it
    after the jitted function)."""
    found, others = {}, []
    for path in sorted(dump_dir.glob("module_*.after_optimizations.txt")):
        stem = path.name[:-len(".after_optimizations.txt")]
        if not (dump_dir / f"{stem}.tpu_comp_env.txt").exists():
            continue  # a CPU program
        name = stem.split(".", 1)[1].rsplit(".", 1)[0]  # module_0003.<name>.cl_<id>
        if name.startswith("torchtpu_"):
            found[name] = hlo_counts(path.read_text())
        else:
            others.append(path)
    if others:
        found["jax"] = hlo_counts(max(others, key=lambda p: p.stat().st_size).read_text())
    return found


def _aten_kernels(run) -> dict[str, str]:
    """Each op's kernel in our capture for JAX (run/resolved.py `kernel_notes`), which must be one both
    lowerings trace alike: ATen ops that also run on a TPU (reference attention, chunked loss).
    Otherwise a one-line error naming the choices: a Pallas kernel (splash, gmm, tokamax) and
    TorchTPU's own splash_sdpa trace in TorchTPU's FX mode, but `build_mlir` then asks for the
    PJRT client ("TPU initialization failed: No jellyfish device found"); sdpa is captured here as
    the CPU's flash kernel, which TorchTPU does not implement."""
    from titan_tpu.kernels import OPS

    moe = getattr(run.spec.args, "moe", None) is not None
    kernels = {}
    for field, chosen in run.kernel_notes.items():
        if field == "chunk_attention" or field == "grouped_mm" and not moe:
            continue  # context parallelism's attention and the experts' matmul: not in a dense step without cp
        name = chosen.split()[0]
        impl = OPS[field].impls[name]
        if impl.jax_form is not None or not {"cpu", "tpu"} <= set(impl.devices):
            both = [n for n, i in OPS[field].impls.items() if i.jax_form is None and {"cpu", "tpu"} <= set(i.devices)]
            raise ValueError(f"kernels.{field} is {name} in our lowering, which TorchTPU's lowering cannot trace on "
                             f"a machine without a TPU; give --kernels.{field} {' or '.join(both)}")
        kernels[field] = name
    return kernels


def stablehlo_signature(text: str) -> tuple[list[str], list[str]]:
    """(argument types, result types) of a StableHLO module's @main, as MLIR prints them: read
    from its text, not by parsing the module a second time in this process (a second parse of
    TorchTPU's module crashed the interpreter in make tpu-check's full run)."""
    header = re.search(r"func\.func (?:public )?@main\((.*?)\)\s*->\s*(.*?)\s*\{\s*$", text, re.M | re.S)
    if header is None:
        raise ValueError("the StableHLO module has no function @main")
    arguments, results = header.group(1), header.group(2)
    return _tensor_types(arguments), _tensor_types(results)


def _tensor_types(text: str) -> list[str]:
    """The tensor types in order, each `tensor<...>` as MLIR prints it (attributes dropped)."""
    return re.findall(r"tensor<[^<>]*>", text)


def _comparable(types: Sequence[str]) -> list[tuple[str, str]]:
    """(shape, element type) of each tensor type; 64-bit integers as 32-bit (JAX without x64 holds
    them so)."""
    out = []
    for t in types:
        match = re.fullmatch(r"tensor<((?:\d+x)*)(\w+)>", t)
        assert match is not None, t
        out.append((match[1].removesuffix("x"), {"i64": "i32", "ui64": "ui32"}.get(match[2], match[2])))
    return out


def _same_results(torchtpu: Sequence[str], ours: Sequence[str]) -> bool:
    """Whether TorchTPU's results are ours on a one-device mesh: the same shapes and types, a
    scalar of TorchTPU's being ours stacked over the mesh ([1])."""
    theirs, mine = _comparable(torchtpu), _comparable(ours)
    return len(theirs) == len(mine) and all(
        t == m or (t[0] == "" and m == ("1", t[1])) for t, m in zip(theirs, mine))


if __name__ == "__main__":
    sys.exit(main())
