"""The one way to build a model (models/spec.py `build`) and the dispatch beside it.

`build` is what the trainer, eval, verify, hf-sweep and the planner's calibration call; its weights
are compared with the plain seeded init of models/registry.py (`build_model`), and the spec of a
Hugging Face directory with the native adapter's reading of it.
"""

import dataclasses

import pytest
import torch

from titan_tpu.config import build_config
from titan_tpu.models.hf.spec import HFSpec
from titan_tpu.models.hub.checkpoint import save_hf_checkpoint
from titan_tpu.models.registry import FAMILIES, MODEL_NAMES, build_model, get_model_args
from titan_tpu.models.spec import NativeSpec, build, model_spec, spec_for_hf_dir, spec_for_weights


@pytest.mark.parametrize("name, scan", [("llama3", False), ("qwen3_moe", True)])
def test_build_gives_the_seeded_init_of_the_flavor(name, scan):
    cfg = build_config(None, ["--model.name", name, "--training.device", "cpu", "--training.seq_len", "32",
                              "--model.scan_layers", str(scan).lower()])
    spec = model_spec(cfg.model)
    model = build(spec, cfg, device="cpu", seed=3)
    reference = build_model(dataclasses.replace(spec.args, max_seq_len=32), seed=3, scan_layers=scan)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)


def test_an_exported_native_directory_is_native_and_reads_back_its_args(tmp_path):
    args = get_model_args("qwen3", "debug")
    save_hf_checkpoint(tmp_path, name="qwen3", args=args, state_dict=build_model(args, seed=0).state_dict())
    spec = spec_for_hf_dir(tmp_path)
    assert isinstance(spec, NativeSpec) and spec.kind == "native"
    assert (spec.name, spec.args) == ("qwen3", args)


def test_a_directory_the_adapter_cannot_read_runs_on_the_transformers_backend(tmp_path):
    from transformers import AutoModelForCausalLM

    from titan_tpu.tools.hf_sweep import tiny_config

    AutoModelForCausalLM.from_config(tiny_config("gemma3_text")).save_pretrained(str(tmp_path))
    spec = spec_for_hf_dir(tmp_path)
    assert isinstance(spec, HFSpec) and spec.kind == "hf" and spec.hf_config == str(tmp_path)
    native = build_config(None, ["--model.name", "llama3", "--training.device", "cpu"]).model
    with pytest.raises(ValueError, match="unsupported HF model"):
        spec_for_weights(native, tmp_path)  # a native name takes HF weights through the adapter only


def test_the_config_offers_every_family_and_hf():
    assert MODEL_NAMES == tuple(FAMILIES)
    for name in (*MODEL_NAMES, "hf"):
        assert build_config(None, ["--model.name", name, "--model.hf_config", "llama"] if name == "hf"
                            else ["--model.name", name]).model.name == name


@pytest.mark.parametrize("shape,std,dtype", [((1000, 37), 0.02, torch.float32), ((4096, 64), 0.5, torch.float32),
                                             ((333,), 1.0, torch.bfloat16), ((128, 128), 0.02, torch.float16)])
def test_the_lean_truncated_normal_draws_torchs_values(shape, std, dtype):
    """Our truncated normal (one temporary, not four) takes the generator's values in torch's
    order: the same weights, and the generator left where torch leaves it."""
    from titan_tpu.models.common.transformer import _trunc_normal

    ours, theirs = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    torch.manual_seed(3)
    torch.nn.init.trunc_normal_(theirs, mean=0.0, std=std, a=-3 * std, b=3 * std)
    after_theirs = torch.rand(3)
    torch.manual_seed(3)
    _trunc_normal(ours, std)
    assert torch.equal(ours, theirs) and torch.equal(torch.rand(3), after_theirs)
    assert ours.abs().max() <= 3 * std
