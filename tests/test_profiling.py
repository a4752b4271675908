"""[profiling]: torch.profiler traces of a real run, one per rank, and the by-category table."""

import gzip
import json
from pathlib import Path

import pytest
from dist_utils import require_multiprocess_marker, train_on_ranks

from titan_tpu.config import build_config
from titan_tpu.loops import assemble
from titan_tpu.train.profiling import CATEGORIES, category

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml")


def test_categories_of_op_names():
    assert category("aten::mm") == category("aten::addmm") == "matmul"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert category("c10d::allgather_") == category("_c10d_functional::reduce_scatter_tensor") == "collectives"
    assert category("_c10d_functional::wait_tensor") == "waiting"
    assert category("aten::copy_", frozenset({"titan/data"})) == "waiting"
    assert category("aten::mul_", frozenset({"titan/optimizer"})) == "optimizer"
    assert category("aten::add") == "elementwise"
    assert category("aten::sort") == "MoE routing/indexing"
    assert set(CATEGORIES) >= {"matmul", "attention", "elementwise", "collectives", "waiting", "optimizer"}


def trace_names(path: Path) -> set[str]:
    with gzip.open(path, "rt") as f:
        trace = json.load(f)  # Perfetto and chrome://tracing read this same JSON
    return {event.get("name", "") for event in trace["traceEvents"]}


def test_one_process_run_profiles_its_window(tmp_path, train_overrides, capsys):
    cfg = build_config(CONFIG, train_overrides(training__steps=4, profiling__enabled="true", profiling__start_step=2,
                                               profiling__active_steps=2, checkpoint__enabled="false",
                                               validation__enabled="false"))
    assemble(cfg).train()
    profile = tmp_path / "run" / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["rank0.json.gz", "summary_rank0.json"]
    names = trace_names(profile / "rank0.json.gz")
    assert {"titan/data", "titan/optimizer", "aten::mm"} <= names
    summary = json.loads((profile / "summary_rank0.json").read_text())
    assert summary["steps"] == 2
    assert {"matmul", "attention", "elementwise", "optimizer", "waiting"} <= set(summary["ms_per_step"])
    out = capsys.readouterr().out
    assert "profile of steps 2-3, rank 0" in out and "matmul" in out


def test_memory_snapshot_needs_cuda(tmp_path, train_overrides):
    cfg = build_config(CONFIG, train_overrides(profiling__enabled="true", profiling__memory_snapshot="true"))
    with pytest.raises(ValueError, match="profiling.memory_snapshot records the CUDA allocator"):
        assemble(cfg).train()


@pytest.mark.multiprocess
def test_two_fully_shard_ranks_write_one_trace_each(tmp_path, data_cache):
    require_multiprocess_marker()
    run = tmp_path / "run"
    args = {"output_dir": run, "data.cache_dir": data_cache, "data.max_bytes": 1_500_000, "training.device": "cpu",
            "training.batch_size": 2, "training.seq_len": 64, "training.steps": 4, "lr_scheduler.warmup_steps": 1,
            "parallelism.dp_shard": 2,
            "metrics.tensorboard": "false", "validation.enabled": "false", "checkpoint.enabled": "false",
            "profiling.enabled": "true", "profiling.start_step": 2, "profiling.active_steps": 2}
    # Ranks forked from the fork server: the trainer as under torchrun, without 3 new interpreters.
    printed = train_on_ranks(CONFIG, [item for k, v in args.items() for item in (f"--{k}", str(v))])
    assert printed[0].count("profile of steps 2-3, rank 0") == 1 and "profile of steps" not in printed[1]  # rank 0
    for rank in (0, 1):
        names = trace_names(run / "profile" / f"rank{rank}.json.gz")
        assert {"titan/data", "titan/optimizer"} <= names, rank
        assert any("mm" in n for n in names) and any("scaled_dot_product" in n for n in names), rank
        assert any("all_gather" in n or "allgather" in n for n in names), rank
        assert any("reduce_scatter" in n for n in names), rank
        summary = json.loads((run / "profile" / f"summary_rank{rank}.json").read_text())["ms_per_step"]
        assert {"matmul", "attention", "elementwise", "collectives", "optimizer", "waiting"} <= set(summary), rank
