"""The JAX path (`--compile.backend jax`) against the eager torch run of the same mesh, on this CPU.

Each case trains the debug model twice from the same seed and data, as torchrun ranks on gloo:
once eagerly (torch's autograd, the reference) and once as the one program our lowering hands XLA,
run by JAX's runtime over the same number of XLA host devices (one process each). It compares
every step's loss and gradient norm and every validation loss, and prints the largest relative
difference of each, with both runs' wall time.

    PYTHONPATH=$PWD .venv-tpu/bin/python bench/jax_path.py                      # the four cases, 100 steps
    PYTHONPATH=$PWD .venv-tpu/bin/python bench/jax_path.py --steps 10 --cases dense_dp4_tp2
    PYTHONPATH=$PWD .venv-tpu/bin/python bench/jax_path.py --json bench/results/jax_path.json

Runs in .venv-tpu (jax); torch-tpu is kept from loading (TORCH_DEVICE_BACKEND_AUTOLOAD=0). The
kernels are the CPU's on both sides (reference attention, the chunked loss, the grouped matmul's
reference form): the Pallas TPU kernels run in interpret mode only in make tpu-check's one-step
tests, not here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (recipe, processes, overrides): the meshes the JAX path is checked on (8 devices, and bf16 on 2).
CASES: dict[str, tuple[str, int, list[str]]] = {
    "dense_dp4_tp2": ("llama3_debug", 8, ["--parallelism.dp_shard", "4", "--parallelism.tp", "2"]),
    "dense_dp2_cp2_tp2_scanned": ("llama3_debug", 8, [
        "--parallelism.dp_shard", "2", "--parallelism.cp", "2", "--parallelism.tp", "2", "--data.document_mask",
        "true", "--model.scan_layers", "true", "--activation_checkpoint.mode", "full"]),
    "moe_dp8_ep2_all_to_all": ("qwen3_moe_debug", 8, [
        "--parallelism.dp_shard", "8", "--parallelism.ep", "2", "--parallelism.ep_dispatch", "all_to_all"]),
    "dense_dp8_accum2": ("llama3_debug", 8, ["--parallelism.dp_shard", "8", "--training.grad_accum_steps", "2"]),
    # bf16 compute (fp32 masters and reductions), on 2 devices: XLA and torch round bf16 matmuls differently.
    "dense_dp2_bf16": ("llama3_debug", 2, ["--parallelism.dp_shard", "2", "--model.dtype", "bfloat16"]),
}

MODES = {"eager": ["--training.mode", "eager"], "jax": ["--training.mode", "graph", "--compile.backend", "jax"]}


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one XLA host device per process
    env.update(TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore:<TorchTpu/Performance/TcMalloc/,ignore::FutureWarning")
    return env


def train(run_dir: Path, recipe: str, processes: int, overrides: list[str], *, steps: int, cache: Path) -> float:
    """One run under torchrun; its wall seconds. Raises with the log's tail when it fails."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               "-m", "titan_tpu", "train", "--config", f"configs/{recipe}.toml", "--output_dir", str(run_dir),
               "--training.device", "cpu", "--training.steps", str(steps), "--training.batch_size", "2",
               "--training.seq_len", "128", "--metrics.log_freq", "1", "--metrics.tensorboard", "false",
               "--validation.freq", str(max(steps // 2, 1)), "--validation.steps", "2",
               "--checkpoint.enabled", "false", "--data.cache_dir", str(cache), "--data.max_bytes", "2000000",
               *overrides]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True)
    seconds = time.perf_counter() - start
    (run_dir / "log.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{run_dir.name} failed:\n" + "\n".join((done.stdout + done.stderr).splitlines()[-30:]))
    return seconds


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def compare(jax_rows: list[dict], eager_rows: list[dict]) -> dict:
    """Largest relative difference of each metric over the steps both runs logged."""
    def by_step(rows, key):
        return {r["step"]: r[key] for r in rows if key in r}

    out = {}
    for key in ("loss", "grad_norm", "val_loss", "aux_loss"):
        ours, reference = by_step(jax_rows, key), by_step(eager_rows, key)
        steps = sorted(set(ours) & set(reference))
        if steps:
            out[key] = max(abs(ours[s] - reference[s]) / max(abs(reference[s]), 1e-12) for s in steps)
            out[f"{key}_steps"] = len(steps)
    last = max(by_step(jax_rows, "loss"))
    out["last_loss"] = {"jax": by_step(jax_rows, "loss")[last], "eager": by_step(eager_rows, "loss")[last]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--keep", help="keep the runs (metrics, logs) in this directory")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="jax_path_") as tmp:
        tmp = Path(args.keep) if args.keep else Path(tmp)
        for name in args.cases.split(","):
            recipe, processes, overrides = CASES[name]
            seconds = {}
            for mode, flags in MODES.items():
                seconds[mode] = train(tmp / f"{name}_{mode}", recipe, processes, overrides + flags, steps=args.steps,
                                      cache=tmp / "cache")
            result = compare(rows(tmp / f"{name}_jax"), rows(tmp / f"{name}_eager"))
            result.update(processes=processes, steps=args.steps, seconds=seconds,
                          fingerprints=[line.split("fingerprint ")[1].split()[0]
                                        for line in (tmp / f"{name}_jax" / "log.txt").read_text().splitlines()
                                        if line.startswith("jax: program")])
            results[name] = result
            print(f"{name} ({processes} devices, {args.steps} steps): loss max rel {result['loss']:.2e}, grad_norm "
                  f"{result['grad_norm']:.2e}, val_loss {result.get('val_loss', float('nan')):.2e}; last loss "
                  f"{result['last_loss']['jax']:.6f} (eager {result['last_loss']['eager']:.6f}); wall jax "
                  f"{seconds['jax']:.0f} s, eager {seconds['eager']:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
