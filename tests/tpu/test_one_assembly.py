"""Certified = run: the program `titan-tpu compile` certifies is the program the trainer hands XLA.

For one rank of a 4-rank mesh, both ways: the run is `titan-tpu train` under torchrun, 4 gloo ranks
on the JAX path (XLA:CPU, one host device each), whose rank 0 logs each program's fingerprint
(graph/fingerprint.py) as it hands it to XLA; compile is `titan-tpu compile`'s core for 4 XLA host
devices, rank 0 assembled on a fake process group with fake tensors. Both resolve the run and build
the step with the same code (components/resolve.py, components/program.py); what these runs check
is that nothing of the real world changes the program: real weights (a Transformers-backend model's
chunked-loss check on them), the gloo group and rank 0's re-shard decision shared over it, the data's
batches, a frozen reference's weights. One run a model kind: a dense model with tp and two
micro-batches, an MoE with ep, an hf model, pipeline stages, LoRA, DPO and ORPO.
"""

from __future__ import annotations

import pytest
from test_jax_path import JAX, fingerprints, overrides, train

from titan_tpu.config import build_config
from titan_tpu.tools.compile_cmd import compile_step_for_tpu

pytestmark = pytest.mark.multiprocess  # torchrun's ranks: tests/stress.py runs them

TINY_HF = ("hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
           "num_key_value_heads=2,vocab_size=512")

# name -> (recipe, overrides beside the common ones): each a 4-rank mesh.
CASES = {
    "dense_dp2_tp2_accum2": ("llama3_debug", dict(parallelism__dp_shard=2, parallelism__tp=2,
                                                  training__grad_accum_steps=2)),
    "moe_dp4_ep2": ("qwen3_moe_debug", dict(parallelism__dp_shard=4, parallelism__ep=2)),
    "hf_dp4": ("llama3_debug", dict(parallelism__dp_shard=4, model__name="hf", model__hf_config="llama",
                                    model__hf_overrides=TINY_HF)),
    "pp2_dp2": ("llama3_debug", dict(parallelism__dp_shard=2, parallelism__pp=2, model__scan_layers="true")),
    "lora_dp4": ("llama3_debug", dict(parallelism__dp_shard=4, lora__enabled="true")),
    "dpo_dp4": ("llama3_debug_dpo", dict(parallelism__dp_shard=4, training__seq_len=32)),
    "orpo_dp4": ("llama3_debug_dpo", dict(parallelism__dp_shard=4, training__seq_len=32, training__objective="orpo")),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("one_assembly_cache")


@pytest.mark.parametrize("name", list(CASES))
def test_the_run_hands_xla_the_program_compile_certifies(tmp_path, cache, name):
    recipe, extra = CASES[name]
    args = dict(extra, training__steps=1, validation__enabled="false", checkpoint__enabled="false")
    printed = train(4, recipe, overrides(tmp_path / "run", cache, **args) + JAX)
    logged = fingerprints(printed)
    assert logged, printed[-2000:]
    cfg = build_config(f"configs/{recipe}.toml", overrides(tmp_path / "compiled", cache, **args) + JAX)
    certified = compile_step_for_tpu(cfg, "cpu:4")["fingerprints"]
    assert certified == {program: logged[program] for program in certified}, (certified, logged)
