"""The tensor-parallel plan table (parallel/tensor_parallel.py BLOCK_PLAN, MLA_BLOCK_PLAN, MODEL_PLAN) covers the
Transformer's linear layers exactly: a new projection without a placement, or a stale path, fails."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from titan_tpu.models.common.transformer import Transformer
from titan_tpu.models.registry import get_model_args
from titan_tpu.parallel.tensor_parallel import BLOCK_PLAN, MLA_BLOCK_PLAN, MODEL_PLAN, block_plan


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_the_plan_names_every_linear_of_a_dense_block_and_the_vocabulary_layers(name):
    with torch.device("meta"):
        model = Transformer(get_model_args(name, "debug"))
    block = next(iter(model.layers.values()))
    linears = {path for path, m in block.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    assert linears == set(BLOCK_PLAN)
    vocabulary = {path: getattr(model, path) for path in MODEL_PLAN}  # output is None with tied embeddings
    assert isinstance(vocabulary["tok_embeddings"], nn.Embedding)
    assert all(m is None or isinstance(m, nn.Linear) for path, m in vocabulary.items() if path != "tok_embeddings")


def test_the_mla_plan_names_every_linear_of_both_query_forms():
    """MLA_BLOCK_PLAN: with the low-rank query (wq_a, wq_b) and without (wq), every linear has a
    placement and every path of the plan is one of the two forms' linears."""
    import dataclasses

    args = get_model_args("deepseek_v3", "debug")
    forms = []
    for q_lora_rank in (args.mla.q_lora_rank, 0):
        dense = dataclasses.replace(args, moe=None, mla=dataclasses.replace(args.mla, q_lora_rank=q_lora_rank))
        with torch.device("meta"):
            model = Transformer(dense)
        assert block_plan(dense) is MLA_BLOCK_PLAN
        block = next(iter(model.layers.values()))
        forms.append({path for path, m in block.named_modules() if isinstance(m, nn.Linear)})
    assert all(linears <= set(MLA_BLOCK_PLAN) for linears in forms)
    assert forms[0] | forms[1] == set(MLA_BLOCK_PLAN)
    assert block_plan(get_model_args("llama3", "debug")) is BLOCK_PLAN
