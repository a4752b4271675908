"""Peak memory of the output projection + cross-entropy: chunked vs materialised logits.

Each contender runs in a fresh process: it builds its inputs, resets the process's peak-RSS
counter and runs the loss forward and backward. Reported: the peak's excess over the memory
resident before (what the loss itself needs: logits or chunks, their gradients, the weight
gradient). Target: chunked <= 1/8 of materialised at Qwen3's vocabulary.

    python bench/loss_memory.py                      # V 151,936, hidden 1024, 8 x 1024 tokens, fp32
    python bench/loss_memory.py --step               # ... and the whole training step of qwen3/0.6B
                                                     #     at batch 1 x seq 1024, loss reference vs chunked
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from titan_tpu.device import get_backend
from titan_tpu.kernels import LOSS, KernelConfig
from titan_tpu.kernels.loss import auto_chunk_tokens


def loss_only(impl: str, args) -> dict:
    backend = get_backend("cpu")
    g = torch.Generator().manual_seed(0)
    n = args.batch * args.seq
    h = torch.randn(n, args.hidden, generator=g).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden**-0.5).requires_grad_()
    labels = torch.randint(0, args.vocab, (n,), generator=g)
    before = backend.memory_stats()["memory_gb"]
    backend.reset_peak_memory()
    start = time.perf_counter()
    loss = LOSS.impls[impl].fn(h, w, labels, chunk_tokens=args.chunk_tokens)
    loss.backward()
    seconds = time.perf_counter() - start
    peak = backend.memory_stats()["max_memory_gb"]
    return {"peak_gb": peak, "loss_gb": peak - before, "seconds": seconds, "loss": loss.item()}


def whole_step(impl: str, args) -> dict:
    from titan_tpu.models.registry import build_model, get_model_args
    from titan_tpu.train.optim import AdamW
    from titan_tpu.train.step import EagerStep

    backend = get_backend("cpu")
    model_args = get_model_args("qwen3", "0.6B")
    model_args.max_seq_len = args.step_seq
    model = build_model(model_args, seed=0, kernels=KernelConfig(loss=impl, loss_chunk_tokens=args.chunk_tokens))
    step = EagerStep(model, AdamW(dict(model.named_parameters())), max_norm=1.0)
    tokens = torch.randint(0, model_args.vocab_size, (1, args.step_seq + 1), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    step([batch], 1e-5)  # optimizer state and allocator warm-up
    before = backend.memory_stats()["memory_gb"]
    backend.reset_peak_memory()
    loss = step([batch], 1e-5).loss
    peak = backend.memory_stats()["max_memory_gb"]
    return {"peak_gb": peak, "step_gb": peak - before, "resident_gb": before, "loss": loss}


def child(contender: str) -> dict:
    done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", contender], capture_output=True,
                          text=True)
    if done.returncode != 0:
        sys.exit(f"{contender} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--chunk-tokens", type=int, default=0, help="0: the kernel's automatic chunk size")
    parser.add_argument("--step", action="store_true", help="also the whole qwen3/0.6B training step")
    parser.add_argument("--step-seq", type=int, default=1024)
    parser.add_argument("--only", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(2)

    if args.only:  # a child process: one contender, result as a JSON line
        kind, impl = args.only.split(":")
        print(json.dumps(loss_only(impl, args) if kind == "loss" else whole_step(impl, args)))
        return

    n = args.batch * args.seq
    chunk = args.chunk_tokens or auto_chunk_tokens(n, args.vocab)
    print(f"loss forward + backward: {n:,} tokens x vocab {args.vocab:,}, hidden {args.hidden}, fp32 CPU; "
          f"chunk {chunk} tokens (logits alone would be {n * args.vocab * 4 / 1e9:.2f} GB)")
    results = {impl: child(f"loss:{impl}") for impl in ("reference", "chunked")}
    for impl, r in results.items():
        print(f"  {impl:10s} peak over resident {r['loss_gb']:.3f} GB, {r['seconds']:.1f} s, loss {r['loss']:.4f}")
    ratio = results["chunked"]["loss_gb"] / results["reference"]["loss_gb"]
    print(f"chunked / materialised loss memory: {ratio:.3f}x (target <= 0.125)")
    if args.step:
        print(f"whole training step, qwen3/0.6B, batch 1 x seq {args.step_seq}, fp32, eager:")
        steps = {impl: child(f"step:{impl}") for impl in ("reference", "chunked")}
        for impl, r in steps.items():
            print(f"  loss {impl:10s} resident {r['resident_gb']:.2f} GB, peak {r['peak_gb']:.2f} GB, "
                  f"step needs {r['step_gb']:.2f} GB, loss {r['loss']:.4f}")
        chunked, reference = steps["chunked"], steps["reference"]
        print(f"whole-step peak chunked / materialised: {chunked['peak_gb'] / reference['peak_gb']:.3f}x; "
              f"step memory: {chunked['step_gb'] / reference['step_gb']:.3f}x")


if __name__ == "__main__":
    main()
