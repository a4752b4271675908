"""GRPO: the objective against TRL's GRPOTrainer, the sampler's log-probabilities against the
training forward's, rewards, prompts, the loop (learning signal, resume) and its one-line errors.

The reference for the loss is TRL itself (trl is a dev dependency): its GRPOTrainer's
`_compute_loss` on a transformers Llama, fed fixed completions, advantages, old and reference
log-probabilities; our native model holds the same weights (models/hf_adapter.py) and our
objective scores the same rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from data_fixtures import write_chat_tokenizer_dir, write_jsonl

from titan_tpu.config import build_config
from titan_tpu.data.batch import IGNORE_INDEX, RolloutBatch

LLAMA_DEBUG = str(Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_chat_tokenizer_dir(tmp_path_factory.mktemp("tok"))


# ------------------------------------------------------------------------------------------------
# the objective against TRL


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, tie_word_embeddings=False)
    return config, LlamaForCausalLM(config)


def _native(config, hf_sd):
    from titan_tpu.models.common.transformer import Transformer
    from titan_tpu.models.hf_adapter import from_hf_state_dict, model_args_from_hf_config

    _, args = model_args_from_hf_config(config.to_dict())
    model = Transformer(args)
    model.load_state_dict(from_hf_state_dict(hf_sd, args), strict=False)
    model.init_buffers()
    return model, args


def _trl_loss(tmp_path, tokenizer_dir, policy, inputs: dict, **grpo) -> tuple[float, dict, dict]:
    """TRL's GRPO loss, gradients and metrics on fixed inputs (no sampling: `_compute_loss` as its
    training step calls it on a generated batch)."""
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    policy.save_pretrained(tmp_path / "policy")  # where TRL builds its reference from (unused here: given)
    policy.config._name_or_path = str(tmp_path / "policy")
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=inputs["completion_ids"].shape[1], report_to=[], use_cpu=True, bf16=False,
                      **grpo)
    trainer = GRPOTrainer(model=policy, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "a"}] * 4),
                          processing_class=PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)))
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(policy, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    return loss.item(), grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type, beta, epsilon_high, kl_correction", [
    ("dapo", 0.0, None, True), ("dapo", 0.04, 0.28, True), ("grpo", 0.04, None, False), ("dr_grpo", 0.1, None, True)])
def test_loss_gradients_kl_and_clipping_equal_trl(tmp_path, tokenizer_dir, loss_type, beta, epsilon_high,
                                                  kl_correction):
    """4 completions of 2 prompts (equal prompt lengths: TRL left-pads, we right-pad), completions
    of different lengths, old log-probabilities away from the policy's so that some ratios clip,
    a reference away from it so that the KL term is not 0."""
    from titan_tpu.models.hf_adapter import to_hf_state_dict
    from titan_tpu.train.grpo import GRPOObjective, token_logps
    from titan_tpu.train.objective import ModelCalls

    config, policy = _tiny_llama()
    hf_sd = {k: v.clone() for k, v in policy.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    B, P, C, temperature = 4, 5, 7, 0.7
    prompt_ids = torch.randint(1, 96, (B, P), generator=g)
    completion_ids = torch.randint(1, 96, (B, C), generator=g)
    lengths = torch.tensor([7, 3, 5, 1])
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()
    completion_ids = completion_ids * completion_mask  # padded with 0 after each completion's end
    advantages = torch.tensor([0.9, -0.9, 1.3, -1.3])
    # Old and reference log-probabilities: the policy's own (at the temperature), moved by noise.
    model, args = _native(config, hf_sd)
    inputs_BS = torch.cat([prompt_ids, completion_ids], dim=1)[:, :-1]
    labels_BS = torch.cat([torch.full((B, P - 1), IGNORE_INDEX), torch.where(completion_mask.bool(), completion_ids,
                                                                               IGNORE_INDEX)], dim=1)
    with torch.no_grad():
        own_BS = token_logps(model(inputs_BS), labels_BS, temperature=temperature)
    own_BC = own_BS[:, P - 1:]
    old_BC = own_BC + 0.3 * torch.randn(B, C, generator=g)
    ref_BC = own_BC + 0.2 * torch.randn(B, C, generator=g)
    trl_inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
                  "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": old_BC,
                  "ref_per_token_logps": ref_BC, "num_items_in_batch": completion_mask.sum()}
    trl_loss, trl_grads, trl_metrics = _trl_loss(tmp_path, tokenizer_dir, policy, trl_inputs, loss_type=loss_type, beta=beta,
                                                 temperature=temperature, epsilon_high=epsilon_high,
                                                 use_bias_correction_kl=kl_correction)

    def spread(x_BC):  # completion-aligned [B, C] -> label-aligned [B, S], 0 on the prompt
        return torch.cat([torch.zeros(B, P - 1), x_BC * completion_mask], dim=1)

    batch = RolloutBatch(inputs_BS, labels_BS, advantages, spread(old_BC), spread(ref_BC) if beta else None)
    objective = GRPOObjective(epsilon=0.2, epsilon_high=epsilon_high, beta=beta, loss_type=loss_type,
                              temperature=temperature, max_completion_length=C, kl_correction=kl_correction)
    count = objective.step_count([batch], dp_size=1)
    out = objective.micro_batch(ModelCalls(model), batch, count=count, share=1.0)
    out.objective.backward()
    terms = objective.report(out.totals).values
    assert abs(out.objective.item() - trl_loss) < 1e-5, (out.objective.item(), trl_loss)
    if beta:
        assert terms["kl"] > 1e-3 and abs(terms["kl"] - trl_metrics["kl"]) < 1e-5
    assert 0 < terms["clip_ratio/region_mean"] < 1
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert abs(terms[name] - trl_metrics[name]) < 1e-6, name
    ours = to_hf_state_dict({n: p.grad for n, p in model.named_parameters()}, args)
    for name, grad in trl_grads.items():
        torch.testing.assert_close(ours[name], grad, rtol=0, atol=1e-5, msg=name)


def test_group_advantages_are_trls():
    """TRL (grpo_trainer.py, `_generate_and_score_completions`, scale_rewards "group"): reward minus
    the group's mean over (the group's Bessel-corrected std + 1e-4); "batch": the batch's std."""
    from titan_tpu.train.grpo import group_advantages

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 0.5, 1.5, 1.0, 0.0])
    groups = rewards.view(3, 4)
    expected = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, group_size=4), expected.flatten())
    assert (group_advantages(rewards, group_size=4)[4:8] == 0).all()  # equal rewards teach nothing
    batch = (groups - groups.mean(1, keepdim=True)) / (rewards.std() + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, group_size=4, scale="batch"), batch.flatten())
    none = groups - groups.mean(1, keepdim=True)
    torch.testing.assert_close(group_advantages(rewards, group_size=4, scale="none"), none.flatten())
