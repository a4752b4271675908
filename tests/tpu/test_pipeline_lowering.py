"""Pipeline stages (parallel/pipeline.py) lowered to one SPMD program: the pp step captured as
`titan-tpu compile` captures it (one program for every rank: the stage a value, the permute the op
``titan_tpu::pp_permute``), run by JAX on a CPU mesh, equals our eager step; and XLA's TPU compiler
takes it with the permute as a collective-permute.

The reference is test_jax_lowering.py's: our eager step in float64 on one process, on the batch
the stages split into micro-batches (tests/test_pipeline_train.py holds the eager pp step to that
same one-process step).
"""

from __future__ import annotations

import jax
import pytest
from test_jax_lowering import TOL, _capture, _config, _max_rel, _reference, _shard_of, per_device_inputs

from titan_tpu.graph.jax_program import global_inputs, jax_mesh, run_on_devices, sharded_step
from titan_tpu.parallel.pipeline import PipelineSchedule

SEQ = 32

# (layout, rows per data-parallel rank): GPipe with 2 and 4 micro-batches, circular (the debug
# model's 6 layers as 3 chunks of one layer per stage, whose rows each iteration reads by its
# repeat), padded (the 6 layers as 4 chunks of 2 rows: stage 1's last chunk is 2 padding rows, which
# the one program runs and a select passes over), and pp 2 x dp_shard 2 and pp 2 x tp 2 on the
# 4-device CPU mesh.
LAYOUTS = [({"pp": 2}, 2), ({"pp": 2, "pp_microbatches": 4}, 4), ({"pp": 2, "pp_repeats": 3, "pp_microbatches": 2}, 2),
           ({"pp": 2, "pp_repeats": 2, "pp_microbatches": 2}, 2), ({"pp": 2, "dp_shard": 2}, 2),
           ({"pp": 2, "tp": 2}, 2)]


def _layout_id(layout: dict) -> str:
    return "-".join(f"{axis}{size}" for axis, size in layout.items())


def _n_layers(cfg) -> int:
    from titan_tpu.models.spec import model_spec

    return model_spec(cfg.model).args.n_layers


def _stack_rows(cfg, n_layers: int) -> list[int]:
    """The model's layer held by each row of a pipelined stack (stage by stage: pipeline_stages);
    ids from n_layers on are padding rows."""
    schedule = PipelineSchedule.from_config(cfg.parallelism, n_layers=n_layers)
    return [layer for stage in range(schedule.stages) for layer in schedule.stage_layers(stage)]


def _rows_of(stack, rows: list[int]):
    """A reference stack's rows in the pipelined order, a padding row as zeros (what it must stay:
    zero weights, zero moments)."""
    import torch

    padded = torch.cat([stack, stack.new_zeros(max(rows) + 1 - len(stack), *stack.shape[1:])])
    return padded[rows]


@pytest.mark.parametrize("layout, batch", LAYOUTS, ids=[_layout_id(lay) for lay, _ in LAYOUTS])
def test_lowered_pipeline_step_equals_eager_step(layout, batch, monkeypatch):
    """One whole step (forward through the stages, loss, backward, the shared weights' gradients
    summed over pp, clipping, AdamW) lowered and run on a CPU mesh of pp x dp_shard devices, rank
    0's program on every device, equals our eager step within 1e-5 (fp32, relative to each tensor's
    largest value): loss, gradient norm, and every device's parameters and moments."""
    cfg = _config("llama3_debug", layout, scan=True, batch=batch, seq=SEQ)
    ranks = cfg.parallelism.pp * cfg.parallelism.dp_shard * cfg.parallelism.tp
    run, step = _capture(cfg, ranks)
    assert step.axis_sizes == {**({"dp_shard": 2} if "dp_shard" in layout else {}), "pp": 2,
                               **({"tp": 2} if "tp" in layout else {})}, step.axis_sizes
    per_device, batches = per_device_inputs(run, step, ranks, batch, SEQ)
    outputs = run_on_devices([step], per_device, jax.devices("cpu"))
    mesh = jax_mesh(step, jax.devices("cpu"))
    text = jax.jit(sharded_step(step, mesh)).lower(*global_inputs(mesh, per_device)).as_text()
    assert "stablehlo.collective_permute" in text

    result, reference, optimizer = _reference(cfg, batches, monkeypatch)
    rows = _stack_rows(cfg, _n_layers(cfg))
    stacked = set(reference.stacked_parameter_names())
    captured = step.captured
    names, specs = captured.param_names, captured.dtensor_specs
    params, state = dict(reference.named_parameters()), optimizer.state
    errors: dict[str, float] = {}
    for rank, flat in enumerate(outputs):
        out = captured.layout.unflatten_outputs(flat)
        errors["loss"] = max(errors.get("loss", 0), _max_rel(out["loss"][0], result.loss))
        errors["grad_norm"] = max(errors.get("grad_norm", 0), _max_rel(out["grad_norm"][0], result.grad_norm))
        for group, full in (("params", params), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
            for n, value in zip(names, out[group]):
                expected = _rows_of(full[n], rows) if n in stacked else full[n]  # the pipelined stack's rows
                error = _max_rel(value, _shard_of(expected, specs.get(n), rank))
                errors[group] = max(errors.get(group, 0), error)
                if error > TOL:
                    print(f"  device {rank} {group} {n}: {error:.1e}")
    print(f"llama3_debug {cfg.parallelism}: max relative error " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) <= TOL, errors


def test_compile_pipeline_step_for_v5p():
    """`titan-tpu compile`'s core on the llama3 debug recipe with pp 2 x dp_shard 2 for a 4-chip v5p
    slice: XLA's TPU compiler takes the lowered pp step, and the stages' hand-over is a
    collective-permute in its optimized program (the shared weights' gradients an all-reduce)."""
    from titan_tpu.config import build_config
    from titan_tpu.tools.compile_cmd import compile_step_for_tpu

    cfg = build_config("configs/llama3_debug.toml", ["--training.batch_size=2", "--training.seq_len=128",
                                                     "--model.scan_layers=true", "--parallelism.pp=2",
                                                     "--parallelism.dp_shard=2"])
    report = compile_step_for_tpu(cfg, "v5p:2x2x1")
    assert report["mesh"] == {"dp_shard": 2, "pp": 2}, report["mesh"]
    assert report["collectives"].get("collective-permute", 0) > 0, report["collectives"]
    assert report["fits"]
    import conftest

    conftest.SUMMARY.append(f"compile llama3_debug pp 2 x dp_shard 2 for v5p:2x2x1: {report['compile_seconds']:.1f} s, "
                            f"peak {report['peak_per_chip_bytes'] / 2**20:.1f} MiB/chip, collectives "
                            f"{report['collectives']}")


# MoE stages with expert parallelism inside each stage (pp 2 x dp_shard 2 with ep 2 on the 4-device CPU
# mesh), scanned with full checkpointing: Qwen3-MoE (4 MoE layers, 2 a stage) with the balancing loss,
# DeepSeek-V3 (its dense first layer whole on every stage, 3 MoE layers padded to 4 rows) with the
# expert biases. The reference takes each data-parallel rank's rows as a micro-batch (a rank's
# balancing loss is of its own rows; tests/test_pipeline_moe.py).
MOE_LAYOUTS = [("qwen3_moe_debug", "aux_loss"), ("deepseek_v3_debug", "expert_bias")]


@pytest.mark.parametrize("name, balance", MOE_LAYOUTS, ids=[f"{n}-pp2-dp_shard2-ep2" for n, _ in MOE_LAYOUTS])
def test_lowered_moe_stages_with_expert_parallelism_equal_eager_step(name, balance, monkeypatch):
    """One whole step lowered as one program on pp x dp_shard devices (the ep group a stage's two
    dp_shard ranks) equals our eager step within 1e-5: loss, gradient norm, the balancing loss and
    every layer's expert loads (the step's totals), the updated expert biases, and every device's
    parameters and moments (the pipelined stack's rows in stage order; padding rows zero)."""
    import dataclasses

    import torch

    from titan_tpu.parallel.pipeline import pipelined_layers

    layout = {"pp": 2, "dp_shard": 2, "ep": 2}
    cfg = _config(name, layout, scan=True, batch=2, seq=SEQ)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_load_balance=balance))
    run, step = _capture(cfg, 4)
    assert step.axis_sizes == {"dp_shard_mod_ep": 1, "ep": 2, "pp": 2}, step.axis_sizes
    per_device, batches = per_device_inputs(run, step, 4, 2, SEQ)
    outputs = run_on_devices([step], per_device, jax.devices("cpu"))

    result, reference, optimizer = _reference(cfg, batches, monkeypatch, per_rank=True)
    *_, (stack_name, stack) = reference.stacks()
    rows = _stack_rows(cfg, pipelined_layers(reference.args))
    pipelined = {f"{stack_name}.{n}" for n in stack.state_names}
    assert rows == list(range(len(rows))) and (len(rows) > stack.n_layers) == (name == "deepseek_v3_debug")
    captured = step.captured
    names, specs = captured.param_names, captured.dtensor_specs
    params, state, buffers = dict(reference.named_parameters()), optimizer.state, dict(reference.named_buffers())
    totals = torch.tensor([result.loss, result.aux_loss, 0.0, *result.expert_load.flatten().tolist()])
    assert (result.aux_loss > 0) == (balance == "aux_loss")
    errors: dict[str, float] = {}

    def record(key, error, what):
        errors[key] = max(errors.get(key, 0), error)
        if error > TOL:
            print(f"  {key} {what}: {error:.1e}")

    for rank, flat in enumerate(outputs):
        out = captured.layout.unflatten_outputs(flat)
        record("loss", _max_rel(out["loss"][0], result.loss), rank)
        record("grad_norm", _max_rel(out["grad_norm"][0], result.grad_norm), rank)
        record("totals", _max_rel(out["totals"][0], totals), rank)  # loss, aux, mtp, expert loads
        for n, value in zip(captured.updated_buffer_names, out["buffers"]):
            record("buffers", _max_rel(value, _rows_of(buffers[n], rows) if n in pipelined else buffers[n]), n)
        for group, full in (("params", params), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
            for n, value in zip(names, out[group]):
                expected = _rows_of(full[n], rows) if n in pipelined else full[n]
                record(group, _max_rel(value, _shard_of(expected, specs.get(n), rank)), f"device {rank} {n}")
    assert len(captured.updated_buffer_names) == (balance == "expert_bias")
    print(f"{name} {cfg.parallelism}: max relative error " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) <= TOL, errors
