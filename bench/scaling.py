"""Weak scaling of SimpleFSDP on this machine: 1 rank vs 2 fully_shard ranks, same per-rank batch.

Each rank runs one thread (the ranks share the machine's cores, as a user would launch them).
A round runs the 1-rank job and then the 2-rank job (alternating which goes first from round to
round), each in fresh spawned processes (parallel/spawn.py, gloo, the same rendezvous as
torchrun). A job times every step after warm-up and reports the median; per-rank retention of a
round is the 2-rank job's median per-rank tokens/s over the 1-rank job's, and the headline is
the median over rounds. Collective counts per step come from CommDebugMode (eager) or the
captured graph's nodes (graph mode).

    python bench/scaling.py                                  # eager and graph, the trainer's defaults
    python bench/scaling.py --modes eager --bucket-mb 0 256 --rounds 3
    python bench/scaling.py --modes graph --prefetch 0 1 --profile   # + rank 0's time split and profile
    python bench/scaling.py --modes graph --profile /tmp/prof        # + its chrome traces in /tmp/prof
    python bench/scaling.py --scan                           # scanned layers
    python bench/scaling.py --bucket-mb 256 --prefetch 1 --reshard true false   # re-sharding on vs off
    python bench/scaling.py --bucket-mb 256 --prefetch 1 --reshard auto true --rounds 3   # the defaults vs re-sharding

--reshard auto is the trainer's default: decided by the planner as the trainer decides it
(planner.with_reshard_resolved), printed with the planner's predicted step time for re-sharding on
and off.

Prints one line per (mode, options) with 1-rank and 2-rank tokens/s per rank, per-round
retentions and their median, the measured 2-rank step time beside the planner's for that setting
(and its 1-rank step), the collectives per step, and the CPU time per step of 1 rank and of the
slowest of 2 (every thread of the process: gloo's worker too). On 2 cores each of 2 ranks has at
most one core, so the CPU ratio bounds the retention a quiet machine can show; other load on the
machine stretches wall times far more than CPU times, so read the ratio when the machine is shared.
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
    times, cpu, main_cpu = [], [], []
    for i in range(warmup + steps):
        start, start_cpu, start_main = time.perf_counter(), time.process_time(), time.thread_time()
        loss = step([data], 1e-4).loss
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        main_cpu.append(time.thread_time() - start_main)
    out["step_s"] = statistics.median(times[warmup:])
    # CPU time of the step, the process's (every thread: gloo's workers too) and the main thread's:
    # other load stretches the wall time, much less the CPU time.
    out["cpu_s"], out["main_cpu_s"] = statistics.median(cpu[warmup:]), statistics.median(main_cpu[warmup:])
    out["loss"] = loss  # the same in every variant of a world size: bucketing and order change no value
    if mode == "eager" and dp_size > 1:
        with CommDebugMode() as comm:
            step([data], 1e-4)
        out["collectives"] = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    if profile:  # every rank runs the profiled steps (they hold collectives); rank 0 reports
        import os
        import tempfile

        from torch.profiler import ProfilerActivity, profile as torch_profile, record_function

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED_STEPS):
                with record_function(STEP_EVENT):
                    step([data], 1e-4)
        if dist.get_rank() == 0:
            out["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            trace = os.path.join(profile, f"scaling_{mode}_{dp_size}rank_rank0.json") if profile != "-" else \
                tempfile.mktemp(suffix=".json")
            prof.export_chrome_trace(trace)
            out["split"] = time_split(trace)
            if profile == "-":
                os.remove(trace)
    return out


PROFILED_STEPS = 3
STEP_EVENT = "scaling_bench_step"


def time_split(trace_path: str) -> dict:
    """Where rank 0's profiled steps spent their wall time (ms per step), from its chrome trace:
    waits (collectives' wait_tensor: communication the schedule did not hide, plus waiting for
    the other rank), issue (the calls that start collectives), compute (every other profiled op,
    compiled programs included), python (time inside the step that no profiled op covers)."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e["name"] == STEP_EVENT]
    thread = (steps[0]["pid"], steps[0]["tid"])
    events = [e for e in events if (e["pid"], e["tid"]) == thread and e["name"] != STEP_EVENT]
    totals = dict(step=0.0, waits=0.0, issue=0.0, busy=0.0)
    for s in steps:
        lo, hi = s["ts"], s["ts"] + s["dur"]
        inside = sorted((e for e in events if lo <= e["ts"] and e["ts"] + e["dur"] <= hi), key=lambda e: e["ts"])
        totals["step"] += s["dur"]
        end = lo
        for e in inside:  # the union of the intervals the profiled ops cover
            start, stop = max(e["ts"], end), e["ts"] + e["dur"]
            if stop > start:
                totals["busy"] += stop - start
                end = stop
            if "wait_tensor" in e["name"]:
                totals["waits"] += e["dur"]
            elif e["name"].startswith("c10d::"):
                totals["issue"] += e["dur"]
    per_step = {k: v / 1000 / len(steps) for k, v in totals.items()}
    return dict(step_ms=per_step["step"], compute_ms=per_step["busy"] - per_step["waits"] - per_step["issue"],
                waits_ms=per_step["waits"], issue_ms=per_step["issue"],
                python_ms=per_step["step"] - per_step["busy"])


def _planner(a, mode: str) -> tuple[str, dict[str, float]]:
    """What --parallelism.reshard_after_forward auto runs as (the planner decides, as the trainer
    does), and the planner's step time in ms for this bench's model, batch and mode: on 2 ranks
    with re-sharding "true" and "false", and on 1 rank ("1")."""
    from pathlib import Path

    from titan_tpu.config import build_config
    from titan_tpu.plan.planner import plan_config, with_reshard_resolved

    def config(ranks: int, value: str):
        overrides = ["--training.device", "cpu", "--training.mode", mode, "--training.batch_size", str(a.batch),
                     "--training.seq_len", str(a.seq), "--parallelism.dp_shard", str(ranks),
                     "--parallelism.bucket_mb", str(a.bucket_mb[-1]), "--parallelism.reshard_after_forward", value,
                     "--model.scan_layers", str(a.scan).lower()]
        return build_config(Path(__file__).parent.parent / "configs" / "llama3_debug.toml", overrides)

    resolved = str(with_reshard_resolved(config(2, "auto"), measure=False).parallelism.reshard_after_forward).lower()
    plans = {value: plan_config(config(2, value), measure=False) for value in ("true", "false")}
    predicted = "; ".join(f"re-shard {v}: {p.time['step_s'] * 1000:.0f} ms/step ({p.time['collectives_s'] * 1000:.0f} "
                          f"ms collectives), peak {p.peak_bytes / 1e9:.2f} GB" for v, p in plans.items())
    flavor = " the debug flavor's layers," if a.layers else ""
    print(f"{mode}: --parallelism.reshard_after_forward auto -> {resolved} (planner,{flavor} 2 ranks of this CPU, "
          f"bucket_mb {a.bucket_mb[-1]:g}: {predicted})", flush=True)
    step_ms = {v: p.time["step_s"] * 1000 for v, p in plans.items()}
    step_ms["1"] = plan_config(config(1, "false"), measure=False).time["step_s"] * 1000
    return resolved, step_ms


def run_job(world_size: int, options: dict) -> dict:
    from titan_tpu.parallel.spawn import run_ranks

    results = run_ranks(_job, world_size=world_size, kwargs=options, timeout_s=900)
    return {"step_s": max(r["step_s"] for r in results),  # the step ends when the slowest rank ends
            "cpu_s": max(r["cpu_s"] for r in results), "main_cpu_s": max(r["main_cpu_s"] for r in results),
            "collectives": results[0].get("collectives", {}), "profile": results[0].get("profile"),
            "split": results[0].get("split"),
            "loss": results[0]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["eager", "graph"], choices=["eager", "graph"])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--split", default="collectives", help="--compile.split for graph mode (see docs)")
    parser.add_argument("--bucket-mb", nargs="+", type=float, default=[256.0],
                        help="--parallelism.bucket_mb settings to compare (0: one collective per parameter)")
    parser.add_argument("--prefetch", nargs="+", type=int, default=[1],
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
    parser.add_argument("--profile", nargs="?", const="-", default="",
                        help="profile 3 more steps of the first round's jobs: rank 0's time split (compute, "
                             "collective waits, issue, Python) on 1 and 2 ranks and, on 2 ranks, torch.profiler's "
                             "table; with a folder, rank 0's chrome traces are written there")
    parser.add_argument("--json", help="write the results here")
    a = parser.parse_args()

    tokens = a.batch * a.seq
    rows = []
    for mode in a.modes:
        auto, planned_ms = _planner(a, mode)
        reshards = {r: (auto if r == "auto" else r) == "true" for r in a.reshard}
        variants = [(b, p, reshards[r]) for b, p, r in
                    itertools.product(a.bucket_mb, a.prefetch if mode == "graph" else [-1], a.reshard)]
        base = dict(mode=mode, backend=a.backend, split=a.split, batch=a.batch, seq=a.seq, steps=a.steps,
                    warmup=a.warmup, layers=a.layers, scan=a.scan)
        single, multi = [], {v: [] for v in variants}
        cpu_single, cpu_multi = [], {v: [] for v in variants}  # (process, main thread) CPU s per step
        counts, profiles, losses, splits = {}, {}, {}, {}
        for r in range(a.rounds):
            order = [("1", None)] + [("2", v) for v in variants]
            if r % 2:
                order.reverse()
            for world, v in order:
                opts = dict(base, bucket_mb=v[0] if v else 0.0, prefetch=v[1] if v else 0, reshard=v[2] if v else True,
                            profile=a.profile if r == 0 else "")
                res = run_job(int(world), opts)
                if res.get("split"):
                    splits[v] = res["split"]
                if world == "1":
                    single.append(res["step_s"])
                    cpu_single.append((res["cpu_s"], res["main_cpu_s"]))
                else:
                    multi[v].append(res["step_s"])
                    cpu_multi[v].append((res["cpu_s"], res["main_cpu_s"]))
                    counts[v] = res["collectives"]
                    losses[v] = res["loss"]
                    if res["profile"]:
                        profiles[v] = res["profile"]
        for v in variants:
            retention = [s / m for s, m in zip(single, multi[v])]  # same tokens per rank: time ratio
            row = dict(mode=mode, bucket_mb=v[0], prefetch=v[1], reshard_after_forward=v[2], scan=a.scan,
                       tokens_s_1=tokens / statistics.median(single), tokens_s_2=tokens / statistics.median(multi[v]),
                       retention_rounds=[round(x, 3) for x in retention], retention=statistics.median(retention),
                       collectives=counts[v], final_loss=losses[v], step_ms_2=statistics.median(multi[v]) * 1000,
                       planner_step_ms_2=planned_ms[str(v[2]).lower()], planner_step_ms_1=planned_ms["1"])
            # Two ranks on two cores: each rank has one core at most, so its step takes at least its
            # CPU time (gloo's worker included); the CPU ratio bounds the retention a quiet machine
            # can show, and the rest of the gap is waiting.
            cpu_1, cpu_2 = (statistics.median(c[0] for c in cs) for cs in (cpu_single, cpu_multi[v]))
            main_2 = statistics.median(c[1] for c in cpu_multi[v])
            row.update(cpu_ms_1=cpu_1 * 1000, cpu_ms_2=cpu_2 * 1000, main_cpu_ms_2=main_2 * 1000,
                       cpu_retention=cpu_1 / cpu_2)
            rows.append(row)
            extra = (f", prefetch {v[1]}" if mode == "graph" else "") + f", reshard {str(v[2]).lower()}"
            print(f"{mode:5s} bucket_mb {v[0]:g}{extra}{' scan' if a.scan else ''}: 1 rank {row['tokens_s_1']:,.0f} "
                  f"tok/s, 2 ranks {row['tokens_s_2']:,.0f} tok/s per rank; retention {row['retention']:.3f} "
                  f"(rounds {row['retention_rounds']}); 2-rank step {row['step_ms_2']:,.0f} ms, planner "
                  f"{row['planner_step_ms_2']:,.0f} ms (1 rank on all cores {row['planner_step_ms_1']:,.0f} ms); "
                  f"collectives/step {counts[v]}; final loss {losses[v]:.6f}", flush=True)
            print(f"  CPU per step: 1 rank {cpu_1 * 1000:,.0f} ms, 2 ranks {cpu_2 * 1000:,.0f} ms (main thread "
                  f"{main_2 * 1000:,.0f} ms, other threads {(cpu_2 - main_2) * 1000:,.0f} ms); CPU ratio "
                  f"{row['cpu_retention']:.3f} (the retention's bound on 2 cores)", flush=True)
            for world, key in (("1 rank ", None), ("2 ranks", v)):
                if key in splits:
                    row[f"split_{world[0]}"] = splits[key]
                    print(f"  time split, rank 0, ms per step ({world}): " +
                          ", ".join(f"{k.removesuffix('_ms')} {x:.1f}" for k, x in splits[key].items()))
            if v in profiles:
                print(profiles[v])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
