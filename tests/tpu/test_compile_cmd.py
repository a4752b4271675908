"""`titan-tpu compile` for the other layouts `make tpu-check` covers (an MoE with expert
parallelism by all-to-all, a dense model with tensor parallelism) and its one-line refusals."""

from __future__ import annotations

import dataclasses

import conftest
import pytest

from titan_tpu.config import build_config
from titan_tpu.graph import jax_devices
from titan_tpu.models.registry import get_model_args
from titan_tpu.tools.compile_cmd import _format, compile_main, compile_step_for_tpu

SMALL = ["--training.batch_size=2", "--training.seq_len=64"]


def _summary(name: str, report: dict) -> None:
    conftest.SUMMARY.append(f"compile {name} for {report['topology']} (mesh {report['mesh']}): "
                            f"{report['compile_seconds']:.1f} s, peak {report['peak_per_chip_bytes'] / 2**20:.1f} "
                            f"MiB/chip, aliased {report['memory_per_chip_bytes']['aliased'] / 2**20:.1f} MiB")


def test_compile_moe_with_expert_parallelism_for_v5p(tmp_path):
    """qwen3_moe debug on 4 v5p chips, dp_shard 4 with ep 2 and ep_dispatch all_to_all: the expert
    mesh's two axes become JAX mesh axes, tokens reach their experts by XLA's ragged all-to-all
    over ep (TorchTPU's ragged_all_to_all, as the trainer sends them on a TPU). The TPU's
    kernels are in the compiled program as Pallas (Mosaic) custom calls: splash attention's
    forward and backward, megablox's grouped matmul (gmm) and its weight gradient (tgmm); the
    loss is tokamax's plain-XLA form, and the report says why."""
    cfg = build_config("configs/qwen3_moe_debug.toml", ["--training.batch_size=1", "--training.seq_len=128",
                                                        "--parallelism.dp_shard=4", "--parallelism.ep=2",
                                                        "--parallelism.ep_dispatch=all_to_all"])
    report = compile_step_for_tpu(cfg, "v5p:2x2x1", xla_dump=tmp_path)
    assert report["mesh"] == {"dp_shard_mod_ep": 2, "ep": 2}
    # Our formula (matmuls only, the routed experts inside gmm and tgmm left out) against the dots
    # and convolutions of XLA's optimized program; cost analysis's total adds the elementwise work.
    counted, matmuls = report["formula_as_xla_counts_per_chip"], report["xla_matmul_flops_per_chip"]
    assert abs(counted / matmuls - 1) < 0.03 and matmuls < report["flops_per_chip"], (counted, matmuls)
    assert report["fits"] and report["memory_per_chip_bytes"]["aliased"] > 0
    # Per MoE layer: tokens, routing and weights out, outputs back, and the backward's two.
    assert {"all-gather", "reduce-scatter", "ragged-all-to-all"} <= set(report["collectives"])
    assert "all-to-all" not in report["collectives"]
    assert report["kernels"]["attention"] == "splash" and report["kernels"]["grouped_mm"] == "gmm"
    assert report["kernels"]["loss"].startswith("tokamax (its plain-XLA implementation: the Mosaic kernel asks")
    kernels = set(report["tpu_kernels"])
    assert {"splash_mha_fwd_segmented_no_residuals", "splash_mha_dq_segmented_no_residuals",
            "splash_mha_dkv_segmented_no_residuals"} <= kernels, kernels
    assert {"gmm", "tgmm"} <= kernels, kernels
    _summary("qwen3_moe_debug ep 2", report)
    conftest.SUMMARY.append("  Pallas kernels in it: " + ", ".join(sorted(kernels)))


def test_compile_with_tensor_parallelism_and_a_recipe_that_does_not_fit(monkeypatch, capsys):
    """llama3 debug on 4 v5p chips as dp_shard 2 x tp 2, through the command; with the chip's HBM
    made 1 MiB the command prints XLA's numbers and refuses in one line naming the peak."""
    from titan_tpu.plan import hardware

    small = dataclasses.replace(hardware.HARDWARE["v5p"], memory_bytes=2**20)
    monkeypatch.setitem(hardware.HARDWARE, "v5p", small)
    with pytest.raises(ValueError, match=r"does not fit v5p:2x2x1: XLA's peak .* GiB per chip > .* GiB HBM") as error:
        compile_main(["--config", "configs/llama3_debug.toml", "--topology", "v5p:2x2x1", *SMALL,
                      "--parallelism.dp_shard=2", "--parallelism.tp=2"])
    assert "\n" not in str(error.value)
    out = capsys.readouterr().out
    assert "mesh {'dp_shard': 2, 'tp': 2}" in out and "does NOT fit" in out


def test_unknown_topology_lists_known_ones():
    with pytest.raises(ValueError, match="unknown TPU topology 'v9:3x3'.*known ones include v5p:2x2x1") as error:
        jax_devices.tpu_topology("v9:3x3")
    assert "\n" not in str(error.value)


def test_missing_tpu_environment_names_the_command_that_builds_it(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else find_spec(name, *a))
    with pytest.raises(ValueError, match="make tpu-check") as error:
        compile_main(["--config", "configs/llama3_debug.toml"])
    assert "\n" not in str(error.value)


def test_compile_dpo_step_with_its_reference():
    """DPO on llama3 debug, dp_shard 4 (scanned, bf16 as on a TPU): the captured step takes the
    frozen reference's weight shards as inputs beside the trained ones and reads both rows of a
    pair; its tokens count two rows per pair, and XLA's FLOPs are our formula with the
    reference's forward (a third of a trained token's) within 3%."""
    cfg = build_config("configs/llama3_debug_dpo.toml", ["--training.batch_size=2", "--training.seq_len=128",
                                                        "--parallelism.dp_shard=4", "--model.dtype=bfloat16",
                                                        "--model.scan_layers=true", "--training.mode=graph",
                                                        "--training.device=tpu"])
    report = compile_step_for_tpu(cfg, "v5p:2x2x1")
    assert report["fits"] and report["mesh"] == {"dp_shard": 4}
    assert report["tokens_per_chip"] == 2 * 2 * 128  # pairs x rows x positions
    counted, xla = report["formula_as_xla_counts_per_chip"], report["flops_per_chip"]
    assert abs(counted / xla - 1) < 0.03, (counted, xla)
    # the TPU compiler's own time for the step (its cost model), recorded beside its FLOPs: no
    # faster than its FLOPs at v5p's bf16 peak
    seconds = report["xla_optimal_seconds_per_step"]
    assert seconds is not None and seconds >= xla / 459e12, (seconds, xla)
    assert f"XLA's own time estimate {seconds:.3f} s per step" in _format(report)
    _summary("llama3_debug_dpo", report)


def test_full_checkpointing_of_unscanned_layers_survives_xla(tmp_path):
    """Unscanned layers (a Transformers-backend model's, or scan_layers false) with full activation
    checkpointing: each layer's recomputed forward is a copy of its forward's ops, which XLA would
    merge back into the forward (or run there), keeping every intermediate. The lowering's
    optimization barriers keep the rerun: XLA's matmuls are our formula counted with the rerun (and
    a third more than without checkpointing), and its peak is below the uncheckpointed step's."""
    reports = {}
    for mode in ("full", "none"):
        cfg = build_config("configs/llama3_debug.toml", ["--training.batch_size=2", "--training.seq_len=128",
                                                         "--model.scan_layers=false",
                                                         f"--activation_checkpoint.mode={mode}"])
        reports[mode] = compile_step_for_tpu(cfg, "v5p:2x2x1", xla_dump=tmp_path / mode)
    full, none = reports["full"], reports["none"]
    counted, matmuls = full["formula_as_xla_counts_per_chip"], full["xla_matmul_flops_per_chip"]
    assert abs(counted / matmuls - 1) < 0.03, (counted, matmuls)
    assert matmuls > 1.2 * none["xla_matmul_flops_per_chip"]
    assert full["memory_per_chip_bytes"]["temporaries"] < none["memory_per_chip_bytes"]["temporaries"]
    _summary("llama3_debug unscanned, full checkpointing", full)


def _most_alive_at_once(dump, shape: str) -> int:
    """The most values of `shape` XLA's buffer assignment holds at one moment of the program."""
    from titan_tpu.xla.dump import placed_values

    ranges = [v.live for v in placed_values(dump) if v.shape == shape and v.live]
    return max((sum(start <= t <= end for start, end in ranges) for t, _ in ranges), default=0)


def test_the_chunked_loss_holds_one_chunk_at_a_time_under_xla(tmp_path):
    """The chunked loss (the TPU recipes' loss for chat data) computes each chunk's logits, their
    gradient, h's gradient and the [vocab, dim] weight gradient's product, summed into one fp32
    buffer. Without the sequence points between chunks XLA ran every chunk's logits before the
    gradients' matmuls and fused the sums into one loop that held every chunk's product at once;
    with them, at most two chunks' are alive at a time, with the output projection trained and frozen
    (LoRA)."""
    chunks = 8
    for lora in ("false", "true"):
        cfg = build_config("configs/llama3_debug.toml", ["--training.batch_size=2", "--training.seq_len=128",
                                                         "--model.dtype=bfloat16", "--kernels.loss=chunked",
                                                         f"--kernels.loss_chunk_tokens={2 * 128 // chunks}",
                                                         f"--lora.enabled={lora}"])
        compile_step_for_tpu(cfg, "v5p:2x2x1", xla_dump=tmp_path / lora)
        args = get_model_args(cfg.model.name, cfg.model.flavor)
        shapes = [f"f32[{2 * 128 // chunks},{args.vocab_size}]"] + \
            ([f"bf16[{args.vocab_size},{args.dim}]"] if lora == "false" else [])
        for shape in shapes:
            assert _most_alive_at_once(tmp_path / lora, shape) <= 2, (lora, shape)


def test_xla_time_counts_each_scanned_loop_as_many_times_as_it_runs(tmp_path):
    """XLA's cost analysis counts a while loop's body once: the report's as-run numbers count each
    of the scanned stack's loops (forward, backward) once per layer. Its matmul FLOPs as run are
    the unscanned program's own; its time estimate (the body read off the step compiled with two
    layers a trip) exceeds the once-counted one by about the layers' share. (It is not the
    unscanned program's estimate: XLA's cost model charges the scanned program's in-place updates
    of its stacked buffers more, bench/xla_cost_model.py.)"""
    reports = {}
    for scan in ("true", "false"):
        cfg = build_config("configs/llama3_debug.toml", [*SMALL, "--parallelism.dp_shard=4", "--model.dtype=bfloat16",
                                                         f"--model.scan_layers={scan}", "--training.mode=graph",
                                                         "--training.device=tpu"])
        reports[scan] = compile_step_for_tpu(cfg, "v5p:2x2x1", xla_dump=tmp_path / scan)
    scanned, unscanned = reports["true"]["programs"]["step"], reports["false"]["programs"]["step"]
    layers = scanned["loop_trips"][0] if scanned["loop_trips"] else 0
    assert scanned["as_run_method"] == "unrolled by 2" and scanned["loop_trips"] == [layers, layers] and layers > 1
    assert unscanned["as_run_method"] == "no loops" and unscanned["loop_trips"] == []
    assert unscanned["optimal_seconds_as_run"] == unscanned["optimal_seconds"]
    assert abs(scanned["matmul_flops_as_run"] / unscanned["matmul_flops"] - 1) < 0.01
    assert scanned["matmul_flops"] < scanned["matmul_flops_as_run"]
    once, unrolled, as_run = (scanned[k] for k in ("optimal_seconds", "optimal_seconds_unrolled_by_2",
                                                   "optimal_seconds_as_run"))
    # two bodies a trip: each loop's body twice, so the program as run adds layers - 1 bodies per loop
    assert as_run == pytest.approx(once + (layers - 1) * (unrolled - once), rel=1e-9) and unrolled > once
    assert reports["true"]["xla_optimal_seconds_per_step_as_run"] == as_run
