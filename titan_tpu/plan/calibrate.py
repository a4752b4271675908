"""`titan-tpu plan --calibrate`: run real CPU configurations and print the planner's prediction
beside what the trainer measured, for peak memory and tokens/s.

Each configuration trains six steps (three for the 0.6B model) in a fresh process (`python -m
titan_tpu train`, torchrun for two ranks) with validation and checkpoints off, logging every step;
the measurements are the trainer's own metrics rows: `max_memory_gb` of the last row, the
process's peak resident memory (VmHWM) since the training loop began, rank 0's, and the best
`tokens_per_s` of the steps after the first. For one-process runs the peak of live tensors in a
step is also measured, with torch's profiler, or glibc's bytes in use for Inductor's compiled
steps, whose buffers the profiler does not see (`measure_live_peak`). The planner
predicts that same quantity: model terms plus the runtime's resident memory, a constant measured
here too: the measured peak of a trainer run with a tiny model and 16 tokens a step minus the
planner's terms for it (`measure_runtime_bytes`), and for graph-mode configurations the same
tiny run in graph mode.

Run it alone on the machine (`flock /work/cpu.lock` where it is shared): the speeds are
comparisons of this process's measured CPU peak with the runs'. Results go to
<out>/calibration.json; `--replay` recomputes the predictions from that file without training.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CASES", "Case", "calibrate_main", "profiled_peak_bytes"]


@dataclass(frozen=True)
class Case:
    name: str
    config: str
    overrides: tuple[str, ...] = ()
    ranks: int = 1
    debug: bool = True  # the tokens/s target (within 25%) applies to the debug models
    extra: tuple[str, ...] = field(default=())
    env: tuple[tuple[str, str], ...] = ()  # environment of the training process (the allocator checks)


_FEW_STEPS = ("--training.steps", "6", "--metrics.log_freq", "1", "--validation.enabled", "false",
              "--checkpoint.enabled", "false", "--metrics.tensorboard", "false", "--training.device", "cpu",
              "--checkpoint.resume", "false", "--lr_scheduler.warmup_steps", "1")

CASES = [
    Case("llama3 debug, AC none, unrolled, chunked loss", "configs/llama3_debug.toml"),
    Case("llama3 debug, AC full, unrolled", "configs/llama3_debug.toml", ("--activation_checkpoint.mode", "full")),
    Case("llama3 debug, AC selective, materialised loss", "configs/llama3_debug.toml",
         ("--activation_checkpoint.mode", "selective", "--kernels.loss", "reference")),
    Case("qwen3 debug, AC none, scanned", "configs/qwen3_debug.toml", ("--model.scan_layers", "true")),
    Case("qwen3 debug, AC full, scanned, seq 1024", "configs/qwen3_debug.toml",
         ("--model.scan_layers", "true", "--activation_checkpoint.mode", "full", "--training.seq_len", "1024")),
    Case("qwen3 debug, AC none, seq 1024, materialised loss", "configs/qwen3_debug.toml",
         ("--training.seq_len", "1024", "--kernels.loss", "reference")),
    Case("qwen3_moe debug, AC none", "configs/qwen3_moe_debug.toml"),
    Case("llama3 debug, 2 ranks fully_shard", "configs/llama3_debug.toml", ranks=2),
    Case("qwen3 debug, 2 ranks fully_shard, scanned, AC selective", "configs/qwen3_debug.toml",
         ("--model.scan_layers", "true", "--activation_checkpoint.mode", "selective"), ranks=2),
    Case("qwen3_moe debug, 2 ranks, ep 2", "configs/qwen3_moe_debug.toml", ("--parallelism.ep", "2"), ranks=2),
    # Tensor parallel: both ranks hold the whole batch, each a tp shard of the model (docs/tensor_parallel.md).
    Case("llama3 debug, 2 ranks tp 2", "configs/llama3_debug.toml", ("--parallelism.tp", "2"), ranks=2),
    Case("llama3 debug, 2 ranks tp 2, scanned", "configs/llama3_debug.toml",
         ("--parallelism.tp", "2", "--model.scan_layers", "true"), ranks=2),
    Case("llama3 debug, 2 ranks tp 2, graph aot_eager, scanned, AC full", "configs/llama3_debug.toml",
         ("--parallelism.tp", "2", "--model.scan_layers", "true", "--training.mode", "graph",
          "--compile.backend", "aot_eager", "--activation_checkpoint.mode", "full"), ranks=2),
    # Context parallel: both ranks hold the whole batch, each half of every sequence (docs/context_parallel.md).
    Case("llama3 debug, 2 ranks cp 2", "configs/llama3_debug.toml", ("--parallelism.cp", "2"), ranks=2),
    Case("llama3 debug, 2 ranks cp 2, scanned", "configs/llama3_debug.toml",
         ("--parallelism.cp", "2", "--model.scan_layers", "true"), ranks=2),
    Case("llama3 debug, 2 ranks cp 2, graph aot_eager, scanned", "configs/llama3_debug.toml",
         ("--parallelism.cp", "2", "--model.scan_layers", "true", "--training.mode", "graph",
          "--compile.backend", "aot_eager"), ranks=2),
    Case("llama3 debug, 2 ranks cp 2, graph aot_eager, scanned, AC full", "configs/llama3_debug.toml",
         ("--parallelism.cp", "2", "--model.scan_layers", "true", "--training.mode", "graph",
          "--compile.backend", "aot_eager", "--activation_checkpoint.mode", "full"), ranks=2),
    # Context x tensor parallel: the 4 ranks hold the whole batch, each half of every sequence with
    # a tp shard of the model (docs/context_parallel.md, "With tensor parallelism").
    Case("llama3 debug, 4 ranks cp 2 x tp 2", "configs/llama3_debug.toml",
         ("--parallelism.cp", "2", "--parallelism.tp", "2"), ranks=4),
    # Pipeline stages: the plan is the last stage's (its layers, the loss), rank 1 (docs/pipeline_parallel.md);
    # the measured peak is rank 0's, the first stage's (no loss): a lower bound of the planner's.
    Case("llama3 debug, 2 ranks pp 2, scanned", "configs/llama3_debug.toml",
         ("--parallelism.pp", "2", "--model.scan_layers", "true"), ranks=2),
    # Graph mode (--training.mode graph): the whole step captured and compiled, one process.
    Case("llama3 debug, graph aot_eager, unrolled", "configs/llama3_debug.toml",
         ("--training.mode", "graph", "--compile.backend", "aot_eager")),
    Case("llama3 debug, graph inductor, unrolled", "configs/llama3_debug.toml",
         ("--training.mode", "graph", "--compile.backend", "inductor")),
    Case("llama3 debug, graph inductor, unrolled, AC full", "configs/llama3_debug.toml",
         ("--training.mode", "graph", "--compile.backend", "inductor", "--activation_checkpoint.mode", "full")),
    Case("qwen3 debug, graph inductor, scanned", "configs/qwen3_debug.toml",
         ("--training.mode", "graph", "--compile.backend", "inductor", "--model.scan_layers", "true")),
    # Scanned in graph mode on two ranks: scan's autograd keeps each layer's gathered weights
    # (planner: gather "model", no re-gather, gradients reduce-scattered per layer).
    Case("qwen3 debug, 2 ranks fully_shard, graph inductor, scanned", "configs/qwen3_debug.toml",
         ("--training.mode", "graph", "--compile.backend", "inductor", "--model.scan_layers", "true",
          "--compile.split", "collectives"), ranks=2),
    Case("qwen3 debug, graph aot_eager, scanned, AC full", "configs/qwen3_debug.toml",
         ("--training.mode", "graph", "--compile.backend", "aot_eager", "--model.scan_layers", "true",
          "--activation_checkpoint.mode", "full")),
    # The same runs as three above with glibc's mmap threshold fixed at 4 MiB: freed large blocks
    # go back to the system instead of staying in the heap, so resident memory follows the live
    # tensors (docs/planner.md, "Where resident memory goes").
    Case("llama3 debug, AC full, unrolled, fixed mmap threshold", "configs/llama3_debug.toml",
         ("--activation_checkpoint.mode", "full"), env=(("MALLOC_MMAP_THRESHOLD_", "4194304"),)),
    Case("qwen3 debug, AC full, scanned, seq 1024, fixed mmap threshold", "configs/qwen3_debug.toml",
         ("--model.scan_layers", "true", "--activation_checkpoint.mode", "full", "--training.seq_len", "1024"),
         env=(("MALLOC_MMAP_THRESHOLD_", "4194304"),)),
    Case("qwen3 debug, 2 ranks fully_shard, scanned, AC selective, fixed mmap threshold", "configs/qwen3_debug.toml",
         ("--model.scan_layers", "true", "--activation_checkpoint.mode", "selective"), ranks=2,
         env=(("MALLOC_MMAP_THRESHOLD_", "4194304"),)),
    Case("qwen3 0.6B, batch 1 x seq 256, AC full", "configs/qwen3_0.6b_cpu.toml",
         ("--training.seq_len", "256", "--activation_checkpoint.mode", "full", "--training.steps", "3"),
         debug=False),
]


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _debug_tokenizer(cache_dir: Path) -> str:
    """A byte-level BPE of the debug vocab on the embedded corpus (cached): the 0.6B run reads
    its ids (all below 2,048) instead of training a 151,936-token vocabulary."""
    from titan_tpu.data.shards import prepare_dataset

    tokenizer, _ = prepare_dataset(source=None, max_bytes=None, tokenizer_path=None, vocab_size=2048,
                                   cache_dir=cache_dir)
    return str(tokenizer.path)


RUNTIME_CASE = Case("runtime: llama3 debug, batch 1 x seq 16", "configs/llama3_debug.toml",
                    ("--training.batch_size", "1", "--training.seq_len", "16"))


def measure_runtime_bytes(out_dir: Path, tokenizer: str, python: str, *, graph: bool = False,
                          ranks: int = 1) -> float:
    """Resident memory of the trainer process that the planner's terms do not model (Python,
    torch, the tokenizer, the data loader, allocator slack): the measured peak of a run whose
    model terms are tiny (llama3 debug, 16 tokens a step: 0.12 GB of parameters, gradients and
    moments, nothing else to speak of) minus the planner's own terms for that run. ranks 2: the
    same run on two ranks (dp_shard 2), so it holds the process group's state too."""
    case = dataclasses.replace(RUNTIME_CASE, ranks=ranks)
    if ranks > 1:
        case = dataclasses.replace(case, name=case.name + f", {ranks} ranks")
    if graph:  # the same tiny run, its step captured and compiled by Inductor (CPU_GRAPH_RUNTIME_BYTES)
        case = dataclasses.replace(case, name=case.name + ", graph inductor",
                                   overrides=case.overrides + ("--training.mode", "graph", "--compile.backend",
                                                               "inductor"))
    result = _run_case(case, out_dir, tokenizer, python)
    plan = predict(result, {"peak_flops": 1e11, "memory_bandwidth": 1e10, "runtime_bytes": 0.0,
                            "graph_runtime_bytes": 0.0, "distributed_runtime_bytes": 0.0})
    return result["measured_peak_gb"] * 1e9 - plan.peak_bytes


def measure_collective_rate(python: str) -> dict:
    """{"bytes_per_s", "latency_s", ...}: what a rank sends per second into gloo's collectives
    between two processes and a small collective's time (plan/collective_rate.py)."""
    torchrun = str(Path(python).with_name("torchrun"))
    out = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", "-m", "titan_tpu.plan.collective_rate"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"collective rate measurement failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def profiled_peak_bytes(run) -> int:
    """The highest the bytes of live tensors rose above their start while `run()` ran, from torch's
    profiler's allocation events in time order (CPU tensors)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    changes = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    now = peak = 0
    for _, delta in changes:
        now += delta
        peak = max(peak, now)
    return peak


_LIVE_PROBE = r"""
import json, sys, torch
from titan_tpu.config import build_config
from titan_tpu.plan.calibrate import profiled_peak_bytes
from titan_tpu.device import get_backend
from titan_tpu.run.resolved import Target
from titan_tpu.run.setup import prepare_run
from titan_tpu.components.make_step import make_step
from titan_tpu.components.program import assemble_program
from titan_tpu.components.resolve import resolve
from titan_tpu.components.world import Place
cfg = build_config(sys.argv[1], sys.argv[2:])
t = cfg.training
backend = get_backend("cpu")
# The trainer's own resolution, program and step on one CPU process (a graph step is captured and
# compiled here, before the measured steps).
run = resolve(prepare_run(cfg), Target.of_backend(backend, 1))
place = Place.of(run, rank=0, device=backend.device)
program = assemble_program(run, place)
model, opt, args = program.model, program.optimizer, run.spec.args
step, _ = make_step(run, program, place, backend=backend, log=lambda message: None)
tokens = torch.randint(0, args.vocab_size, (t.batch_size, t.seq_len + 1), generator=torch.Generator().manual_seed(0))
batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
step([batch], 1e-4)
# Live at the start of a step: parameters, buffers and the two moments (gradients are dropped after each step).
static = sum(x.numel() * x.element_size() for x in [*model.parameters(), *model.buffers()])
static += sum(x.numel() * x.element_size() for d in (opt.state["exp_avg"], opt.state["exp_avg_sq"]) for x in d.values())
if t.mode == "graph" and cfg.compile.backend == "inductor":
    # The profiler does not see the buffers Inductor's compiled code allocates, so: glibc's bytes
    # in use (mallinfo2), read at every call the compiled step makes from Python (kernels,
    # buffer allocations), minus those at the start of the step: the step's own allocations.
    from titan_tpu.plan.malloc_stats import malloc_in_use as in_use
    start = in_use()
    most = [start]
    def sample(frame, event, arg):
        if event in ("c_call", "c_return", "call", "return"):
            most[0] = max(most[0], in_use())
    sys.setprofile(sample)
    step([batch], 1e-4)
    sys.setprofile(None)
    peak = most[0] - start
else:
    peak = profiled_peak_bytes(lambda: step([batch], 1e-4))
print(json.dumps({"live_peak_gb": (static + peak) / 1e9}))
"""


def measure_live_peak(case: Case, python: str, tokenizer: str) -> float | None:
    """Peak bytes of live tensors during one training step (torch's profiler: every allocation
    and free of the step, plus the parameters and moments alive before it), one process only:
    what an accelerator's allocator would report, without the CPU allocator's retained memory."""
    if case.ranks > 1:
        return None
    args = [str(_repo_root() / case.config), *_FEW_STEPS, *case.overrides]
    if "0.6b" in case.config:
        args += ["--data.source", "stdlib", "--data.tokenizer_path", tokenizer]
    out = subprocess.run([python, "-c", _LIVE_PROBE, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{case.name}: live-memory probe failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["live_peak_gb"]


def _run_case(case: Case, out_dir: Path, tokenizer: str, python: str) -> dict:
    run_dir = out_dir / case.name.replace(" ", "_").replace(",", "")
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ["--config", str(_repo_root() / case.config), *_FEW_STEPS, *case.overrides, "--output_dir", str(run_dir)]
    if "0.6b" in case.config:
        args += ["--data.source", "stdlib", "--data.tokenizer_path", tokenizer]
    if case.ranks == 1:
        cmd = [python, "-m", "titan_tpu", "train", *args]
    else:
        torchrun = str(Path(python).with_name("torchrun"))
        cmd = [torchrun, "--standalone", f"--nproc_per_node={case.ranks}", "-m", "titan_tpu", "train", *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **dict(case.env)})
    if proc.returncode != 0:
        raise RuntimeError(f"{case.name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tokens_per_s" in r]
    # Speed: the best step after the first (the first builds lazily created state); best, not mean,
    # as the CPU peak is a best-of-10: a neighbour stealing the cores slows steps, never speeds them.
    best = max(steps[1:], key=lambda r: r["tokens_per_s"])
    return {"name": case.name, "argv": args, "ranks": case.ranks, "debug": case.debug,
            "measured_peak_gb": steps[-1]["max_memory_gb"], "measured_tokens_per_s": best["tokens_per_s"],
            "measured_mfu": best["mfu"], "step_tokens_per_s": [r["tokens_per_s"] for r in steps],
            "compile_s": steps[0].get("capture_s", 0.0) + steps[0].get("compile_s", 0.0),  # graph mode
            "wall_s": time.perf_counter() - start}


def predict(result: dict, hw_numbers: dict) -> dict:
    """The planner's numbers for a calibration run, on the hardware numbers measured with it."""
    from titan_tpu.config import build_config
    from titan_tpu.plan import hardware as hw_mod
    from titan_tpu.plan.planner import plan_config
    from titan_tpu.run.setup import prepare_run

    argv = list(result["argv"])
    config = argv[argv.index("--config") + 1]
    rest = [a for i, a in enumerate(argv) if a != "--config" and (i == 0 or argv[i - 1] != "--config")]
    model_share = 1  # ranks that share one data-parallel rank's batch (tp x cp x pp)
    for key in ("--parallelism.tp", "--parallelism.cp", "--parallelism.pp"):
        model_share *= int(rest[rest.index(key) + 1]) if key in rest else 1
    overrides = rest + (["--parallelism.dp_shard", str(result["ranks"] // model_share)] if result["ranks"] > 1 else [])
    cfg = prepare_run(build_config(config, overrides)).cfg
    cpu = hw_mod.cpu_hardware(measure=False)
    cpu = hw_mod.Hardware(**{**cpu.as_dict(), "peak_flops": hw_numbers["peak_flops"],
                             "memory_bandwidth": hw_numbers["memory_bandwidth"],
                             "interconnect_bandwidth": hw_numbers.get("interconnect_bandwidth",
                                                                      hw_mod.CPU_COLLECTIVE_BANDWIDTH),
                             "runtime_bytes": hw_numbers["runtime_bytes"],
                             "collective_latency": hw_numbers.get("collective_latency", hw_mod.CPU_COLLECTIVE_LATENCY),
                             "graph_runtime_bytes": hw_numbers.get("graph_runtime_bytes", hw_numbers["runtime_bytes"]),
                             "distributed_runtime_bytes": hw_numbers.get("distributed_runtime_bytes",
                                                                         hw_mod.CPU_DISTRIBUTED_RUNTIME_BYTES)})
    return plan_config(cfg, cpu)


def _table(results: list[dict], hw_numbers: dict) -> tuple[str, dict[str, list[float]]]:
    lines = ["| configuration | predicted peak | measured peak RSS | error | predicted tensors | live tensors "
             "(profiler) | error | tok/s predicted | tok/s measured | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    implied = {"eager": [], "graph": []}  # eager: (compute at peak, elementwise at the copy rate, measured) s
    for r in results:
        # Each run is predicted on the CPU numbers measured in its own invocation (--only runs merge).
        plan = predict(r, r.get("hardware", hw_numbers))
        mem_err = (plan.peak_bytes / 1e9 - r["measured_peak_gb"]) / r["measured_peak_gb"]
        tps_err = (plan.tokens_per_s - r["measured_tokens_per_s"]) / r["measured_tokens_per_s"]
        if r["debug"]:
            # The efficiency at which this run's predicted compute time would match its measured time.
            t = plan.time
            measured_step = plan.batch["tokens_per_step"] / r["measured_tokens_per_s"]
            compute_measured = measured_step - t["elementwise_s"] - t["collectives_s"]
            if compute_measured > 0 and not r.get("env"):
                if plan.batch["mode"] == "graph":
                    implied["graph"].append(t["efficiency"] * t["compute_s"] / compute_measured)
                else:
                    implied["eager"].append((t["efficiency"] * t["compute_s"],
                                             t["elementwise_efficiency"] * t["elementwise_s"],
                                             measured_step - t["collectives_s"]))
        tensors = (plan.peak_bytes - plan.memory["runtime"]) / 1e9
        live = r.get("live_peak_gb")
        live_cols = (f"{live:.3f} GB | {tensors / live - 1:+.1%}" if live else
                     "(as without) | " if r.get("env") else "(2 ranks) | ")
        lines.append(f"| {r['name']} | {plan.peak_bytes / 1e9:.3f} GB | {r['measured_peak_gb']:.3f} GB | "
                     f"{mem_err:+.1%} | {tensors:.3f} GB | {live_cols} | {plan.tokens_per_s:,.0f} | "
                     f"{r['measured_tokens_per_s']:,.0f} | {tps_err:+.1%} |")
    return "\n".join(lines), implied


def fit_eager_time(runs: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(matmul efficiency, elementwise efficiency) for which compute_at_peak / e + elementwise_at_copy_rate / w
    best matches each run's measured step time (least squares on the relative error)."""
    import torch

    a = torch.tensor([[c / m, e / m] for c, e, m in runs], dtype=torch.float64)
    coef = torch.linalg.lstsq(a, torch.ones(len(runs), 1, dtype=torch.float64)).solution.flatten()
    return 1 / coef[0].item(), 1 / coef[1].item()


def calibrate_main(*, out_dir: str, replay: bool, only: str | None) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "calibration.json"
    if replay:
        data = json.loads(path.read_text())
    else:
        from titan_tpu.device_cpu import cpu_peak_flops
        from titan_tpu.files import default_cache_dir
        from titan_tpu.plan.hardware import measure_cpu_memory_bandwidth

        python = sys.executable
        cases = [c for c in CASES if only is None or any(part in c.name for part in only.split("|"))]
        if not cases:
            raise ValueError(f"--only {only!r} matches no calibration configuration")
        tokenizer = _debug_tokenizer(default_cache_dir())
        hw_numbers = {"peak_flops": cpu_peak_flops(), "memory_bandwidth": measure_cpu_memory_bandwidth(),
                      "runtime_bytes": measure_runtime_bytes(out, tokenizer, python),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": os.cpu_count()}
        if any(c.ranks > 1 for c in cases):
            rate = measure_collective_rate(python)
            hw_numbers["interconnect_bandwidth"] = rate["bytes_per_s"]
            hw_numbers["collective_latency"] = rate["latency_s"]
            print(f"gloo collective rate {rate['bytes_per_s'] / 1e9:.2f} GB/s per rank, "
                  f"{rate['latency_s'] * 1e3:.2f} ms per small call", flush=True)
            two_ranks = measure_runtime_bytes(out, tokenizer, python, ranks=2)
            hw_numbers["distributed_runtime_bytes"] = two_ranks - hw_numbers["runtime_bytes"]
            print(f"a rank's process-group memory {hw_numbers['distributed_runtime_bytes'] / 1e9:.3f} GB", flush=True)
        if any("graph" in " ".join(c.overrides) for c in cases):
            hw_numbers["graph_runtime_bytes"] = measure_runtime_bytes(out, tokenizer, python, graph=True)
            print(f"graph-mode runtime resident memory {hw_numbers['graph_runtime_bytes'] / 1e9:.3f} GB", flush=True)
        print(f"CPU: peak {hw_numbers['peak_flops'] / 1e9:.0f} GFLOP/s, copy bandwidth "
              f"{hw_numbers['memory_bandwidth'] / 1e9:.1f} GB/s, runtime resident memory "
              f"{hw_numbers['runtime_bytes'] / 1e9:.3f} GB", flush=True)
        # A partial run (--only) replaces its configurations in an existing file, so the set can be
        # measured in several sittings (each result keeps the CPU numbers measured with it).
        old = json.loads(path.read_text())["results"] if only is not None and path.exists() else []
        results = {r["name"]: r for r in old}
        order = [c.name for c in CASES]
        for case in cases:
            print(f"running: {case.name}", flush=True)
            result = _run_case(case, out, tokenizer, python)
            result["live_peak_gb"] = None if case.env else measure_live_peak(case, python, tokenizer)
            result["hardware"], result["env"] = hw_numbers, dict(case.env)
            results[case.name] = result
            # Written after every case, so a failure later in a sitting keeps what was measured.
            ordered = sorted(results.values(),
                             key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
            data = {"hardware": hw_numbers, "results": ordered}
            path.write_text(json.dumps(data, indent=2) + "\n")

    table, implied = _table(data["results"], data["hardware"])
    hardware = data["hardware"]
    print(f"calibration of {hardware['date']}: CPU peak {hardware['peak_flops'] / 1e9:.0f} GFLOP/s, "
          f"copy {hardware['memory_bandwidth'] / 1e9:.1f} GB/s, runtime {hardware['runtime_bytes'] / 1e9:.3f} GB")
    print(table)
    from titan_tpu.plan import hardware as hw_mod

    if len(implied["eager"]) >= 2:
        efficiency, elementwise = fit_eager_time(implied["eager"])
        print(f"eager-mode debug runs, fitted together: matmul efficiency {efficiency:.3f}, elementwise efficiency "
              f"{elementwise:.3f}; the planner uses {hw_mod.CPU_EFFICIENCY} and {hw_mod.CPU_ELEMENTWISE_EFFICIENCY}")
    if implied["graph"]:
        values = implied["graph"]
        print(f"efficiency implied by the graph-mode debug runs: median {statistics.median(values):.3f} "
              f"(range {min(values):.3f}-{max(values):.3f}); the planner uses {hw_mod.CPU_GRAPH_EFFICIENCY}")
    print(f"results: {path}")
    return 0
