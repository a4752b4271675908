"""docs/features.md's table of what runs with what (feature x eager / graph mode x native / Hugging
Face model) is kept true against the code's own refusals: each row's overrides are applied to a
native model (Llama 3 debug; Qwen3-MoE debug for the MoE rows) and to a tiny Hugging Face
directory (a tiny transformers Qwen3-MoE for the MoE rows), in eager and in graph mode, and a
cell says "yes" exactly when the config, the mesh and the model-parallel checks accept the
combination (the checks the trainer and the planner run before building anything). Nothing
trains here: what runs is tested where each feature is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from titan_tpu.config import build_config
from titan_tpu.parallel.context_parallel import check_context_parallel
from titan_tpu.parallel.mesh import ParallelDims
from titan_tpu.parallel.tensor_parallel import check_tensor_parallel
from titan_tpu.run.setup import prepare_run

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "features.md"
COLUMNS = (("eager", "native"), ("graph", "native"), ("eager", "hf"), ("graph", "hf"))
ROW = re.compile(r"^\| (?P<feature>[^|]+) \| `(?P<overrides>[^`]*)` \| (?P<cells>.*) \|$")


def table_rows() -> list[tuple[str, list[str], list[str]]]:
    """(feature, overrides, cells) of every row of the table in docs/features.md."""
    rows = []
    for line in TABLE.read_text().splitlines():
        if m := ROW.match(line):
            cells = [c.strip().split(" ")[0] for c in m["cells"].split("|")]
            rows.append((m["feature"].strip(), m["overrides"].split(), cells))
    return rows


def refusal(overrides: list[str]) -> str | None:
    """The first refusal of the config (read and set up), its mesh or the model-parallel checks, or None."""
    try:
        setup = prepare_run(build_config(ROOT / "configs" / "llama3_debug.toml", overrides))
        cfg, spec = setup.cfg, setup.spec
        p = cfg.parallelism
        ParallelDims.from_config(p, world_size=None)  # every axis the section sizes, pp's compositions too
        if spec.plannable:  # the native models' split checks (an hf model refuses tp and cp in its spec)
            check_tensor_parallel(spec.args, p.tp, seq_len=cfg.training.seq_len)
            check_context_parallel(p.cp, seq_len=cfg.training.seq_len, tp=p.tp)
    except ValueError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("hf")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=2048,
                max_position_embeddings=4096).save_pretrained(path)
    return path


# The MoE rows' Hugging Face model: transformers' Qwen3-MoE (stacked experts), tiny, from its model type.
HF_MOE = ["--model.name", "hf", "--model.hf_config", "qwen3_moe", "--model.hf_overrides",
          "hidden_size=64,moe_intermediate_size=64,num_experts=4,num_experts_per_tok=2,num_hidden_layers=2,"
          "num_attention_heads=4,num_key_value_heads=2,head_dim=16,vocab_size=2048"]


def column_overrides(mode: str, model: str, moe: bool, hf_dir: Path) -> list[str]:
    out = ["--training.mode", mode, "--training.device", "cpu"]
    if model == "hf":
        return out + (HF_MOE if moe else ["--model.name", "hf", "--model.hf_config", str(hf_dir)])
    return out + (["--model.name", "qwen3_moe", "--model.flavor", "debug"] if moe else [])


def test_the_table_is_the_codes(hf_dir):
    rows = table_rows()
    assert len(rows) >= 10, "docs/features.md lost its table"
    wrong = []
    for feature, overrides, cells in rows:
        assert len(cells) == len(COLUMNS), (feature, cells)
        moe = "(MoE)" in feature
        for (mode, model), cell in zip(COLUMNS, cells):
            reason = refusal(column_overrides(mode, model, moe, hf_dir) + overrides)
            actual = "yes" if reason is None else "no"
            if cell != actual:
                wrong.append(f"{feature} / {mode} / {model}: the table says {cell}, the code says {actual}"
                             + (f" ({reason})" if reason else ""))
    assert not wrong, "\n".join(wrong)


def test_a_wrong_cell_is_caught(hf_dir):
    assert refusal(column_overrides("eager", "hf", False, hf_dir) + ["--parallelism.tp", "2"]) is not None
    assert refusal(column_overrides("eager", "native", False, hf_dir) + ["--parallelism.tp", "2"]) is None
