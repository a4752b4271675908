"""graph/reverse_scan.py: the scanned backward reads its stacks with a reversed index under Inductor,
and the loops' matmuls write their products straight into their stacks.

The pass must remove every flip a scanned step has (torch's scan autograd flips the saved stacks
and the stacked weights in and the gradients out; `_ScanRecomputingLayers` does the same), let
every weight gradient's matmul write into its slice of the gradient stack, and change no number:
the same body runs on the same slices in the same order with the same kernels, so losses and
weights are bitwise those of the flipped, copying form.

Also graph/scan_body_transposes.py, the pass Inductor runs just before it: a scan body's matmuls
read transposed weights as views. Scan's autograd functionalises the body, turning `W.t()` into a
contiguous copy before each matmul; the pass lets the matmul read the view instead. Same values in
a different memory layout: the run is compared with the same step compiled without that pass
(bitwise here). Both passes' tests compare against the same run with both passes, compiled once
(`with_passes`): an Inductor compile of the scanned step is most of what each test costs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_scan_ac import batches, lr, make_step, tiny_args
from torch._inductor import config as inductor_config

from titan_tpu.graph import compile as graph_compile, scan_body_transposes
from titan_tpu.graph.capture import capture_train_step
from titan_tpu.graph.reverse_scan import SCAN_REVERSE, mark_reverse_scans, marked_reverse, reverse_scan_stats
from titan_tpu.graph.scan_body_transposes import scan_body_transpose_stats
from titan_tpu.models.registry import build_model

STEPS = 6


def train_inductor(ac: str) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """Losses, final parameters, and the flips in the captured graph of a scanned Inductor run."""
    model = build_model(tiny_args(), seed=0, scan_layers=True, ac_mode=ac)
    data = batches()[:STEPS]
    with inductor_config.patch(fx_graph_cache=False):  # the pass runs only when Inductor compiles
        step, _ = make_step(model, mode="inductor", example=data[0])
    losses = [step([b], lr(i + 1)).loss for i, b in enumerate(data)]
    flips = sum(n.target is torch.ops.aten.flip.default for n in step.captured.graph_module.graph.nodes)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, flips


@pytest.fixture(scope="module")
def with_passes():
    """`with_passes(ac)`: the scanned Inductor run with both passes (losses, parameters, flips) and
    what each pass counted during its compile; computed once per ac for the tests below. One
    intra-op thread, as `one_thread` (tests/conftest.py): the runs are compared bit for bit."""
    runs = {}

    def run(ac: str) -> dict:
        if ac not in runs:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                before, before_transposes = reverse_scan_stats.copy(), scan_body_transpose_stats.copy()
                losses, params, flips = train_inductor(ac)
                runs[ac] = {"losses": losses, "params": params, "flips": flips, "done": reverse_scan_stats - before,
                            "transposes": scan_body_transpose_stats - before_transposes}
            finally:
                torch.set_num_threads(threads)
        return runs[ac]

    return run


@pytest.mark.parametrize("ac", ["none", "full"])
def test_reversed_backward_scan_removes_every_flip_and_changes_no_bit(ac, with_passes, monkeypatch, one_thread):
    run = with_passes(ac)
    flips, done = run["flips"], run["done"].copy()
    # One backward scan; every flip of the step gone (AC none, llama3-like block: 29 flipped
    # inputs, the saved stacks and stacked weights, and 9 flipped gradient stacks). Both loops
    # lowered by the pass; at least the block's 7 weight gradients written in place.
    in_place, copies = done.pop("matmuls_into_stacks"), done.pop("copies_dropped", 0)
    assert flips > 9 and done == {"scans": 1, "flips_removed": flips, "forward_scans": 1}
    assert in_place >= 7
    # Under scan's own autograd the bodies' fallback copies go: RoPE's cos/sin halves and their
    # gradients (select_copy), the saved attention output and norm statistics (detach_copy).
    assert copies >= 4 or ac == "full"

    monkeypatch.setattr(graph_compile, "_backend_passes", lambda backend: contextlib.nullcontext())
    before = reverse_scan_stats.copy()
    flipped_losses, flipped_params, _ = train_inductor(ac)
    assert reverse_scan_stats - before == {}  # the second run: without the pass
    assert run["losses"] == flipped_losses
    for name, p in run["params"].items():
        assert torch.equal(p, flipped_params[name]), name


# Activation checkpointing none only: with full, the scans are ours (`_ScanRecomputingLayers`), not
# partitioned by scan's autograd, and the pass finds no copied transposes there.
@pytest.mark.parametrize("ac", ["none"])
def test_scan_body_matmuls_read_transposes_in_place_same_numbers(ac, with_passes, monkeypatch, one_thread):
    run = with_passes(ac)
    dropped = run["transposes"]["copies_dropped"]
    # Every dense matmul weight of the block (llama3-like: wq, wk, wv, wo, w1, w2, w3) at least
    # once in the forward body.
    assert dropped >= 7

    monkeypatch.setattr(scan_body_transposes, "drop_transpose_copies", lambda gm: 0)
    before = scan_body_transpose_stats.copy()
    copied_losses, copied_params, _ = train_inductor(ac)
    assert scan_body_transpose_stats - before == {}  # compiled without the pass
    # The matmuls take the transposed operand as a view; on this CPU every number is bitwise the same.
    assert run["losses"] == copied_losses
    for name, p in run["params"].items():
        assert torch.equal(p, copied_params[name]), name


def test_a_body_writing_its_stacks_out_of_order_is_refused():
    """Inductor pairs a loop body's mutated operands with its outputs in first-write order."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from titan_tpu.graph.reverse_scan import _check_write_order

    def body(a, b, x):
        b.copy_(x)
        a.copy_(x)
        return a, b

    gm = make_fx(body)(torch.zeros(2), torch.zeros(2), torch.ones(2))
    with pytest.raises(AssertionError, match="out of order"):
        _check_write_order(gm)
    _check_write_order(make_fx(lambda a, b, x: (a.copy_(x), b.copy_(x)))(torch.zeros(2), torch.zeros(2),
                                                                          torch.ones(2)))


class _ReverseAwareInterpreter(torch.fx.Interpreter):
    """Runs a graph whose scans may be marked to run in reverse (mark_reverse_scans) the way the
    mark means: a marked scan iterates over its stacks last row first and writes each output row
    where its input row was. Torch has no reverse scan, so it runs here as the flips the mark
    replaced: that equality is the contract TorchTPU and the JAX lowering implement."""

    def call_function(self, target, args, kwargs):
        if target is torch.ops.higher_order.scan and marked_reverse(args[0]):
            body, init, xs, additional = args
            out = target(body, init, [x.flip(0) for x in xs], additional)
            return [*out[:len(init)], *(y.flip(0) for y in out[len(init):])]
        return super().call_function(target, args, kwargs)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_tpu_reverse_mark_takes_every_flip_and_keeps_the_step(ac):
    """The TPU form (mark_reverse_scans, applied by graph/compile.py for TorchTPU and by `titan-tpu
    compile`): the backward scan takes the stacks unflipped, no flip is left in the step, the scan
    and every node of its body carry TorchTPU's reverse mark, and run as the mark means the step
    gives the same outputs, bit for bit."""
    model = build_model(tiny_args(), seed=0, scan_layers=True, ac_mode=ac)
    step, _ = make_step(model, mode="eager", example=batches()[0])
    captured = capture_train_step(model, max_norm=1.0, adamw_hparams=step.optimizer.hparams,
                                  decay=step.optimizer.decay, example_batch=batches()[0])
    gm = captured.graph_module
    flips = lambda: sum(n.target is torch.ops.aten.flip.default for n in gm.graph.nodes)  # noqa: E731
    torch.manual_seed(0)  # real, positive values of the example inputs' shapes (token ids 1, every count 1)
    inputs = [0.02 * torch.rand(t.shape, dtype=t.dtype) if t.is_floating_point() else torch.ones(t.shape, dtype=t.dtype)
              for t in captured.example_inputs]
    # The step updates its parameters and moments in place: each run gets its own copy.
    expected = torch.fx.Interpreter(gm).run(*(t.clone() for t in inputs))
    assert flips() > 0
    assert mark_reverse_scans(gm) == 1
    assert flips() == 0
    scans = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.scan]
    marked = [n for n in scans if n.meta.get("custom", {}).get(SCAN_REVERSE)]
    assert len(scans) == 2 and len(marked) == 1 and marked_reverse(getattr(gm, marked[0].args[0].target))
    got = _ReverseAwareInterpreter(gm).run(*(t.clone() for t in inputs))
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
