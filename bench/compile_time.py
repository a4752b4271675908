"""Graph-mode capture + compile time against depth: unrolled layers vs scanned layers.

For each depth (2, 4, 8, 16 layers of the Llama 3 debug block by default) and each layout, a
fresh process builds the model, captures the training step (make_fx) and compiles it (Inductor
by default), with Inductor's on-disk caches disabled so every compile is cold. Prints a table of
capture and compile seconds and each layout's time relative to its own 2-layer time. Target:
scanned at 16 layers <= 1.25x its 2-layer time, while unrolled grows with depth.

With --throughput, also measures steady-state step time of graph+inductor, unrolled vs scanned,
at the deepest depth, alternating single steps of the two in one process (the ratio is the
median of per-round ratios, so machine noise hits both alike).

    python bench/compile_time.py                      # 2,4,8,16 layers, inductor
    python bench/compile_time.py --depths 2,8 --backend aot_eager --throughput
    python bench/compile_time.py --model qwen3_moe --depths 2,16   # the MoE debug block
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from titan_tpu.models.registry import build_model, get_model_args
from titan_tpu.train.optim import AdamW


def build_step(depth: int, scan: bool, args):
    from titan_tpu.graph.compile import GraphStep

    model_args = dataclasses.replace(get_model_args(args.model, "debug"), n_layers=depth, max_seq_len=args.seq)
    model = build_model(model_args, seed=0, scan_layers=scan)
    optimizer = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq + 1), generator=g)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    step = GraphStep(model, optimizer, max_norm=1.0, example_batch=batch, backend=args.backend)
    return step, batch


def compile_one(depth: int, scan: bool, args) -> dict:
    torch.set_num_threads(args.threads)
    step, batch = build_step(depth, scan, args)
    loss = step([batch], 1e-4).loss  # it runs
    return {"capture_s": step.capture_seconds, "compile_s": step.compile_seconds, "loss": loss,
            "nodes": len(step.captured.graph_module.graph.nodes)}


def interleaved_seconds(steps: dict, rounds: int) -> dict[str, list[float]]:
    """{name: (step, batch)} -> {name: seconds of each round's step}: one step of each per round,
    the order reversed every other round, so machine noise hits all alike."""
    seconds = {name: [] for name in steps}
    for r in range(rounds):
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            step, batch = steps[name]
            start = time.perf_counter()
            step([batch], 1e-4)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def throughput(depth: int, args) -> dict:
    torch.set_num_threads(args.threads)
    steps = {name: build_step(depth, name == "scanned", args) for name in ("unrolled", "scanned")}
    for step, batch in steps.values():  # warm-up
        step([batch], 1e-4)
    seconds = interleaved_seconds(steps, args.rounds)
    ratio = statistics.median(s / u for s, u in zip(seconds["scanned"], seconds["unrolled"]))
    tokens = args.batch * args.seq
    return {name: tokens / statistics.median(s) for name, s in seconds.items()} | {"scanned_over_unrolled": 1 / ratio}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3", choices=["llama3", "qwen3", "qwen3_moe"],
                        help="whose debug block to stack")
    parser.add_argument("--depths", default="2,4,8,16")
    parser.add_argument("--backend", default="inductor", choices=["aot_eager", "inductor"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--throughput", action="store_true", help="also compare steady-state tokens/s")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--only", help=argparse.SUPPRESS)  # child: "compile:<depth>:<scan 0|1>" or "throughput:<depth>"
    return parser


def main() -> None:
    args = build_parser().parse_args()

    if args.only:
        kind, depth, *rest = args.only.split(":")
        result = compile_one(int(depth), rest[0] == "1", args) if kind == "compile" else throughput(int(depth), args)
        print(json.dumps(result))
        return

    # Cold compiles: no Inductor FX-graph / autotune caches from earlier runs.
    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")

    def child(only: str) -> dict:
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", only],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.exit(f"{only} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    depths = [int(d) for d in args.depths.split(",")]
    print(f"{args.model} debug block, batch {args.batch} x seq {args.seq}, fp32, backend {args.backend}, "
          f"{args.threads} threads, cold compiles")
    print(f"{'layers':>6} {'layout':>9} {'nodes':>6} {'capture s':>10} {'compile s':>10} {'total s':>8} "
          f"{'vs 2-layer':>10}")
    base = {}
    for depth in depths:
        for layout in ("unrolled", "scanned"):
            r = child(f"compile:{depth}:{int(layout == 'scanned')}")
            total = r["capture_s"] + r["compile_s"]
            base.setdefault(layout, total)
            print(f"{depth:>6} {layout:>9} {r['nodes']:>6} {r['capture_s']:>10.1f} {r['compile_s']:>10.1f} "
                  f"{total:>8.1f} {total / base[layout]:>9.2f}x", flush=True)
    if args.throughput:
        r = child(f"throughput:{depths[-1]}")
        print(f"steady state at {depths[-1]} layers: unrolled {r['unrolled']:,.0f} tok/s, scanned {r['scanned']:,.0f} "
              f"tok/s; scanned / unrolled {r['scanned_over_unrolled']:.3f}x")


if __name__ == "__main__":
    main()
