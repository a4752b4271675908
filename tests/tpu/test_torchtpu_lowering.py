"""TorchTPU's compile of the captured step as the trainer calls it (graph/torchtpu.py) and its own
lowering of the step (tools/torchtpu_lowering.py), compiled by libtpu's compile-only client beside
our JAX lowering's program of the same step, on this CPU."""

from __future__ import annotations

import inspect

import conftest
import pytest
import torch

from titan_tpu.tools.torchtpu_lowering import compare, lower_with_torchtpu

# The TPU recipes' form (scanned layers, full checkpointing) at the debug model's size; kernels both
# lowerings trace as the same ATen ops.
KERNELS = ["--kernels.attention=reference", "--kernels.loss=chunked"]
STEP = ["--training.batch_size=2", "--training.seq_len=64", "--model.scan_layers=true",
        "--activation_checkpoint.mode=full", *KERNELS]


def test_the_torchtpu_api_the_trainer_calls():
    """What graph/torchtpu.py relies on, read from torch-tpu itself (its calls' names and arguments
    are checked by test_api.py's scan): StaticCompiler takes donated inputs; SplitCompiler keeps a
    collective in its piece when the node carries TorchTPU's spmd_safe annotation, the one its
    decorator writes; the handshake, the other way to one program, is for the world group only."""
    from torch_tpu._internal.compile import split_compiler
    from torch_tpu._internal.compile.compiler import StaticCompiler
    from torch_tpu._internal.distributed import handshake, spmd_util

    assert {"donated_inputs", "module_name"} <= set(inspect.signature(StaticCompiler.__call__).parameters)
    assert "donated_inputs" not in inspect.signature(split_compiler.SplitCompiler.__call__).parameters
    assert spmd_util.SPMD_SAFE_METADATA_KEY == "spmd_safe"
    assert "spmd_util.SPMD_SAFE_METADATA_KEY" in inspect.getsource(split_compiler.SplitCompiler._compile_graph)
    assert "fx.traceback.annotate({SPMD_SAFE_METADATA_KEY: True})" in inspect.getsource(spmd_util.spmd_safe)
    assert "len(pg_to_num_collectives) != 1 or global_pg not in" in inspect.getsource(handshake.should_handshake)


def test_torchtpu_program_compiles_like_ours(tmp_path):
    """One chip: TorchTPU lowers the scanned step (its scan op: two while loops) and XLA compiles
    it for a v5p chip. Its outputs have our program's shapes. Split (0.2.0's backend as it is) it
    is one program that donates nothing (aliased 0); as the trainer calls it XLA aliases what it
    aliases in ours. FLOPs within 2% of ours and the peak within 10% (measured: 0.2% more FLOPs,
    1.3% less peak; at 256 positions 3% more FLOPs, as XLA rewrites our softmax and P V into its
    online-softmax kernel, whose work it does not count, and not TorchTPU's)."""
    report = compare("configs/llama3_debug.toml", STEP, "v5p:1x1x1", tmp_path)
    one, split, ours = report["runtimes"]["one_program"], report["runtimes"]["split"], report["jax"]
    assert report["outputs_match"], (one["result_types"], ours["result_types"])
    assert one["programs"] == split["programs"] == 1 and one["texts_match"]
    assert one["scan_bodies"] == 2 and one["stablehlo"]["while"] == ours["stablehlo"]["while"] == 2
    memory, ours_memory = one["memory_per_chip_bytes"], ours["memory_per_chip_bytes"]
    assert split["memory_per_chip_bytes"]["aliased"] == 0 and split["donated_arguments"] == 0
    # Donated as ours: XLA pairs each donor with an output itself (ours names the pairs), 12 KiB apart.
    assert memory["aliased"] == pytest.approx(ours_memory["aliased"], rel=1e-3) and memory["aliased"] > 0
    # The arguments differ by the batch's integers: 64-bit in TorchTPU's program, 32-bit in ours.
    assert memory["arguments"] == pytest.approx(ours_memory["arguments"], rel=1e-3)
    flops = one["flops_per_chip"] / ours["flops_per_chip"]
    peak = one["peak_per_chip_bytes"] / ours["peak_per_chip_bytes"]
    assert abs(flops - 1) < 0.02 and abs(peak - 1) < 0.10, (flops, peak)
    conftest.SUMMARY.append(f"TorchTPU's lowering of the scanned llama3 debug step vs ours (v5p, one chip): FLOPs "
                            f"{flops:.3f}x, peak {peak:.3f}x donated; split (undonated) peak "
                            f"{split['peak_per_chip_bytes'] / ours['peak_per_chip_bytes']:.3f}x")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """TorchTPU's programs for rank 0 of the llama3 debug step on 2 dp_shard ranks, both runtimes."""
    out = tmp_path_factory.mktemp("torchtpu")
    return lower_with_torchtpu("configs/llama3_debug.toml", [*STEP, "--parallelism.dp_shard=2"], out, world=2)


def test_the_trainer_call_makes_one_donated_program_with_the_collectives(two_ranks):
    """As the trainer calls TorchTPU (every node SPMD-safe, StaticCompiler's donated inputs): one
    program per step that holds the step's collectives (stand-ins of their shapes here, each
    behind optimization barriers) and donates the parameters and both moments; the text TorchTPU's
    executable keeps, which a run fingerprints, is the program's. TorchTPU's backend as it is cuts
    the step into a program per collective and one per piece between two (none between two
    collectives with nothing between them): counted against the captured step's collectives."""
    lowerings, meta = two_ranks
    one, split = lowerings["one_program"], lowerings["split"]
    groups = meta["input_groups"]
    ops = {op: n for op, n in meta["collectives"].items() if "wait_tensor" not in op}
    collectives = sum(ops.values())
    assert collectives > 0
    (program,) = one.programs
    assert program.collective and one.texts_match
    # The stand-ins hold an all-gather's and a reduce-scatter's input and output behind barriers, an
    # all-reduce's one tensor (tools/torchtpu_lowering.py stand_in_group).
    held = sum(n * (1 if "all_reduce" in op else 2) for op, n in ops.items())
    assert program.text.count("stablehlo.optimization_barrier") >= held
    moved = [name for group in ("params", "exp_avg", "exp_avg_sq") for name in one.step_inputs[slice(*groups[group])]]
    assert sorted(program.arguments[j] for j in program.donated) == sorted(moved)
    assert program.text.count("jax.buffer_donor = true") == len(moved)
    assert sum(p.collective for p in split.programs) == collectives  # each collective its own program
    assert collectives < len(split.programs) <= 2 * collectives + 1 and not any(p.donated for p in split.programs)
    conftest.SUMMARY.append(f"TorchTPU, llama3 debug on 2 dp_shard ranks: {len(split.programs)} programs per step as "
                            f"its backend runs it ({collectives} collectives), 1 as the trainer calls it, "
                            f"{len(moved)} arguments donated")


def test_a_multi_chip_step_compiles_beside_ours(tmp_path):
    """dp_shard 2 on 2 v5p chips: TorchTPU's one program (rank 0's) and ours for the slice hold the
    same per-chip arguments and alias the same donated bytes; FLOPs within 2%."""
    report = compare("configs/llama3_debug.toml", [*STEP, "--parallelism.dp_shard=2"], "v5p:2x1x1", tmp_path,
                     runtimes=("one_program",))
    one, ours = report["runtimes"]["one_program"], report["jax"]
    assert report["devices"] == 2 and one["programs"] == 1
    memory, ours_memory = one["memory_per_chip_bytes"], ours["memory_per_chip_bytes"]
    assert memory["arguments"] == pytest.approx(ours_memory["arguments"], rel=1e-3)
    assert memory["aliased"] == pytest.approx(ours_memory["aliased"], rel=1e-3) and memory["aliased"] > 0
    flops = one["flops_per_chip"] / ours["flops_per_chip"]
    peak = one["peak_per_chip_bytes"] / ours["peak_per_chip_bytes"]
    assert abs(flops - 1) < 0.02, flops
    conftest.SUMMARY.append(f"TorchTPU's one program vs ours, llama3 debug dp_shard 2 on v5p:2x1x1: FLOPs "
                            f"{flops:.3f}x, peak {peak:.3f}x")


def test_rebind_makes_the_model_hold_the_new_values():
    """After a donated call the trainer re-points the tensors the model and the optimizer hold
    (graph/torchtpu.py owner, rebind): a DTensor parameter's local tensor itself, which the
    module then reads; no copy into the old buffer."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan_tpu.graph.torchtpu import owner, rebind

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        linear = torch.nn.Linear(4, 4, bias=False)
        linear.weight = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 4), mesh, [Shard(0)], run_check=False))
        plain = torch.nn.Parameter(torch.zeros(3))
        new_local, new_plain = torch.ones(2, 4), torch.full((3,), 2.0)
        held = [owner(linear.weight), owner(plain)]
        rebind(held, [new_local, new_plain])
        assert torch.equal(linear.weight.to_local(), new_local) and torch.equal(plain, new_plain)
        assert linear.weight.to_local().data_ptr() == new_local.data_ptr()  # the new buffer, not a copy
    finally:
        dist.destroy_process_group()


def test_context_parallelism_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="--parallelism.cp 1") as error:
        compare("configs/llama3_debug.toml", [*STEP, "--parallelism.cp=2"], "v5p:2x1x1", tmp_path)
    assert "\n" not in str(error.value)


def test_a_kernel_torchtpu_cannot_trace_without_a_tpu_is_refused_in_one_line(tmp_path):
    # The TPU's pick for attention is splash (Pallas, through jax_op): TorchTPU's build_mlir asks
    # for the PJRT client to lower it.
    with pytest.raises(ValueError, match="kernels.attention is splash .* give --kernels.attention reference") as error:
        compare("configs/llama3_debug.toml", STEP[:4], "v5p:1x1x1", tmp_path)
    assert "\n" not in str(error.value)
