"""Peak memory of training steps, each contender in a fresh process.

Each contender builds the model and AdamW, builds its step (for graph mode: capture + compile),
then resets the process's peak-RSS counter and runs a few steps. Reported: the resident memory
before the steps, the peak during them, and the peak's excess over the resident memory (what the
step itself needs: activations, gradients, temporaries).

Two comparisons:

* default: eager vs graph mode (target: graph within +10% of eager);
* ``--activation-checkpoint``: activation checkpointing none / selective / full, in eager and
  graph mode (``--scan`` for scanned layers), on a shape where activations dominate; the step
  memory of each mode is printed as a ratio to none's (target: full <= 0.5).

    python bench/step_memory.py                              # llama3 debug, batch 8 x seq 256
    python bench/step_memory.py --backend aot_eager --seq 512
    python bench/step_memory.py --activation-checkpoint --seq 1024 [--scan]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from titan_tpu.device import get_backend
from titan_tpu.models.registry import build_model, get_model_args
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep


def run_one(contender: str, args) -> dict:
    mode, ac_mode = contender.split(":")  # e.g. "graph:full"
    torch.set_num_threads(args.threads)
    backend = get_backend("cpu")
    model_args = get_model_args(args.model, args.flavor)
    model = build_model(model_args, seed=0, scan_layers=args.scan, ac_mode=ac_mode)
    optimizer = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq + 1), generator=g)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    if mode == "eager":
        step = EagerStep(model, optimizer, max_norm=1.0)
    else:
        from titan_tpu.graph.compile import GraphStep

        step = GraphStep(model, optimizer, max_norm=1.0, example_batch=batch, backend=args.backend)
    step([batch], 1e-4)  # first step: allocator warm-up, lazily created state
    before = backend.memory_stats()["memory_gb"]
    backend.reset_peak_memory()
    for _ in range(args.steps):
        step([batch], 1e-4)
    peak = backend.memory_stats()["max_memory_gb"]
    return {"resident_gb": before, "peak_gb": peak, "step_gb": peak - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backend", default="inductor", choices=["aot_eager", "inductor"])
    parser.add_argument("--activation-checkpoint", action="store_true",
                        help="compare activation checkpointing none / selective / full")
    parser.add_argument("--scan", action="store_true", help="scanned layers (model.scan_layers)")
    parser.add_argument("--modes", default="eager,graph", help="with --activation-checkpoint: eager, graph or both")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.only:  # a child process: one contender, result as a JSON line
        print(json.dumps(run_one(args.only, args)))
        return

    if args.activation_checkpoint:
        contenders = [f"{m}:{ac}" for m in args.modes.split(",") for ac in ("none", "selective", "full")]
    else:
        contenders = ["eager:none", "graph:none"]
    results = {}
    for contender in contenders:
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", contender],
                               capture_output=True, text=True)
        if child.returncode != 0:
            sys.exit(f"{contender} failed:\n{child.stderr[-3000:]}")
        results[contender] = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"{args.model}/{args.flavor}, batch {args.batch} x seq {args.seq}, fp32, graph backend {args.backend}"
          + (", scanned layers" if args.scan else ""))
    for contender, r in results.items():
        print(f"  {contender:16s} resident {r['resident_gb']:.3f} GB, peak during steps {r['peak_gb']:.3f} GB, "
              f"step needs {r['step_gb']:.3f} GB")
    if args.activation_checkpoint:
        for mode in args.modes.split(","):
            none = results[f"{mode}:none"]["step_gb"]
            ratios = ", ".join(f"{ac} {results[f'{mode}:{ac}']['step_gb'] / none:.3f}x" for ac in ("selective", "full"))
            print(f"{mode}: step memory vs no checkpointing: {ratios}")
    else:
        e, g = results["eager:none"], results["graph:none"]
        print(f"peak graph / eager: {g['peak_gb'] / e['peak_gb']:.3f}x; "
              f"step memory graph / eager: {g['step_gb'] / e['step_gb']:.3f}x")


if __name__ == "__main__":
    main()
