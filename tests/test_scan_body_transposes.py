"""graph/scan_body_transposes.py: a scan body's matmuls read transposed weights as views.

Scan's autograd functionalises the body, turning `W.t()` into a contiguous copy before each
matmul; the pass lets the matmul read the view instead. Same values in a different memory layout:
the run is compared with the same step compiled without the pass (bitwise here).
"""

from __future__ import annotations

import pytest
import torch
from test_reverse_scan import STEPS
from test_scan_ac import batches, lr, make_step, tiny_args
from torch._inductor import config as inductor_config

from titan_tpu.graph import scan_body_transposes
from titan_tpu.graph.scan_body_transposes import scan_body_transpose_stats
from titan_tpu.models.registry import build_model


def train_inductor(ac: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model(tiny_args(), seed=0, scan_layers=True, ac_mode=ac)
    data = batches()[:STEPS]
    with inductor_config.patch(fx_graph_cache=False):  # the pass runs only when Inductor compiles
        step, _ = make_step(model, mode="inductor", example=data[0])
    losses = [step([b], lr(i + 1)).loss for i, b in enumerate(data)]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# Activation checkpointing none only: with full, the scans are ours (`_ScanRecomputingLayers`), not
# partitioned by scan's autograd, and the pass finds no copied transposes there.
@pytest.mark.parametrize("ac", ["none"])
def test_scan_body_matmuls_read_transposes_in_place_same_numbers(ac, monkeypatch, one_thread):
    before = scan_body_transpose_stats.copy()
    losses, params = train_inductor(ac)
    dropped = (scan_body_transpose_stats - before)["copies_dropped"]
    # Every dense matmul weight of the block (llama3-like: wq, wk, wv, wo, w1, w2, w3) at least
    # once in the forward body.
    assert dropped >= 7

    monkeypatch.setattr(scan_body_transposes, "drop_transpose_copies", lambda gm: 0)
    copied_losses, copied_params = train_inductor(ac)
    assert (scan_body_transpose_stats - before)["copies_dropped"] == dropped  # compiled without the pass
    # The matmuls take the transposed operand as a view; on this CPU every number is bitwise the same.
    assert losses == copied_losses
    for name, p in params.items():
        assert torch.equal(p, copied_params[name]), name
