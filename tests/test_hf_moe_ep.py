"""Expert parallelism (`--parallelism.ep`) for Transformers-backend MoE models: transformers' stacked
experts (use_experts_implementation) laid out on the expert mesh by SimpleFSDP, each rank holding
E / ep experts, and our experts function (models/hf/hooks.py `_titan_experts`) bringing the ep
group's tokens to them through the model's dispatch. Compared with transformers' own model in one
process; the refusals are one line."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from titan_tpu.tools import hf_sweep  # noqa: E402

# Mixtral (gate_up [E, 2F, D]), Qwen3-MoE (the layout qwen3_moe's native adapter reads too) and
# gpt-oss (transposed, interleaved gate/up, per-expert biases, its own gate).
FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")
GRAPH_FAMILY = "qwen3_moe"  # also trained as a captured step with the all-to-all dispatch (the slowest part)
STEPS = 3
# Trained with activation checkpointing too: the recomputation in the backward dispatches again.
AC = {"mixtral": "full"}
TOL = 1e-5


def _save_tiny(family: str, root: Path) -> Path:
    """A tiny `family` model saved as an HF directory, with random biases: gpt-oss initialises its
    expert biases to zero, which would hide a bias added by the wrong expert."""
    config = hf_sweep.tiny_config(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    path = root / family
    model.save_pretrained(path)
    return path


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch per step; the first is the one the gradients are compared on."""
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(3, hf_sweep.VOCAB, (hf_sweep.BATCH, hf_sweep.SEQ + 1), generator=generator)
              for _ in range(STEPS)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _halves(batch, rank: int):
    rows = slice(rank * hf_sweep.BATCH // 2, (rank + 1) * hf_sweep.BATCH // 2)
    return tuple(t[rows].contiguous() for t in batch)


def _build(path: str, dispatch: str = "all_gather", ac: str = "none", **parallel):
    from titan_tpu.config import Config
    from titan_tpu.models.hf.spec import HFSpec
    from titan_tpu.models.spec import build
    from titan_tpu.parallel.simple_fsdp import MixedPrecision

    cfg = Config()
    cfg.parallelism.ep_dispatch = dispatch  # what models/spec.py `build` installs under ep
    cfg.activation_checkpoint.mode = ac
    return build(HFSpec.of_dir(path), cfg, device="cpu", seed=0, mp=MixedPrecision(), **parallel)


def _train(model, batches, *, graph: bool, dp_size: int, micro_batches) -> tuple[list[float], dict]:
    """STEPS optimizer steps (each over `micro_batches(batch)`): the losses and the full parameters."""
    from titan_tpu.graph.compile import GraphStep
    from titan_tpu.train.optim import AdamW, trained_parameters
    from titan_tpu.train.step import EagerStep

    optimizer = AdamW(trained_parameters(model))
    if graph:
        step = GraphStep(model, optimizer, max_norm=1.0, example_batch=micro_batches(batches[0])[0], backend="eager",
                         dp_size=dp_size)
    else:
        step = EagerStep(model, optimizer, max_norm=1.0, dp_size=dp_size)
    losses = [step(micro_batches(batch), 1e-3).loss for batch in batches]
    return losses, hf_sweep._full_params(model)


def _ep_rank(dirs: dict[str, str]) -> dict:
    """One of 2 ranks, dp_shard 2 x ep 2, every family: the loss and full gradients of the first
    batch (this rank's half of it), the local expert shapes, then STEPS training steps, eager with
    the all-gather dispatch (and captured with the all-to-all one, its static padded buffer, for
    GRAPH_FAMILY)."""
    import torch.distributed as dist

    from titan_tpu.parallel.mesh import ParallelDims

    rank = dist.get_rank()
    dims = ParallelDims(dp_shard=2, world_size=2, ep=2)
    parallel = dict(mesh=dims.build_mesh("cpu"), parallel_dims=dims, expert_mesh=dims.build_expert_mesh("cpu"))
    batches = _batches()
    out = {}
    for family, path in dirs.items():
        model = _build(path, **parallel)  # the directory's weights, each rank reading its experts
        inputs, labels = _halves(batches[0], rank)
        loss, grads = hf_sweep._loss_and_grads(model, inputs, labels, num_tokens=batches[0][1].numel(), dp_size=2)
        dist.all_reduce(loss)
        result = {"loss": loss.item(), "grads": grads,
                  "local": {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if ".experts." in n},
                  "state": {n: tuple(t.shape) for n, t in model.state_dict().items()}}
        for mode in ("eager", "graph") if family == GRAPH_FAMILY else ("eager",):
            dispatch = "all_to_all" if mode == "graph" else "all_gather"
            ac = AC.get(family, "none")
            result[mode] = _train(_build(path, dispatch, ac, **parallel), batches, graph=mode == "graph", dp_size=2,
                                  micro_batches=lambda batch: [_halves(batch, rank)])
        out[family] = result if rank == 0 else {k: v for k, v in result.items() if k == "local"}
    return out


@functools.cache
def _reference(path: str) -> dict:
    """transformers' own model on the whole first batch (loss and gradients), and our model trained
    in one process on the ranks' halves as micro-batches."""
    from titan_tpu.models.hf.weights import reference_attention

    config = transformers.AutoConfig.from_pretrained(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation=reference_attention(config))
    theirs.train()
    inputs, labels = _batches()[0]
    logits = theirs(input_ids=inputs, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    grads = {f"hf_model.{n}": p.grad for n, p in theirs.named_parameters() if p.grad is not None}
    trained = _train(_build(path), _batches(), graph=False, dp_size=1,
                     micro_batches=lambda batch: [_halves(batch, 0), _halves(batch, 1)])
    return {"loss": loss.item(), "grads": grads, "trained": trained,
            "state": {n: tuple(t.shape) for n, t in _build(path).state_dict().items()}}


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory) -> tuple[dict, dict[str, str]]:
    """Every family on 2 ranks in one spawn (starting ranks costs more than these tiny models)."""
    from dist_utils import run_distributed

    root = tmp_path_factory.mktemp("hf_moe_ep")
    dirs = {family: str(_save_tiny(family, root)) for family in FAMILIES}
    return run_distributed(_ep_rank, world_size=2, args=(dirs,), timeout_s=300), dirs


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_two_ep_ranks_match_transformers_and_one_process(family, ep_runs):
    """dp_shard 2 x ep 2: each rank holds half the experts (whole) and the loss and gradients of the
    ranks' halves of a batch equal transformers' own model on the whole batch; checkpoints hold whole
    experts; STEPS training steps (eager, and captured with the all-to-all dispatch for one family) equal
    one process."""
    ranks, dirs = ep_runs
    want = _reference(dirs[family])
    got = ranks[0][family]
    experts = {n: s for n, s in want["state"].items() if ".experts." in n}
    assert experts and got["state"] == want["state"]  # whole experts in the state dict
    for rank in ranks:  # E / ep experts on each rank, whole on dp_shard_mod_ep (size 1 here)
        assert rank[family]["local"] == {n: (s[0] // 2, *s[1:]) for n, s in experts.items()}
    assert abs(got["loss"] - want["loss"]) <= TOL
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in got["grads"].items():
        assert hf_sweep._close(grad, want["grads"][name]) <= TOL, name
    want_losses, want_params = want["trained"]
    for mode in ("eager", "graph") if family == GRAPH_FAMILY else ("eager",):
        losses, params = got[mode]
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= TOL, (mode, losses, want_losses)
        for name, value in params.items():
            assert hf_sweep._close(value, want_params[name]) <= TOL, (mode, name)


@pytest.mark.multiprocess
def test_ep_checkpoint_resumes_on_one_process(tmp_path, data_cache):
    """`titan-tpu train` on 2 ranks with --parallelism.ep 2 (the all-to-all dispatch, which
    models/spec.py `build` installs) saves whole experts; one process resumes from that checkpoint
    and every loss is one process's all along."""
    from test_train_dist import losses, overrides, train_forked, train_here

    model = {"model__name": "hf", "model__hf_config": "qwen3_moe",
             "model__hf_overrides": "hidden_size=64,moe_intermediate_size=64,num_experts=4,num_experts_per_tok=2,"
                                    "num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,head_dim=16,"
                                    "vocab_size=512"}
    one = tmp_path / "one"
    train_here(overrides(one, data_cache, **model))
    run = tmp_path / "run"
    first = train_forked(2, overrides(run, data_cache, training__steps=5, training__batch_size=2,
                                      parallelism__dp_shard=2, parallelism__ep=2, parallelism__ep_dispatch="all_to_all",
                                      **model))
    assert "expert parallel: 2" in first
    from titan_tpu.train.checkpoint import load_full_state_dict

    saved = load_full_state_dict(run / "checkpoints" / "step-00000005")
    assert saved["hf_model.model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 64)
    assert "resumed from" in train_here(overrides(run, data_cache, **model))
    want, got = losses(one), losses(run)
    assert sorted(got) == sorted(want) == list(range(1, 11))
    assert max(abs(got[step] - want[step]) for step in want) <= TOL


def _tiny(model_type: str, **changes) -> list[str]:
    import json

    return ["--model.name", "hf", "--model.hf_config", model_type,
            "--model.hf_overrides", json.dumps({**hf_sweep.tiny_overrides(model_type), **changes})]


@pytest.mark.parametrize("model, ep, message", [
    (_tiny("qwen3"), 2, "parallelism.ep = 2 spreads MoE experts; Qwen3ForCausalLM has none"),
    (_tiny("qwen3_moe"), 3, "parallelism.ep = 3 must divide the 4 experts of Qwen3MoeForCausalLM"),
    (_tiny("dbrx"), 2, "cannot spread the experts of DbrxForCausalLM: DbrxExperts runs them in its own forward"),
    (_tiny("llama4_text"), 2, "cannot spread the experts of Llama4ForCausalLM: they are not transformers' stacked"),
])
def test_ep_refusals_are_one_line(model, ep, message):
    from titan_tpu.config import build_config
    from titan_tpu.run.setup import prepare_run

    with pytest.raises(ValueError) as err:
        prepare_run(build_config(None, [*model, "--parallelism.ep", str(ep)]))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_ep_is_allowed_for_stacked_experts():
    from titan_tpu.config import build_config
    from titan_tpu.run.setup import prepare_run

    prepare_run(build_config(None, [*_tiny("gpt_oss"), "--parallelism.ep", "2"]))


def test_planner_counts_stacked_experts_under_ep():
    """The planner counts an hf model's stacked experts as a native model's (plan/hf_terms.py): stored
    1 / dp_shard whatever ep, gathered E / ep, and the token dispatch on the ep axis."""
    from titan_tpu.plan import plan_config, resolve_hardware
    from titan_tpu.plan.setting import for_planning

    config = Path(__file__).resolve().parents[1] / "configs" / "llama3_debug.toml"
    model = ["--model.name", "hf", "--model.hf_config", "qwen3_moe", "--model.hf_overrides",
             "hidden_size=64,moe_intermediate_size=128,num_experts=8,num_experts_per_tok=2,num_hidden_layers=2,"
             "num_attention_heads=4,num_key_value_heads=2,head_dim=16,vocab_size=256",
             "--training.seq_len", "64", "--training.batch_size", "4", "--parallelism.dp_shard", "4"]
    plans = {ep: plan_config(for_planning(config, [*model, "--parallelism.ep", str(ep)]),
                             resolve_hardware("v5p", measure=False)[0], chips=4, measure=False)
             for ep in (1, 2)}
    experts = 2 * 8 * 3 * 64 * 128  # layers x experts x (gate, up, down) x D x F
    assert plans[1].params["experts"] == plans[2].params["experts"] == experts
    assert plans[1].params["stored_per_device"] == plans[2].params["stored_per_device"]
    # One piece gathered whole (every weight, in the compute dtype), less the other rank's experts.
    gathered = {ep: plan.memory["gathered_weights"] for ep, plan in plans.items()}
    compute_bytes = gathered[1] / plans[1].params["total"]
    assert gathered[1] - gathered[2] == pytest.approx(experts / 2 * compute_bytes)
    dispatch = [c for c in plans[2].communication if c["axis"] == "ep"]
    assert len(dispatch) == 1 and "MoE token dispatch" in dispatch[0]["purpose"]
    assert not [c for c in plans[1].communication if c["axis"] == "ep"]
