"""Bucketed SimpleFSDP collectives (parallel/buckets.py) and the collective schedule of captured
steps (graph/passes.py, schedule_collectives).

One pair of gloo ranks runs every variant (eager and graph, unrolled and scanned, per-parameter
and bucketed, with and without prefetch) for 20 steps and reports losses, final parameters,
collective counts and the captured node order; the test compares them here. Bucketing and
reordering change no arithmetic (each gradient element is still the sum of the same two per-rank
values), so bucketed runs must equal per-parameter runs bitwise.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist_utils import run_distributed
from titan_tpu.models.common.transformer import Transformer, TransformerArgs

STEPS, BATCH, SEQ = 20, 2, 16
AG, RS, WAIT = ("_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.reduce_scatter_tensor.default",
                "_c10d_functional.wait_tensor.default")


def tiny_args() -> TransformerArgs:
    # vocab 101 and ffn 72 / 2 ranks: the embedding and output shard unevenly (101 rows = 51 + 50),
    # which exercises the padding of shards in the flat buffer.
    return TransformerArgs(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=101, ffn_hidden_dim=72,
                           max_seq_len=SEQ)


class _CountCollectives(TorchDispatchMode):
    """Counts the collective ops an eager step dispatches (CommDebugMode's module tracking fails on
    the scanned model's functional blocks, so count at the dispatch level)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in (AG, RS):
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _run_variant(*, mode: str, scan: bool, bucket_mb: float, prefetch: int | None) -> dict:
    from titan_tpu.graph.compile import GraphStep
    from titan_tpu.parallel.mesh import ParallelDims
    from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
    from titan_tpu.train.optim import AdamW
    from titan_tpu.train.step import EagerStep

    dims = ParallelDims(world_size=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(tiny_args(), scan_layers=scan)
    model = materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                 seed=0, bucket_mb=bucket_mb)
    optimizer = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    # Two batches in turn: the loss must fall within 20 steps (the runs train, not just agree).
    tokens = torch.randint(0, tiny_args().vocab_size, (2, BATCH, SEQ + 1), generator=g)
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens] * (STEPS // 2)
    out = {"buckets": len(model._simple_fsdp_bucket_list)}
    if mode == "eager":
        step = EagerStep(model, optimizer, max_norm=1.0, dp_size=2)
        with _CountCollectives() as counter:
            first = step([batches[0]], 1e-2)
        out["counts"] = dict(counter.counts)
    else:
        step = GraphStep(model, optimizer, max_norm=1.0, example_batch=batches[0], backend="eager", dp_size=2,
                         prefetch=prefetch)
        nodes = list(step.captured.graph_module.graph.nodes)
        out["counts"] = {k: v for k, v in step.captured.collective_counts().items() if k in (AG, RS)}
        # The schedule: (kind, index) of collectives, their waits and the matmuls, in node order.
        out["order"] = [("wait:" + str(n.args[0].target) if str(n.target) == WAIT else str(n.target))
                        for n in nodes if str(n.target) in (AG, RS, WAIT, "aten.mm.default")]
        first = step([batches[0]], 1e-2)
    losses = [first.loss] + [step([b], 1e-2).loss for b in batches[1:]]
    out["losses"] = losses
    out["params"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    return out


VARIANTS = {
    # name: (mode, scan, bucket_mb, prefetch)
    "eager": ("eager", False, 0, None),
    "eager_bucketed": ("eager", False, 256, None),
    "eager_scan": ("eager", True, 0, None),
    "eager_scan_bucketed": ("eager", True, 256, None),
    "graph": ("graph", False, 0, None),
    "graph_bucketed_prefetch": ("graph", False, 256, 1),
    "graph_scan": ("graph", True, 0, None),
    "graph_scan_bucketed_prefetch": ("graph", True, 256, 1),
}


def _all_variants() -> dict:
    return {name: _run_variant(mode=m, scan=s, bucket_mb=b, prefetch=p) for name, (m, s, b, p) in VARIANTS.items()}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_variants, world_size=2, timeout_s=600)


@pytest.mark.multiprocess
def test_bucketed_and_reordered_runs_equal_per_parameter_runs_bitwise(runs):
    for rank in range(2):
        r = runs[rank]
        for plain, bucketed in [("eager", "eager_bucketed"), ("eager_scan", "eager_scan_bucketed"),
                                ("graph", "graph_bucketed_prefetch"), ("graph_scan", "graph_scan_bucketed_prefetch")]:
            assert r[plain]["losses"] == r[bucketed]["losses"], (rank, plain, bucketed)
            for name, p in r[plain]["params"].items():
                assert torch.equal(p, r[bucketed]["params"][name]), (rank, plain, bucketed, name)
        assert r["eager"]["losses"][-1] < r["eager"]["losses"][0] - 0.1  # it trains


@pytest.mark.multiprocess
def test_one_all_gather_and_one_reduce_scatter_per_bucket(runs):
    r = runs[0]
    n_params = len(r["eager"]["params"])
    # Unrolled: embedding, 3 blocks, final norm, output; scanned: the stack is one piece.
    assert r["eager_bucketed"]["buckets"] == 6 and r["eager_scan_bucketed"]["buckets"] == 4
    for name in ("eager", "graph"):
        assert r[name]["counts"] == {AG: n_params, RS: n_params}, (name, r[name]["counts"])
    for name in ("eager_scan", "graph_scan"):
        assert r[name]["counts"] == {AG: 12, RS: 12}, (name, r[name]["counts"])  # 3 + 9 stacked weights
    for name in ("eager_bucketed", "graph_bucketed_prefetch", "eager_scan_bucketed", "graph_scan_bucketed_prefetch"):
        buckets = r[name]["buckets"]
        assert r[name]["counts"] == {AG: buckets, RS: buckets}, (name, r[name]["counts"])


@pytest.mark.multiprocess
def test_prefetch_issues_the_next_all_gather_before_the_current_compute(runs):
    order = runs[0]["graph_bucketed_prefetch"]["order"]
    gathers = [i for i, op in enumerate(order) if op == AG]
    gather_waits = [i for i, op in enumerate(order) if op == "wait:" + AG]
    # Every all-gather after the first is issued before the previous bucket's wait has any
    # matmul after it: between wait i-1 and gather i there is no compute.
    for i in range(1, len(gathers)):
        between = order[gather_waits[i - 1] + 1:gathers[i]] if gathers[i] > gather_waits[i - 1] else []
        assert "aten.mm.default" not in between, (i, between)
        assert gathers[i] < gather_waits[i]
    # Per-parameter trace order, for contrast: each gather is waited for before the next is issued.
    plain = runs[0]["graph"]["order"]
    plain_gathers = [i for i, op in enumerate(plain) if op == AG]
    assert all(plain[i + 1] == "wait:" + AG for i in plain_gathers)
    # Reduce-scatters: all issued before the first of their waits (they run behind the backward).
    scatters = [i for i, op in enumerate(order) if op == RS]
    scatter_waits = [i for i, op in enumerate(order) if op == "wait:" + RS]
    assert max(scatters) < min(scatter_waits)
    # The unrolled model's matmuls: with one bucket per block the forward's matmuls of block i
    # run while the gather of block i + 1 is in flight.
    mm_between = [sum(op == "aten.mm.default" for op in order[gathers[i]:gather_waits[i]])
                  for i in range(len(gathers))]
    assert sum(1 for n in mm_between if n > 0) >= 3, mm_between
