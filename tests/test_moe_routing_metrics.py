"""Routing at a glance (loops/routing.py): an MoE step's expert loads as per-layer metrics, the
warning on a collapsing layer, what the console and the trackers get of them, and the blocks a
native model names its expert-load rows by. The report's heat map: tests/test_report.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from titan_tpu.config import ModelConfig, build_config
from titan_tpu.loops.routing import Routing, balancing_advice
from titan_tpu.train.metrics import MetricsLogger

# Three MoE layers (blocks 1-3: block 0 is dense, as DeepSeek-V3's first blocks), 4 experts, top-2,
# 8 tokens: 16 token-expert pairs per layer, 4 per expert when even.
LOADS = torch.tensor([[4, 4, 4, 4],   # block 1: even
                      [7, 5, 4, 0],   # block 2: expert 3 dead, uneven
                      [1, 0, 8, 7]])  # block 3: every token picks expert 2 (the most top-2 allows)
EVEN = torch.full((3, 4), 4)
ADVICE = "raise model.moe_aux_loss_coef (now 0.001)"


def test_per_layer_numbers_from_a_hand_built_load():
    row, _ = Routing(blocks=[1, 2, 3], warn_above=0.0, advice=ADVICE).row(10, LOADS)
    # load / the layer's mean (4): block 2 [1.75, 1.25, 1, 0]; block 3 [0.25, 0, 2, 1.75].
    assert row["moe/layer1/load_max"] == 1.0 and row["moe/layer1/top_share"] == 0.25 and row["moe/layer1/dead"] == 0
    assert row["moe/layer2/load_max"] == 1.75 and row["moe/layer2/top_share"] == 7 / 16 and row["moe/layer2/dead"] == 1
    # Collapsed: max/mean at E / top_k = 2, the busiest expert holds 1 / top_k of the layer's pairs.
    assert row["moe/layer3/load_max"] == 2.0 and row["moe/layer3/top_share"] == 0.5 and row["moe/layer3/dead"] == 1
    assert row["expert_load_max"] == 2.0 and row["expert_load_min"] == 0.0  # over all layers, as before
    assert row["expert_load"] == {"layer1": [1.0, 1.0, 1.0, 1.0], "layer2": [1.75, 1.25, 1.0, 0.0],
                                  "layer3": [0.25, 0.0, 2.0, 1.75]}
    # Per-layer keys only for the layers there are; nothing at all for a dense model.
    assert {k for k in row if k.startswith("moe/")} == {f"moe/layer{b}/{m}" for b in (1, 2, 3)
                                                       for m in ("load_max", "top_share", "dead")}
    assert Routing(blocks=[], warn_above=4.0, advice=ADVICE).row(10, None) == ({}, [])


def test_relative_loads_are_rounded_to_three_decimals():
    row, _ = Routing(blocks=[0], warn_above=0.0, advice=ADVICE).row(1, torch.tensor([[1, 2]]))
    assert row["expert_load"] == {"layer0": [0.667, 1.333]}
    assert row["moe/layer0/load_max"] == pytest.approx(4 / 3)  # the scalar keys keep full precision


def test_rows_name_the_blocks_there_are():
    """A per-sequence forward (DPO, ORPO) reports no multi-token-prediction rows, the last blocks named."""
    row, _ = Routing(blocks=[1, 2, 3, 4], warn_above=0.0, advice=ADVICE).row(1, LOADS)
    assert list(row["expert_load"]) == ["layer1", "layer2", "layer3"]


def test_the_warning_names_the_collapsed_layer_once_until_it_recovers():
    routing = Routing(blocks=[1, 2, 3], warn_above=1.8, advice=ADVICE)  # block 2 (1.75) stays below
    _, lines = routing.row(10, LOADS)
    assert len(lines) == 1
    assert lines[0] == ("warning: step 10: MoE layer 3 (moe/layer3) sends 50.0% of its routed tokens to expert 2: "
                        "load max/mean 2.00 > metrics.expert_load_warning = 1.8, 1 of 4 experts got no token. If it "
                        f"persists, {ADVICE}. Said again only after the layer recovers.")
    assert routing.row(20, LOADS)[1] == []  # still collapsed: no second line
    assert routing.row(30, EVEN)[1] == []  # recovered
    _, again = routing.row(40, LOADS)  # collapsed again: warned again
    assert len(again) == 1 and again[0].startswith("warning: step 40: MoE layer 3 ")
    assert Routing(blocks=[1, 2, 3], warn_above=0.0, advice=ADVICE).row(10, LOADS)[1] == []  # 0: off


def test_the_advice_follows_the_runs_balancing():
    assert balancing_advice(ModelConfig(moe_load_balance="aux_loss", moe_aux_loss_coef=0.01)) == \
        "raise model.moe_aux_loss_coef (now 0.01)"
    assert balancing_advice(ModelConfig(moe_load_balance="expert_bias")) == \
        "raise model.moe_bias_update_rate (now 0.001)"
    assert "set model.moe_load_balance" in balancing_advice(ModelConfig(moe_load_balance="none"))


def test_the_threshold_is_a_checked_config_key():
    assert build_config(None, []).metrics.expert_load_warning == 4.0
    assert build_config(None, ["--metrics.expert_load_warning", "3"]).metrics.expert_load_warning == 3.0
    with pytest.raises(ValueError, match="metrics.expert_load_warning = -1.0 must be >= 0"):
        build_config(None, ["--metrics.expert_load_warning", "-1"])


class _Tracker:
    def __init__(self):
        self.logged = []

    def log(self, step, scalars):
        self.logged.append(scalars)

    def state_dict(self):
        return {}

    def close(self):
        pass


def test_the_console_line_stays_short_and_the_file_and_trackers_get_the_rest(tmp_path, capsys):
    routing, _ = Routing(blocks=[1, 2, 3], warn_above=0.0, advice=ADVICE).row(1, LOADS)
    tracker = _Tracker()
    with MetricsLogger(output_dir=tmp_path, tensorboard=False, trackers=[tracker]) as log:
        log.log(1, {"loss": 2.0, "aux_loss": 0.01, **routing, "other": 1})
    line = capsys.readouterr().out.strip()
    assert line == "step 1 loss 2.0000 | aux 0.0100 | expert load max/mean 2.00 | min/mean 0.00 | other 1"
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["expert_load"]["layer3"] == [0.25, 0.0, 2.0, 1.75] and row["moe/layer2/dead"] == 1
    assert tracker.logged[0]["moe/layer3/top_share"] == 0.5 and "expert_load" not in tracker.logged[0]
    # A kind that names its console keys cannot bring the per-layer ones onto the line either.
    named = MetricsLogger(output_dir=tmp_path / "named", tensorboard=False, console=False,
                          console_keys=("moe/layer3/load_max",))
    assert named.format_line(1, {"loss": 2.0, **routing}) == \
        "step 1 loss 2.0000 | expert load max/mean 2.00 | min/mean 0.00"
    named.close()


def test_a_native_model_names_its_rows_by_block():
    """DeepSeek-V3's debug flavor: block 0 dense, blocks 1-3 MoE, and two MTP depths (blocks 4 and 5)
    whose rows follow; a per-sequence forward runs no MTP depth."""
    from titan_tpu.models.registry import build_model, get_model_args

    args = dataclasses.replace(get_model_args("deepseek_v3", "debug"), mtp_num_layers=2)
    model = build_model(args, seed=0)
    assert model.expert_load_layers() == [1, 2, 3, 4, 5]
    tokens = torch.randint(0, args.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert model(tokens[:, :-1], tokens[:, 1:]).expert_load.shape[0] == 5
        assert model(tokens[:, :-1], tokens[:, 1:], per_sequence=True).expert_load.shape[0] == 3
    dense = build_model(get_model_args("llama3", "debug"), seed=0)
    assert dense.expert_load_layers() == []
