"""TorchTPU's own lowering of the captured step, compiled by XLA's TPU compiler on a CPU beside ours.

`titan-tpu compile` lowers the captured step with our own FX -> JAX table (graph/jax_lowering.py).
A TPU does not run that program: the trainer hands the captured graph to TorchTPU's Dynamo backend
"tpu" (graph/compile.py), which lowers it to StableHLO with TorchTPU's FX-tracing mode and
compiles it with libtpu. This module makes that StableHLO on a machine without a TPU and compiles
it with libtpu's compile-only client for a TPU topology, as `titan-tpu compile` does ours, so the
two programs' memory and FLOPs can be compared (bench/torchtpu_lowering.py).

How, in a process where torch-tpu is loaded (`import torch` auto-loads it; a child process, since
`titan-tpu compile` turns that off):
* `torch_tpu._loader._init_device("tpu")` registers the device without a PJRT client; the captured
  graph's factory calls that name the CPU are pointed at it.
* The trainer's own call: `TpuBackend()(graph, example_inputs)` on fake "tpu" tensors (AOTAutograd,
  TorchTPU's passes, its split at collectives, its placeholders, `EagerLikeFxInterpreter` under
  `EagerMode._INTERNAL_COMPILE_FX_GRAPH`, scan bodies through `create_scan_op`).
* One piece replaced: `fx_to_mlir`. TorchTPU's reads `torch.tpu.default_generators`, which needs
  the PJRT client ("failed to retrieve the PjRt client"), to thread the RNG state through the
  program, then compiles on the chip. Ours runs the same interpreter, output de-duplication and
  `tpu_torch_compile.build_mlir`, and stops at the module: no RNG state (the captured step draws
  no random numbers) and no executable.
The options: `serializable` off (the AOTAutograd cache would serialize an executable there is
none of); nothing else differs from the trainer's call. The trainer passes no `donated_inputs`, so
TorchTPU's program donates nothing: the new parameters and moments are written beside the old and
copied back by the trainer (train/step.py). `compile_stablehlo(..., donated=...)` compiles it also
with our JAX program's donation (`jax.buffer_donor` on the parameters and moments), to separate
the lowering from that choice.

Where it stops: a step with collectives (more than one device). TorchTPU's compiler splits the
graph at each collective (`SplitCompiler`) and compiles the parts between them one by one; each
collective runs between them through the process group, in TorchTPU's `tpu_dist` backend, which
is registered only where a TPU is present. On the fake process group of our capture, the part
before the first collective lowers and the first `all_gather_into_tensor` stops it: "RuntimeError:
No backend type associated with device type tpu". So this module lowers one-device steps, and
`compare` refuses a config with parallelism in one line.
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
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TorchTpuProgram", "compile_stablehlo", "lower_with_torchtpu", "main", "torchtpu_program"]

GiB = 1024**3
PROGRAM_FILE, META_FILE = "torchtpu.stablehlo.mlir", "torchtpu.json"


@dataclass
class TorchTpuProgram:
    """TorchTPU's StableHLO of a captured step, and how its arguments map to the step's.

    text: the module (`func.func @main`). argument_order[j]: the captured step's flat input index
    of the program's argument j (TorchTPU's split pass orders them by first use). seconds: the
    lowering's time (the backend call, AOTAutograd's re-trace included). scan_bodies: modules made
    for scan bodies, inlined into the program's while loops.
    """

    text: str
    argument_order: list[int]
    seconds: float
    scan_bodies: int


# -- in the process with torch-tpu ------------------------------------------------------------

def torchtpu_program(gm, example_inputs: Sequence) -> TorchTpuProgram:
    """TorchTPU's StableHLO for a captured one-device step: `gm` (CapturedStep.graph_module, not
    changed) and its fake CPU example inputs. Needs torch-tpu loaded (see the module docstring)."""
    import copy

    import torch
    import torch_tpu._loader
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch_tpu._internal.compile import TpuBackend, tpu_torch_compile

    tpu = torch_tpu._loader._init_device("tpu")
    gm = copy.deepcopy(gm)
    _point_factories_at(gm, tpu)
    with FakeTensorMode():
        inputs = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=tpu) for x in example_inputs]
    start = time.perf_counter()
    with _module_builder() as built, torch.no_grad():
        TpuBackend()(gm, inputs, options={"serializable": False})
    seconds = time.perf_counter() - start
    programs = built["programs"]
    if len(programs) != 1:
        raise ValueError(f"TorchTPU split the step into {len(programs)} programs (it compiles the parts between "
                         "collectives separately and runs each collective through its tpu_dist process group, "
                         "which needs a TPU); lower a one-device step (parallelism all 1)")
    module, names = programs[0]
    order = _argument_order(names, len(example_inputs))
    return TorchTpuProgram(text=tpu_torch_compile.serialize_mlir_text(module), argument_order=order,
                           seconds=seconds, scan_bodies=len(built["scan_bodies"]))


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
    (`torch_tpu._internal.export.export.fx_to_mlir`, the loop bodies). Yields what was built:
    {"programs": [(module, placeholder names)], "scan_bodies": [module]}."""
    import torch_tpu._internal.export
    import torch_tpu._internal.export.export

    built = {"programs": [], "scan_bodies": []}
    package, module = torch_tpu._internal.export, torch_tpu._internal.export.export
    saved = package.fx_to_mlir, module.fx_to_mlir
    package.fx_to_mlir = lambda gm, args, **options: _fx_to_module(gm, args, built["programs"], options)
    module.fx_to_mlir = lambda gm, args, **options: _fx_to_module(gm, args, built["scan_bodies"], options)
    try:
        yield built
    finally:
        package.fx_to_mlir, module.fx_to_mlir = saved


def _fx_to_module(gm, args: Sequence, built: list, options: dict):
    """`fx_to_mlir` without the RNG generators and without compiling: TorchTPU's interpreter in
    its FX-compile mode, its de-duplication of the outputs, `build_mlir`; returns its
    `ExportedMlir` with the module and no executable, and appends the module to `built`."""
    import torch
    from torch_tpu._internal import execution_mode
    from torch_tpu._internal.compile import tpu_torch_compile
    from torch_tpu._internal.export import export

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    with execution_mode.set_eager_mode(execution_mode.EagerMode._INTERNAL_COMPILE_FX_GRAPH):
        # Cloned as fx_to_mlir does, so that in-place updates do not write the placeholders.
        outputs = export.EagerLikeFxInterpreter(gm).run(*[a.clone() if isinstance(a, torch.Tensor) else a
                                                          for a in args])
        results, rebuild, dynamic, unique = export._process_fx_outputs(gm, outputs,
                                                                       dynamic_outputs=options.get("dynamic_outputs"))
        module = tpu_torch_compile.build_mlir(result_tensors=results, argument_tensors=tensors)
    built.append((module, [node.name for node in gm.graph.nodes if node.op == "placeholder"]))
    return export.ExportedMlir(module=module, executable=None, mlir_result_tensors=results,
                               reconstruct_fx_outputs_fn=rebuild, updates_default_generator_state=False,
                               dynamic_outputs=dynamic, unique_output_indices=unique)


def _argument_order(names: list[str], count: int) -> list[int]:
    """The captured step's input index of each program argument, from the placeholder names
    AOTAutograd gives the flat inputs (arg<i>_1), which TorchTPU's split keeps."""
    order = []
    for name in names:
        match = re.fullmatch(r"arg(\d+)_1", name)
        if match is None:
            raise ValueError(f"TorchTPU's program has an argument {name!r} that is no input of the captured step")
        order.append(int(match[1]))
    if sorted(order) != list(range(count)):
        raise ValueError(f"TorchTPU's program takes {len(order)} arguments, the captured step {count} inputs")
    return order


def main(argv: list[str] | None = None) -> int:
    """The child process: capture a config's one-device step, lower it with TorchTPU, write the
    StableHLO and what maps it to the step (PROGRAM_FILE, META_FILE) to --out."""
    parser = argparse.ArgumentParser(prog="python -m titan_tpu.tools.torchtpu_lowering")
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args, overrides = parser.parse_known_args(argv)
    try:
        from titan_tpu.config import build_config
        from titan_tpu.run_setup import prepare_run
        from titan_tpu.tools.device_step import capture_device_step

        cfg = prepare_run(build_config(args.config, overrides)).cfg
        start = time.perf_counter()
        step = capture_device_step(cfg, world_size=1, batch_size=cfg.training.batch_size,
                                   seq_len=cfg.training.seq_len)
        capture_seconds = time.perf_counter() - start
        program = torchtpu_program(step.captured.graph_module, step.captured.example_inputs)
    except (ValueError, RuntimeError) as e:
        print(f"error: {type(e).__name__}: {' '.join(str(e).split())[:600]}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / PROGRAM_FILE).write_text(program.text)
    slices = step.captured.input_slices()
    meta = {"argument_order": program.argument_order, "lowering_seconds": program.seconds,
            "capture_seconds": capture_seconds, "scan_bodies": program.scan_bodies,
            "input_groups": {name: [s.start, s.stop] for name, s in slices.items()},
            "graph_nodes": len(step.captured.graph_module.graph.nodes)}
    (out / META_FILE).write_text(json.dumps(meta, indent=1))
    return 0


# -- in the JAX process ----------------------------------------------------------------------

def lower_with_torchtpu(config: str, overrides: Sequence[str], out_dir: Path, *,
                        timeout: float | None = None) -> tuple[TorchTpuProgram, dict]:
    """TorchTPU's program for `config` with `overrides` (one device), made in a child process
    where torch-tpu loads (this one may have turned that off); returns it and its META_FILE."""
    env = {**os.environ, "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
           "PYTHONWARNINGS": "ignore:<TorchTpu/Performance/TcMalloc/"}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)  # TorchTPU's lowering needs torch-tpu loaded
    command = [sys.executable, "-m", "titan_tpu.tools.torchtpu_lowering", "--config", config, "--out", str(out_dir),
               *overrides]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        said = [line for line in lines if line.startswith("error: ")]
        raise ValueError("TorchTPU's lowering failed: " + (said[-1][len("error: "):] if said else
                                                           f"exit {result.returncode}: {(lines or ['?'])[-1]}"))
    meta = json.loads((out_dir / META_FILE).read_text())
    program = TorchTpuProgram(text=(out_dir / PROGRAM_FILE).read_text(), argument_order=meta["argument_order"],
                              seconds=meta["lowering_seconds"], scan_bodies=meta["scan_bodies"])
    return program, meta


def compile_stablehlo(text: str, topology_name: str, *, donated: Sequence[int] = (), name: str | None = None) -> dict:
    """A StableHLO module compiled for the first device of a TPU topology with libtpu's
    compile-only client, as JAX compiles for one (jax._src.compiler.backend_compile_and_load):
    XLA's memory by kind (the keys of `titan-tpu compile`'s report), its peak, FLOPs, bytes
    accessed, the optimized program's instruction counts and the main function's signature.
    donated: argument indices marked `jax.buffer_donor` (XLA may then write an output of the same
    shape into the argument's buffer). name: the module's name (XLA's dump files carry it)."""
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    from titan_tpu.tools.compile_cmd import _topology, xla_numbers

    device = _topology(topology_name).devices[0]
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        if name is not None:
            module.operation.attributes["sym_name"] = ir.StringAttr.get(name)
        main = _main_function(module)
        signature = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        if donated:
            marked = set(donated)
            main.attributes["arg_attrs"] = ir.ArrayAttr.get([
                ir.DictAttr.get({"jax.buffer_donor": ir.BoolAttr.get(True)} if i in marked else {})
                for i in range(len(signature.inputs))])
        options = compiler.get_compile_options(num_replicas=1, num_partitions=1, device_assignment=[device])
        start = time.perf_counter()
        executable = device.client.compile(module, executable_devices=xla_client.DeviceList((device,)),
                                           compile_options=options)
        seconds = time.perf_counter() - start
        arguments = [str(t) for t in signature.inputs]
        results = [str(t) for t in signature.results]
    kinds, peak, cost = xla_numbers(executable.get_compiled_memory_stats(), executable.cost_analysis())
    return {"topology": topology_name, "memory_per_chip_bytes": kinds, "peak_per_chip_bytes": peak,
            "flops_per_chip": cost.get("flops"), "bytes_accessed_per_chip": cost.get("bytes accessed"),
            "stablehlo": stablehlo_counts(text), "hlo": _optimized_counts(executable), "compile_seconds": seconds,
            "argument_types": arguments, "result_types": results}


def _main_function(module):
    from jax._src.lib.mlir import ir

    for op in module.body.operations:
        if ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    raise ValueError("the StableHLO module has no function @main")


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
                 "broadcast_in_dim"):
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


def compare(config: str, overrides: Sequence[str], topology_name: str, work_dir: Path, *,
            undonated: bool = True, xla_dump: Path | None = None) -> dict:
    """The captured one-device step of `config` compiled for one chip of `topology_name` twice:
    through TorchTPU's lowering (child process) and through ours (`titan-tpu compile`'s core).
    Returns {"torchtpu": TorchTPU's program with our donation, "torchtpu_undonated": as the
    trainer compiles it (no donation; left out with undonated=False), "jax": ours, "kernels",
    "outputs_match", ...}; the compile reports as `compile_stablehlo`'s. xla_dump: the directory
    XLA_FLAGS=--xla_dump_to names in this process (set before JAX started), from whose optimized
    HLO the instruction counts come where libtpu cannot print the compiled program."""
    from titan_tpu.config import build_config
    from titan_tpu.run_setup import prepare_run
    from titan_tpu.tools.compile_cmd import compile_step_for_tpu

    cfg = prepare_run(build_config(config, list(overrides))).cfg
    p = cfg.parallelism
    split = {key: getattr(p, key) for key in ("dp_replicate", "dp_shard", "tp", "cp", "ep") if getattr(p, key) > 1}
    if split:
        raise ValueError(f"TorchTPU's lowering is compared on one device, {config} has parallelism "
                         + ", ".join(f"{k} {v}" for k, v in split.items()) + "; add "
                         + " ".join(f"--parallelism.{k} 1" for k in split)
                         + " (TorchTPU runs collectives between separately compiled programs, through tpu_dist)")
    kernels = _aten_kernels(cfg)
    # The child captures with the kernels our capture for JAX resolved to, named explicitly.
    named = [f"--kernels.{op}={name}" for op, name in kernels.items()]
    program, meta = lower_with_torchtpu(config, [*overrides, *named], work_dir / "torchtpu")
    groups = meta["input_groups"]
    moved = {i for group in ("params", "exp_avg", "exp_avg_sq") for i in range(*groups[group])}
    donated = [j for j, i in enumerate(program.argument_order) if i in moved]
    report = {"config": " ".join([config, *overrides]), "topology": topology_name, "kernels": kernels,
              "torchtpu_lowering_seconds": program.seconds, "torchtpu_capture_seconds": meta["capture_seconds"],
              "scan_bodies": program.scan_bodies,
              "torchtpu": _compiled_or_refused(program.text, topology_name, donated=donated, name="torchtpu_donated")}
    if undonated:
        report["torchtpu_undonated"] = _compiled_or_refused(program.text, topology_name, name="torchtpu_undonated")
    dump = work_dir / "jax"
    try:
        ours = compile_step_for_tpu(cfg, topology_name, dump)
    except Exception as e:  # noqa: BLE001 - XLA's RESOURCE_EXHAUSTED is a JaxRuntimeError
        report["jax"] = {"refused": _refusal(e), "stablehlo": None, "hlo": None, "result_types": None}
    else:
        stablehlo = (dump / "step.stablehlo.mlir").read_text()
        arguments, results = stablehlo_signature(stablehlo)
        optimized = dump / "step.optimized.hlo"
        report["jax"] = {**ours, "stablehlo": stablehlo_counts(stablehlo),
                         "hlo": hlo_counts(optimized.read_text()) if optimized.exists() else None,
                         "argument_types": arguments, "result_types": results}
    # On the one-device mesh ours gives each value as it is, but a scalar stacked over the mesh ([1]).
    ours_results = report["jax"]["result_types"]
    report["outputs_match"] = None if ours_results is None else _same_results(report["torchtpu"]["result_types"],
                                                                               ours_results)
    if xla_dump is not None:
        dumped = hlo_counts_from_dump(xla_dump)
        for key in ("torchtpu", "torchtpu_undonated", "jax"):
            if key in report and report[key]["hlo"] is None and "refused" not in report[key]:
                report[key]["hlo"] = dumped.get({"torchtpu": "torchtpu_donated"}.get(key, key))
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


def _aten_kernels(cfg) -> dict[str, str]:
    """Each op's kernel in our capture for JAX (compile_cmd.jax_kernels), which must be one both
    lowerings trace alike: ATen ops that also run on a TPU (reference attention, chunked loss).
    Otherwise a one-line error naming the choices: a Pallas kernel (splash, gmm, tokamax) and
    TorchTPU's own splash_sdpa trace in TorchTPU's FX mode, but `build_mlir` then asks for the
    PJRT client ("TPU initialization failed: No jellyfish device found"); sdpa is captured here as
    the CPU's flash kernel, which TorchTPU does not implement."""
    from titan_tpu.kernels import OPS
    from titan_tpu.models.spec import model_spec
    from titan_tpu.tools.compile_cmd import jax_kernels

    _, used = jax_kernels(cfg)
    moe = getattr(model_spec(cfg.model).args, "moe", None) is not None
    kernels = {}
    for field, chosen in used.items():
        if field == "chunk_attention" or field == "grouped_mm" and not moe:
            continue  # context parallelism's attention and the experts' matmul: not in a dense one-device step
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
