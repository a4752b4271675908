"""TorchTPU's own lowering of the captured step (tools/torchtpu_lowering.py), compiled by libtpu's
compile-only client beside our JAX lowering's program of the same step, on this CPU."""

from __future__ import annotations

import conftest
import pytest

from titan_tpu.tools.torchtpu_lowering import compare

# The TPU recipes' form (scanned layers, full checkpointing) at the debug model's size; kernels both
# lowerings trace as the same ATen ops.
STEP = ["--training.batch_size=2", "--training.seq_len=64", "--model.scan_layers=true",
        "--activation_checkpoint.mode=full", "--kernels.attention=reference", "--kernels.loss=chunked"]


def test_torchtpu_program_compiles_like_ours(tmp_path):
    """TorchTPU lowers the scanned step (its scan op: two while loops) and XLA compiles it for a
    v5p chip. Its outputs have our program's shapes. As the trainer calls TorchTPU's backend it
    donates nothing (aliased 0); with our donation XLA aliases what it aliases in ours.
    FLOPs within 2% of ours and the peak within 10% (measured: 0.2% more FLOPs, 1.3% less peak; at
    256 positions 3% more FLOPs, as XLA rewrites our softmax and P V into its online-softmax kernel,
    whose work it does not count, and not TorchTPU's)."""
    report = compare("configs/llama3_debug.toml", STEP, "v5p:1x1x1", tmp_path)
    torchtpu, undonated, ours = report["torchtpu"], report["torchtpu_undonated"], report["jax"]
    assert report["outputs_match"], (torchtpu["result_types"], ours["result_types"])
    assert report["scan_bodies"] == 2 and torchtpu["stablehlo"]["while"] == ours["stablehlo"]["while"] == 2
    memory, ours_memory = torchtpu["memory_per_chip_bytes"], ours["memory_per_chip_bytes"]
    assert undonated["memory_per_chip_bytes"]["aliased"] == 0
    # Donated as ours: XLA pairs each donor with an output itself (ours names the pairs), 12 KiB apart.
    assert memory["aliased"] == pytest.approx(ours_memory["aliased"], rel=1e-3) and memory["aliased"] > 0
    # The arguments differ by the batch's integers: 64-bit in TorchTPU's program, 32-bit in ours.
    assert memory["arguments"] == pytest.approx(ours_memory["arguments"], rel=1e-3)
    flops = torchtpu["flops_per_chip"] / ours["flops_per_chip"]
    peak = torchtpu["peak_per_chip_bytes"] / ours["peak_per_chip_bytes"]
    assert abs(flops - 1) < 0.02 and abs(peak - 1) < 0.10, (flops, peak)
    conftest.SUMMARY.append(f"TorchTPU's lowering of the scanned llama3 debug step vs ours (v5p, one chip): FLOPs "
                            f"{flops:.3f}x, peak {peak:.3f}x with our donation; undonated peak "
                            f"{undonated['peak_per_chip_bytes'] / ours['peak_per_chip_bytes']:.3f}x")


def test_parallelism_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="--parallelism.dp_shard 1") as error:
        compare("configs/llama3_debug.toml", [*STEP, "--parallelism.dp_shard=2"], "v5p:1x1x1", tmp_path)
    assert "\n" not in str(error.value)


def test_a_kernel_torchtpu_cannot_trace_without_a_tpu_is_refused_in_one_line(tmp_path):
    # The TPU's pick for attention is splash (Pallas, through jax_op): TorchTPU's build_mlir asks
    # for the PJRT client to lower it.
    with pytest.raises(ValueError, match="kernels.attention is splash .* give --kernels.attention reference") as error:
        compare("configs/llama3_debug.toml", STEP[:4], "v5p:1x1x1", tmp_path)
    assert "\n" not in str(error.value)
