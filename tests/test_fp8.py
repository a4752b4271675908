"""fp8 training (models/fp8.py, kernels/fp8.py): each converted linear's forward and backward
against a float64 reference of the same quantise-matmul-dequantise, the converter seam in build,
the runs (eager, captured, scanned) and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from titan_tpu.config import build_config
from titan_tpu.kernels.fp8 import E4M3, E5M2, FP8_MAX, fp8_matmul, quantize
from titan_tpu.models.fp8 import Float8Linear, convert_to_float8, float8_modules

# The relative rounding of one float8 value (half its step): e4m3 keeps 3 mantissa bits, e5m2 2.
ROUNDING = {E4M3: 2.0**-4, E5M2: 2.0**-3}


def _reference_quantize(x: torch.Tensor, fp8: torch.dtype, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """In float64, as documented: scale = FP8_MAX / amax (per tensor, or along `dim`), the scaled
    values rounded to the format; returns (the rounded values as float64, the scale)."""
    x64 = x.double()
    amax = x64.abs().amax() if dim is None else x64.abs().amax(dim=dim, keepdim=True)
    scale = FP8_MAX[fp8] / amax
    return (x64 * scale).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8).double(), scale


def _reference_matmul(a, b, *, rowwise, a_fp8=E4M3, b_fp8=E4M3):
    qa, sa = _reference_quantize(a, a_fp8, 1 if rowwise else None)
    qb, sb = _reference_quantize(b, b_fp8, 0 if rowwise else None)
    return (qa @ qb) / (sa * sb)


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("a_fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_matmul_equals_the_float64_reference_of_the_same_quantisation(rowwise, a_fp8):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(48, 64, generator=g) * torch.logspace(-2, 2, 64)  # columns of very different size
    b = torch.randn(64, 32, generator=g)
    # The scales, as documented: FP8_MAX / amax over the tensor or along the contracted dimension.
    _, inv = quantize(a, a_fp8, dim=1 if rowwise else None)
    want_scale = FP8_MAX[a_fp8] / (a.double().abs().amax(dim=1, keepdim=True) if rowwise else a.double().abs().amax())
    torch.testing.assert_close(1 / inv.double(), want_scale, rtol=1e-6, atol=0)
    got = fp8_matmul(a, b, rowwise=rowwise, a_fp8=a_fp8).double()
    want = _reference_matmul(a, b, rowwise=rowwise, a_fp8=a_fp8)
    # Equal but for fp32 summation (and a scaled value on a rounding boundary in fp32 vs float64).
    bound = (a.double().abs() @ b.double().abs())
    assert ((got - want).abs() <= 1e-5 * bound + 1e-6).all()
    # And within the formats' rounding of the unquantised product.
    exact = a.double() @ b.double()
    assert ((got - exact).abs() <= (ROUNDING[a_fp8] + ROUNDING[E4M3] + 1e-3) * bound + 1e-6).all()
    assert (got - exact).abs().max() > 0  # quantised: not the plain product


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_a_converted_linear_forward_and_backward_equal_the_reference(rowwise):
    """Output x W^T + b, the input's gradient g W and the weight's gradient g^T x, each the
    float64 reference of its operands quantised (the gradient in e5m2 under tensorwise scaling,
    e4m3 under rowwise), the bias's gradient unquantised."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    convert_to_float8(_Holder(linear), scaling="rowwise" if rowwise else "tensorwise", target_modules=["proj"])
    assert isinstance(linear, Float8Linear)
    x = torch.randn(2, 24, 64, requires_grad=True)
    g = torch.randn(2, 24, 32)
    out = linear(x)
    out.backward(g)
    x2d, g2d, w = x.detach().reshape(-1, 64), g.reshape(-1, 32), linear.weight.detach()
    grad_fp8 = E4M3 if rowwise else E5M2
    bias = linear.bias.detach().double()
    checks = [(out.detach().reshape(-1, 32), _reference_matmul(x2d, w.t(), rowwise=rowwise) + bias,
               x2d.abs() @ w.t().abs()),
              (x.grad.reshape(-1, 64), _reference_matmul(g2d, w, rowwise=rowwise, a_fp8=grad_fp8), g2d.abs() @ w.abs()),
              (linear.weight.grad, _reference_matmul(g2d.t(), x2d, rowwise=rowwise, a_fp8=grad_fp8),
               g2d.t().abs() @ x2d.abs())]
    for got, want, bound in checks:
        assert ((got.double() - want).abs() <= 1e-5 * bound.double() + 1e-5).all()
    torch.testing.assert_close(linear.bias.grad, g2d.sum(0))


class _Holder(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.proj = linear


def _debug_model(**overrides):
    from tests.test_train import LLAMA_DEBUG
    from titan_tpu.models.spec import build, native_spec

    args = [f"--{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    cfg = build_config(LLAMA_DEBUG, ["--training.device=cpu", *args])
    return build(native_spec(cfg.model), cfg, device="cpu", seed=0)


def test_the_converter_seam_takes_the_attention_and_mlp_projections_and_keeps_the_state_dict():
    plain = _debug_model()
    model = _debug_model(fp8__enabled="true")
    converted = float8_modules(model)
    assert converted and all(name.rsplit(".", 1)[1] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3") for name in converted)
    assert "output" not in converted  # the output projection stays in the compute dtype
    assert len(converted) == 7 * 6
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in model.state_dict().items())


def test_fp8_and_lora_on_the_same_layer_and_bad_dims_are_one_line():
    with pytest.raises(ValueError, match=r"fp8: layer layers\.0\.attention\.wq carries LoRA adapters") as error:
        _debug_model(fp8__enabled="true", lora__enabled="true")
    assert "\n" not in str(error.value)
    # LoRA on the attention, fp8 on the MLP: both, each on its own layers.
    model = _debug_model(fp8__enabled="true", fp8__target_modules="w1,w2,w3", lora__enabled="true",
                         lora__target_modules="wq,wv")
    assert len(float8_modules(model)) == 18
    with pytest.raises(ValueError, match=r"fp8: layer proj \(40 -> 32\) has a side that is not a multiple of 16"):
        convert_to_float8(_Holder(nn.Linear(40, 32)), scaling="tensorwise", target_modules=["proj"])
    with pytest.raises(ValueError, match="fp8.target_modules: 'router' matches no linear layer"):
        _debug_model(fp8__enabled="true", fp8__target_modules="router")


def _losses(run_dir):
    from tests.test_train import train_losses

    return [loss for _, loss in sorted(train_losses(run_dir).items())]


def test_fp8_runs_eager_captured_and_scanned_alike_and_learn_like_bf16(tmp_path, train_overrides):
    """The debug model, 6 steps, emulated on the CPU: fp8 (rowwise) eager, captured and scanned
    under full checkpointing give the same losses; they differ from the plain run's but stay
    close to them (bench/fp8_learning.py runs the 300-step comparison)."""
    from titan_tpu.loops import assemble

    def run(name, **extra):
        values = dict(output_dir=str(tmp_path / name), training__steps=6, training__seq_len=32,
                      training__batch_size=2, training__deterministic="true", validation__enabled="false",
                      checkpoint__enabled="false", optimizer__lr=3e-3, **extra)
        from tests.test_train import LLAMA_DEBUG

        assemble(build_config(LLAMA_DEBUG, train_overrides(**values))).train()
        return _losses(tmp_path / name)

    plain = run("plain")
    eager = run("fp8", fp8__enabled="true", fp8__scaling="rowwise")
    assert eager != pytest.approx(plain, rel=1e-4) and eager == pytest.approx(plain, rel=0.02)
    for name, extra in (("graph", dict(training__mode="graph", compile__backend="aot_eager")),
                        ("scan", dict(model__scan_layers="true", activation_checkpoint__mode="full",
                                      training__mode="graph", compile__backend="aot_eager"))):
        # Close, not bitwise: where the captured step's fp32 arithmetic differs in the last bit, a
        # value on an fp8 rounding boundary rounds the other way (measured: 3.4e-5 by step 5).
        assert run(name, fp8__enabled="true", fp8__scaling="rowwise", **extra) == pytest.approx(eager, rel=3e-4), name


def test_a_transformers_backend_model_converts_and_trains_a_step():
    """The HF backend (any architecture through transformers): its q_proj ... down_proj become
    Float8 linears, lm_head stays; a step's loss is close to the plain model's and every converted
    weight gets a gradient."""
    pytest.importorskip("transformers")
    from titan_tpu.models.hf.config import hf_args_from_config
    from titan_tpu.models.hf.model import build_hf_model
    from titan_tpu.parallel.simple_fsdp import materialize_and_init
    from titan_tpu.tools.hf_sweep import sweep_batch, tiny_config

    def model(fp8: bool):
        m = build_hf_model(hf_args_from_config(tiny_config("llama")))
        if fp8:
            convert_to_float8(m, scaling="tensorwise", target_modules=[])
        return materialize_and_init(m, None, mode="none", mp=None, device="cpu", seed=0)

    plain, converted = model(False), model(True)
    names = float8_modules(converted)
    assert names and {n.rsplit(".", 1)[1] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"}
    inputs, labels = sweep_batch()
    losses = []
    for m in (plain, converted):
        loss = torch.nn.functional.cross_entropy(m(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=0.01) and losses[1] != losses[0]
    assert all(linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0 for linear in names.values())
