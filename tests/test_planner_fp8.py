"""The planner's fp8 terms (plan/fp8.py `fp8_terms`): the chip table's fp8 peaks, the converted
matmuls' FLOPs at that peak, the casts as elementwise traffic, the fp8 copies and scales in memory,
`plan`'s fp8 vs bf16 line, and `plan --search --allow-fp8`. All planning, no model: well under a
second each. The compiled side (XLA's f8 dots) is tests/tpu/test_fp8_lowering.py."""

from __future__ import annotations

import dataclasses

import pytest

from titan_tpu.cli import main
from titan_tpu.models.spec import model_spec
from titan_tpu.plan.fp8 import fp8_linear_params
from titan_tpu.plan.hardware import HARDWARE, resolve_hardware
from titan_tpu.plan.planner import plan_run
from titan_tpu.plan.search import search
from titan_tpu.plan.setting import setup_for_planning
from titan_tpu.xla.dump import f8_dots

RECIPE = "configs/llama3_70b_v7_tpu.toml"


def test_chips_with_an_fp8_peak_and_without():
    # Vendor pages (hardware.py): tpu7x 4,614 TFLOP/s per chip (two devices), H100/H200 1,979 dense,
    # B200 4,500 dense; Google's table gives v5p and v6e an fp8 peak equal to their bf16 one.
    assert HARDWARE["v7"].fp8_peak_flops == pytest.approx(4614e12 / 2)
    assert {name: HARDWARE[name].fp8_peak_flops for name in ("h100", "h200", "b200")} == \
        {"h100": 1979e12, "h200": 1979e12, "b200": 4500e12}
    for name in ("v4", "v5e", "v5p", "v6e"):
        assert HARDWARE[name].fp8_peak_flops is None, name
    assert resolve_hardware("cpu", measure=False)[0].fp8_peak_flops is None


def test_fp8_moves_the_converted_matmuls_to_the_fp8_peak():
    setup = setup_for_planning(RECIPE)
    bf16, fp8 = (plan_run(setup, measure=False, fp8=on) for on in (False, True))
    args, t = model_spec(setup.cfg.model).args, setup.cfg.training
    converted, down = fp8_linear_params(args)
    # attention projections and the dense MLP of 80 layers: 91% of the executed FLOPs at 8k
    assert converted == 80 * (8192 * 128 * (2 * 64 + 2 * 8) + 3 * 8192 * 28672)
    tokens = t.batch_size * t.seq_len * t.grad_accum_steps
    fp8_flops = (6 * converted + 2 * (converted - down)) * tokens  # full checkpointing reruns all but w2
    assert fp8.flops["fp8_executed_per_step_per_device"] == pytest.approx(fp8_flops)
    assert fp8.flops["executed_per_step_per_device"] == bf16.flops["executed_per_step_per_device"]
    hw = HARDWARE["v7"]
    rest = bf16.flops["executed_per_step_per_device"] - fp8_flops
    assert fp8.time["compute_s"] == pytest.approx(rest / (hw.peak_flops * hw.efficiency)
                                                  + fp8_flops / (hw.fp8_peak_flops * hw.efficiency))
    assert fp8.time["elementwise_s"] > bf16.time["elementwise_s"]  # the casts
    assert 1.3 < fp8.tokens_per_s / bf16.tokens_per_s < 1.7  # MaxText measured 1.54x on this chip
    assert fp8.memory["phases"]["backward"] == pytest.approx(bf16.memory["phases"]["backward"]
                                                             + fp8.memory["fp8_copies"] + fp8.memory["fp8_scales"])
    assert fp8.memory["phases"]["forward_end"] == bf16.memory["phases"]["forward_end"]
    assert "fp8_copies" not in bf16.memory


def test_fp8_on_a_chip_without_an_fp8_peak_only_costs(capsys):
    setup = setup_for_planning(RECIPE)
    v5p, chips = resolve_hardware("v5p-256")
    bf16, fp8 = (plan_run(setup, v5p, chips=chips, fp8=on) for on in (False, True))
    assert fp8.time["compute_s"] == pytest.approx(bf16.time["compute_s"])
    assert fp8.tokens_per_s < bf16.tokens_per_s
    main(["plan", "--config", RECIPE])  # tpu7x: fp8 beside bf16
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("fp8 vs bf16"))
    assert "tokens/s (1.4" in line, line
    main(["plan", "--config", RECIPE, "--hardware", "v5p-256"])  # a bf16 recipe on v5p: no fp8 line
    assert "fp8 vs bf16" not in capsys.readouterr().out


def test_search_considers_fp8_only_when_allowed_and_where_it_pays():
    cfg = setup_for_planning(RECIPE).cfg
    keep = ("model.scan_layers", "parallelism.bucket_mb", "parallelism.reshard_after_forward",
            "parallelism.dp_replicate", "activation_checkpoint.mode")
    plain = search(cfg, keep=keep, measure=False)
    assert not any("fp8.enabled" in c.values for c in plain.fitting)
    allowed = search(cfg, keep=keep, measure=False, allow_fp8=True)
    assert allowed.total == 2 * plain.total
    assert allowed.fitting[0].values["fp8.enabled"] and "--fp8.enabled" in allowed.fitting[0].changes
    v5p, chips = resolve_hardware("v5p-256")
    elsewhere = search(cfg, v5p, chips=chips, keep=keep, allow_fp8=True)
    assert not any("fp8.enabled" in c.values for c in elsewhere.fitting)
    assert elsewhere.fp8_note.startswith("v5p has no fp8 peak")


def test_f8_dots_are_counted_from_the_program_text():
    # XLA's TPU passes turn a dot into a convolution whose operands are named values; StableHLO types them inline.
    hlo = """HloModule m
%a = f8e4m3fn[16,32]{1,0} parameter(0)
%b = f8e5m2[32,64]{1,0} fusion(%x), kind=kLoop
%c = bf16[32,64]{1,0} parameter(1)
%convolution.1 = f32[16,64]{1,0:T(8,128)} convolution(%a, %b), dim_labels=bf_io->bf
ROOT %dot.2 = f32[16,64]{1,0} dot(bf16[16,32]{1,0} %d, bf16[32,64]{1,0} %c), lhs_contracting_dims={1}
%dot.3 = f32[16,64]{1,0} dot(f8e4m3fn[16,32]{1,0} %a, f8e4m3fn[32,64]{1,0} %e), lhs_contracting_dims={1}
"""
    assert f8_dots(hlo) == 2
    stablehlo = ("%0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<16x32xf8E4M3FN>, "
                 "tensor<32x64xf8E4M3FN>) -> tensor<16x64xf32>\n"
                 "%1 = stablehlo.dot_general %c, %d, contracting_dims = [1] x [0] : (tensor<16x32xbf16>, "
                 "tensor<32x64xbf16>) -> tensor<16x64xf32>")
    assert f8_dots(stablehlo) == 1


def test_a_plan_without_fp8_is_unchanged_by_the_fp8_terms():
    setup = setup_for_planning("configs/llama3_8b_tpu.toml")
    plan = plan_run(setup, measure=False)
    assert "fp8" not in plan.batch and "fp8_executed_per_step_per_device" not in plan.flops
    assert dataclasses.asdict(plan) == dataclasses.asdict(plan_run(setup, measure=False, fp8=False))


MOE_RECIPE = "configs/qwen3_235b_a22b_v7_fp8_tpu.toml"


def test_fp8_experts_move_the_expert_matmuls_to_the_fp8_peak_too():
    """fp8.experts: each token's top-k experts' three grouped matmuls (forward, both gradients, and
    all three again in the checkpointed rerun) at the fp8 peak, beside the attention linears; their
    casts (the ep x top-k routed rows of the all_gather dispatch, and this device's experts) as
    elementwise traffic; one MoE layer's fp8 expert weights and rows, and scales, in memory."""
    setup = setup_for_planning(MOE_RECIPE)
    linears, experts = (plan_run(dataclasses.replace(setup, cfg=_with_experts(setup.cfg, on)), measure=False)
                        for on in (False, True))
    args, t, p = model_spec(setup.cfg.model).args, setup.cfg.training, setup.cfg.parallelism
    moe = args.moe
    assert (moe.num_experts, moe.top_k, moe.hidden_dim, args.dim, p.ep) == (128, 8, 1536, 4096, 8)
    tokens = t.batch_size * t.seq_len * t.grad_accum_steps
    expert_flops = (6 + 2) * args.n_layers * moe.top_k * 3 * args.dim * moe.hidden_dim * tokens
    assert experts.flops["fp8_expert_executed_per_step_per_device"] == pytest.approx(expert_flops)
    assert experts.flops["fp8_executed_per_step_per_device"] == pytest.approx(
        linears.flops["fp8_executed_per_step_per_device"] + expert_flops)
    assert "fp8_expert_executed_per_step_per_device" not in linears.flops
    # the experts are 61% of this model's executed FLOPs: all of them now at the fp8 peak
    assert expert_flops / experts.flops["executed_per_step_per_device"] == pytest.approx(0.61, abs=0.01)
    hw = HARDWARE["v7"]
    rest = experts.flops["executed_per_step_per_device"] - experts.flops["fp8_executed_per_step_per_device"]
    assert experts.time["compute_s"] == pytest.approx(
        rest / (hw.peak_flops * hw.efficiency)
        + experts.flops["fp8_executed_per_step_per_device"] / (hw.fp8_peak_flops * hw.efficiency))
    assert experts.time["compute_s"] < linears.time["compute_s"]
    # The casts: the quantised routed rows (ep x top-k per token) dominate, each read twice, written once.
    rows = t.batch_size * t.seq_len * moe.top_k * p.ep
    D, F = args.dim, moe.hidden_dim
    per_layer = rows * ((2 * D + F) * 4 + (2 * F + D) * 3) + moe.num_experts // p.ep * 3 * D * F * 3
    assert experts.time["fp8_cast_bytes"] - linears.time["fp8_cast_bytes"] == pytest.approx(
        5 * args.n_layers * per_layer)
    assert experts.time["elementwise_s"] > linears.time["elementwise_s"]
    assert experts.memory["fp8_copies"] > linears.memory["fp8_copies"]  # an MoE layer's experts in fp8
    assert experts.memory["fp8_scales"] > linears.memory["fp8_scales"]


def _with_experts(cfg, on: bool):
    return dataclasses.replace(cfg, fp8=dataclasses.replace(cfg.fp8, experts=on))
