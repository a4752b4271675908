"""Bucketed SimpleFSDP collectives (parallel/buckets.py), re-sharding after the forward
(parallel/reshard.py) and the collective schedule of captured steps (graph/passes.py,
schedule_collectives).

One pair of gloo ranks runs every variant (eager and graph, unrolled and scanned, per-parameter
and bucketed, with and without prefetch, gathered weights kept or re-sharded, with and without
full activation checkpointing) for 4 steps and reports losses, final parameters, collective
counts, the captured node order and what the forward leaves alive; the test compares them here.
Bucketing, reordering and re-gathering change no arithmetic (each gradient element is still the
sum of the same two per-rank values; a re-gathered weight is the same copy), so all of them must
equal the per-parameter runs bitwise.
"""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist_utils import run_distributed
from titan_tpu.models.common.transformer import Transformer, TransformerArgs

# 4 steps: the runs are compared bitwise at every step, so a difference shows in the first one, and
# the eager run's loss still falls (5.02 -> 4.68; it needs 0.1). Tracing the 13 captured variants is
# most of this file's time; each step cut takes 23 steps off the spawn.
STEPS, BATCH, SEQ = 4, 2, 16
AG, RS, WAIT = ("_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.reduce_scatter_tensor.default",
                "_c10d_functional.wait_tensor.default")


def tiny_args() -> TransformerArgs:
    # vocab 101 / 2 ranks: the embedding and output are sharded on their model dim instead of 51 + 50
    # rows (simple_fsdp._even_blocks), which exercises the flat buffer's shards on another dim than the first.
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


class _LiveStorages(TorchDispatchMode):
    """Records the storage of every plain tensor an op returns; `alive_bytes()` sums those still
    referenced (freed storages expire at once: CPython frees by reference count, so the figure is
    deterministic)."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if type(t) in (torch.Tensor, torch.nn.Parameter):
                storage = t.untyped_storage()
                self.storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive_bytes(self) -> int:
        return sum(n for ref, n in self.storages.values() if not ref.expired())


_VIEW_OR_COPY = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.slice.Tensor",
                 "aten.select.int", "aten.narrow.default", "aten.permute.default", "aten.t.default",
                 "aten.transpose.int", "aten.clone.default", "aten.alias.default", "aten.expand.default",
                 "aten.unsqueeze.default", "aten.squeeze.dim", "aten.as_strided.default", "aten._to_copy.default",
                 "aten.contiguous.default", WAIT}


def _backward_reads_of_forward_gathers(gm) -> list[int]:
    """Per forward all-gather (bucket order): how many backward nodes read its gathered weights
    (its output or a view or copy of it), i.e. keep them alive from the forward to the backward."""
    from titan_tpu.graph.passes import _in_backward

    out = []
    for gather in [n for n in gm.graph.nodes if str(n.target) == AG and not _in_backward(n)]:
        todo, weights = [gather], set()
        while todo:
            n = todo.pop()
            if n in weights or _in_backward(n):
                continue
            weights.add(n)
            todo += [u for u in n.users if str(u.target) in _VIEW_OR_COPY or "getitem" in str(u.target)]
        out.append(sum(1 for w in weights for u in w.users if _in_backward(u)))
    return out


def _scan_body_collectives(gm) -> list[tuple[int, int]]:
    """(all-gathers, reduce-scatters) in each scan body subgraph of the captured step."""
    out = []
    for name, sub in gm.named_modules():
        if sub is gm or not hasattr(sub, "graph"):
            continue
        targets = [str(n.target) for n in sub.graph.nodes]
        out.append((targets.count(AG), targets.count(RS)))
    return sorted(out)


def _run_variant(*, mode: str, scan: bool, bucket_mb: float, prefetch: int | None, reshard: bool = True,
                 ac: str = "none", per_tensor: bool = False) -> dict:
    from titan_tpu.graph.compile import GraphStep
    from titan_tpu.parallel.mesh import ParallelDims
    from titan_tpu.parallel.simple_fsdp import MixedPrecision, fsdp_state, materialize_and_init
    from titan_tpu.train.optim import AdamW
    from titan_tpu.train.step import EagerStep

    dims = ParallelDims(world_size=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(tiny_args(), scan_layers=scan, ac_mode=ac)
    model = materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(per_tensor=per_tensor),
                                 device=torch.device("cpu"),
                                 seed=0, bucket_mb=bucket_mb, reshard_after_forward=reshard)
    optimizer = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    # Two batches in turn: the loss must fall within STEPS steps (the runs train, not just agree).
    tokens = torch.randint(0, tiny_args().vocab_size, (2, BATCH, SEQ + 1), generator=g)
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens] * (STEPS // 2)
    out = {"buckets": len(fsdp_state(model).all_buckets)}
    if mode == "eager":
        step = EagerStep(model, optimizer, max_norm=1.0, dp_size=2)
    else:
        step = GraphStep(model, optimizer, max_norm=1.0, example_batch=batches[0], backend="eager", dp_size=2,
                         prefetch=prefetch)
        gm = step.captured.graph_module
        nodes = list(gm.graph.nodes)
        out["captured"] = {k: v for k, v in step.captured.collective_counts().items() if k in (AG, RS)}
        # The schedule: (kind, index) of collectives, their waits and the matmuls, in node order.
        out["order"] = [("wait:" + str(n.args[0].target) if str(n.target) == WAIT else str(n.target))
                        for n in nodes if str(n.target) in (AG, RS, WAIT, "aten.mm.default")]
        out["backward_reads_of_forward_gathers"] = _backward_reads_of_forward_gathers(gm)
        out["scan_bodies"] = _scan_body_collectives(gm)
    if mode == "eager":
        # Collectives one step runs, counted at dispatch.
        with _CountCollectives() as counter:
            first = step([batches[0]], 1e-2)
        out["counts"] = dict(counter.counts)
    else:
        # From the captured graph: its own nodes plus, once per layer, a scan body's.
        counts = Counter(out["captured"])
        for gathers, scatters in out["scan_bodies"]:
            counts[AG] += gathers * tiny_args().n_layers
            counts[RS] += scatters * tiny_args().n_layers
        out["counts"] = {k: v for k, v in counts.items() if v}
        first = step([batches[0]], 1e-2)
    losses = [first.loss] + [step([b], 1e-2).loss for b in batches[1:]]
    out["losses"] = losses
    out["params"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    if mode == "eager":
        # What a forward leaves alive for the backward (activations and, unless re-sharded, the
        # gathered block weights); then the backward, which must still work from the tokens.
        # Only what the forward itself keeps alive counts, so two other holders are ruled out:
        # - garbage held by reference cycles, freed whenever the cyclic collector happens to run:
        #   collect first, and not during the forward;
        # - the gloo worker thread: a finished collective's work object keeps its input and output
        #   alive until that thread gets the CPU back and drops it. Under load that came after the
        #   count once in 900 stress runs: 19,584 bytes extra, exactly the output bucket's shard
        #   (6,528) and gathered buffer (13,056), the forward's last all-gather. The group's one
        #   worker thread (parallel/gloo.py) drops each work before it runs the next, so a
        #   barrier on the group returns only after the forward's works are released.
        gc.collect()
        gc.disable()
        try:
            with _LiveStorages() as live:
                loss = model(batches[0][0], batches[0][1]).ce_sum
        finally:
            gc.enable()
        gc.collect()
        dist.barrier(group=mesh.get_group())
        out["alive_after_forward"] = live.alive_bytes()
        loss.backward()
        model.zero_grad(set_to_none=True)
    return out


VARIANTS = {
    # name: (mode, scan, bucket_mb, prefetch, reshard_after_forward, activation checkpointing[, per_tensor])
    "eager": ("eager", False, 0, None, True, "none"),
    "eager_bucketed": ("eager", False, 256, None, True, "none"),
    "eager_bucketed_kept": ("eager", False, 256, None, False, "none"),
    "eager_scan": ("eager", True, 0, None, True, "none"),
    "eager_scan_bucketed": ("eager", True, 256, None, True, "none"),
    "eager_scan_bucketed_kept": ("eager", True, 256, None, False, "none"),
    "eager_full": ("eager", False, 256, None, True, "full"),
    "eager_full_kept": ("eager", False, 256, None, False, "full"),
    "eager_scan_full": ("eager", True, 256, None, True, "full"),
    "eager_scan_full_kept": ("eager", True, 256, None, False, "full"),
    "graph": ("graph", False, 0, None, True, "none"),
    "graph_bucketed_prefetch": ("graph", False, 256, 1, True, "none"),
    "graph_bucketed_prefetch_kept": ("graph", False, 256, 1, False, "none"),
    "graph_full": ("graph", False, 256, 1, True, "full"),
    "graph_full_kept": ("graph", False, 256, 1, False, "full"),
    "graph_scan": ("graph", True, 0, None, True, "none"),
    "graph_scan_bucketed_prefetch": ("graph", True, 256, 1, True, "none"),
    "graph_scan_bucketed_prefetch_kept": ("graph", True, 256, 1, False, "none"),
    "graph_scan_full": ("graph", True, 256, 1, True, "full"),
    "graph_scan_full_kept": ("graph", True, 256, 1, False, "full"),
    # The TPU's form (MixedPrecision.per_tensor): a bucket gathered one collective per tensor.
    "eager_bucketed_per_tensor": ("eager", False, 256, None, True, "none", True),
    "graph_scan_bucketed_prefetch_per_tensor": ("graph", True, 256, 1, True, "none", True),
    "graph_scan_full_per_tensor": ("graph", True, 256, 1, True, "full", True),
}
# Re-sharded runs against the same run keeping the gathered weights: bitwise equal.
RESHARD_PAIRS = [(name, name.replace("_kept", "")) for name in VARIANTS if name.endswith("_kept")]
# Per-tensor collectives against the flat bucket: the same sums in the same order, bitwise equal.
PER_TENSOR_PAIRS = [(name.removesuffix("_per_tensor"), name) for name in VARIANTS if name.endswith("_per_tensor")]


def _all_variants() -> dict:
    return {name: _run_variant(mode=m, scan=s, bucket_mb=b, prefetch=p, reshard=r, ac=ac, per_tensor=t)
            for name, (m, s, b, p, r, ac, t) in ((n, (*v, False)[:7]) for n, v in VARIANTS.items())}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_variants, world_size=2, timeout_s=600)


@pytest.mark.multiprocess
def test_bucketed_and_reordered_runs_equal_per_parameter_runs_bitwise(runs):
    for rank in range(2):
        r = runs[rank]
        for plain, bucketed in [("eager", "eager_bucketed"), ("eager_scan", "eager_scan_bucketed"),
                                ("graph", "graph_bucketed_prefetch"), ("graph_scan", "graph_scan_bucketed_prefetch"),
                                *RESHARD_PAIRS, *PER_TENSOR_PAIRS]:
            assert r[plain]["losses"] == r[bucketed]["losses"], (rank, plain, bucketed)
            for name, p in r[plain]["params"].items():
                assert torch.equal(p, r[bucketed]["params"][name]), (rank, plain, bucketed, name)
        assert r["eager"]["losses"][-1] < r["eager"]["losses"][0] - 0.1  # it trains


@pytest.mark.multiprocess
def test_one_all_gather_and_one_reduce_scatter_per_bucket(runs):
    r = runs[0]
    n_params = len(r["eager"]["params"])
    # Unrolled: embedding, 3 blocks, final norm, output; scanned: the stack is one more piece,
    # unless re-sharded (then it is gathered per layer inside the loop, not as a bucket).
    assert r["eager_bucketed"]["buckets"] == r["eager_bucketed_kept"]["buckets"] == 6
    assert r["eager_scan_bucketed_kept"]["buckets"] == 4 and r["eager_scan_bucketed"]["buckets"] == 3
    # Per parameter (bucket_mb 0): re-sharding acts on buckets only, so one gather per parameter.
    for name in ("eager", "graph"):
        assert r[name]["counts"] == {AG: n_params, RS: n_params}, (name, r[name]["counts"])
    for name in ("eager_scan", "graph_scan"):
        assert r[name]["counts"] == {AG: 12, RS: 12}, (name, r[name]["counts"])  # 3 + 9 stacked weights
    # Gathered weights kept: one all-gather and one reduce-scatter per bucket.
    for name in ("eager_bucketed_kept", "graph_bucketed_prefetch_kept", "eager_full_kept", "graph_full_kept",
                 "eager_scan_bucketed_kept", "graph_scan_bucketed_prefetch_kept", "eager_scan_full_kept",
                 "graph_scan_full_kept"):
        buckets = r[name]["buckets"]
        assert r[name]["counts"] == {AG: buckets, RS: buckets}, (name, r[name]["counts"])
    # Re-sharded, unrolled: blocks 0 and 1 are gathered again in the backward (the last block,
    # whose backward comes first, and the embedding, norm and output stay gathered): 6 + 2; with
    # activation checkpointing the recomputation does those 2 gathers. The captured graph holds
    # the same counts (the re-gathers are graph nodes).
    for name in ("eager_bucketed", "graph_bucketed_prefetch", "eager_full", "graph_full"):
        assert r[name]["counts"] == {AG: 6 + 2, RS: 6}, (name, r[name]["counts"])
    for name in ("graph_bucketed_prefetch", "graph_full"):
        assert r[name]["captured"] == {AG: 6 + 2, RS: 6}, (name, r[name]["captured"])
    # Re-sharded, scanned: 3 pieces, each of the 3 layers gathered in the forward and again in the
    # backward (eager: saved-tensor tokens; graph with full checkpointing: the backward scan body
    # recomputes the layer), and each layer's gradient reduce-scattered on its own: 3 + 3.
    for name in ("eager_scan_bucketed", "eager_scan_full", "graph_scan_full"):
        assert r[name]["counts"] == {AG: 3 + 3 + 3, RS: 3 + 3}, (name, r[name]["counts"])
    assert r["graph_scan_full"]["scan_bodies"] == [(1, 0), (1, 1)]  # forward body; backward body
    # Graph mode, scanned, no checkpointing: scan's own autograd partitioner saves each layer's
    # gathered weights (stacked) for its backward and never recomputes a collective, so there is
    # no re-gather (docs/decisions.md); the gradients are still reduce-scattered per layer.
    assert r["graph_scan_bucketed_prefetch"]["counts"] == {AG: 3 + 3, RS: 3 + 3}
    assert r["graph_scan_bucketed_prefetch"]["scan_bodies"] == [(0, 1), (1, 0)]
    # Per tensor: a collective for each of a bucket's tensors where the flat form has one (12 =
    # 3 + 9 stacked weights gathered per layer; 6 + 2 re-gathered unrolled pieces' tensors).
    assert r["eager_bucketed_per_tensor"]["counts"] == {AG: n_params + 2 * 9, RS: n_params}
    assert r["graph_scan_bucketed_prefetch_per_tensor"]["counts"] == {AG: 3 + 9 * 3, RS: 3 + 9 * 3}
    assert r["graph_scan_full_per_tensor"]["scan_bodies"] == [(9, 0), (9, 9)]


@pytest.mark.multiprocess
def test_resharded_forward_leaves_no_gathered_block_weights_alive(runs):
    r = runs[0]
    with torch.device("meta"):
        model = Transformer(tiny_args())
    block_bytes = sum(p.numel() for p in model.layers["0"].parameters()) * 4  # fp32 compute
    # Eager: bytes a forward leaves alive, kept minus re-sharded: exactly the gathered weights of
    # the re-sharded blocks (2 unrolled; all 3 layers scanned), with or without checkpointing.
    for kept, resharded, blocks in [("eager_bucketed_kept", "eager_bucketed", 2), ("eager_full_kept", "eager_full", 2),
                                    ("eager_scan_bucketed_kept", "eager_scan_bucketed", 3),
                                    ("eager_scan_full_kept", "eager_scan_full", 3)]:
        saved = r[kept]["alive_after_forward"] - r[resharded]["alive_after_forward"]
        assert saved == blocks * block_bytes, (kept, saved, blocks * block_bytes)
    # Graph: which forward gathers (embedding, blocks 0-2, norm, output) the backward reads.
    # Re-sharded, none of blocks 0 and 1: the backward reads their re-gathers instead.
    for kept, resharded in [("graph_bucketed_prefetch_kept", "graph_bucketed_prefetch"),
                            ("graph_full_kept", "graph_full")]:
        assert all(n > 0 for n in r[kept]["backward_reads_of_forward_gathers"][1:4]), r[kept]
        reads = r[resharded]["backward_reads_of_forward_gathers"]
        assert reads[1] == reads[2] == 0 and reads[3] > 0, (resharded, reads)


@pytest.mark.multiprocess
def test_prefetch_issues_the_next_all_gather_before_the_current_compute(runs):
    order = runs[0]["graph_bucketed_prefetch_kept"]["order"]
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
    # The output projection's gather (the last) does not wait for the final norm's, which has no
    # matmul behind it: it travels while the last block computes.
    assert mm_between[-1] > 0, mm_between


@pytest.mark.multiprocess
def test_backward_re_gathers_are_prefetched_within_the_backward(runs):
    order = runs[0]["graph_bucketed_prefetch"]["order"]
    gathers = [i for i, op in enumerate(order) if op == AG]
    waits = [i for i, op in enumerate(order) if op == "wait:" + AG]
    forward, backward = gathers[:6], gathers[6:]
    assert len(backward) == 2 and max(forward) < min(backward)
    # The first re-gather (block 1) stays where the backward first needs it, after the output's
    # and the last block's backward (matmuls in between), not hoisted into the forward ...
    assert "aten.mm.default" in order[waits[5] + 1:backward[0]]
    # ... and the second (block 0) is issued right after the first's wait, so it travels while
    # block 1's backward computes.
    assert backward[1] == waits[6] + 1 and backward[1] < waits[7]


@pytest.mark.parametrize("world, layout", [
    (1, [((2, 3), 1, (2, 3)), ((4,), 0, (4,))]),  # one rank: every reshape is a view
    (2, [((2, 3), 0, (4, 3))]),  # the buffer's only tensor, split on dim 0: rank-major is the layout
])
def test_gathered_tensors_never_alias_the_gathered_buffer(world, layout):
    """_CopyOut's outputs are fresh tensors where a reshape would have returned a view: a view of
    the buffer broke the scanned MoE step with ep = world = 2 in graph mode (scan's
    functionalisation rebuilt the saved weight as an out-of-bounds strided view)."""
    from titan_tpu.parallel.buckets import _CopyOut

    numel = sum(torch.Size(local).numel() for local, _, _ in layout)
    by_rank = torch.arange(world * numel, dtype=torch.float32).view(world, numel).requires_grad_()
    outs = _CopyOut.apply(by_rank, layout)
    offset = 0
    for out, (local, dim, full) in zip(outs, layout):
        n = torch.Size(local).numel()
        expected = torch.cat(list(by_rank.detach()[:, offset:offset + n].view(world, *local)), dim=dim)
        offset += n
        assert torch.equal(out, expected)
        assert not out._is_view() and out.untyped_storage().data_ptr() != by_rank.untyped_storage().data_ptr()
