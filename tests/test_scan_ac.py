"""Scan-over-layers and activation checkpointing: same numbers as the plain unrolled model.

A tiny fp32 model (dim 64, 3 layers, vocab 256, seq 32) learning a deterministic token rule, so
the loss moves and a wrong gradient would show. Each variant (scanned or not, AC none / full /
selective, eager or graph mode, one process or two fully_shard ranks) trains 20 steps and must
match the unrolled eager run to 1e-6 in loss.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from test_train import LLAMA_DEBUG, train_losses
from torch.utils._python_dispatch import TorchDispatchMode

from titan_tpu.config import build_config
from titan_tpu.graph import GraphStep, capture_train_step
from titan_tpu.loops import assemble
from titan_tpu.models.common.transformer import Transformer, TransformerArgs
from titan_tpu.models.registry import build_model
from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep

SEED = 0
# 10 steps: a wrong gradient shows in the first step's loss; the reference still drops its loss by
# more than 1.0 (5.94 -> 4.84, which the reference fixture checks); 20 only cost time.
STEPS = 10
BATCH, SEQ = 4, 32
TOL = 1e-6


def tiny_args() -> TransformerArgs:
    return TransformerArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128,
                           max_seq_len=SEQ)


def batches(rows: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """x[t+1] = (5 x[t] + 1) mod V from random starts: learnable in a few steps."""
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 256, (STEPS, rows), generator=g)]
    for _ in range(SEQ):
        tokens.append((5 * tokens[-1] + 1) % 256)
    tokens = torch.stack(tokens, dim=-1)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def lr(step: int) -> float:
    return 3e-3 * min(1.0, step / 3)


def make_step(model, *, mode: str, example, dp_size: int = 1):
    opt = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    if mode == "eager":
        return EagerStep(model, opt, max_norm=1.0, dp_size=dp_size), opt
    return GraphStep(model, opt, max_norm=1.0, example_batch=example, backend=mode, dp_size=dp_size), opt


def train(*, scan: bool, ac: str, mode: str = "eager") -> list[float]:
    model = build_model(tiny_args(), seed=SEED, scan_layers=scan, ac_mode=ac)
    data = batches()
    step, _ = make_step(model, mode=mode, example=data[0])
    return [step([b], lr(i + 1)).loss for i, b in enumerate(data)]


@pytest.fixture(scope="module")
def reference() -> list[float]:
    losses = train(scan=False, ac="none")
    assert losses[-1] < losses[0] - 1.0  # it learns: a wrong gradient would show
    return losses


def assert_close_losses(losses, reference, tol=TOL):
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    assert diff <= tol, f"max loss difference {diff:.2e}"


# ---------------------------------------------------------------------------------------------
# Layout: stacked weights, per-layer checkpoints
# ---------------------------------------------------------------------------------------------


def test_scanned_model_has_stacked_weights_and_the_unrolled_state_dict():
    unrolled = build_model(tiny_args(), seed=SEED)
    scanned = build_model(tiny_args(), seed=SEED, scan_layers=True)
    assert scanned.layers.attention.wq.weight.shape == (3, 64, 64)
    assert len(list(scanned.parameters())) == 3 + 9  # embeddings, norm, output + 9 stacked
    expected, got = unrolled.state_dict(), scanned.state_dict()
    assert list(got) == list(expected)  # same names, same order
    for name, value in expected.items():
        assert torch.equal(got[name], value), name  # same init, layer by layer
    # Per-layer entries are views: loading into them in place (as DCP does) fills the stack.
    got["layers.1.feed_forward.w2.weight"].fill_(7.0)
    assert (scanned.layers.feed_forward.w2.weight[1] == 7.0).all()
    # Checkpoints load across layouts.
    unrolled.load_state_dict(scanned.state_dict())
    assert (unrolled.layers["1"].feed_forward.w2.weight == 7.0).all()
    fresh = build_model(tiny_args(), seed=SEED + 1, scan_layers=True)
    fresh.load_state_dict(unrolled.state_dict())
    torch.testing.assert_close(fresh.layers.feed_forward.w2.weight, scanned.layers.feed_forward.w2.weight,
                               rtol=0, atol=0)


def test_stacked_norm_weights_get_no_weight_decay():
    scanned = build_model(tiny_args(), seed=SEED, scan_layers=True)
    opt = AdamW(dict(scanned.named_parameters()), layer_stacked=scanned.stacked_parameter_names())
    unrolled = build_model(tiny_args(), seed=SEED)
    expected = AdamW(dict(unrolled.named_parameters())).decay
    assert opt.decay["layers.attention_norm.weight"] is False
    assert opt.decay["layers.attention.wq.weight"] is True
    # Stacked names expand to one entry per layer, each with its unrolled twin's decay.
    flags = {n: torch.full((3,) if n in scanned.stacked_parameter_names() else (), float(d))
             for n, d in opt.decay.items()}
    per_layer = scanned.to_per_layer(flags)
    assert {n: bool(v) for n, v in per_layer.items()} == expected


# ---------------------------------------------------------------------------------------------
# Numerics, one process
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scan, ac", [(True, "none"), (False, "full"), (False, "selective"),
                                      (True, "full"), (True, "selective")])
def test_eager_variants_match_unrolled(reference, scan, ac):
    assert_close_losses(train(scan=scan, ac=ac), reference)


@pytest.mark.parametrize("scan, ac", [(False, "none"), (True, "none"), (False, "full"), (False, "selective"),
                                      (True, "full"), (True, "selective")])
def test_graph_variants_match_unrolled_eager(reference, scan, ac):
    assert_close_losses(train(scan=scan, ac=ac, mode="aot_eager"), reference)


def test_scanned_graph_compiles_with_inductor(reference):
    # Inductor lowers scan to a while loop; full AC inside the body on top.
    assert_close_losses(train(scan=True, ac="full", mode="inductor"), reference)


def test_eager_checkpointing_keeps_fewer_activations():
    """Bytes autograd saves for the backward during one forward: full << selective < none."""
    saved = {}
    for ac in ("none", "selective", "full"):
        model = build_model(tiny_args(), seed=SEED, ac_mode=ac)
        total = [0]

        def pack(t, total=total):
            total[0] += t.numel() * t.element_size() if not isinstance(t, torch.nn.Parameter) else 0
            return t

        inputs, _ = batches()[0]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(inputs).sum().backward()
        saved[ac] = total[0]
    # Under checkpointing, the checkpointed block's own saves happen during the recompute in the
    # backward (also counted above, but freed block by block); what matters here is the forward.
    assert saved["full"] < saved["none"] and saved["selective"] < saved["none"], saved


class _CreatedShapes(TorchDispatchMode):
    """The shape of every tensor an op returns in new memory (not in one of its inputs' storages:
    views, detach and in-place results are not counted) while active."""

    def __init__(self):
        super().__init__()
        self.shapes = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.shapes[tuple(t.shape)] += 1
        return out


@pytest.mark.parametrize("ac", ["none", "full"])
def test_eager_scan_backward_builds_one_full_size_gradient_per_stacked_weight(ac):
    """The eager loop unbinds the stack once per forward: the backward stacks the L layer
    gradients of each stacked weight once. Indexing w[i] per layer built a zero-filled [L, ...]
    tensor per layer and weight (select_backward) and summed them: 5 full-size tensors per weight
    at 3 layers instead of 1 (3 select_backward zeros, 2 sums)."""
    model = build_model(tiny_args(), seed=SEED, scan_layers=True, ac_mode=ac)
    stacked = Counter(tuple(p.shape) for n, p in model.named_parameters() if n in model.stacked_parameter_names())
    inputs, _ = batches()[0]
    loss = model(inputs).sum()
    with _CreatedShapes() as created:
        loss.backward()
    assert {shape: created.shapes[shape] for shape in stacked} == dict(stacked)


def test_graph_checkpointing_recomputes_in_the_backward():
    counts = {}
    for ac in ("none", "selective", "full"):
        model = build_model(tiny_args(), seed=SEED, ac_mode=ac)
        opt = AdamW(dict(model.named_parameters()))
        captured = capture_train_step(model, max_norm=1.0, adamw_hparams=opt.hparams,
                                      decay=opt.decay, example_batch=batches()[0])
        counts[ac] = (captured.recomputed_node_count(), captured.op_counts()["aten.mm.default"])
        assert "recomputed in the backward" in captured.summary()
    assert counts["none"][0] == 0
    assert counts["selective"][0] > 0 and counts["selective"][1] == counts["none"][1]  # matmuls are kept
    assert counts["full"][0] > counts["selective"][0] and counts["full"][1] > counts["none"][1]  # and redone


def test_bad_activation_checkpoint_mode_is_refused():
    with pytest.raises(ValueError, match="activation_checkpoint.mode must be one of none, full, selective"):
        Transformer(tiny_args(), ac_mode="everything")


# ---------------------------------------------------------------------------------------------
# Two fully_shard ranks
# ---------------------------------------------------------------------------------------------


def _sharded_worker(scan: bool, ac: str, mode: str) -> dict:
    dims = ParallelDims(dp_shard=2, world_size=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    rank, size = dp_rank_and_size(mesh)
    with torch.device("meta"):
        model = Transformer(tiny_args(), scan_layers=scan, ac_mode=ac)
    model = materialize_and_init(model, mesh, mode="fully_shard", mp=MixedPrecision(), device=torch.device("cpu"),
                                 seed=SEED)
    rows = [(x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]) for x, y in batches(2 * BATCH)]
    step, opt = make_step(model, mode=mode, example=rows[0], dp_size=size)
    losses = [step([b], lr(i + 1)).loss for i, b in enumerate(rows)]
    full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in model.state_dict().items()}
    out = {"losses": losses, "state": full}
    if mode != "eager":
        out["collectives"] = dict(step.captured.collective_counts())
    return out


SHARDED_VARIANTS = [(True, "none"), (True, "full"), (False, "selective")]
# The unrolled eager run without checkpointing (the reference), then each variant in both modes.
SHARDED_CASES = [(False, "none", "eager")] + [(scan, ac, mode) for mode in ("eager", "aot_eager")
                                              for scan, ac in SHARDED_VARIANTS]


def _sharded_cases_worker(cases: list[tuple]) -> list[dict]:
    """One spawn for every run (starting ranks costs more than a tiny model's steps)."""
    return [_sharded_worker(*case) for case in cases]


@functools.cache
def sharded_runs() -> dict[tuple, list[dict]]:
    """Per case of SHARDED_CASES, each rank's result: one 2-rank spawn shared by both modes."""
    results = run_distributed(_sharded_cases_worker, world_size=2, args=(SHARDED_CASES,), timeout_s=600)
    return {case: [rank_results[i] for rank_results in results] for i, case in enumerate(SHARDED_CASES)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_two_rank_fully_shard_scan_and_checkpointing_match_unrolled(mode):
    reference = sharded_runs()[SHARDED_CASES[0]]
    for scan, ac in SHARDED_VARIANTS:
        results = sharded_runs()[(scan, ac, mode)]
        for rank in range(2):
            assert_close_losses(results[rank]["losses"], reference[rank]["losses"])
        # Stacked weights are sharded per layer: the gathered state is the unrolled one.
        for name, value in reference[0]["state"].items():
            torch.testing.assert_close(results[0]["state"][name], value, atol=1e-5, rtol=0)
        if mode != "eager":
            collectives = results[0]["collectives"]
            n_gathers = collectives["_c10d_functional.all_gather_into_tensor.default"]
            n_scatters = collectives["_c10d_functional.reduce_scatter_tensor.default"]
            # One gather per bucket (parallel/buckets.py, the default bucket_mb) in the captured
            # graph's own nodes, re-sharded after the forward (the default, parallel/reshard.py):
            # scanned, the embeddings, norm and output (each layer is gathered and its gradient
            # reduce-scattered inside the scan bodies, which these counts do not include);
            # unrolled, 3 blocks + those 3, and blocks 0 and 1 gathered again in the backward
            # (selective checkpointing recomputes their gathers; the last block stays gathered).
            assert (n_gathers, n_scatters) == ((3, 3) if scan else (6 + 2, 6)), collectives


# ---------------------------------------------------------------------------------------------
# Trainer: scanned and unrolled runs resume from each other's checkpoints
# ---------------------------------------------------------------------------------------------


def test_scanned_run_resumes_an_unrolled_checkpoint(tmp_path, train_overrides):
    overrides = train_overrides(training__steps=8, training__deterministic="true", checkpoint__interval=4,
                                training__batch_size=2, training__seq_len=64, validation__enabled="false")
    assemble(build_config(LLAMA_DEBUG, overrides)).train()
    straight = train_losses(tmp_path / "run")
    # The same run, unrolled for 4 steps and checkpointed, then continued with scanned layers and
    # full activation checkpointing (and the other way round).
    for first, second in [([], ["--model.scan_layers", "true", "--activation_checkpoint.mode", "full"]),
                          (["--model.scan_layers", "true"], [])]:
        run_dir = tmp_path / f"split{len(first)}"
        base = overrides + ["--output_dir", str(run_dir)]
        trainer = assemble(build_config(LLAMA_DEBUG, base + first))
        for _ in range(4):
            trainer.train_step()
        trainer.saving.save_checkpoint()
        del trainer
        resumed = assemble(build_config(LLAMA_DEBUG, base + second))
        resumed.train()
        got = train_losses(run_dir)
        assert sorted(got) == list(range(5, 9))
        for step in range(5, 9):
            assert abs(got[step] - straight[step]) <= TOL, (first, second, step, got[step], straight[step])
