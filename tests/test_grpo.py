"""GRPO: the objective against TRL's GRPOTrainer, the sampler's log-probabilities against the
training forward's, rewards, prompts, the loop (learning signal, resume) and its one-line errors.

The reference for the loss is TRL itself (trl is a dev dependency): its GRPOTrainer's
`_compute_loss` on a transformers Llama, fed fixed completions, advantages, old and reference
log-probabilities; our native model holds the same weights (models/hub/adapter.py) and our
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
    from titan_tpu.models.hub.adapter import from_hf_state_dict, model_args_from_hf_config

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
    from titan_tpu.models.hub.adapter import to_hf_state_dict
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
    trl_inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
                  "completion_ids": completion_ids,
                  "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": old_BC,
                  "ref_per_token_logps": ref_BC, "num_items_in_batch": completion_mask.sum()}
    trl_loss, trl_grads, trl_metrics = _trl_loss(
        tmp_path, tokenizer_dir, policy, trl_inputs, loss_type=loss_type, beta=beta, temperature=temperature,
        epsilon_high=epsilon_high, use_bias_correction_kl=kl_correction)

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


# ------------------------------------------------------------------------------------------------
# sampling and training see the same weights


def test_sampler_logprobs_equal_the_training_forward():
    """The log-probabilities `generate` reports for its samples (at the sampling temperature, the
    old policy's of the ratio) equal the training forward's on the same rows, within 1e-5 in fp32:
    the sampler runs the weights the step trains, through the cache, and the objective reads them."""
    import dataclasses

    from titan_tpu.generate import Sampling, generate
    from titan_tpu.loops.grpo import rollout_batch
    from titan_tpu.models.common.transformer import Transformer
    from titan_tpu.models.llama3 import LLAMA3_FLAVORS
    from titan_tpu.train.grpo import token_logps

    torch.manual_seed(0)
    args = dataclasses.replace(LLAMA3_FLAVORS["debug"], n_layers=2, vocab_size=128, max_seq_len=64)
    model = Transformer(args)
    model.init_weights()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [3]] * 2  # two samples of each, right-padded in the cache
    out = generate(model, prompts, max_new_tokens=10, sampling=Sampling(temperature=0.7, top_k=50), seed=3,
                   stop_ids={1, 2}, logprob_temperature=0.7)
    completions = [out.completion(i) for i in range(len(prompts))]
    batch = rollout_batch(prompts, completions, out.logprobs_BN.tolist(), advantages_N=torch.zeros(len(prompts)),
                          pad_id=0)
    with torch.no_grad():
        forward_BS = token_logps(model(batch.inputs_BS), batch.labels_BS, temperature=0.7)
    trained = batch.labels_BS != IGNORE_INDEX
    assert trained.sum() == sum(len(c) for c in completions) > 0
    assert (forward_BS - batch.old_logps_BS).abs().max() < 1e-5


# ------------------------------------------------------------------------------------------------
# rewards


def test_builtin_rewards_and_a_function_from_a_file(tmp_path):
    from titan_tpu.train.rewards import Rewards, final_answer

    assert final_answer("so it is 4 #### 42 ") == "42" and final_answer("x \\boxed{a{b}} y") == "a{b}"
    assert final_answer("  7\n") == "7"
    chat = [[{"role": "assistant", "content": " 12"}], [{"role": "assistant", "content": "13"}]]
    ids = [[1, 2, 3], [4]]
    both = Rewards(["exact_match", "length"], [1.0, 0.5], max_completion_length=4)
    totals, means = both.score(["q", "q"], chat, {"answer": ["12", 12], "completion_ids": ids})
    assert totals == [1.0 - 0.5 * 3 / 4, 0.0 - 0.5 * 1 / 4] and means == {"exact_match": 0.5, "length": -0.5}
    regex = Rewards(["regex"], [], pattern=r"^\d+$")
    assert regex.score(["q"] * 2, ["123", "12a"], {"completion_ids": ids})[0] == [1.0, 0.0]
    module = tmp_path / "my_reward.py"
    module.write_text("def longer(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    assert Rewards([f"{module}:longer"], []).score(["q"], ["abc"], {"completion_ids": [[1]]})[0] == [3.0]


@pytest.mark.parametrize("source, message", [
    ("no_such_module_xyz:f", r"grpo.reward = 'no_such_module_xyz:f': cannot import no_such_module_xyz "
                             r"\(ModuleNotFoundError"),
    ("json:no_such_function", r"json has no function 'no_such_function'"),
    ("missing.py:f", r"cannot import missing.py \(FileNotFoundError"),
    ("nonsense", r"neither a built-in \(exact_match, regex, length\) nor module:function"),
    ("regex", r"grpo.reward regex needs grpo.reward_pattern"),
])
def test_reward_that_cannot_be_loaded_is_one_line(source, message):
    from titan_tpu.train.rewards import Rewards

    with pytest.raises(ValueError, match=message) as e:
        Rewards([source], [])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("body, message", [
    ("return [1 / (len(c) - 3) for c in completions]",
     r"grpo.reward .*:f raised ZeroDivisionError: division by zero on prompt 'q2' and sample 'bad'"),
    ("return 1.0", r"returned float; return a list of one number per completion \(3\)"),
    ("return [1.0, 2.0]", r"returned 2 values for 3 completions"),
    ("return [1.0, None, 0.0]",
     r"returned None for completion 1 \(prompt 'q1', sample 'okay'\); return finite numbers"),
    ("return [1.0, 'x', 0.0]", r"returned 'x' for completion 1"),
])
def test_reward_that_raises_or_returns_the_wrong_thing_is_one_line(tmp_path, body, message):
    from titan_tpu.train.rewards import Rewards

    (tmp_path / "r.py").write_text(f"def f(prompts, completions, **kw):\n    {body}\n")
    rewards = Rewards([f"{tmp_path / 'r.py'}:f"], [])
    with pytest.raises(ValueError, match=message) as e:
        rewards.score(["q0", "q1", "q2"], ["good", "okay", "bad"], {"completion_ids": [[1], [2], [3]]})
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------
# prompts and the config


def test_prompts_read_jsonl_parquet_and_chat_and_the_loader_resumes(tmp_path, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from titan_tpu.data.chat import load_chat_template
    from titan_tpu.data.prompts import PromptLoader, load_prompts
    from titan_tpu.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    rows = [{"prompt": f"alpha {i} beta", "answer": str(i)} for i in range(6)]
    plain = load_prompts(str(write_jsonl(tmp_path / "p.jsonl", rows)), tokenizer=tok, max_prompt_len=16)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    again = load_prompts(str(tmp_path / "p.parquet"), tokenizer=tok, max_prompt_len=16)
    assert [r.ids for r in plain] == [r.ids for r in again] == [tok.encode_prompt(r["prompt"]) for r in rows]
    assert plain[2].columns == {"answer": "2"} and plain[2].prompt == "alpha 2 beta"
    chat = [{"prompt": [{"role": "user", "content": "alpha"}], "answer": "1"}]
    row = load_prompts(str(write_jsonl(tmp_path / "c.jsonl", chat)), tokenizer=tok, max_prompt_len=32,
                       chat_template=load_chat_template(tokenizer_dir))[0]
    assert row.chat and tok.decode(row.ids).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match=r"p.jsonl row 1: the prompt is \d+ tokens, longer than training.seq_len - "
                                         r"grpo.max_completion_length = 2"):
        load_prompts(str(tmp_path / "p.jsonl"), tokenizer=tok, max_prompt_len=2)
    one = PromptLoader(plain, batch_size=2, seed=1)
    ranks = [PromptLoader(plain, batch_size=1, seed=1, dp_rank=r, dp_world_size=2) for r in range(2)]
    for _ in range(4):  # across an epoch's end
        assert [r.prompt for r in one.next_batch()] == [r.next_batch()[0].prompt for r in ranks]
    resumed = PromptLoader(plain, batch_size=2, seed=1)
    resumed.load_state_dict(one.state_dict())
    assert [r.prompt for r in resumed.next_batch()] == [r.prompt for r in one.next_batch()]


def grpo_overrides(tmp_path: Path, data: Path, reward: str, **extra) -> list[str]:
    values = {"output_dir": tmp_path / "run", "data.cache_dir": tmp_path / "cache", "training.device": "cpu",
              "training.objective": "grpo", "data.format": "prompts", "data.source": data,
              "training.batch_size": 2, "training.seq_len": 16, "training.steps": 2, "metrics.log_freq": 1,
              "metrics.tensorboard": "false", "validation.enabled": "false", "checkpoint.enabled": "false",
              "lr_scheduler.warmup_steps": 0, "lr_scheduler.decay_ratio": 0.0, "grpo.num_generations": 4,
              "grpo.max_completion_length": 6, "grpo.reward": reward, "optimizer.lr": 1e-3}
    values.update({k.replace("__", "."): v for k, v in extra.items()})
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def digit_rows(n: int) -> list[dict]:
    return [{"prompt": f"say {i % 10}:", "answer": str(i % 10)} for i in range(n)]


@pytest.mark.parametrize("extra, message", [
    ({"grpo__num_generations": 1}, r"grpo.num_generations = 1 must be >= 2"),
    ({"data__format": "text"}, r"training.objective = grpo reads one source of prompt rows: set data.format = prompts"),
    ({"training__objective": "next_token"}, r"data format = prompts holds prompt rows for training.objective = grpo"),
    ({"training__mode": "graph"}, r"training.objective = grpo runs in training.mode = eager"),
    ({"grpo__max_completion_length": 16}, r"grpo.max_completion_length = 16 leaves no room for a prompt"),
    ({"training__grad_accum_steps": 3}, r"training.grad_accum_steps = 3 must divide the 8 samples"),
    ({"grpo__reward_weights": "1,2"}, r"grpo.reward_weights has 2 numbers for 1 rewards"),
])
def test_bad_config_is_one_line(tmp_path, extra, message):
    from titan_tpu.run.setup import prepare_run

    data = write_jsonl(tmp_path / "p.jsonl", digit_rows(8))
    with pytest.raises(ValueError, match=message) as e:
        prepare_run(build_config(LLAMA_DEBUG, grpo_overrides(tmp_path, data, "exact_match", **extra)))
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------
# the loop


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# A reward that varies between samples from the first step (a random policy's token ids).
ID_REWARD = ("def f(prompts, completions, completion_ids, **kw):\n"
             "    return [float(sum(i) % 7) for i in completion_ids]\n")


def test_run_logs_trl_metrics_and_resumes_exactly(tmp_path, capsys):
    """3 steps with 2 passes each and a KL penalty against a frozen reference, checkpoints at steps 2
    and 3; the run resumed from its step-2 checkpoint samples the same completions at step 3 (the
    sampler's seeds follow the step, the prompts the loader's position) and logs the same numbers."""
    import shutil

    from titan_tpu.loops import assemble

    data = write_jsonl(tmp_path / "p.jsonl", digit_rows(16))
    (tmp_path / "r.py").write_text(ID_REWARD)
    overrides = grpo_overrides(tmp_path, data, f"{tmp_path / 'r.py'}:f", training__steps=3, grpo__passes=2,
                               grpo__beta=0.04, checkpoint__enabled="true", checkpoint__interval=2,
                               checkpoint__keep_latest_k=0, training__grad_accum_steps=2, grpo__num_generations=2,
                               grpo__max_completion_length=4)
    assemble(build_config(LLAMA_DEBUG, overrides)).train()
    straight = [r for r in rows_of(tmp_path / "run") if "loss" in r]
    step_lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 3 and all(len(line) < 260 and "reward " in line and "kl " in line for line in step_lines)
    assert not any("clip_ratio" in line or "completions/" in line for line in step_lines)  # metrics.jsonl's
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000003")  # as if the run had died after step 2's checkpoint
    (checkpoints / "latest").write_text("step-00000002")
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line).get("step", 0) <= 2))
    assemble(build_config(LLAMA_DEBUG, overrides)).train()
    resumed = [r for r in rows_of(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in straight] == [r["step"] for r in resumed] == [1, 2, 3]
    keys = ("loss", "reward", "reward_std", "kl", "clip_ratio/region_mean", "completions/mean_length", "grad_norm")
    assert {k: straight[2][k] for k in keys} == {k: resumed[2][k] for k in keys}
    first, second = straight[0], straight[1]
    for key in ("reward", "reward_std", "rewards/f/mean", "frac_reward_zero_std", "completions/mean_length",
                "completions/min_length", "completions/max_length", "completions/clipped_ratio", "kl",
                "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "sampling_s", "training_s"):
        assert key in first, key
    assert first["reward_std"] > 0 and second["kl"] > 0  # the policy moved away from the reference


def test_lora_reference_is_the_base_model_without_a_copy(tmp_path):
    """LoRA-GRPO with a KL penalty: no second model; the reference's log-probabilities are the
    trained model's with its adapters off (the base), which the adapters' training leaves alone."""
    from titan_tpu.loops import assemble
    from titan_tpu.loops.grpo import rollout_batch
    from titan_tpu.train.grpo import token_logps

    data = write_jsonl(tmp_path / "p.jsonl", digit_rows(8))
    trainer = assemble(build_config(LLAMA_DEBUG, grpo_overrides(tmp_path, data, "length", grpo__beta=0.04,
                                                                   lora__enabled="true")))
    assert trainer.components.reference is None and trainer.components.objective.frozen_modules() == {}
    batch = rollout_batch([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], [[0.0] * 2, [0.0] * 3],
                          advantages_N=torch.zeros(2), pad_id=0)
    reference = trainer._reference_logps(batch)
    with torch.no_grad():
        for name, p in trainer.components.model.named_parameters():
            if "lora_" in name:
                p.add_(0.1)  # the adapters move, as training moves them
        policy = token_logps(trainer.components.model(batch.inputs_BS), batch.labels_BS)
    assert torch.equal(trainer._reference_logps(batch), reference)  # the base, untouched
    assert not torch.allclose(policy, reference)


@pytest.mark.multiprocess
def test_two_sharded_ranks_sample_their_own_prompts_and_step_together(tmp_path):
    """2 fully_shard ranks, one prompt each: each samples through the sharded model (its weights
    all-gathered in every decode step, the ranks decoding in step to max_completion_length), the
    rollout metrics are summed over both ranks' samples, and the update is the sharded step."""
    from dist_utils import train_on_ranks

    data = write_jsonl(tmp_path / "p.jsonl", digit_rows(8))
    (tmp_path / "r.py").write_text(ID_REWARD)
    train_on_ranks(LLAMA_DEBUG, grpo_overrides(tmp_path, data, f"{tmp_path / 'r.py'}:f", parallelism__dp_shard=2,
                                               training__batch_size=1, grpo__beta=0.04, grpo__passes=2))
    rows = [r for r in rows_of(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 1 <= row["completions/min_length"] <= row["completions/mean_length"] <= 6
        assert row["reward_std"] > 0 and row["grad_norm"] > 0
    assert rows[1]["kl"] > 0  # the sharded update moved the policy away from the (sharded) reference


def test_plan_counts_the_samples_and_the_kl_reference(tmp_path):
    """The planner reads the kind's record: a step's rows are its prompts' samples, and a KL
    penalty stores a frozen reference copy (none under LoRA: the base with its adapters off) whose
    forward runs once per batch of samples, which grpo.passes updates train on."""
    from titan_tpu.plan.hardware import resolve_hardware
    from titan_tpu.plan.planner import plan_config

    data = write_jsonl(tmp_path / "p.jsonl", digit_rows(8))
    hardware, _ = resolve_hardware("v5p-8")
    overrides = grpo_overrides(tmp_path, data, "length", training__device="tpu", parallelism__dp_shard=4)

    def plan(*extra: str):
        return plan_config(build_config(LLAMA_DEBUG, overrides + list(extra)), hardware, chips=4, measure=False)

    kl, no_kl, lora, two_passes = (plan("--grpo.beta", "0.04"), plan("--grpo.beta", "0"),
                                   plan("--grpo.beta", "0.04", "--lora.enabled", "true"),
                                   plan("--grpo.beta", "0.04", "--grpo.passes", "2"))
    t = kl.batch["tokens_per_step"]
    assert t == 2 * 4 * 16 * 4  # 2 prompts x 4 samples x 16 positions on each of 4 data-parallel ranks
    assert kl.memory["reference"] == kl.memory["parameters"] > 0 and lora.memory["reference"] == 0
    assert "reference" not in no_kl.memory
    per_token = no_kl.flops["per_token"]
    assert kl.flops["reference_per_token"] == pytest.approx(per_token / 3)
    assert two_passes.flops["reference_per_token"] == pytest.approx(per_token / 6)
