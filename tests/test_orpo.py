"""ORPO: the objective's loss, metrics and gradients against TRL's ORPOTrainer, accumulation, the config.

The reference is TRL's own code (trl is a dev dependency): `ORPOTrainer.get_batch_loss_metrics`,
which runs its `concatenated_forward` (the NLL, `get_batch_logps(average_log_prob=True)`) and
`odds_ratio_loss`, on a trainer that holds only the attributes those methods read, with our native
model standing in for the Hugging Face one (its logits, from the same weights). TRL's batch is
built from the tokenized pairs' ids, lengths and prompt lengths, not from our labels, so a
mistake in how the objective finds the prompt and the completion shows.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from data_fixtures import WORDS, write_chat_tokenizer_dir, write_jsonl

from titan_tpu.config import build_config
from titan_tpu.data.preference import PreferencePairs, load_preference_pairs, pair_batch
from titan_tpu.data.tokenizer import load_tokenizer
from titan_tpu.train.objective import ModelCalls
from titan_tpu.train.orpo import ORPOObjective

LLAMA_DEBUG = str(Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml")
BETA = 0.25  # not TRL's default, so a beta dropped on either side shows


def preference_rows(n: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    return [{"prompt": f"p{i}: {words(1, 5)}", "chosen": f" {words(1, 4)}", "rejected": f" not {i} {words(1, 4)}"}
            for i in range(n)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> PreferencePairs:
    tmp = tmp_path_factory.mktemp("orpo")
    tokenizer = load_tokenizer(write_chat_tokenizer_dir(tmp / "tok"))
    return load_preference_pairs(str(write_jsonl(tmp / "pairs.jsonl", preference_rows(4))), tokenizer=tokenizer,
                                 seq_len=32)


@pytest.fixture()
def model():
    """A small native Llama holding the weights of a seeded transformers Llama (fp32, CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from titan_tpu.models.common.transformer import Transformer
    from titan_tpu.models.hub.adapter import from_hf_state_dict, model_args_from_hf_config

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=400, max_position_embeddings=64, tie_word_embeddings=False)
    hf = LlamaForCausalLM(config)
    _, args = model_args_from_hf_config(config.to_dict())
    native = Transformer(args)
    native.load_state_dict(from_hf_state_dict(hf.state_dict(), args), strict=False)
    native.init_buffers()
    return native


def trl_batch(pairs: PreferencePairs, index: list[int], *, mask_prompt: bool) -> dict[str, torch.Tensor]:
    """TRL's collated batch of the pairs: whole rows, attention masks, labels -100 on the prompt and
    padding. mask_prompt: the prompt masked out of the attention mask too, which our model ignores
    but TRL's NLL reads (its labels are the tokens the mask keeps): the NLL over the completion only."""
    batch = {}
    prompt_N1 = torch.from_numpy(pairs.prompt_len_N[index])[:, None]
    for side, rows, lengths in (("chosen", pairs.chosen_NT, pairs.chosen_len_N),
                                ("rejected", pairs.rejected_NT, pairs.rejected_len_N)):
        ids_NT = torch.from_numpy(rows[index]).long()
        position_T = torch.arange(ids_NT.shape[1])
        real_NT = position_T < torch.from_numpy(lengths[index])[:, None]
        completion_NT = real_NT & (position_T >= prompt_N1)
        batch[f"{side}_input_ids"] = ids_NT
        batch[f"{side}_attention_mask"] = (completion_NT if mask_prompt else real_NT).long()
        batch[f"{side}_labels"] = torch.where(completion_NT, ids_NT, -100)
    return batch


def trl_loss_and_metrics(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's ORPO loss and metrics of `batch`, our model standing in for the Hugging Face one."""
    from trl.experimental.orpo import ORPOTrainer

    trainer = ORPOTrainer.__new__(ORPOTrainer)  # only what the loss reads: no model, data or accelerate state
    trainer.beta, trainer.is_encoder_decoder, trainer.padding_value, trainer.aux_loss_enabled = BETA, False, 0, False
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda t: t)

    def hf_model(input_ids, attention_mask=None, use_cache=False):
        return SimpleNamespace(logits=model(input_ids))

    return trainer.get_batch_loss_metrics(hf_model, batch)


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("nll_includes_prompt", [True, False], ids=["trl", "completion_nll"])
def test_loss_metrics_and_gradients_equal_trl(pairs, model, nll_includes_prompt):
    index = [0, 1, 2, 3]
    loss, metrics = trl_loss_and_metrics(model, trl_batch(pairs, index, mask_prompt=not nll_includes_prompt))
    loss.backward()
    trl_grads = gradients(model)

    objective = ORPOObjective(beta=BETA, nll_includes_prompt=nll_includes_prompt)
    batch = pair_batch(pairs, index)
    count = objective.step_count([batch], dp_size=1)
    out = objective.micro_batch(ModelCalls(model), batch, count=count, share=1.0)
    out.objective.backward()
    ours = objective.report(out.totals).values

    assert abs(out.objective.item() - loss.item()) < 1e-5
    assert abs(ours["loss"] - loss.item()) < 1e-5
    assert ours["aux_loss"] == 0.0
    for name in ORPOObjective.terms[1:-1]:
        assert abs(ours[name] - metrics[name]) < 1e-5, (name, ours[name], metrics[name])
    assert 0 < ours["rewards/accuracies"] < 1  # the pairs disagree, so a swapped side shows
    for name, grad in gradients(model).items():
        assert trl_grads[name].abs().max() > 0, name
        torch.testing.assert_close(grad, trl_grads[name], rtol=0, atol=1e-5, msg=name)


def test_two_micro_batches_equal_one_batch_of_both(pairs, model):
    """The step's NLL is its token mean and the odds term its pair mean, whatever the split: two
    micro-batches of 2 pairs (different token counts) give the loss, terms and gradients of one of 4."""
    objective = ORPOObjective(beta=BETA)
    whole = pair_batch(pairs, [0, 1, 2, 3])
    halves = [pair_batch(pairs, [0, 1]), pair_batch(pairs, [2, 3])]
    assert objective.nll_tokens(halves[0]) != objective.nll_tokens(halves[1])  # a per-micro-batch mean would differ
    calls = ModelCalls(model)
    one = objective.micro_batch(calls, whole, count=objective.step_count([whole], 1), share=1.0)
    one.objective.backward()
    one_grads = gradients(model)
    count = objective.step_count(halves, 1)
    assert count == objective.step_count([whole], 1)
    totals = 0
    for half in halves:
        out = objective.micro_batch(calls, half, count=count, share=0.5)
        out.objective.backward()
        totals = totals + out.totals
    torch.testing.assert_close(totals, one.totals, rtol=0, atol=1e-6)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, one_grads[name], rtol=0, atol=1e-6, msg=name)


def test_validation_batch_reports_sums(pairs, model):
    """A count of 1 and share 0 (how validation scores a batch): the NLL summed over its tokens and
    the pair terms over its pairs, so a loop can divide each by its own count."""
    objective = ORPOObjective(beta=BETA)
    batch = pair_batch(pairs, [0, 1, 2, 3])
    with torch.no_grad():
        mean = objective.report(objective.micro_batch(ModelCalls(model), batch, count=objective.step_count([batch], 1),
                                                      share=1.0).totals).values
        summed = objective.report(objective.micro_batch(ModelCalls(model), batch, count=1, share=0.0).totals).values
    tokens = objective.nll_tokens(batch).item()
    assert summed["nll_loss"] == pytest.approx(mean["nll_loss"] * tokens, rel=1e-6)
    for name in ("rewards/chosen", "rewards/margins", "log_odds_ratio", "log_odds_chosen"):
        assert summed[name] == pytest.approx(mean[name] * 4, rel=1e-6), name
    assert summed["loss"] == pytest.approx(summed["nll_loss"] - BETA * summed["log_odds_ratio"], rel=1e-6)
    # Validation's loss from those sums (two held-out batches summed) is the step's loss over both.
    first, second = pair_batch(pairs, [0, 1]), pair_batch(pairs, [2, 3])
    with torch.no_grad():
        sums = sum(objective.validation_sums(b, objective.micro_batch(ModelCalls(model), b, count=1, share=0.0).totals)
                   for b in (first, second))
    assert objective.validation_loss(sums).item() == pytest.approx(mean["loss"], rel=1e-6)


def test_config_section():
    cfg = build_config(LLAMA_DEBUG, ["--training.objective", "orpo", "--orpo.beta", "0.5",
                                     "--orpo.nll_includes_prompt", "false"])
    assert (cfg.training.objective, cfg.orpo.beta, cfg.orpo.nll_includes_prompt) == ("orpo", 0.5, False)
    assert build_config(LLAMA_DEBUG).orpo.beta == 0.1  # TRL's ORPOConfig default
    with pytest.raises(ValueError, match=r"^orpo.beta = 0.0 must be > 0$"):
        build_config(LLAMA_DEBUG, ["--orpo.beta", "0"])


def test_captured_step_equals_eager_step(pairs, model):
    """The objective as the captured step traces it (the count a graph input, two accumulated
    micro-batches): the eager step's loss, terms and updated weights."""
    import copy

    from titan_tpu.graph.compile import GraphStep
    from titan_tpu.train.optim import AdamW
    from titan_tpu.train.step import EagerStep

    batches = [pair_batch(pairs, [0, 1]), pair_batch(pairs, [2, 3])]
    results, weights = [], []
    for captured in (False, True):
        copy_ = copy.deepcopy(model)
        optimizer = AdamW(dict(copy_.named_parameters()))
        objective = ORPOObjective(beta=BETA)
        step = (GraphStep(copy_, optimizer, max_norm=1.0, example_batch=batches[0], backend="aot_eager",
                          grad_accum_steps=2, objective=objective) if captured else
                EagerStep(copy_, optimizer, max_norm=1.0, objective=objective))
        results.append(step(batches, lr=1e-3))
        weights.append({n: p.detach().clone() for n, p in copy_.named_parameters()})
    eager, graph = results
    assert abs(eager.loss - graph.loss) < 1e-6 and eager.num_tokens == graph.num_tokens
    for name, value in eager.terms.items():
        assert abs(value - graph.terms[name]) < 1e-6, name
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=0, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------------
# the run: assembled from the kind's record, driven by the preference loop

def orpo_overrides(run: Path, data: Path, **extra) -> list[str]:
    values = {"output_dir": run, "data.cache_dir": run.parent / "cache", "training.device": "cpu",
              "training.objective": "orpo", "data.format": "preference", "data.source": data,
              "training.batch_size": 2, "training.seq_len": 32, "training.steps": 3, "metrics.log_freq": 1,
              "metrics.tensorboard": "false", "validation.enabled": "true", "validation.freq": 3,
              "validation.steps": 1, "data.val_fraction": 0.25, "checkpoint.enabled": "false",
              "lr_scheduler.warmup_steps": 0, "lr_scheduler.decay_ratio": 0.0, "orpo.beta": BETA}
    values.update({k.replace("__", "."): v for k, v in extra.items()})
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def test_a_run_learns_and_graph_equals_eager(tmp_path):
    """`titan-tpu train --training.objective orpo`: the loss falls with TRL's metrics in its rows, a
    validation loss is logged, and the captured step trains the same numbers as the eager one."""
    import json

    from titan_tpu.loops import assemble

    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(16))
    runs = {}
    for name, mode in (("eager", []), ("graph", ["--training.mode", "graph", "--compile.backend", "aot_eager"])):
        summary = assemble(build_config(LLAMA_DEBUG, orpo_overrides(tmp_path / name, data) + mode)).train()
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [r for r in rows if "loss" in r]
        assert summary["val_loss"] is not None and summary["val_loss"] > 0
    eager = runs["eager"]
    assert eager[-1]["loss"] < eager[0]["loss"]
    assert {"nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/margins"} <= set(eager[0])
    for a, b in zip(runs["graph"], eager):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["nll_loss"] == pytest.approx(b["nll_loss"],
                                                                                                   abs=1e-6)


def test_bad_config_is_one_line(tmp_path):
    from titan_tpu.run.setup import prepare_run

    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(4))
    with pytest.raises(ValueError, match="training.objective = orpo reads one source of preference pairs"):
        prepare_run(build_config(LLAMA_DEBUG, orpo_overrides(tmp_path / "run", data, data__format="text")))
    with pytest.raises(ValueError, match="data format = preference holds preference pairs for training.objective = "
                                         "dpo or orpo"):
        prepare_run(build_config(LLAMA_DEBUG, orpo_overrides(tmp_path / "run", data, training__objective="next_token")))
    with pytest.raises(ValueError, match="set them to 1"):
        prepare_run(build_config(LLAMA_DEBUG, orpo_overrides(tmp_path / "run", data, parallelism__tp=2)))


def test_plan_counts_three_rows_per_pair_and_no_reference(tmp_path):
    """The planner reads the kind's record: an ORPO pair is its chosen and rejected rows and the
    chosen again for the prompt's NLL (two rows without it), and there is no reference to store."""
    from titan_tpu.plan.hardware import resolve_hardware
    from titan_tpu.plan.planner import plan_config

    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(4))
    hardware, _ = resolve_hardware("v5p-8")
    overrides = orpo_overrides(tmp_path / "run", data, training__device="tpu", parallelism__dp_shard=4)

    def plan(*extra: str):
        return plan_config(build_config(LLAMA_DEBUG, overrides + list(extra)), hardware, chips=4, measure=False)

    orpo, completion_only, dpo = plan(), plan("--orpo.nll_includes_prompt", "false"), plan("--training.objective",
                                                                                           "dpo")
    assert "reference" not in orpo.memory and "reference_per_token" not in orpo.flops
    assert orpo.batch["tokens_per_step"] == 3 * completion_only.batch["tokens_per_step"] // 2
    assert completion_only.batch["tokens_per_step"] == dpo.batch["tokens_per_step"]
    assert dpo.memory["reference"] > 0
