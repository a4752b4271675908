"""Functional AdamW, gradient clipping and the WSD learning-rate schedule."""

import math

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from titan_tpu.train.optim import (
    AdamW,
    adamw_init,
    adamw_update,
    clip_grad_norm,
    clip_grad_norm_,
    lr_at,
    weight_decay_mask,
)

HP = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(32, 16),
        nn.Linear(16, 24),
        nn.LayerNorm(24),
        nn.Linear(24, 8, bias=False),
    )


def random_grads(params: dict, step: int) -> dict:
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}


def torch_adamw(model: nn.Module, *, lr: float, foreach: bool) -> torch.optim.AdamW:
    mask = weight_decay_mask(model.named_parameters())
    decay = [p for n, p in model.named_parameters() if mask[n]]
    no_decay = [p for n, p in model.named_parameters() if not mask[n]]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": HP["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(HP["beta1"], HP["beta2"]),
        eps=HP["eps"],
        foreach=foreach,
    )


def test_weight_decay_mask_matrices_only():
    mask = weight_decay_mask(small_model().named_parameters())
    assert mask == {
        "0.weight": True,  # embedding
        "1.weight": True,
        "1.bias": False,
        "2.weight": False,  # LayerNorm
        "2.bias": False,
        "3.weight": True,
    }


@pytest.mark.parametrize("foreach, tensor_args", [(False, False), (True, False), (True, True)])
def test_adamw_matches_torch_adamw(foreach, tensor_args):
    model = small_model()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    decay = weight_decay_mask(model.named_parameters())
    state = adamw_init(params)
    lrs = [1e-3 * (0.5 + (i % 5) / 4) for i in range(25)]  # a varying lr, as a schedule gives
    opt = torch_adamw(model, lr=lrs[0], foreach=foreach)
    for step, lr in enumerate(lrs, start=1):
        grads = random_grads(params, step)
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        if tensor_args:  # 0-dim tensors, as in a traced step
            step_arg, lr_arg = torch.tensor(float(step)), torch.tensor(lr)
        else:
            step_arg, lr_arg = step, lr
        params, state = adamw_update(params, grads, state, step=step_arg, lr=lr_arg, decay=decay, **HP)
        for n, p in model.named_parameters():
            assert (params[n] - p.detach()).abs().max().item() <= 1e-6, (step, n)
            assert (state["exp_avg"][n] - opt.state[p]["exp_avg"]).abs().max().item() <= 1e-6
            assert (state["exp_avg_sq"][n] - opt.state[p]["exp_avg_sq"]).abs().max().item() <= 1e-6


def test_adamw_update_is_pure_and_accepts_tensor_step_lr():
    model = small_model()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    decay = weight_decay_mask(model.named_parameters())
    state = adamw_init(params)
    state["exp_avg"] = {n: torch.randn_like(t) for n, t in state["exp_avg"].items()}
    state["exp_avg_sq"] = {n: torch.rand_like(t) for n, t in state["exp_avg_sq"].items()}
    grads = random_grads(params, 0)
    snapshot = [{n: t.clone() for n, t in d.items()} for d in (params, grads, state["exp_avg"], state["exp_avg_sq"])]

    out_f = adamw_update(params, grads, state, step=3, lr=1e-3, decay=decay, **HP)
    out_t = adamw_update(params, grads, state, step=torch.tensor(3), lr=torch.tensor(1e-3), decay=decay, **HP)

    for before, after in zip(snapshot, (params, grads, state["exp_avg"], state["exp_avg_sq"])):
        for n in before:
            assert torch.equal(before[n], after[n]), f"input {n} was mutated"
    for n in params:
        assert out_f[0][n] is not params[n]
        # 0-dim fp32 step/lr vs Python float64 scalars: the same math, rounded differently.
        torch.testing.assert_close(out_t[0][n], out_f[0][n], rtol=0, atol=1e-6)
        torch.testing.assert_close(out_t[1]["exp_avg_sq"][n], out_f[1]["exp_avg_sq"][n], rtol=0, atol=1e-6)


def test_adamw_update_traces_with_make_fx():
    model = small_model()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    decay = weight_decay_mask(model.named_parameters())

    def update(params, grads, state, step, lr):
        return adamw_update(params, grads, state, step=step, lr=lr, decay=decay, **HP)

    state = adamw_init(params)
    grads = random_grads(params, 0)
    traced = make_fx(update)(params, grads, state, torch.tensor(1.0), torch.tensor(1e-3))
    assert not any(n.target is torch.ops.aten.item.default for n in traced.graph.nodes)

    # The traced graph must give the eager results, step after step (new step/lr each time).
    p_eager, s_eager = params, state
    p_traced, s_traced = params, state
    for step in range(1, 6):
        grads = random_grads(params, step)
        lr = torch.tensor(1e-3 * step)
        p_eager, s_eager = update(p_eager, grads, s_eager, torch.tensor(float(step)), lr)
        p_traced, s_traced = traced(p_traced, grads, s_traced, torch.tensor(float(step)), lr)
        for n in params:
            assert torch.equal(p_eager[n], p_traced[n])
            assert torch.equal(s_eager["exp_avg_sq"][n], s_traced["exp_avg_sq"][n])


def test_missing_grad_leaves_param_and_state_alone():
    params = {"w": torch.randn(3, 3), "b": torch.randn(3)}
    state = adamw_init(params)
    new_params, new_state = adamw_update(
        params, {"w": torch.randn(3, 3)}, state, step=1, lr=1e-2, decay={"w": True, "b": False}, **HP
    )
    assert new_params["b"] is params["b"] and new_state["exp_avg"]["b"] is state["exp_avg"]["b"]
    assert not torch.equal(new_params["w"], params["w"])
    with pytest.raises(ValueError, match="not parameters"):
        adamw_update(params, {"x": torch.randn(1)}, state, step=1, lr=1e-2, decay={}, **HP)


def test_eager_adamw_matches_torch_adamw_in_place():
    """The eager holder updates the nn.Parameters themselves, as torch.optim.AdamW does."""
    ours, ref = small_model(), small_model()
    opt = AdamW(dict(ours.named_parameters()), **HP)
    ref_opt = torch_adamw(ref, lr=1e-3, foreach=True)
    ids_before = [id(p) for p in ours.parameters()]
    for step in range(1, 21):
        grads = random_grads(dict(ours.named_parameters()), step)
        for n, p in ref.named_parameters():
            p.grad = grads[n].clone()
        ref_opt.step()
        opt.step(grads, lr=1e-3)
        for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
            assert (p - q).abs().max().item() <= 1e-6, (step, n)
    assert [id(p) for p in ours.parameters()] == ids_before


def test_adamw_wrapper_matches_functional_and_resumes_exactly():
    def run(model, opt, steps):
        for step in steps:
            grads = random_grads(dict(model.named_parameters()), step)
            opt.step(grads, lr=1e-3)

    model_a = small_model()
    opt_a = AdamW(dict(model_a.named_parameters()), **HP)
    run(model_a, opt_a, range(1, 11))

    # Stop after 5 steps, save, rebuild from scratch, load, continue.
    model_b = small_model()
    opt_b = AdamW(dict(model_b.named_parameters()), **HP)
    run(model_b, opt_b, range(1, 6))
    saved_model = {k: v.clone() for k, v in model_b.state_dict().items()}
    saved_opt = {k: (dict(v) if isinstance(v, dict) else v) for k, v in opt_b.state_dict().items()}
    saved_opt = {k: ({n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v) for k, v in saved_opt.items()}
    assert saved_opt["step"] == 5

    model_c = small_model()
    model_c.load_state_dict(saved_model)
    opt_c = AdamW(dict(model_c.named_parameters()), **HP)
    opt_c.load_state_dict(saved_opt)
    run(model_c, opt_c, range(6, 11))

    for (n, pa), pc in zip(model_a.named_parameters(), model_c.parameters()):
        assert torch.equal(pa, pc), n
    assert opt_c.step_count == 10
    with pytest.raises(ValueError, match="missing"):
        opt_c.load_state_dict({"step": 1})


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(max_norm, inplace):
    torch.manual_seed(0)
    grads = {f"g{i}": torch.randn(7, i + 1) * (i + 1) for i in range(5)}
    if inplace:
        original = {n: g.clone() for n, g in grads.items()}
        norm = clip_grad_norm_(grads, max_norm)
        clipped, grads = grads, original
    else:
        clipped, norm = clip_grad_norm(grads, max_norm)

    refs = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(refs, grads.values()):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(refs, max_norm)
    torch.testing.assert_close(norm, ref_norm)
    for p, n in zip(refs, grads):
        torch.testing.assert_close(clipped[n], p.grad)
    if max_norm > 1e3:  # not clipping: grads come back unchanged
        assert all(torch.equal(clipped[n], grads[n]) for n in grads)
    else:
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in clipped.values()]))
        assert abs(total.item() - max_norm) < 1e-4


def test_clip_grad_norm_disabled_and_pure_and_fp32_accumulation():
    grads = {"a": torch.full((4,), 3.0), "b": torch.full((4,), 4.0)}
    before = {n: g.clone() for n, g in grads.items()}
    out, norm = clip_grad_norm(grads, 0.0)
    assert norm.item() == pytest.approx(10.0)
    assert all(out[n] is grads[n] for n in grads)
    clip_grad_norm(grads, 1.0)
    assert all(torch.equal(before[n], grads[n]) for n in grads)
    # bf16 grads: the norm is accumulated and returned in fp32.
    bf = {"a": torch.full((1000,), 0.01, dtype=torch.bfloat16)}
    clipped, norm = clip_grad_norm(bf, 0.1)
    assert norm.dtype == torch.float32 and clipped["a"].dtype == torch.bfloat16
    assert norm.item() == pytest.approx(math.sqrt(1000) * 0.01, rel=1e-2)


SCHED = dict(base_lr=1e-3, warmup_steps=10, total_steps=100, decay_ratio=0.2)


def test_lr_warmup_and_stable():
    assert lr_at(1, **SCHED) == pytest.approx(1e-4)
    assert lr_at(5, **SCHED) == pytest.approx(5e-4)
    assert lr_at(10, **SCHED) == pytest.approx(1e-3)
    assert lr_at(11, **SCHED) == lr_at(80, **SCHED) == 1e-3  # stable until decay starts at 81
    assert lr_at(3, **{**SCHED, "warmup_steps": 0}) == 1e-3


def test_lr_linear_decay_endpoints_and_floor():
    assert lr_at(81, **SCHED) == pytest.approx(1e-3 * 19 / 20)
    assert lr_at(90, **SCHED) == pytest.approx(0.5e-3)
    assert lr_at(100, **SCHED) == pytest.approx(0.0)
    floor = dict(SCHED, min_lr_ratio=0.1)
    assert lr_at(90, **floor) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(100, **floor) == pytest.approx(1e-4)
    assert lr_at(150, **floor) == pytest.approx(1e-4)  # past the end stays at the floor
    assert all(lr_at(s, **floor) >= 1e-4 - 1e-12 for s in range(11, 160))
    assert lr_at(100, **dict(SCHED, decay_type="none")) == 1e-3


def test_lr_cosine_classic():
    cfg = dict(base_lr=1.0, warmup_steps=10, total_steps=110, decay_ratio=1.0, decay_type="cosine")
    # The decay window is clipped to the 100 steps after warmup: classic warmup + cosine.
    assert lr_at(10, **cfg) == pytest.approx(1.0)
    assert lr_at(60, **cfg) == pytest.approx(0.5)
    assert lr_at(110, **cfg) == pytest.approx(0.0, abs=1e-12)
    assert lr_at(35, **cfg) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))
    values = [lr_at(s, **cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize(
    "override, key",
    [
        (dict(warmup_steps=200), "lr_scheduler.warmup_steps"),
        (dict(warmup_steps=-1), "lr_scheduler.warmup_steps"),
        (dict(decay_ratio=1.5), "lr_scheduler.decay_ratio"),
        (dict(decay_type="step"), "lr_scheduler.decay_type"),
        (dict(min_lr_ratio=2.0), "lr_scheduler.min_lr_ratio"),
        (dict(total_steps=0), "training.steps"),
        (dict(base_lr=-1.0), "optimizer.lr"),
    ],
)
def test_lr_validation(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        lr_at(5, **{**SCHED, **override})


def test_lr_step_is_one_based():
    with pytest.raises(ValueError, match="1-based"):
        lr_at(0, **SCHED)
