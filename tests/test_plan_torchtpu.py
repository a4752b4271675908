"""The planner's TorchTPU runtimes (plan/torchtpu.py) against the plan's own terms: split at every
collective is the plan without overlap and with its out-of-place update; one program is the plan
with overlap and the update of the program `titan-tpu compile` certifies (donated, in place)."""

from __future__ import annotations

import pytest

from titan_tpu.plan.planner import plan_config
from titan_tpu.plan.setting import for_planning
from titan_tpu.plan.torchtpu import torchtpu_lines, torchtpu_step

# A TPU recipe with the chunked loss, on TorchTPU (the recipe runs the JAX path, whose plan is always
# `as_compiled`): `as_compiled` then differs from a TPU's plan by the donated update alone (tokamax's
# loss it also swaps for its plain-XLA form).
RECIPE = ("configs/qwen3_8b_tpu.toml", ["--kernels.loss", "chunked", "--compile.backend", "tpu"])


@pytest.fixture(scope="module")
def plans():
    cfg = for_planning(*RECIPE)
    return plan_config(cfg, measure=False), plan_config(cfg, measure=False, as_compiled=True)


def test_split_is_the_plan_without_overlap_and_out_of_place(plans):
    plan, _ = plans
    split = torchtpu_step(plan, "split")
    assert split.phases == plan.memory["phases"] and split.peak_bytes == plan.peak_bytes
    assert split.step_s == plan.time["step_s_no_overlap"] and not split.donated
    assert split.programs == 1 + 2 * sum(c["calls"] for c in plan.communication)
    assert split.tokens_per_s == pytest.approx(plan.tokens_per_s * plan.time["step_s"] / split.step_s)


def test_one_program_is_the_plan_with_overlap_and_the_certified_update(plans):
    plan, compiled = plans
    one = torchtpu_step(plan, "one_program")
    assert one.phases == pytest.approx(compiled.memory["phases"])
    assert one.phases["optimizer"] < plan.memory["phases"]["optimizer"]
    assert one.step_s == plan.time["step_s_overlap"] and one.programs == 1 and one.donated
    assert one.mfu == pytest.approx(plan.mfu * plan.time["step_s"] / one.step_s)


def test_it_needs_a_graph_step_a_tpu_runs(plans):
    plan, compiled = plans
    with pytest.raises(ValueError, match="not as_compiled"):
        torchtpu_step(compiled, "split")
    with pytest.raises(ValueError, match="one of one_program, split"):
        torchtpu_step(plan, "pipelined")
    eager = plan_config(for_planning(RECIPE[0], ["--training.mode", "eager"]), measure=False)
    with pytest.raises(ValueError, match="--training.mode graph"):
        torchtpu_step(eager, "split")


def test_titan_tpu_plan_prints_both_runtimes(plans, capsys):
    from titan_tpu.cli import main

    plan, _ = plans
    main(["plan", "--config", RECIPE[0], *RECIPE[1], "--torchtpu"])
    out = capsys.readouterr().out
    lines, _ = torchtpu_lines(plan)
    assert lines in out
    # The recipe as it stands runs the JAX path: --torchtpu shows the same step on TorchTPU.
    main(["plan", "--config", RECIPE[0], *RECIPE[1][:2], "--torchtpu"])
    assert lines in capsys.readouterr().out
