"""fp8 MoE experts through our JAX lowering (graph/jax_ops.py): `titan_tpu::scaled_grouped_mm` and its
weight-gradient form become XLA's ragged dot on float8 operands with an fp32 accumulator
(`chlo.ragged_dot` on f8E4M3FN in the program), times the dequantisation scales.

An fp8 expert matmul's forward and backward captured with make_fx, lowered and run on JAX's CPU
backend, equal the same matmul run eagerly by torch (the CPU's emulation), and lowered for a tpu7x
device keep all three grouped matmuls on float8 operands. Then the Qwen3-MoE debug model's whole
step with fp8 experts, captured by the run's own assembly and lowered for tpu7x (lowering only: no
XLA compile), holds the experts' f8 ragged dots: three forward, three for the checkpointed rerun
and six backward, in its one scanned layer body.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from titan_tpu.graph.jax_lowering import functional_graph, to_jax
from titan_tpu.kernels import device_type_as
from titan_tpu.models.fp8 import Float8Settings, float8_grouped_linear
from titan_tpu.xla.dump import f8_dots

T, D, F, E = 64, 128, 256, 4
SIZES = [16, 0, 24, 8]  # 48 of 64 rows: the rest past the last group


def _step(x_TD, w_EFD, sizes_E, grad_TF, *, rowwise):
    """(y, grad_x, grad_w) of one fp8 expert matmul, y = x w[e]^T per group."""
    x_TD, w_EFD = x_TD.detach().requires_grad_(), w_EFD.detach().requires_grad_()
    y = float8_grouped_linear(x_TD, w_EFD, sizes_E, settings=Float8Settings(rowwise=rowwise))
    grad_x, grad_w = torch.autograd.grad(y, (x_TD, w_EFD), grad_TF)
    return y, grad_x, grad_w


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(T, D, generator=g), torch.randn(E, F, D, generator=g) / D**0.5,
            torch.tensor(SIZES), torch.randn(T, F, generator=g)]


def _lowered(rowwise):
    inputs = _inputs()
    with device_type_as("cpu", "jax"):
        traced = make_fx(lambda *a: _step(*a, rowwise=rowwise), tracing_mode="fake")(*inputs)
    ops = {str(n.target) for n in traced.graph.nodes}
    assert {"titan_tpu.scaled_grouped_mm.default", "titan_tpu.scaled_grouped_mm_weight_grad.default"} <= ops
    return to_jax(functional_graph(traced, inputs)), inputs


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_lowered_fp8_expert_matmul_equals_the_eager_one(rowwise):
    fn, inputs = _lowered(rowwise)
    ours = jax.jit(fn)(*[x.numpy() for x in inputs])
    reference = _step(*inputs, rowwise=rowwise)
    for name, a, b in zip(("y", "grad_x", "grad_w"), ours, reference):
        b = b.detach().numpy()
        # The same quantisation on both sides; the products differ by fp32 summation order, and a
        # scaled value on an fp8 rounding boundary may round the other way (one fp8 step of one term).
        error = float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())
        assert error < 2e-3, (name, error)
    assert np.abs(np.asarray(ours[0])[sum(SIZES):]).max() == 0  # rows past the groups


def _tpu7x_device():
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name="tpu7x:2x2x1", platform="tpu").devices[0]


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_fp8_expert_matmuls_lower_to_f8_ragged_dots_for_tpu7x(rowwise):
    fn, inputs = _lowered(rowwise)
    sharding = jax.sharding.SingleDeviceSharding(_tpu7x_device())
    args = [jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(str(x.dtype).removeprefix("torch.")), sharding=sharding)
            for x in inputs]
    text = jax.jit(fn).lower(*args).as_text()
    ragged = [line for line in text.splitlines() if "chlo.ragged_dot" in line]
    assert len(ragged) == 3 and all("f8E4M3FN" in line for line in ragged), ragged
    # the output gradient is e5m2 under tensorwise scaling, e4m3 under rowwise
    assert sum("f8E5M2" in line for line in ragged) == (0 if rowwise else 2)
    assert f8_dots(text) == 3


def _lowered_step_texts(cfg, topology: str) -> dict[str, str]:
    """Each program of `cfg`'s step for `topology`, captured by the run's own assembly and lowered
    (tools/compile_cmd.py's path, without XLA's compile)."""
    from titan_tpu.components.program import capture_rank
    from titan_tpu.graph.jax_devices import tpu_topology
    from titan_tpu.graph.jax_program import jax_mesh, lower_step
    from titan_tpu.plan.hardware import HARDWARE
    from titan_tpu.run.resolved import Target

    devices = list(tpu_topology(topology).devices)
    _run, steps, _ = capture_rank(cfg, Target.for_jax("tpu", len(devices)), hardware=HARDWARE["v7"])
    return {name: lower_step(step, jax_mesh(step, devices), name).text for name, step in steps.items()}


def test_debug_moe_step_with_fp8_experts_lowers_to_f8_ragged_dots():
    from titan_tpu.config import build_config

    overrides = ["--fp8.enabled=true", "--fp8.experts=true", "--fp8.scaling=rowwise", "--training.batch_size=8",
                 "--training.seq_len=128", "--model.scan_layers=true", "--activation_checkpoint.mode=full",
                 "--parallelism.dp_shard=-1"]
    plain = _lowered_step_texts(build_config("configs/qwen3_moe_debug.toml", overrides[3:]), "tpu7x:2x2x1")
    texts = _lowered_step_texts(build_config("configs/qwen3_moe_debug.toml", overrides), "tpu7x:2x2x1")
    ragged = [line for text in texts.values() for line in text.splitlines() if "chlo.ragged_dot" in line]
    # The scanned body's experts: 3 forward, 3 in the checkpointed rerun, 3 input and 3 weight gradients.
    assert len(ragged) == 12 and all(line.count("xf8E4M3FN>") >= 2 for line in ragged), ragged
    # the attention's linears too: f8 dots beside the ragged ones; none in the plain step
    assert sum(f8_dots(t) for t in texts.values()) > 12
    assert sum(f8_dots(t) for t in plain.values()) == 0
    plain_ragged = [line for text in plain.values() for line in text.splitlines() if "chlo.ragged_dot" in line]
    assert not any("f8E4M3FN" in line for line in plain_ragged)


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_torchtpu_fp8_experts_through_jax_op_equal_the_emulation(rowwise):
    """On TorchTPU (the kernels of device type "tpu") the fp8 expert matmul is one jax_op pair
    (kernels/tpu.py): quantised and multiplied on the JAX side. Through the CPU stand-in for jax_op,
    forward and both gradients equal the torch emulation of the same quantisation."""
    import jax_bridge

    from titan_tpu.kernels import tpu as tpu_kernels

    called = []

    def jax_op(name, fn):
        op = jax_bridge.jax_op(name, fn)
        return lambda *args: called.append(name) or op(*args)

    inputs = _inputs()
    tpu_kernels._ops.cache_clear()  # the ops made by another stand-in are cached per jax_op
    with tpu_kernels.jax_op_replaced(jax_op), device_type_as("cpu", "tpu"):
        ours = _step(*inputs, rowwise=rowwise)
    assert called == ["titan_tpu::fp8_grouped_linear", "titan_tpu::fp8_grouped_linear_vjp"]
    reference = _step(*inputs, rowwise=rowwise)
    for name, a, b in zip(("y", "grad_x", "grad_w"), ours, reference):
        error = float((a.double() - b.double()).abs().max() / b.double().abs().max())
        assert error < 2e-3, (name, error)
        assert a.dtype == b.dtype and a.shape == b.shape
    assert ours[0][sum(SIZES):].abs().max() == 0


def test_the_tpu7x_moe_fp8_recipe_lowers_to_f8_ragged_dots():
    """configs/qwen3_235b_a22b_v7_fp8_tpu.toml for its whole slice (tpu7x:4x8x8, 512 devices), lowered
    only (about 30 s here; no XLA compile): the scanned body's 12 expert matmuls are ragged dots on
    f8E4M3FN over the ep group's routed rows (ep 8 x top-8 x 4,096 = 262,144) and a rank's 16 experts,
    beside 16 f8 dots of the attention linears (4 linears: forward, rerun, two gradients)."""
    from titan_tpu.config import build_config

    texts = _lowered_step_texts(build_config("configs/qwen3_235b_a22b_v7_fp8_tpu.toml"), "tpu7x:4x8x8")
    ragged = [line for text in texts.values() for line in text.splitlines() if "chlo.ragged_dot" in line]
    assert len(ragged) == 12 and all(line.count("xf8E4M3FN>") >= 2 for line in ragged)
    assert any("tensor<262144x4096xf8E4M3FN>, tensor<16x4096x1536xf8E4M3FN>" in line for line in ragged)
    assert sum(f8_dots(t) for t in texts.values()) == 12 + 16
