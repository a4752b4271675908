"""`titan-tpu plan --calibrate`: run real CPU configurations and print the planner's prediction
beside what the trainer measured, for peak memory and tokens/s.

Each configuration trains a few steps in a fresh process (`python -m titan_tpu.train`, torchrun
for two ranks) with validation and checkpoints off; the measurement is the trainer's own last
metrics row: `max_memory_gb`, the process's peak resident memory (VmHWM) since the training loop
began, rank 0's, and `tokens_per_s`, the throughput of the steps after the first. The planner
predicts that same quantity: model terms plus the runtime's resident memory, a constant measured
here too (a process that does everything the trainer does before it builds the model: imports,
tokenizer, data loader, the CPU peak measurement).

Run it alone on the machine (`flock /work/cpu.lock` where it is shared): the speeds are
comparisons of this process's measured CPU peak with the runs'. Results go to
<out>/calibration.json; `--replay` recomputes the predictions from that file without training.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CASES", "Case", "calibrate_main"]


@dataclass(frozen=True)
class Case:
    name: str
    config: str
    overrides: tuple[str, ...] = ()
    ranks: int = 1
    debug: bool = True  # the tokens/s target (within 25%) applies to the debug models
    extra: tuple[str, ...] = field(default=())


_FEW_STEPS = ("--training.steps", "4", "--metrics.log_freq", "100", "--validation.enabled", "false",
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


_RUNTIME_PROBE = r"""
import json, sys, torch
from titan_tpu.config import build_config
from titan_tpu.device import get_backend, _cpu_memory_stats
from titan_tpu.data.loader import TokenLoader
from titan_tpu.data.shards import prepare_dataset
import titan_tpu.train.trainer  # everything the trainer imports
cfg = build_config(sys.argv[1], sys.argv[2:])
backend = get_backend("cpu")
tok, shards = prepare_dataset(source=None, max_bytes=None, tokenizer_path=None, vocab_size=2048,
                              cache_dir=cfg.data.cache_dir or titan_tpu.train.trainer.default_cache_dir())
loader = TokenLoader(shards, split="train", seq_len=cfg.training.seq_len, batch_size=cfg.training.batch_size,
                     seed=0, val_fraction=cfg.data.val_fraction)
loader.next_batch()
backend.peak_flops()
print(json.dumps(_cpu_memory_stats()))
"""


def measure_runtime_bytes(python: str) -> float:
    """Resident memory of a process that has done what the trainer does before building a model."""
    out = subprocess.run([python, "-c", _RUNTIME_PROBE, str(_repo_root() / "configs/llama3_debug.toml")],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["memory_gb"] * 1e9


def _run_case(case: Case, out_dir: Path, tokenizer: str, python: str) -> dict:
    run_dir = out_dir / case.name.replace(" ", "_").replace(",", "")
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ["--config", str(_repo_root() / case.config), *_FEW_STEPS, *case.overrides, "--output_dir", str(run_dir)]
    if "0.6b" in case.config:
        args += ["--data.source", "stdlib", "--data.tokenizer_path", tokenizer]
    if case.ranks == 1:
        cmd = [python, "-m", "titan_tpu.train", *args]
    else:
        torchrun = str(Path(python).with_name("torchrun"))
        cmd = [torchrun, "--standalone", f"--nproc_per_node={case.ranks}", "-m", "titan_tpu.train", *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{case.name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "tokens_per_s" in r][-1]
    return {"name": case.name, "argv": args, "ranks": case.ranks, "debug": case.debug,
            "measured_peak_gb": last["max_memory_gb"], "measured_tokens_per_s": last["tokens_per_s"],
            "measured_mfu": last["mfu"], "wall_s": time.perf_counter() - start}


def predict(result: dict, hw_numbers: dict) -> dict:
    """The planner's numbers for a calibration run, on the hardware numbers measured with it."""
    from titan_tpu.config import build_config
    from titan_tpu.plan import hardware as hw_mod
    from titan_tpu.plan.planner import plan_config

    argv = list(result["argv"])
    config = argv[argv.index("--config") + 1]
    rest = [a for i, a in enumerate(argv) if a != "--config" and (i == 0 or argv[i - 1] != "--config")]
    overrides = rest + (["--parallelism.dp_shard", str(result["ranks"])] if result["ranks"] > 1 else [])
    cfg = build_config(config, overrides)
    cpu = hw_mod.cpu_hardware(measure=False)
    cpu = hw_mod.Hardware(**{**cpu.as_dict(), "peak_flops": hw_numbers["peak_flops"],
                             "memory_bandwidth": hw_numbers["memory_bandwidth"],
                             "interconnect_bandwidth": hw_numbers["memory_bandwidth"] / 4,
                             "runtime_bytes": hw_numbers["runtime_bytes"]})
    return plan_config(cfg, cpu)


def _table(results: list[dict], hw_numbers: dict) -> tuple[str, list[float]]:
    lines = ["| configuration | peak predicted | peak measured | error | tok/s predicted | tok/s measured | error |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    implied = []
    for r in results:
        plan = predict(r, hw_numbers)
        mem_err = (plan.peak_bytes / 1e9 - r["measured_peak_gb"]) / r["measured_peak_gb"]
        tps_err = (plan.tokens_per_s - r["measured_tokens_per_s"]) / r["measured_tokens_per_s"]
        if r["debug"]:
            # The efficiency at which this run's predicted compute time would match its measured time.
            t = plan.time
            measured_step = plan.batch["tokens_per_step"] / r["measured_tokens_per_s"]
            compute_measured = measured_step - t["elementwise_s"] - t["collectives_s"]
            if compute_measured > 0:
                implied.append(plan.hardware["efficiency"] * t["compute_s"] / compute_measured)
        lines.append(f"| {r['name']} | {plan.peak_bytes / 1e9:.3f} GB | {r['measured_peak_gb']:.3f} GB | "
                     f"{mem_err:+.1%} | {plan.tokens_per_s:,.0f} | {r['measured_tokens_per_s']:,.0f} | {tps_err:+.1%} |")
    return "\n".join(lines), implied


def calibrate_main(*, out_dir: str, replay: bool, only: str | None) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "calibration.json"
    if replay:
        data = json.loads(path.read_text())
    else:
        from titan_tpu.device import cpu_peak_flops
        from titan_tpu.plan.hardware import measure_cpu_memory_bandwidth
        from titan_tpu.train.trainer import default_cache_dir

        python = sys.executable
        cases = [c for c in CASES if only is None or only in c.name]
        tokenizer = _debug_tokenizer(default_cache_dir())
        hw_numbers = {"peak_flops": cpu_peak_flops(), "memory_bandwidth": measure_cpu_memory_bandwidth(),
                      "runtime_bytes": measure_runtime_bytes(python), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "threads": os.cpu_count()}
        print(f"CPU: peak {hw_numbers['peak_flops'] / 1e9:.0f} GFLOP/s, copy bandwidth "
              f"{hw_numbers['memory_bandwidth'] / 1e9:.1f} GB/s, runtime resident memory "
              f"{hw_numbers['runtime_bytes'] / 1e9:.3f} GB", flush=True)
        results = []
        for case in cases:
            print(f"running: {case.name}", flush=True)
            results.append(_run_case(case, out, tokenizer, python))
        data = {"hardware": hw_numbers, "results": results}
        path.write_text(json.dumps(data, indent=2) + "\n")
    table, implied = _table(data["results"], data["hardware"])
    print(f"calibration of {data['hardware']['date']}: CPU peak {data['hardware']['peak_flops'] / 1e9:.0f} GFLOP/s, "
          f"copy {data['hardware']['memory_bandwidth'] / 1e9:.1f} GB/s, runtime {data['hardware']['runtime_bytes'] / 1e9:.3f} GB")
    print(table)
    if implied:
        print(f"efficiency implied by the debug runs: median {statistics.median(implied):.3f} "
              f"(range {min(implied):.3f}-{max(implied):.3f}); hardware.CPU_EFFICIENCY is "
              f"{__import__('titan_tpu.plan.hardware', fromlist=['x']).CPU_EFFICIENCY}")
    print(f"results: {path}")
    return 0
