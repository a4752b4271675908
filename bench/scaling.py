"""Weak scaling of SimpleFSDP on this machine: 1 rank vs 2 fully_shard ranks, same per-rank batch.

Each rank runs one thread (the ranks share the machine's cores, as a user would launch them).
A round runs the 1-rank job and then the 2-rank job (alternating which goes first from round to
round), each in fresh spawned processes (parallel/spawn.py, gloo, the same rendezvous as
torchrun). A job times every step after warm-up and reports the median; per-rank retention of a
round is the 2-rank job's median per-rank tokens/s over the 1-rank job's, and the headline is
the median over rounds. Collective counts per step come from CommDebugMode (eager) or the
captured graph's nodes (graph mode).

    python bench/scaling.py                                  # eager and graph, every bucket setting
    python bench/scaling.py --modes eager --bucket-mb 0 25 --rounds 3
    python bench/scaling.py --modes graph --prefetch 0 1 --profile /tmp/prof   # + torch.profiler trace of rank 0
    python bench/scaling.py --scan                           # scanned layers
    python bench/scaling.py --bucket-mb 256 --prefetch 1 --reshard true false   # re-sharding on vs off
    python bench/scaling.py --bucket-mb 256 --prefetch 1 --reshard auto true --rounds 3   # the defaults vs re-sharding

--reshard auto is the trainer's default: decided by the planner as the trainer decides it
(planner.with_reshard_resolved), printed with the planner's predicted step time and retention for
re-sharding on and off.

Prints one line per (mode, options) with 1-rank and 2-rank tokens/s per rank, per-round
retentions and their median, and the collectives per step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
import torch.distributed as dist


def _job(*, mode: str, backend: str, split: str, batch: int, seq: int, steps: int, warmup: int, layers: int,
         scan: bool, bucket_mb: float, prefetch: int, profile: str, reshard: bool = True) -> dict:
    """One rank's run (called on every rank by run_ranks); returns its step times and counts."""
    from torch.distributed.tensor.debug import CommDebugMode

    from titan_tpu.models.common.transformer import Transformer
    from titan_tpu.models.registry import get_model_args
    from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
    from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
    from titan_tpu.train.optim import AdamW
    from titan_tpu.train.step import EagerStep

    dims = ParallelDims(world_size=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    _, dp_size = dp_rank_and_size(mesh)
    args = get_model_args("llama3", "debug")
    if layers:
        args.n_layers = layers
    with torch.device("meta"):
        model = Transformer(args, scan_layers=scan)
    model = materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                 seed=0, bucket_mb=bucket_mb, reshard_after_forward=reshard)
    optimizer = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=g)
    data = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    out = {}
    if mode == "eager":
        step = EagerStep(model, optimizer, max_norm=1.0, dp_size=dp_size)
    else:
        from titan_tpu.graph.compile import GraphStep

        step = GraphStep(model, optimizer, max_norm=1.0, example_batch=data, backend=backend, dp_size=dp_size,
                         split=split, prefetch=None if prefetch < 0 else prefetch)
        out["collectives"] = {k.removeprefix("_c10d_functional.").removesuffix(".default"): v
                              for k, v in step.captured.collective_counts().items()}
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        loss = step([data], 1e-4).loss
        times.append(time.perf_counter() - start)
    out["step_s"] = statistics.median(times[warmup:])
    out["loss"] = loss  # the same in every variant of a world size: bucketing and order change no value
    if mode == "eager" and dp_size > 1:
        with CommDebugMode() as comm:
            step([data], 1e-4)
        out["collectives"] = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    if profile:  # every rank runs the profiled steps (they hold collectives); rank 0 reports
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step([data], 1e-4)
        if dist.get_rank() == 0:
            out["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            prof.export_chrome_trace(f"/tmp/scaling_{mode}_rank0.json")
    return out


def _planned_reshard(a, mode: str, reshard: str) -> bool:
    """What --parallelism.reshard_after_forward `reshard` runs as (auto: the planner decides, as
    the trainer does), printed with the planner's step time and 1 -> 2 rank retention for
    re-sharding on and off, for this bench's model, batch and mode."""
    from pathlib import Path

    from titan_tpu.config import build_config
    from titan_tpu.plan.planner import plan_config, with_reshard_resolved

    def config(ranks: int, value: str):
        overrides = ["--training.device", "cpu", "--training.mode", mode, "--training.batch_size", str(a.batch),
                     "--training.seq_len", str(a.seq), "--parallelism.dp_shard", str(ranks),
                     "--parallelism.bucket_mb", str(a.bucket_mb[-1]), "--parallelism.reshard_after_forward", value,
                     "--model.scan_layers", str(a.scan).lower()]
        return build_config(Path(__file__).parent.parent / "configs" / "llama3_debug.toml", overrides)

    if reshard != "auto":
        return reshard == "true"
    resolved = with_reshard_resolved(config(2, "auto"), measure=False).parallelism.reshard_after_forward
    plans = {value: plan_config(config(2, value), measure=False) for value in ("true", "false")}
    predicted = "; ".join(f"re-shard {v}: {p.time['step_s'] * 1000:.0f} ms/step ({p.time['collectives_s'] * 1000:.0f} "
                          f"ms collectives), peak {p.peak_bytes / 1e9:.2f} GB" for v, p in plans.items())
    flavor = " the debug flavor's layers," if a.layers else ""
    print(f"{mode}: --parallelism.reshard_after_forward auto -> {resolved} (planner,{flavor} 2 ranks of this CPU, "
          f"bucket_mb {a.bucket_mb[-1]:g}: {predicted})", flush=True)
    return resolved == "true"


def run_job(world_size: int, options: dict) -> dict:
    from titan_tpu.parallel.spawn import run_ranks

    results = run_ranks(_job, world_size=world_size, kwargs=options, timeout_s=900)
    return {"step_s": max(r["step_s"] for r in results),  # the step ends when the slowest rank ends
            "collectives": results[0].get("collectives", {}), "profile": results[0].get("profile"),
            "loss": results[0]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["eager", "graph"], choices=["eager", "graph"])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--split", default="collectives", help="--compile.split for graph mode (see docs)")
    parser.add_argument("--bucket-mb", nargs="+", type=float, default=[0.0, 25.0])
    parser.add_argument("--prefetch", nargs="+", type=int, default=[-1],
                        help="graph mode: all-gather prefetch depths to compare; -1 keeps the trace order")
    parser.add_argument("--reshard", nargs="+", default=["auto"], choices=["auto", "true", "false"],
                        help="--parallelism.reshard_after_forward settings to compare (auto: the default, "
                             "resolved by the planner as the trainer does)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=17, help="timed steps after warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=0, help="override the debug flavor's 6 layers")
    parser.add_argument("--scan", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's table for rank 0")
    parser.add_argument("--json", help="write the results here")
    a = parser.parse_args()

    tokens = a.batch * a.seq
    rows = []
    for mode in a.modes:
        reshards = {r: _planned_reshard(a, mode, r) for r in a.reshard}
        variants = [(b, p, reshards[r]) for b, p, r in
                    itertools.product(a.bucket_mb, a.prefetch if mode == "graph" else [-1], a.reshard)]
        base = dict(mode=mode, backend=a.backend, split=a.split, batch=a.batch, seq=a.seq, steps=a.steps,
                    warmup=a.warmup, layers=a.layers, scan=a.scan)
        single, multi = [], {v: [] for v in variants}
        counts, profiles, losses = {}, {}, {}
        for r in range(a.rounds):
            order = [("1", None)] + [("2", v) for v in variants]
            if r % 2:
                order.reverse()
            for world, v in order:
                opts = dict(base, bucket_mb=v[0] if v else 0.0, prefetch=v[1] if v else 0, reshard=v[2] if v else True,
                            profile=a.profile and r == 0 and world == "2")
                res = run_job(int(world), opts)
                if world == "1":
                    single.append(res["step_s"])
                else:
                    multi[v].append(res["step_s"])
                    counts[v] = res["collectives"]
                    losses[v] = res["loss"]
                    if res["profile"]:
                        profiles[v] = res["profile"]
        for v in variants:
            retention = [s / m for s, m in zip(single, multi[v])]  # same tokens per rank: time ratio
            row = dict(mode=mode, bucket_mb=v[0], prefetch=v[1], reshard_after_forward=v[2], scan=a.scan,
                       tokens_s_1=tokens / statistics.median(single), tokens_s_2=tokens / statistics.median(multi[v]),
                       retention_rounds=[round(x, 3) for x in retention], retention=statistics.median(retention),
                       collectives=counts[v], final_loss=losses[v])
            rows.append(row)
            extra = (f", prefetch {v[1]}" if mode == "graph" else "") + f", reshard {str(v[2]).lower()}"
            print(f"{mode:5s} bucket_mb {v[0]:g}{extra}{' scan' if a.scan else ''}: 1 rank {row['tokens_s_1']:,.0f} "
                  f"tok/s, 2 ranks {row['tokens_s_2']:,.0f} tok/s per rank; retention {row['retention']:.3f} "
                  f"(rounds {row['retention_rounds']}); collectives/step {counts[v]}; final loss {losses[v]:.6f}",
                  flush=True)
            if v in profiles:
                print(profiles[v])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
