"""Steady-state speed of scanned layers in graph mode: unrolled vs scanned, and scanned without
each of our changes, interleaved in one process: with `F.linear`'s own backward inside the body
(before models/common/scan.py `_LinearsSaveTheirWeight`: the forward scan saved a transposed copy of
every stacked weight), with the backward scan over flipped stacks (before graph/reverse_scan.py),
with the body's matmuls reading copied transposes (before graph/scan_body_transposes.py), and with
matmul products copied into their stacks (before graph/reverse_scan.py wrote them in place), and
with the loop bodies' fallback copies (before reverse_scan.drop_body_copies).

Each layout is captured and compiled once (Inductor, warm caches allowed: compile time is
bench/compile_time.py's business), then single steps of each alternate for --rounds rounds
(order reversed every other round) and each ratio is the median of the per-round ratios, so
machine noise hits all alike. Losses of the first two steps are printed: all must agree.

    python bench/scan_steady_state.py                       # 16 layers, batch 2 x seq 128
    python bench/scan_steady_state.py --depth 6 --batch 8 --seq 256 --threads 1
    python bench/scan_steady_state.py --threads 1 --variants "scanned, transposed copies;scanned"
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

from titan_tpu.models.common import scan as scan_module


def _passthrough(self, func, types, args=(), kwargs=None):
    return func(*args, **(kwargs or {}))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3", choices=["llama3", "qwen3", "qwen3_moe"])
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--variants", default=";".join(VARIANTS),
                        help="';'-separated subset of: " + ", ".join(VARIANTS) + " (unrolled is always run)")
    return parser


@contextlib.contextmanager
def _without(change: str):
    """Build a scanned step as it was before one of our changes: "linear" runs `F.linear`'s own
    backward in the body (scan.py `_LinearsSaveTheirWeight` off: the mode acts while the body is
    traced only), "reverse" compiles without graph/reverse_scan.py (flipped stacks), "transposes"
    without graph/scan_body_transposes.py (the body's matmuls read copied transposes), "in place"
    without reverse_scan.write_matmuls_into_stacks (products copied into their stacks), "copies"
    without reverse_scan.drop_body_copies (detach_copy / select_copy kernels in the bodies)."""
    from torch._inductor import config as inductor_config

    from titan_tpu.graph import compile as graph_compile, reverse_scan, scan_body_transposes

    mode, passes = scan_module._LinearsSaveTheirWeight, graph_compile._backend_passes
    ours, drop = mode.__torch_function__, scan_body_transposes.drop_transpose_copies
    write, drop_copies = reverse_scan.write_matmuls_into_stacks, reverse_scan.drop_body_copies
    stack = contextlib.ExitStack()
    if change == "linear":
        mode.__torch_function__ = _passthrough
    elif change == "reverse":
        graph_compile._backend_passes = lambda backend: contextlib.nullcontext()
    elif change == "transposes":
        # Inductor's cache keys on the pass's source, not on this patch: compile uncached.
        scan_body_transposes.drop_transpose_copies = lambda gm: 0
        stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    elif change == "in place":
        reverse_scan.write_matmuls_into_stacks = lambda body: 0
        stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    elif change == "copies":
        reverse_scan.drop_body_copies = lambda body: 0
        stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    try:
        yield
    finally:
        stack.close()
        mode.__torch_function__, graph_compile._backend_passes = ours, passes
        scan_body_transposes.drop_transpose_copies = drop
        reverse_scan.write_matmuls_into_stacks, reverse_scan.drop_body_copies = write, drop_copies


# name -> (scanned?, the change left out)
VARIANTS = {"unrolled": (False, None), "scanned, F.linear backward": (True, "linear"),
            "scanned, flipped stacks": (True, "reverse"), "scanned, transposed copies": (True, "transposes"),
            "scanned, products copied": (True, "in place"), "scanned, fallback copies": (True, "copies"),
            "scanned": (True, None)}


def main() -> None:
    from compile_time import build_step, interleaved_seconds  # bench/ is on the path when this runs as a script

    args = build_parser().parse_args()
    args.backend = "inductor"
    torch.set_num_threads(args.threads)

    chosen = ["unrolled", *(v for v in VARIANTS if v != "unrolled" and v in args.variants.split(";"))]
    steps = {}
    for name in chosen:
        scanned, change = VARIANTS[name]
        with _without(change):
            steps[name] = build_step(args.depth, scanned, args)
    for name, (step, batch) in steps.items():
        print(f"{name}: losses {[step([batch], 1e-4).loss for _ in range(2)]}", flush=True)
    seconds = interleaved_seconds(steps, args.rounds)
    tokens = args.batch * args.seq
    print(f"{args.model} debug block x {args.depth}, batch {args.batch} x seq {args.seq}, fp32, inductor, "
          f"{args.threads} threads, {args.rounds} interleaved rounds")
    for name, s in seconds.items():
        ratio = statistics.median(u / x for x, u in zip(s, seconds["unrolled"]))
        print(f"  {name:28s} {tokens / statistics.median(s):10,.0f} tok/s  {ratio:.3f}x unrolled")


if __name__ == "__main__":
    main()
