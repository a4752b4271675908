"""DPO: preference data, the objective against TRL's DPOTrainer, the reference policy, the loops.

The reference for the loss and its gradients is TRL itself (trl is a dev dependency): its
DPOTrainer tokenizes the same rows, collates them and computes its loss on a transformers Llama;
our native model holds the same weights (models/hub/adapter.py) and our objective scores the rows
our own preference reader tokenized.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from data_fixtures import write_chat_tokenizer_dir, write_jsonl, write_parquet

from titan_tpu.config import build_config
from titan_tpu.data.batch import IGNORE_INDEX
from titan_tpu.data.preference import PreferenceLoader, load_preference_pairs, pair_batch
from titan_tpu.data.tokenizer import load_tokenizer

LLAMA_DEBUG = str(Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def pair_rows(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"prompt": f"q{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))),
             "chosen": " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5))),
             "rejected": f" no {i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))}
            for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_chat_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def dpo_overrides(tmp_path: Path, data: Path, **extra) -> list[str]:
    values = {"output_dir": tmp_path / "run", "data.cache_dir": tmp_path / "cache", "training.device": "cpu",
              "training.objective": "dpo", "data.format": "preference", "data.source": data,
              "training.batch_size": 2, "training.seq_len": 32, "training.steps": 2, "metrics.log_freq": 1,
              "metrics.tensorboard": "false", "validation.enabled": "false", "checkpoint.enabled": "false",
              "lr_scheduler.warmup_steps": 0, "lr_scheduler.decay_ratio": 0.0}
    values.update({k.replace("__", "."): v for k, v in extra.items()})
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


# ------------------------------------------------------------------------------------------------
# data


def test_pairs_label_the_completion_only_and_read_jsonl_parquet_and_chat(tmp_path, tokenizer_dir):
    rows = pair_rows(6)
    tok = load_tokenizer(tokenizer_dir)
    pairs = load_preference_pairs(str(write_jsonl(tmp_path / "p.jsonl", rows)), tokenizer=tok, seq_len=24)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    again = load_preference_pairs(str(tmp_path / "p.parquet"), tokenizer=tok, seq_len=24)
    assert (pairs.chosen_NT == again.chosen_NT).all() and (pairs.rejected_NT == again.rejected_NT).all()
    batch = pair_batch(pairs, torch.arange(len(rows)).numpy())
    for i, row in enumerate(rows):
        prompt, chosen = tok.encode(row["prompt"]), tok.encode(row["prompt"] + row["chosen"]) + [tok.eos_id]
        labels = batch.chosen.labels_BS[i]
        trained = labels[labels != IGNORE_INDEX].tolist()
        assert trained == chosen[len(prompt):]  # the completion and its EOS, nothing of the prompt
        assert batch.chosen.inputs_BS[i, :len(chosen) - 1].tolist() == chosen[:-1]
    # Chat messages: the prompt rendered with the generation prompt, the reply after it.
    chat = [{"prompt": [{"role": "user", "content": "alpha beta"}],
             "chosen": [{"role": "assistant", "content": "gamma"}],
             "rejected": [{"role": "assistant", "content": "delta delta"}]}]
    from titan_tpu.data.chat import load_chat_template

    pairs = load_preference_pairs(str(write_jsonl(tmp_path / "c.jsonl", chat)), tokenizer=tok, seq_len=24,
                                  chat_template=load_chat_template(tokenizer_dir))
    labels = pair_batch(pairs, torch.arange(1).numpy()).chosen.labels_BS[0]
    assert tok.decode(labels[labels != IGNORE_INDEX].tolist()) == "gamma<|im_end|>\n"


@pytest.mark.parametrize("row, message", [
    ({"prompt": "a", "chosen": "b"}, r"p.jsonl row 2 has no column 'rejected'"),
    ({"prompt": "a", "chosen": " b", "rejected": " b"}, r"p.jsonl row 2: chosen and rejected are identical"),
    ({"prompt": "alpha " * 40, "chosen": " b", "rejected": " c"},
     r"p.jsonl row 2: the prompt is \d+ tokens, longer than training.seq_len = 16"),
])
def test_bad_rows_are_one_line_naming_row_and_column(tmp_path, tokenizer_dir, row, message):
    path = write_jsonl(tmp_path / "p.jsonl", pair_rows(1) + [row])
    with pytest.raises(ValueError, match=message) as e:
        load_preference_pairs(str(path), tokenizer=load_tokenizer(tokenizer_dir), seq_len=16)
    assert "\n" not in str(e.value)


def test_parquet_row_missing_a_column(tmp_path, tokenizer_dir):
    path = write_parquet(tmp_path / "p.parquet", ["a", "b"], field="prompt")
    with pytest.raises(ValueError, match=r"p.parquet row 1 has no column 'chosen'"):
        load_preference_pairs(str(path), tokenizer=load_tokenizer(tokenizer_dir), seq_len=16)


def test_loader_shards_ranks_and_resumes():
    from titan_tpu.data.preference import PreferencePairs

    n = 10
    rows = torch.arange(n)[:, None].repeat(1, 9).numpy()
    pairs = PreferencePairs(rows, rows + 100, torch.full((n,), 9).numpy(), torch.full((n,), 9).numpy(),
                            torch.full((n,), 2).numpy())
    one = PreferenceLoader(pairs, batch_size=2, seed=3)
    ranks = [PreferenceLoader(pairs, batch_size=1, seed=3, dp_rank=r, dp_world_size=2) for r in range(2)]
    for _ in range(7):  # across an epoch's end
        whole = one.next_batch().chosen.inputs_BS[:, 0].tolist()
        assert whole == [r.next_batch().chosen.inputs_BS[0, 0].item() for r in ranks]
    resumed = PreferenceLoader(pairs, batch_size=2, seed=3)
    resumed.load_state_dict(one.state_dict())
    assert torch.equal(resumed.next_batch().chosen.inputs_BS, one.next_batch().chosen.inputs_BS)


# ------------------------------------------------------------------------------------------------
# the objective against TRL


def _trl_and_ours(tmp_path: Path, tokenizer_dir: Path, rows: list[dict]):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=400, max_position_embeddings=64, tie_word_embeddings=False)
    reference = LlamaForCausalLM(config)
    policy = LlamaForCausalLM(config)
    policy.load_state_dict(reference.state_dict())
    with torch.no_grad():  # a policy that has moved from the reference, so the loss is not ln 2
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf_sd = {k: v.clone() for k, v in policy.state_dict().items()}
    ref_sd = {k: v.clone() for k, v in reference.state_dict().items()}
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(rows), beta=0.1, report_to=[],
                     use_cpu=True, bf16=False, loss_type=["sigmoid"])  # fp32 throughout, as ours
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)))
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    batch = trainer.data_collator(examples)
    loss = trainer.compute_loss(policy, batch)
    loss.backward()
    trl = {"loss": loss.item(), "grads": {n: p.grad for n, p in policy.named_parameters()},
           "metrics": {k: v[-1] for k, v in trainer._metrics["train"].items()}, "examples": examples}
    return trl, config, hf_sd, ref_sd


def test_loss_gradients_and_rewards_equal_trl(tmp_path, tokenizer_dir):
    from titan_tpu.models.common.transformer import Transformer
    from titan_tpu.models.hub.adapter import from_hf_state_dict, model_args_from_hf_config, to_hf_state_dict
    from titan_tpu.train.dpo import DPOObjective
    from titan_tpu.train.objective import ModelCalls

    rows = pair_rows(3)
    trl, config, hf_sd, ref_sd = _trl_and_ours(tmp_path, tokenizer_dir, rows)
    _, args = model_args_from_hf_config(config.to_dict())
    policy, reference = Transformer(args), Transformer(args)
    policy.load_state_dict(from_hf_state_dict(hf_sd, args), strict=False)
    reference.load_state_dict(from_hf_state_dict(ref_sd, args), strict=False)
    policy.init_buffers(), reference.init_buffers()
    from titan_tpu.data.chat import load_chat_template

    pairs = load_preference_pairs(str(write_jsonl(tmp_path / "p.jsonl", rows)), tokenizer=load_tokenizer(tokenizer_dir),
                                  seq_len=24, chat_template=load_chat_template(tokenizer_dir))
    # Our reader tokenizes as TRL does: the same prompt, chosen and rejected ids.
    for i, ex in enumerate(trl["examples"]):
        n = int(pairs.prompt_len_N[i])
        assert pairs.chosen_NT[i, :n].tolist() == ex["prompt_ids"]
        assert pairs.chosen_NT[i, n:pairs.chosen_len_N[i]].tolist() == ex["chosen_ids"]
        assert pairs.rejected_NT[i, n:pairs.rejected_len_N[i]].tolist() == ex["rejected_ids"]
    objective = DPOObjective(beta=0.1, loss_type="sigmoid", reference=reference)
    out = objective.micro_batch(ModelCalls(policy, {"reference": reference}), pair_batch(pairs, range(3)), count=3,
                                share=1.0)
    out.objective.backward()
    terms = objective.report(out.totals)
    assert abs(out.objective.item() - trl["loss"]) < 1e-5
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert abs(terms.values[name] - trl["metrics"][name]) < 1e-5, name
    ours = to_hf_state_dict({n: p.grad for n, p in policy.named_parameters()}, args)
    assert set(ours) == set(trl["grads"])
    for name, grad in trl["grads"].items():
        torch.testing.assert_close(ours[name], grad, rtol=0, atol=1e-5, msg=name)


# ------------------------------------------------------------------------------------------------
# runs


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_first_step_is_ln2_with_trl_metrics_and_graph_equals_eager(tmp_path):
    from titan_tpu.loops import assemble

    data = write_jsonl(tmp_path / "p.jsonl", pair_rows(16))
    eager = tmp_path / "eager"
    assemble(build_config(LLAMA_DEBUG, dpo_overrides(eager, data))).train()
    first, second = [r for r in rows_of(eager / "run") if "loss" in r]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7)  # policy = reference: every margin 0
    assert first["rewards/margins"] == 0 and first["rewards/accuracies"] == 0
    assert second["loss"] < first["loss"] and second["rewards/margins"] > 0
    for mode in (["--training.mode", "graph", "--compile.backend", "aot_eager"],
                 ["--training.mode", "graph", "--compile.backend", "aot_eager", "--model.scan_layers", "true",
                  "--activation_checkpoint.mode", "full"]):
        run = tmp_path / mode[-1]
        assemble(build_config(LLAMA_DEBUG, dpo_overrides(run, data) + mode)).train()
        graph = [r for r in rows_of(run / "run") if "loss" in r]
        for a, b in zip(graph, [first, second]):
            assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["rewards/margins"] - b["rewards/margins"]) < 1e-6


def test_lora_reference_is_the_base_model_without_a_copy(tmp_path):
    from titan_tpu.loops import assemble
    from titan_tpu.models.common.transformer import Transformer
    from titan_tpu.train.objective import ModelCalls

    data = write_jsonl(tmp_path / "p.jsonl", pair_rows(16))
    cfg = build_config(LLAMA_DEBUG, dpo_overrides(tmp_path, data, lora__enabled="true", optimizer__lr=1e-2))
    trainer = assemble(cfg)
    trainer.train_step()
    trainer.train_step()
    objective, model = trainer.components.objective, trainer.components.model
    assert objective.frozen_modules() == {}
    batch = trainer.components.train_loader.next_batch()
    tokens = torch.cat([batch.chosen.inputs_BS, batch.rejected.inputs_BS])
    labels = torch.cat([batch.chosen.labels_BS, batch.rejected.labels_BS])
    calls = ModelCalls(model)
    reference = objective._reference_logps(calls, tokens, labels)
    # The base weights alone (adapters dropped) give the reference's log-probabilities ...
    base = Transformer(model.args)
    base.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" not in k})
    base.init_buffers()
    with torch.no_grad():
        assert torch.equal(reference, -base(tokens, labels, per_sequence=True).ce_sum)
        assert not torch.equal(reference, -model(tokens, labels, per_sequence=True).ce_sum)  # the adapters moved
        # ... and they are the model's own: changing a base weight in place changes the reference (a copy would not).
        model.layers["0"].attention.wq.weight.mul_(1.5)
    assert not torch.equal(objective._reference_logps(calls, tokens, labels), reference)


def test_bad_config_is_one_line(tmp_path):
    from titan_tpu.run.setup import prepare_run

    data = write_jsonl(tmp_path / "p.jsonl", pair_rows(4))
    with pytest.raises(ValueError, match="training.objective = dpo reads one source of preference pairs"):
        prepare_run(build_config(LLAMA_DEBUG, dpo_overrides(tmp_path, data, data__format="text")))
    with pytest.raises(ValueError, match="data format = preference holds preference pairs"):
        prepare_run(build_config(LLAMA_DEBUG, dpo_overrides(tmp_path, data, training__objective="next_token")))
    with pytest.raises(ValueError, match="set them to 1"):
        prepare_run(build_config(LLAMA_DEBUG, dpo_overrides(tmp_path, data, parallelism__tp=2)))


def test_planner_counts_the_reference(tmp_path):
    from titan_tpu.plan.hardware import resolve_hardware
    from titan_tpu.plan.planner import plan_config

    data = write_jsonl(tmp_path / "p.jsonl", pair_rows(4))
    hardware, _ = resolve_hardware("v5p-8")
    overrides = dpo_overrides(tmp_path, data, training__device="tpu", parallelism__dp_shard=4)
    dpo = plan_config(build_config(LLAMA_DEBUG, overrides), hardware, chips=4, measure=False)
    lora = plan_config(build_config(LLAMA_DEBUG, overrides + ["--lora.enabled", "true"]), hardware, chips=4,
                       measure=False)
    plain = plan_config(build_config(LLAMA_DEBUG, overrides[:overrides.index("--training.objective")] +
                                     ["--training.batch_size", "4", "--training.seq_len", "32",
                                      "--training.device", "tpu", "--parallelism.dp_shard", "4"]),
                        hardware, chips=4, measure=False)
    assert dpo.memory["reference"] == dpo.memory["parameters"] > 0  # a copy, sharded like the model
    assert lora.memory["reference"] == 0  # the base model with its adapters off
    # 2 pairs of 2 rows = the 4 rows of the next-token plan; the reference adds its forward, 1/3 of a token's.
    assert dpo.batch["tokens_per_step"] == plain.batch["tokens_per_step"]
    assert dpo.flops["model_per_step_per_device"] == pytest.approx(plain.flops["model_per_step_per_device"] * 4 / 3)


@pytest.mark.multiprocess
def test_two_sharded_ranks_equal_one_process_with_two_micro_batches(tmp_path):
    """2 fully_shard ranks, each its own pairs of the global batch, against one process that takes
    the same pairs as 2 micro-batches: the same losses and rewards, step by step."""
    from dist_utils import train_on_ranks

    from titan_tpu.loops import assemble

    data = write_jsonl(tmp_path / "p.jsonl", pair_rows(16))
    threads = torch.get_num_threads()  # one thread, as each rank runs
    torch.set_num_threads(1)
    try:
        assemble(build_config(LLAMA_DEBUG, dpo_overrides(tmp_path / "one", data, training__grad_accum_steps=2,
                                                             training__steps=3))).train()
    finally:
        torch.set_num_threads(threads)
    train_on_ranks(LLAMA_DEBUG, dpo_overrides(tmp_path / "two", data, parallelism__dp_shard=2, training__steps=3))
    one, two = ([r for r in rows_of(tmp_path / name / "run") if "loss" in r] for name in ("one", "two"))
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (key, a, b)
        # The reported norm of sharded gradients differs from one process's by ~7e-5 relative in
        # next-token training too (bench/step_parity.py: dp_shard_2 against one process with two
        # micro-batches, whose losses are bitwise equal); docs/known-issues.md.
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 2e-4 * a["grad_norm"], (a, b)
