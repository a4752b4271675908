"""bf16 mixed precision against fp32: loss curves of the debug models on the embedded corpus.

Both runs build the same model from the same seed (fp32 master weights, docs/mixed_precision.md),
read the same batches and take the same learning-rate schedule; one computes in fp32, the other in
bf16. Printed per model: the final smoothed loss of each (mean of the last `--window` steps), their
relative difference (the issue's criterion: within 1%) and the largest per-step difference.

    python bench/mixed_precision.py                         # llama3 and qwen3 debug, 300 steps
    python bench/mixed_precision.py --models qwen3 --steps 100 --batch 4 --seq 64

On a CPU without bf16 instructions (no avx512_bf16/amx_bf16) bf16 matmuls are emulated, ~100x
slower than fp32: the script prints why and stops, unless --emulated-bf16 asks for the run anyway
(same numbers, hours at the default shapes; use small ones). It builds the models from the
framework's functions, not the trainer, so it never makes the trainer accept bf16 on such a CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from titan_tpu.data.loader import TokenLoader
from titan_tpu.data.shards import prepare_dataset
from titan_tpu.device_cpu import cpu_bf16_support
from titan_tpu.files import default_cache_dir
from titan_tpu.models.common.transformer import Transformer
from titan_tpu.models.registry import get_model_args
from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
from titan_tpu.train.optim import AdamW, lr_at
from titan_tpu.train.step import EagerStep


def build(name: str, seq: int, dtype: torch.dtype):
    args = get_model_args(name, "debug")
    args.max_seq_len = seq
    with torch.device("meta"):
        model = Transformer(args)
    model = materialize_and_init(model, None, mode="none", mp=MixedPrecision(param_dtype=dtype),
                                 device=torch.device("cpu"), seed=0)
    step = EagerStep(model, AdamW(dict(model.named_parameters()), beta2=0.95, weight_decay=0.1), max_norm=1.0)
    return args, step


def compare(name: str, opts) -> dict:
    args, fp32 = build(name, opts.seq, torch.float32)
    _, bf16 = build(name, opts.seq, torch.bfloat16)
    _, shards = prepare_dataset(source=None, max_bytes=opts.max_bytes, tokenizer_path=None,
                                vocab_size=args.vocab_size, cache_dir=default_cache_dir())
    loader = TokenLoader(shards, split="train", seq_len=opts.seq, batch_size=opts.batch, seed=0, val_fraction=0.01)
    losses = {"fp32": [], "bf16": []}
    seconds = {"fp32": 0.0, "bf16": 0.0}
    for step in range(1, opts.steps + 1):
        batch = loader.next_batch()
        lr = lr_at(step, base_lr=opts.lr, warmup_steps=10, total_steps=opts.steps, decay_ratio=0.8,
                   decay_type="cosine", min_lr_ratio=0.1)
        for key, step_fn in (("fp32", fp32), ("bf16", bf16)):
            start = time.perf_counter()
            losses[key].append(step_fn([batch], lr).loss)
            seconds[key] += time.perf_counter() - start
        if step % 50 == 0:
            print(f"  {name} step {step}: fp32 {losses['fp32'][-1]:.4f}  bf16 {losses['bf16'][-1]:.4f}", flush=True)
    final = {k: statistics.fmean(v[-opts.window:]) for k, v in losses.items()}
    per_step = [abs(b - f) / f for f, b in zip(losses["fp32"], losses["bf16"])]
    return {"final": final, "rel": abs(final["bf16"] - final["fp32"]) / final["fp32"], "max_step": max(per_step),
            "first": (losses["fp32"][0], losses["bf16"][0]), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama3,qwen3")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=8e-4)
    parser.add_argument("--window", type=int, default=20, help="steps averaged into the final smoothed loss")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-bytes", type=int, default=4_000_000)
    parser.add_argument("--emulated-bf16", action="store_true",
                        help="run even where the CPU has no bf16 instructions (emulated: ~100x slower)")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    supported, why = cpu_bf16_support()
    if not supported and not opts.emulated_bf16:
        print(f"skipped: this CPU has no bf16 matmul instructions ({why}); bf16 runs ~100x slower than fp32 "
              "here. --emulated-bf16 runs it anyway (small shapes)")
        return
    note = "" if supported else " (bf16 emulated: this CPU has no bf16 instructions)"
    print(f"bf16 mixed precision vs fp32{note}: batch {opts.batch} x seq {opts.seq}, {opts.steps} steps, lr {opts.lr} "
          f"(warmup 10, cosine to 0.1), {opts.threads} threads; final = mean loss of the last {opts.window} steps")
    for name in opts.models.split(","):
        r = compare(name, opts)
        print(f"{name}/debug: final fp32 {r['final']['fp32']:.4f}  bf16 {r['final']['bf16']:.4f}  "
              f"relative difference {100 * r['rel']:.2f}% (criterion < 1%); largest per-step difference "
              f"{100 * r['max_step']:.2f}%; first-step losses {r['first'][0]:.4f} / {r['first'][1]:.4f}; "
              f"seconds fp32 {r['seconds']['fp32']:.0f}, bf16 {r['seconds']['bf16']:.0f}")


if __name__ == "__main__":
    main()
