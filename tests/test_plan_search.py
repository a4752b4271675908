"""`titan-tpu plan --search` (plan/search.py): every ranked configuration is what the planner says
of the config with the printed overrides pasted; the global batch stays the config's; rejections
carry their reason; bad input and an empty space are one line. Whether the ranking matches real
runs is measured, not tested: bench/search_check.py, docs/planner.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_tpu.cli import main
from titan_tpu.config import build_config
from titan_tpu.plan import plan_config, resolve_hardware
from titan_tpu.plan.search import search
from titan_tpu.plan.setting import for_planning

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CPU = resolve_hardware("cpu", measure=False)[0]


def _tokens_per_step(cfg, devices):
    """Tokens of one step: tensor-parallel ranks share their data-parallel rank's batch."""
    dp_ranks = devices // cfg.parallelism.tp
    return cfg.training.batch_size * cfg.training.grad_accum_steps * cfg.training.seq_len * dp_ranks


@pytest.mark.parametrize("config,overrides,hardware", [
    ("llama3_debug", [], "cpu"),
    ("llama3_debug", ["--parallelism.dp_shard", "2"], "cpu"),
    ("qwen3_moe_debug", ["--parallelism.dp_shard", "4"], "cpu"),
    ("llama3_debug", ["--parallelism.dp_shard", "2", "--parallelism.tp", "2"], "cpu"),
    ("qwen3_8b_graph_tpu", [], None),
])
def test_ranked_configurations_are_the_plans_of_their_overrides(config, overrides, hardware):
    base = for_planning(CONFIGS / f"{config}.toml", overrides)
    hw = CPU if hardware == "cpu" else None
    result = search(base, hw, measure=False)
    assert result.fitting
    rates = [c.plan.tokens_per_s for c in result.fitting]
    assert rates[0] == pytest.approx(max(rates), rel=0.005)  # first within the tie of the best
    for c in result.fitting[:8]:
        # The reference: the planner on the config with the printed overrides pasted.
        pasted = for_planning(CONFIGS / f"{config}.toml", overrides + c.changes)
        again = plan_config(pasted, hw, measure=False) if hw else plan_config(pasted)
        assert again.tokens_per_s == pytest.approx(c.plan.tokens_per_s)
        assert again.peak_bytes == pytest.approx(c.plan.peak_bytes) and again.fits
        assert again.batch["tokens_per_step"] == c.plan.batch["tokens_per_step"] == \
            _tokens_per_step(base, result.devices)


def test_knobs_move_the_prediction_the_way_the_planner_models_them():
    result = search(build_config(CONFIGS / "llama3_debug.toml", ["--parallelism.dp_shard", "2"]), CPU, measure=False)
    first = result.fitting[0].values
    assert first["activation_checkpoint.mode"] == "none"  # recomputation costs FLOPs, memory is no limit here

    def best(**want):
        return max(c.plan.tokens_per_s for c in result.fitting
                   if all(c.values[k] == v for k, v in {**first, **want}.items()
                          if k not in ("parallelism.reshard_after_forward",)))

    # Per-parameter collectives (57 calls each way) pay gloo's per-call latency: slower than buckets (9).
    assert best(**{"parallelism.bucket_mb": 0.0}) < best(**{"parallelism.bucket_mb": 256.0})
    assert best(**{"activation_checkpoint.mode": "full"}) < best(**{"activation_checkpoint.mode": "selective"}) \
        < result.fitting[0].plan.tokens_per_s
    # Every candidate splits the same sequences per device (pipeline stages share a data-parallel rank's).
    assert {c.values["training.batch_size"] * c.values["training.grad_accum_steps"] // c.values["parallelism.pp"]
            for c in result.fitting} == {8}
    assert any(c.values["parallelism.pp"] == 2 for c in result.fitting)  # llama3 debug's 6 layers on 2 stages


def test_collective_calls_are_the_codes():
    """The calls SimpleFSDP makes on 2 ranks of llama3 debug (6 blocks, 9 buckets: README, counted
    in the traced graph by tests/test_buckets.py): 57 per parameter, 9 bucketed, 5 blocks
    gathered again when re-sharded after the forward. The default (auto) keeps them: the debug
    model fits with them kept, so the plan is the one with re-sharding off."""
    def calls(*overrides):
        plan = plan_config(build_config(CONFIGS / "llama3_debug.toml", ["--parallelism.dp_shard", "2", *overrides]),
                           CPU, measure=False)
        return [(c["kind"], c["calls"]) for c in plan.communication]

    assert calls("--parallelism.bucket_mb", "0") == [("all_gather", 57), ("reduce_scatter", 57)]
    assert calls("--parallelism.reshard_after_forward", "false") == [("all_gather", 9), ("reduce_scatter", 9)]
    assert calls("--parallelism.reshard_after_forward", "true") == [("all_gather", 9), ("all_gather", 5),
                                                                   ("reduce_scatter", 9)]
    assert calls() == calls("--parallelism.reshard_after_forward", "false")


def test_rejections_say_why():
    result = search(for_planning(CONFIGS / "qwen3_235b_a22b_tpu.toml"), measure=False)
    assert result.fitting and "memory" in result.rejected and "divisibility: ep" in result.rejected
    for c in result.rejected["divisibility: ep"]:
        assert c.values["parallelism.dp_shard"] % c.values["parallelism.ep"]
    for c in result.rejected["memory"]:
        assert c.plan.peak_bytes > c.plan.capacity_bytes
    graph = search(for_planning(CONFIGS / "qwen3_8b_graph_tpu.toml"), measure=False)
    # Graph mode accumulates micro-batches too: such candidates are planned, not refused.
    planned = graph.fitting + graph.rejected.get("memory", [])
    assert any(c.values["training.grad_accum_steps"] > 1 for c in planned)
    assert not any("micro-batch" in reason for reason in graph.rejected)


def test_cli_search_prints_overrides_and_json(capsys):
    argv = ["plan", "--search", "--config", str(CONFIGS / "qwen3_8b_graph_tpu.toml"), "--top", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("   overrides: ") == 3 and "rejected" in out and "memory (e.g." in out
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["best"]) == 3 and data["devices"] == 16
    assert data["fitting"] + sum(r["count"] for r in data["rejected"].values()) == data["candidates"]


def test_nothing_fits_is_one_line_with_how_much(capsys):
    code = main(["plan", "--search", "--config", str(CONFIGS / "llama3_405b_tpu.toml"), "--hardware", "v5e-8"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "nothing fits on 8 x v5e (16.0 GB per device)" in err and "x the device" in err
    # A space narrowed by --keep: AC none and unrolled on the recipe's own slice.
    code = main(["plan", "--search", "--config", str(CONFIGS / "llama3_405b_tpu.toml"),
                 "--activation_checkpoint.mode", "none", "--keep", "activation_checkpoint.mode"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "need more memory, the least" in err


def test_bad_search_input_is_one_line(capsys):
    assert main(["plan", "--search", "--config", str(CONFIGS / "llama3_debug.toml"), "--hardware", "tpu9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "known: v4, v5e, v5p, v6e, v7, h100, h200, b200, cpu" in err
    assert main(["plan", "--search", "--config", str(CONFIGS / "llama3_debug.toml"), "--keep", "training.steps"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a searched knob" in err and "activation_checkpoint.mode" in err


def test_search_holds_tp_and_factorises_the_rest():
    """With tp the search splits devices / tp into dp_replicate x dp_shard and keeps blocks unrolled
    (the layout tp runs), or into pipeline stages over the scanned stack; the 70B H100 recipe's tp 8
    on its 32 GPUs searches (it raised before)."""
    result = search(build_config(CONFIGS / "llama3_debug.toml", ["--parallelism.dp_shard", "2", "--parallelism.tp",
                                                                  "2"]), CPU, measure=False)
    assert result.devices == 4
    flat = [c for c in result.fitting if c.values["parallelism.pp"] == 1]
    staged = [c for c in result.fitting if c.values["parallelism.pp"] > 1]
    layouts = {(c.values["parallelism.dp_replicate"], c.values["parallelism.dp_shard"]) for c in flat}
    assert layouts == {(1, 2), (2, 1)}
    assert not any(c.values["model.scan_layers"] for c in flat)
    assert staged and all(c.values["model.scan_layers"] and c.values["parallelism.pp"] == 2 for c in staged)
    assert all(c.plan.mesh["tp"] == 2 for c in result.fitting)
    recipe = search(for_planning(CONFIGS / "llama3_70b_h100_tp.toml", []), measure=False,
                    keep=["parallelism.tp"])
    assert recipe.devices == 32 and recipe.fitting and not recipe.tps
    assert {c.values["parallelism.dp_replicate"] * c.values["parallelism.dp_shard"] * c.values["parallelism.pp"]
            for c in recipe.fitting} == {4}


def test_configurations_that_plan_the_same_are_one_row():
    """Bucket sizes that make the same buckets (25 and 256 MB hold a whole debug block) plan exactly
    the same: the search lists them once, naming the other size, and a row without buckets does
    not claim to re-shard."""
    cfg = for_planning(CONFIGS / "llama3_debug.toml", ["--parallelism.dp_shard", "2"])
    result = search(cfg, CPU, chips=2, measure=False)

    def plan_of(values: dict, bucket_mb: float):
        overrides = [f"--{key}={str(value).lower() if isinstance(value, bool) else value}"
                     for key, value in {**values, "parallelism.bucket_mb": bucket_mb}.items()]
        return plan_config(for_planning(CONFIGS / "llama3_debug.toml", overrides), CPU, chips=2, measure=False)

    merged = [c for c in result.fitting if c.same_buckets]
    assert merged, "25 and 256 MB buckets of the debug model were not recognised as the same"
    for c in merged:
        for size in c.same_buckets:
            twin = plan_of(c.values, size)
            assert twin.peak_bytes == c.plan.peak_bytes and twin.time == c.plan.time
            assert f"(= {size:g} MB)" in c.describe()
    for c in result.fitting:
        if c.values["parallelism.bucket_mb"] <= 0:
            assert "no buckets" in c.describe() and "re-shard" not in c.describe()


def test_lora_only_where_full_fine_tuning_fits_nowhere(capsys):
    """Llama 3 8B on one H200: full fine-tuning fits in no candidate, so the search ranks the same
    space with LoRA (each row the planner's plan of the config with its printed overrides, the
    adapters among them); `--keep lora.enabled` holds full fine-tuning, and nothing fits."""
    config = CONFIGS / "llama3_8b_cuda.toml"
    h200, chips = resolve_hardware("h200-1")
    result = search(for_planning(config), h200, chips=chips, measure=False)
    assert result.lora_fallback and result.rejected["memory"]
    assert all(not c.values["lora.enabled"] for c in result.rejected["memory"])
    for c in result.fitting[:3]:
        assert c.values["lora.enabled"] and c.changes[-2:] == ["--lora.enabled", "true"]
        again = plan_config(for_planning(config, c.changes), h200, chips=chips)
        assert again.peak_bytes == pytest.approx(c.plan.peak_bytes) and again.fits
    with pytest.raises(ValueError, match="nothing fits on 1 x h200"):
        search(for_planning(config), h200, chips=chips, keep=["lora.enabled"], measure=False)
    assert main(["plan", "--search", "--config", str(config), "--hardware", "h200-1", "--top", "1"]) == 0
    assert "full fine-tuning fits in none of them; with LoRA (lora.rank 16" in capsys.readouterr().out
    # A config with LoRA on is searched as LoRA, and one where full fine-tuning fits never gets it.
    assert all(c.values["lora.enabled"] for c in search(for_planning(config, ["--lora.enabled", "true"]), h200,
                                                        chips=chips, measure=False).fitting)
    assert not search(for_planning(CONFIGS / "llama3_debug.toml"), CPU, measure=False).lora_fallback


def test_moe_models_are_searched_in_pipeline_stages_with_ep_on_a_tpu():
    """pp x ep (ep inside each stage) is in the space for an MoE recipe on a TPU slice (the trainer
    runs it and lowers it as one program); each such candidate is the plan of its pasted overrides."""
    held = ["activation_checkpoint.mode", "model.scan_layers", "parallelism.bucket_mb",
            "parallelism.reshard_after_forward", "parallelism.dp_replicate"]
    config = CONFIGS / "qwen3_30b_a3b_tpu.toml"
    result = search(for_planning(config), keep=held, measure=False)
    staged = [c for c in result.fitting if c.values["parallelism.pp"] > 1 and c.values["parallelism.ep"] > 1]
    assert staged, sorted(result.rejected)
    for c in staged[:3]:
        again = plan_config(for_planning(config, c.changes))
        assert again.tokens_per_s == pytest.approx(c.plan.tokens_per_s) and again.peak_bytes == c.plan.peak_bytes
