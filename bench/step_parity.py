"""Losses and gradient norms of short training runs, recorded to compare two versions of the code bitwise.

A refactor of the step, the objective or the trainer must not change a number. This runs the trainer
itself (data, step, optimizer, metrics row) for a few steps on a matrix of run kinds and writes every
step's loss, grad_norm (and the MoE balancing and multi-token-prediction losses where a model has
them) to JSON; `--compare FILE` runs the matrix again and fails naming the first value that differs
in any bit.

    .venv/bin/python bench/step_parity.py --out before.json            # on the old code
    .venv/bin/python bench/step_parity.py --compare before.json        # on the new code
    .venv/bin/python bench/step_parity.py --plans before_plans.json    # `titan-tpu plan --json` of every recipe

The matrix: eager; graph (Inductor); scanned layers with full activation checkpointing in graph mode
with two micro-batches; a transformers model; DeepSeek-V3 debug (MTP, expert biases); two-rank
dp_shard, tp, cp, and ep (Qwen3-MoE) runs; LoRA; fp8 (emulated on the CPU); DPO (eager, and LoRA's
adapters-off reference in graph mode); GRPO (sampling, rewards, a KL reference); ORPO; two pipeline
stages; the accumulation derived from training.global_batch_tokens on two ranks in graph mode. One intra-op
thread per process, so that every run's reductions take the same order.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TINY_HF = ("hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
           "num_key_value_heads=2,vocab_size=512")

MATRIX: dict[str, tuple[str, int, list[str]]] = {  # name -> (recipe, ranks, overrides)
    "eager": ("llama3_debug", 1, []),
    "graph": ("llama3_debug", 1, ["--training.mode", "graph", "--compile.backend", "inductor"]),
    "scan_ac_accum": ("llama3_debug", 1, ["--training.mode", "graph", "--compile.backend", "aot_eager",
                                          "--model.scan_layers", "true", "--activation_checkpoint.mode", "full",
                                          "--training.grad_accum_steps", "2"]),
    "hf_model": ("llama3_debug", 1, ["--model.name", "hf", "--model.hf_config", "llama",
                                     "--model.hf_overrides", TINY_HF]),
    "deepseek_mtp": ("deepseek_v3_debug", 1, ["--model.mtp_num_layers", "1"]),
    "dp_shard_2": ("llama3_debug", 2, ["--parallelism.dp_shard", "2"]),
    "tp_2": ("llama3_debug", 2, ["--parallelism.tp", "2", "--parallelism.dp_shard", "1"]),
    "cp_2": ("llama3_debug", 2, ["--parallelism.cp", "2", "--parallelism.dp_shard", "1"]),
    "ep_2": ("qwen3_moe_debug", 2, ["--parallelism.ep", "2", "--parallelism.dp_shard", "2"]),
    "lora": ("llama3_debug", 1, ["--lora.enabled", "true"]),
    "fp8": ("llama3_fp8_debug", 1, []),
    "dpo": ("llama3_debug_dpo", 1, ["--training.seq_len", "32"]),
    "dpo_lora_graph": ("llama3_debug_dpo", 1, ["--training.seq_len", "32", "--lora.enabled", "true",
                                               "--training.mode", "graph", "--compile.backend", "aot_eager"]),
    "grpo": ("llama3_debug_grpo", 1, ["--training.seq_len", "24", "--training.batch_size", "2"]),
    "orpo": ("llama3_debug_dpo", 1, ["--training.seq_len", "32", "--training.objective", "orpo"]),
    "pp_2": ("llama3_debug", 2, ["--parallelism.pp", "2", "--parallelism.dp_shard", "1",
                                 "--model.scan_layers", "true"]),
    "global_batch": ("llama3_debug", 2, ["--parallelism.dp_shard", "2", "--training.global_batch_tokens", "512",
                                         "--training.mode", "graph", "--compile.backend", "aot_eager"]),
}

KEYS = ("loss", "grad_norm", "aux_loss", "mtp_loss")


def common(run_dir: Path, cache: Path) -> list[str]:
    values = {"output_dir": run_dir, "data.cache_dir": cache, "data.max_bytes": 400_000, "training.device": "cpu",
              "training.batch_size": 2, "training.seq_len": 64, "training.steps": 3, "metrics.log_freq": 1,
              "metrics.tensorboard": "false", "validation.enabled": "false", "checkpoint.enabled": "false",
              "lr_scheduler.warmup_steps": 1}
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def _train(config: str, overrides: list[str]) -> str:
    from titan_tpu.config import build_config
    from titan_tpu.loops import assemble

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assemble(build_config(config, overrides)).train()
    return printed.getvalue()


def run_case(name: str, work: Path) -> list[dict]:
    recipe, ranks, extra = MATRIX[name]
    run_dir = work / name
    overrides = common(run_dir, work / "cache") + extra
    config = str(ROOT / "configs" / f"{recipe}.toml")
    if ranks == 1:
        _train(config, overrides)
    else:
        from titan_tpu.parallel.spawn import run_ranks

        run_ranks(_train, world_size=ranks, args=(config, overrides), timeout_s=600)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in KEYS if k in r} | {"step": r["step"]} for r in rows if "loss" in r]


def plans() -> dict[str, dict]:
    """`titan-tpu plan --json` of every recipe: on the hardware it names, a CPU recipe on v5p-8 (planning the CPU
    would measure this machine's matmul rate, which differs from run to run)."""
    from titan_tpu.cli import main as cli

    out = {}
    for recipe in sorted((ROOT / "configs").glob("*.toml")):
        argv = ["plan", "--config", str(recipe), "--json"]
        if "device = \"tpu\"" not in recipe.read_text() and "device = \"cuda\"" not in recipe.read_text():
            argv += ["--hardware", "v5p-8", "--training.device", "tpu"]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            try:
                cli(argv)
            except SystemExit:
                pass
        out[recipe.stem] = json.loads(printed.getvalue()) if printed.getvalue().strip().startswith("{") else \
            printed.getvalue()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the values here")
    parser.add_argument("--compare", help="fail unless every value equals this file's, bit for bit")
    parser.add_argument("--only", help="comma-separated case names (default: all)")
    parser.add_argument("--plans", help="write (or, if it exists, compare with) every recipe's plan JSON")
    args = parser.parse_args(argv)
    if args.plans:
        got, path = plans(), Path(args.plans)
        if not path.exists():
            path.write_text(json.dumps(got, indent=1) + "\n")
            return 0
        differ = [name for name, plan in got.items() if plan != json.loads(path.read_text()).get(name)]
        print(f"plans differ: {differ}" if differ else f"plans identical: {len(got)} recipes")
        return 1 if differ else 0
    torch.set_num_threads(1)
    names = args.only.split(",") if args.only else list(MATRIX)
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for name in names:
            results[name] = run_case(name, Path(tmp))
            print(f"{name}: {results[name]}", flush=True)
    return write_or_compare(results, out=args.out, compare=args.compare, same="bitwise equal")


def write_or_compare(results: dict, *, out: str | None, compare: str | None, same: str) -> int:
    """Write `results` to `out` (JSON) and/or compare them with `compare`'s: 1 naming each entry that
    differs, else 0 and `same` with the entries' names (bench/recipe_fingerprints.py shares it)."""
    if out:
        Path(out).write_text(json.dumps(results, indent=1) + "\n")
    if compare:
        expected = json.loads(Path(compare).read_text())
        differ = [f"{name}: {got} != {expected.get(name)}" for name, got in results.items()
                  if got != expected.get(name)]
        if differ:
            print("DIFFERENT:\n" + "\n".join(differ))
            return 1
        print(f"{same}: {', '.join(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
