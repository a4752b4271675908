"""fp8 MoE experts (docs/fp8.md "MoE experts"): the grouped matmuls in float8 with per-expert scales.

The emulated grouped matmul, forward and both backward products, against a float64 reference
written per expert (quantise each operand as documented, multiply, dequantise); the converter
seam; a captured step recording the fp8 grouped ops; a short Qwen3-MoE debug run with fp8 experts
against the same run without (bench/fp8_learning.py runs the 300-step comparison).
"""

from __future__ import annotations

import pytest
import torch

from titan_tpu.config import build_config
from titan_tpu.kernels.fp8 import E4M3, E5M2, FP8_MAX
from titan_tpu.models.common.moe import GroupedExperts
from titan_tpu.models.fp8 import (
    Float8GroupedExperts,
    Float8Settings,
    convert_experts_to_float8,
    float8_grouped_linear,
    float8_modules,
)

MOE_DEBUG = "configs/qwen3_moe_debug.toml"


def _q(x64: torch.Tensor, fp8: torch.dtype, dims) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: (x rounded to `fp8` after scaling by FP8_MAX / amax over `dims` (None: all), as
    float64, the scale)."""
    amax = x64.abs().amax() if dims is None else x64.abs().amax(dim=dims, keepdim=True)
    scale = FP8_MAX[fp8] / amax
    return (x64 * scale).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8).double(), scale


def _reference(x, w_EFD, sizes, g, *, rowwise):
    """(y, grad_x, grad_w) per expert in float64: y_e = x_e w_e^T, grad_x_e = g_e w_e,
    grad_w_e = g_e^T x_e; activations e4m3 with one scale for the whole tensor (tensorwise) or per
    row; weights e4m3 with one scale per expert (tensorwise) or per column along the contracted
    dim; the output gradient e5m2 (tensorwise) or e4m3 (rowwise); the weight gradient's operands
    scaled over the whole tensor (tensorwise) or per column over the expert's own rows (rowwise)."""
    x64, w64, g64 = x.double(), w_EFD.double(), g.double()
    gf8 = E4M3 if rowwise else E5M2
    rows = None if not rowwise else 1
    xq, xs = _q(x64, E4M3, rows)
    gq, gs = _q(g64, gf8, rows)
    y, grad_x = torch.zeros_like(g64), torch.zeros_like(x64)
    grad_w = torch.zeros_like(w64)
    start = 0
    for e, n in enumerate(sizes.tolist()):
        r = slice(start, start + n)
        start += n
        wq, ws = _q(w64[e].t(), E4M3, 0 if rowwise else None)  # [D, F], contracted along D
        y[r] = (xq[r] / xs[r] if rowwise else xq[r] / xs) @ (wq / ws)
        wq2, ws2 = _q(w64[e], E4M3, 0 if rowwise else None)  # [F, D], contracted along F
        grad_x[r] = (gq[r] / gs[r] if rowwise else gq[r] / gs) @ (wq2 / ws2)
        if rowwise:
            if n:
                ge, ges = _q(g64[r], gf8, 0)
                xe, xes = _q(x64[r], E4M3, 0)
                grad_w[e] = (ge / ges).t() @ (xe / xes)
        else:
            grad_w[e] = (gq[r] / gs).t() @ (xq[r] / xs)
    return y, grad_x, grad_w


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_fp8_grouped_matmul_and_its_gradients_equal_the_per_expert_reference(rowwise):
    """Groups of different sizes, an empty one, and rows past the last group (expert parallelism's
    other ranks' rows: zeros out, no gradient)."""
    g = torch.Generator().manual_seed(0)
    T, D, F, E = 44, 32, 48, 4
    sizes = torch.tensor([10, 0, 17, 9])  # 36 of 44 rows
    x = (torch.randn(T, D, generator=g) * torch.logspace(-2, 1, D)).requires_grad_()  # columns of unlike size
    w = (torch.randn(E, F, D, generator=g) * torch.logspace(-1, 1, E).view(E, 1, 1)).requires_grad_()
    grad_y = torch.randn(T, F, generator=g) * torch.logspace(-3, 0, T).view(T, 1)
    y = float8_grouped_linear(x, w, sizes, settings=Float8Settings(rowwise=rowwise))
    y.backward(grad_y)
    want = _reference(x.detach(), w.detach(), sizes, grad_y, rowwise=rowwise)
    exact = _reference_exact(x.detach(), w.detach(), sizes, grad_y)
    for name, got, ref, plain in zip(("y", "grad_x", "grad_w"), (y, x.grad, w.grad), want, exact):
        got = got.detach().double()
        # Equal but for fp32 summation (a scaled value on a rounding boundary may round the other way
        # in fp32 than in float64: one fp8 step of one term).
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), name
        assert (got - plain).abs().max() > 0, name  # quantised: not the plain product
        assert (got - plain).abs().max() <= 0.1 * plain.abs().max(), name
    assert y[36:].abs().max() == 0 and x.grad[36:].abs().max() == 0
    assert w.grad[1].abs().max() == 0  # the empty group


def _reference_exact(x, w, sizes, g):
    x64, w64, g64 = x.double(), w.double(), g.double()
    y, grad_x, grad_w = torch.zeros_like(g64), torch.zeros_like(x64), torch.zeros_like(w64)
    start = 0
    for e, n in enumerate(sizes.tolist()):
        r = slice(start, start + n)
        start += n
        y[r], grad_x[r], grad_w[e] = x64[r] @ w64[e].t(), g64[r] @ w64[e], g64[r].t() @ x64[r]
    return y, grad_x, grad_w


def _moe_model(**overrides):
    from titan_tpu.models.spec import build, native_spec

    args = [f"--{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    cfg = build_config(MOE_DEBUG, ["--training.device=cpu", *args])
    return build(native_spec(cfg.model), cfg, device="cpu", seed=0)


def test_the_converter_takes_the_experts_only_when_asked_and_keeps_the_state_dict():
    plain = _moe_model()
    linears_only = float8_modules(_moe_model(fp8__enabled="true"))
    assert linears_only and not any(isinstance(m, Float8GroupedExperts) for m in linears_only.values())
    model = _moe_model(fp8__enabled="true", fp8__experts="true")
    experts = [n for n, m in float8_modules(model).items() if isinstance(m, Float8GroupedExperts)]
    assert experts == [f"layers.{i}.moe.experts" for i in range(4)]
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in model.state_dict().items())
    # scanned: the stack's template computes, and it is converted
    scanned = _moe_model(fp8__enabled="true", fp8__experts="true", model__scan_layers="true",
                         activation_checkpoint__mode="full")
    assert all(type(t.moe.experts) is Float8GroupedExperts for t in scanned.block_templates())


def test_fp8_experts_that_cannot_be_are_one_line():
    with pytest.raises(ValueError, match=r"fp8\.experts = true, but the model has no native MoE experts") as error:
        from tests.test_train import LLAMA_DEBUG
        from titan_tpu.models.spec import build, native_spec

        cfg = build_config(LLAMA_DEBUG, ["--training.device=cpu", "--fp8.enabled=true", "--fp8.experts=true"])
        build(native_spec(cfg.model), cfg, device="cpu", seed=0)
    assert "\n" not in str(error.value)
    holder = torch.nn.Module()
    holder.experts = GroupedExperts(dim=64, hidden_dim=72, num_experts=2)
    with pytest.raises(ValueError, match=r"fp8: experts experts \(dim 64, hidden 72\) have a side that is not a "
                                         r"multiple of 16; set --fp8\.experts false") as error:
        convert_experts_to_float8(holder, Float8Settings(rowwise=True))
    assert "\n" not in str(error.value)
    assert type(holder.experts) is GroupedExperts  # nothing converted


def _losses(run_dir):
    from tests.test_train import train_losses

    return [loss for _, loss in sorted(train_losses(run_dir).items())]


def test_fp8_experts_train_eager_and_captured_alike_and_close_to_plain(tmp_path, train_overrides, monkeypatch):
    """The Qwen3-MoE debug model, 8 steps, emulated: fp8 experts (with the linears, rowwise) eager
    and captured (graph mode, scanned layers under full checkpointing) give the same losses; they
    differ from the plain run's but stay close to them. The captured step records the fp8 grouped
    matmuls: per MoE layer three forward, three input-gradient and three weight-gradient ones."""
    from titan_tpu.loops import assemble

    def run(name, **extra):
        values = dict(output_dir=str(tmp_path / name), training__steps=8, training__seq_len=64,
                      training__batch_size=2, training__deterministic="true", validation__enabled="false",
                      checkpoint__enabled="false", optimizer__lr=3e-3, **extra)
        assemble(build_config(MOE_DEBUG, train_overrides(**values))).train()
        return _losses(tmp_path / name)

    plain = run("plain")
    fp8 = dict(fp8__enabled="true", fp8__experts="true", fp8__scaling="rowwise")
    eager = run("fp8", **fp8)
    assert eager != pytest.approx(plain, rel=1e-4) and eager == pytest.approx(plain, rel=0.02)
    ops = _recorded_ops(monkeypatch, lambda: run("scan", model__scan_layers="true", activation_checkpoint__mode="full",
                                                 training__mode="graph", compile__backend="aot_eager", **fp8))
    # Close, not bitwise: where the captured step's fp32 arithmetic differs in the last bit, a value on
    # an fp8 rounding boundary rounds the other way.
    assert ops["losses"] == pytest.approx(eager, rel=5e-4)
    # One scanned body: its forward (3), the checkpointed rerun (3) and the backward (3 + 3).
    assert ops["titan_tpu.scaled_grouped_mm.default"] == 9
    assert ops["titan_tpu.scaled_grouped_mm_weight_grad.default"] == 3
    assert ops["titan_tpu.grouped_mm.default"] == 0  # no expert matmul left in fp32


def _recorded_ops(monkeypatch, train) -> dict:
    """Run `train`, counting the expert ops in every graph the captured step hands its compiler (the
    scanned body's subgraphs included)."""
    from titan_tpu.graph import compile as graph_compile

    graphs = []
    original = graph_compile.compile_step

    def spy(captured, *args, **kwargs):
        graphs.append(captured.graph_module)
        return original(captured, *args, **kwargs)

    monkeypatch.setattr(graph_compile, "compile_step", spy)
    losses = train()
    counts = {name: 0 for name in ("titan_tpu.scaled_grouped_mm.default",
                                   "titan_tpu.scaled_grouped_mm_weight_grad.default", "titan_tpu.grouped_mm.default")}
    for gm in graphs:
        for module in gm.modules():
            for node in module.graph.nodes if isinstance(module, torch.fx.GraphModule) else ():
                if str(node.target) in counts:
                    counts[str(node.target)] += 1
    return {**counts, "losses": losses}


def test_the_cuda_kernels_pass_torchs_checks_of_scaled_grouped_mm():
    """No GPU here: the CUDA kernels' calls of torch._scaled_grouped_mm, on meta tensors, pass torch's
    own meta checks (e4m3 operands, a row-major left and column-major right operand, 16-byte strides,
    scale shapes [T] and [E, N], or [E * M] and [E * N] for the 2d x 2d weight gradient), which a
    wrong layout fails; e5m2 (tensorwise gradients) is refused in one line."""
    from titan_tpu.kernels import fp8_grouped_mm as kernels

    T, D, F, E = 64, 32, 48, 4
    meta = dict(device="meta")
    x = torch.empty(T, D, dtype=E4M3, **meta)
    w = torch.empty(E, D, F, dtype=E4M3, **meta)
    sizes = torch.empty(E, dtype=torch.int64, **meta)
    y = kernels._cuda_scaled_grouped_mm(x, w, torch.empty(T, 1, **meta), torch.empty(E, 1, F, **meta), sizes,
                                        torch.float32)
    assert (y.shape, y.dtype) == ((T, F), torch.float32)
    g = torch.empty(T, F, dtype=E4M3, **meta)
    grad_w = kernels._cuda_scaled_grouped_mm_weight_grad(g, x, torch.empty(E, F, 1, **meta),
                                                         torch.empty(E, 1, D, **meta), sizes, torch.bfloat16)
    assert grad_w.shape == (E, F, D)
    with pytest.raises(RuntimeError, match="column major"):  # the check is real: b row-major fails it
        torch._scaled_grouped_mm(x, w, torch.empty(T, **meta), torch.empty(E, F, **meta),
                                 offs=torch.empty(E, dtype=torch.int32, **meta), out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="takes e4m3 operands only.*use --fp8.scaling rowwise") as error:
        kernels._cuda_scaled_grouped_mm(g.to(E5M2), w, torch.empty(T, 1, **meta), torch.empty(E, 1, F, **meta),
                                        sizes, torch.float32)
    assert "\n" not in str(error.value)
