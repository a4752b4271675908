"""graph/reverse_scan.py: the scanned backward reads its stacks with a reversed index under Inductor,
and the loops' matmuls write their products straight into their stacks.

The pass must remove every flip a scanned step has (torch's scan autograd flips the saved stacks
and the stacked weights in and the gradients out; `_ScanRecomputingLayers` does the same), let
every weight gradient's matmul write into its slice of the gradient stack, and change no number:
the same body runs on the same slices in the same order with the same kernels, so losses and
weights are bitwise those of the flipped, copying form.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_scan_ac import batches, lr, make_step, tiny_args
from torch._inductor import config as inductor_config

from titan_tpu.graph import compile as graph_compile
from titan_tpu.graph.reverse_scan import reverse_scan_stats
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


@pytest.mark.parametrize("ac", ["none", "full"])
def test_reversed_backward_scan_removes_every_flip_and_changes_no_bit(ac, monkeypatch, one_thread):
    before = reverse_scan_stats.copy()
    losses, params, flips = train_inductor(ac)
    done = reverse_scan_stats - before
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
    flipped_losses, flipped_params, _ = train_inductor(ac)
    # the second run: without the pass
    assert reverse_scan_stats - before == done | {"matmuls_into_stacks": in_place} | (
        {"copies_dropped": copies} if copies else {})
    assert losses == flipped_losses
    for name, p in params.items():
        assert torch.equal(p, flipped_params[name]), name


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
