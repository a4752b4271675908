"""The pipeline schedule (parallel/pipeline.py) on gloo ranks against the same layers applied in
sequence on one process: a stack of tanh(x W) layers split over 2 and 4 stages, GPipe and
circular, with as many micro-batches as stages and more (activations waiting at the first stage
for their next repeat). The loss, every layer's gradient and the inputs' gradients (which cross
every stage backwards) equal the sequential ones."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from titan_tpu.parallel.pipeline import PipelineSchedule, run_pipeline, run_pipeline_spmd
from titan_tpu.tracing import one_program_for_every_rank

D, ROWS, LAYERS = 8, 3, 8


def _problem(micro_batches: int):
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(LAYERS, D, D, generator=generator) / D ** 0.5
    inputs = torch.randn(micro_batches, ROWS, D, generator=generator)
    targets = torch.randn(micro_batches, ROWS, D, generator=generator)
    return weights, inputs, targets


def _sequential(micro_batches: int):
    weights, inputs, targets = _problem(micro_batches)
    weights.requires_grad_(True)
    inputs.requires_grad_(True)
    loss = 0.0
    for m in range(micro_batches):
        x = inputs[m]
        for layer in range(LAYERS):
            x = torch.tanh(x @ weights[layer])
        loss = loss + (x * targets[m]).sum()
    loss.backward()
    return loss.detach(), weights.grad, inputs.grad


def _stage(micro_batches: int, repeats: int):
    stages, stage = torch.distributed.get_world_size(), torch.distributed.get_rank()
    schedule = PipelineSchedule(stages=stages, micro_batches=micro_batches, repeats=repeats, n_layers=LAYERS)
    weights, inputs, targets = _problem(micro_batches)
    mine = weights[schedule.stage_layers(stage)].clone().requires_grad_(True)  # this stage's layers, repeat-major
    inputs.requires_grad_(True)

    def stage_fn(x, micro_batch, repeat):
        for w in mine[repeat * schedule.layers_per_chunk:(repeat + 1) * schedule.layers_per_chunk]:
            x = torch.tanh(x @ w)
        return x

    outputs, last, _ = run_pipeline(stage_fn, list(inputs), schedule=schedule, stage=stage,
                                 group=torch.distributed.group.WORLD)
    loss = sum((out * targets[m]).sum() for m, out in enumerate(outputs)) if outputs else 0.0 * last.sum()
    loss.backward()
    return {"loss": loss.detach(), "layers": schedule.stage_layers(stage), "grads": mine.grad,
            "input_grads": inputs.grad}


def _stage_one_program(micro_batches: int, repeats: int):
    """`_stage` by `run_pipeline_spmd`, as a step captured for the JAX lowering runs it: the stage,
    micro-batch and repeat as values, every stage computing in every iteration and the loss."""
    stages, stage = torch.distributed.get_world_size(), torch.distributed.get_rank()
    schedule = PipelineSchedule(stages=stages, micro_batches=micro_batches, repeats=repeats, n_layers=LAYERS)
    weights, inputs, targets = _problem(micro_batches)
    mine = weights[schedule.stage_layers(stage)].clone().requires_grad_(True)
    inputs.requires_grad_(True)
    chunk = schedule.layers_per_chunk

    def stage_fn(x, micro_batch, repeat):
        for j in range(chunk):
            x = torch.tanh(x @ mine.index_select(0, (repeat * chunk + j).reshape(1))[0])
        return x

    with one_program_for_every_rank():
        outputs, _, _ = run_pipeline_spmd(stage_fn, list(inputs), schedule=schedule, stage=torch.tensor(stage),
                                       group=torch.distributed.group.WORLD)
    loss = sum((out * targets[m]).sum() for m, out in enumerate(outputs))
    loss = loss if stage == stages - 1 else 0.0 * loss  # the last stage's outputs are the stack's
    loss.backward()
    return {"loss": loss.detach(), "layers": schedule.stage_layers(stage), "grads": mine.grad,
            "input_grads": inputs.grad}


@pytest.mark.multiprocess
@pytest.mark.parametrize("one_program", [False, True], ids=["per_rank", "one_program"])
@pytest.mark.parametrize("stages, micro_batches, repeats", [(2, 4, 1), (2, 5, 2), (4, 4, 2), (4, 6, 1)],
                         ids=["gpipe2", "circular2_waiting", "circular4", "gpipe4"])
def test_pipeline_equals_the_layers_in_sequence(stages, micro_batches, repeats, one_program):
    loss, weight_grads, input_grads = _sequential(micro_batches)
    ranks = run_distributed(_stage_one_program if one_program else _stage, world_size=stages,
                            args=(micro_batches, repeats))
    assert ranks[-1]["loss"] == pytest.approx(float(loss), rel=1e-6)
    held = sorted(layer for rank in ranks for layer in rank["layers"])
    assert held == list(range(LAYERS))
    for rank in ranks:
        torch.testing.assert_close(rank["grads"], weight_grads[rank["layers"]], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ranks[0]["input_grads"], input_grads, rtol=1e-5, atol=1e-6)


def test_schedule_layout_bubble_and_one_line_errors():
    circular = PipelineSchedule(stages=2, micro_batches=4, repeats=2, n_layers=8)
    assert circular.stage_layers(0) == [0, 1, 4, 5] and circular.stage_layers(1) == [2, 3, 6, 7]
    assert circular.iterations == 9 and circular.bubble == pytest.approx(1 / 9)
    assert PipelineSchedule(stages=4, micro_batches=8).bubble == pytest.approx(3 / 11)
    # Layers that do not fill pp x repeats chunks: padding rows in the last chunks (the last stages' last repeat).
    padded = PipelineSchedule(stages=4, micro_batches=4, repeats=2, n_layers=126)
    assert (padded.rows, padded.padding, padded.layers_per_chunk) == (128, 2, 16)
    assert padded.chunk_layers(3, 1) == range(112, 128) and padded.is_padding(126) and not padded.is_padding(125)
    assert padded.padding_notice.endswith("padded to 128 with 2 identity rows in the last chunks (1.6% of a stage's "
                                          "work, never saved)")
    assert PipelineSchedule(stages=4, micro_batches=4, repeats=2, n_layers=128).padding_notice == ""
    with pytest.raises(ValueError, match=r"^parallelism.pp \(4\) x parallelism.pp_repeats \(1\) chunks of the model's "
                                         r"6 layers leave a stage with padding rows only; lower pp or pp_repeats$"):
        PipelineSchedule(stages=4, micro_batches=4, repeats=1, n_layers=6)
    with pytest.raises(ValueError, match=r"^parallelism.pp_microbatches = 2 is fewer than the 4 pipeline stages"):
        PipelineSchedule(stages=4, micro_batches=2)


@pytest.mark.parametrize("args, message", [
    ([], "parallelism.pp > 1 splits the scanned layer stack into stages: set --model.scan_layers true"),
    (["--model.scan_layers", "true", "--parallelism.pp", "4", "--training.batch_size", "4"],
     "parallelism.pp (4) x parallelism.pp_repeats (1) chunks of the model's 6 layers leave a stage with padding"),
    (["--model.scan_layers", "true", "--training.batch_size", "3"],
     "training.batch_size = 3 rows do not split into parallelism.pp_microbatches = 2 equal micro-batches"),
    (["--model.scan_layers", "true", "--lora.enabled", "true"],
     "parallelism.pp > 1 with lora.enabled is not built yet"),
    (["--model.name", "hf", "--model.hf_config", "qwen3"],
     "parallelism.pp > 1 splits a native model's scanned layer stack into stages; the Transformers backend"),
    (["--config", "configs/llama3_debug_dpo.toml", "--model.scan_layers", "true"],
     "training.objective = dpo runs with dp_replicate and dp_shard alone; got parallelism."),
    (["--config", "configs/deepseek_v3_debug.toml", "--model.scan_layers", "true", "--model.mtp_num_layers", "1"],
     "parallelism.pp > 1 with multi-token prediction is not built yet"),
], ids=["no_scan", "layers", "batch", "lora", "hf_backend", "dpo", "mtp"])
def test_what_pipeline_stages_refuse_is_one_line(args, message, capsys):
    """Checked before anything is built."""
    from titan_tpu.cli import main

    config = [] if "--config" in args else ["--config", "configs/llama3_debug.toml"]
    code = main(["train", *config, "--training.device", "cpu", "--parallelism.pp", "2", *args])
    _, err = capsys.readouterr()
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_pipeline_stages_with_other_model_axes_are_one_line():
    from titan_tpu.parallel.mesh import ParallelDims

    with pytest.raises(ValueError, match=r"^--parallelism.pp > 1 composes with the data-parallel axes, tp and ep only "
                                         r"so far, not --parallelism.cp 2 \("):
        ParallelDims(pp=2, cp=2, dp_shard=1, world_size=4)


def test_the_pipeline_recipe_fills_its_slice():
    """configs/llama3_8b_pp_tpu.toml (tests/test_tpu_recipes.py checks it as every TPU recipe): its
    schedule splits the model's layers, and its batch splits into the micro-batches, one sequence each."""
    from titan_tpu.config import build_config
    from titan_tpu.models.registry import get_model_args

    cfg = build_config("configs/llama3_8b_pp_tpu.toml")
    p = cfg.parallelism
    assert "64 chips" in cfg.job.description and p.dp_replicate * p.dp_shard * p.pp == 64
    schedule = PipelineSchedule.from_config(p, n_layers=get_model_args(cfg.model.name, cfg.model.flavor).n_layers)
    assert (schedule.stages, schedule.layers_per_chunk, schedule.micro_batches) == (4, 1, cfg.training.batch_size)
    assert schedule.bubble == pytest.approx(3 / 35)
    assert (cfg.model.scan_layers, cfg.compile.backend, cfg.activation_checkpoint.mode) == (True, "jax", "none")
