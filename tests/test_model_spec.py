"""The model spec (models/spec.py) and the model contract (model_contract.py).

Every native flavor and the HF backend resolve to a spec that answers the trainer's questions;
the models both kinds build satisfy `TrainableModel` with the signatures the trainer, SimpleFSDP
and graph capture call.
"""

import dataclasses
import inspect

import pytest
import torch
from torch import nn

from titan_tpu.config import ModelConfig, build_config
from titan_tpu.model_contract import TrainableModel
from titan_tpu.models.registry import MODEL_FLAVORS, flops_per_token, get_model_args
from titan_tpu.models.spec import NativeSpec
from titan_tpu.parallel.mesh import ParallelDims
from titan_tpu.run.setup import prepare_run

TINY = ("hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
        "vocab_size=512")
NATIVE = [(name, flavor) for name, flavors in MODEL_FLAVORS.items() for flavor in flavors]
# The methods the protocol's body defines (what `isinstance` checks), __call__ included.
CONTRACT = [name for name, value in vars(TrainableModel).items()
            if inspect.isfunction(value) and (name == "__call__" or not name.startswith("_"))]


def _spec_of(overrides: list[str]):
    # seq_len 64 fits every flavor's max_seq_len; the spec itself does not depend on it.
    return prepare_run(build_config(None, ["--training.seq_len", "64", "--training.device", "cpu", *overrides])).spec


def _meta_model(spec, overrides: list[str]):
    cfg = build_config(None, ["--training.seq_len", "64", "--training.device", "cpu", *overrides])
    return spec.build_on_meta(cfg, mesh=None, parallel_dims=ParallelDims(dp_shard=1), documents=False)


@pytest.mark.parametrize("name, flavor", NATIVE, ids=[f"{n}-{f}" for n, f in NATIVE])
def test_every_native_flavor_resolves(name, flavor):
    spec = _spec_of(["--model.name", name, "--model.flavor", flavor])
    assert isinstance(spec, NativeSpec)
    assert spec.name == name and spec.label == f"{name}/{flavor}" and spec.plannable
    expected = get_model_args(name, flavor)
    if expected.moe is not None:  # the config's balancing options replace the flavor's
        defaults = ModelConfig()
        expected.moe = dataclasses.replace(expected.moe, load_balance=defaults.moe_load_balance,
                                           aux_loss_coef=defaults.moe_aux_loss_coef,
                                           bias_update_rate=defaults.moe_bias_update_rate)
    assert spec.args == expected
    flops, note = spec.flops_per_token(None, 64)
    assert flops == flops_per_token(spec.args, 64) and note == ""
    assert spec.own_tokenizer_path() is None


def test_native_model_satisfies_the_contract():
    overrides = ["--model.name", "qwen3_moe", "--model.moe_load_balance", "expert_bias"]
    model = _meta_model(_spec_of(overrides), overrides)
    _check_contract(model)
    assert model.expert_bias_names()  # the balancing buffers the step moves


def test_hf_spec_resolves_and_its_model_satisfies_the_contract():
    pytest.importorskip("transformers")
    from titan_tpu.models.hf.spec import HFSpec

    overrides = ["--model.name", "hf", "--model.hf_config", "qwen3", "--model.hf_overrides", TINY]
    spec = _spec_of(overrides)
    assert isinstance(spec, HFSpec)
    assert spec.name == "hf" and spec.label == "hf:qwen3" and not spec.plannable
    assert spec.args.vocab_size == 512 and spec.args.moe is None
    assert spec.own_tokenizer_path() is None  # a model_type, not a directory
    model = _meta_model(spec, overrides)
    _check_contract(model)
    assert model.expert_bias_names() == [] and model.updated_expert_biases({}, torch.zeros(0, 0)) == {}
    from titan_tpu.plan import plan_config
    from titan_tpu.plan.setting import for_planning

    # The planner measures what it has no formulas for (plan/hf_terms.py; tests/test_plan_hf.py).
    plan = plan_config(for_planning(None, overrides + ["--training.device", "cpu"]), measure=False)
    assert plan.params["total"] == sum(p.numel() for p in model.parameters())


def test_a_plain_module_is_not_a_trainable_model():
    # SimpleFSDP and the step accept plain modules (tests' MLPs) and skip what the contract adds.
    assert not isinstance(nn.Linear(2, 2), TrainableModel)


def _check_contract(model: nn.Module) -> None:
    assert isinstance(model, TrainableModel)
    for name in CONTRACT:
        want = inspect.signature(getattr(TrainableModel, name))
        got = inspect.signature(getattr(type(model), name if name != "__call__" else "forward"))
        assert _accepts(got, want), f"{type(model).__name__}.{name}{got} does not accept the calls of {want}"


def _accepts(got: inspect.Signature, want: inspect.Signature) -> bool:
    """Every parameter of `want` under the same name and kind; anything more has a default."""
    kinds = {name: p.kind for name, p in got.parameters.items()}
    extra = [p for name, p in got.parameters.items() if name not in want.parameters]
    return (all(kinds.get(name) == p.kind for name, p in want.parameters.items())
            and all(p.default is not inspect.Parameter.empty for p in extra))
