"""Kernel numerics: every TPU kernel variant that goes through `torch.tpu.pallas.jax_op`, run on this
CPU against the project's PyTorch reference, forward and backward.

The call is the variant's own (kernels/tpu.py: layout changes, autograd.Function, the VJP op for
the backward); only jax_op is swapped for jax_bridge.jax_op, which runs the same JAX function
(kernels/tpu_jax.py) on CPU with the Pallas TPU kernels in interpret mode
(`pltpu.force_tpu_interpret_mode()`). One more swap for the loss: tokamax's Mosaic kernel refuses
to run off a TPU even in interpret mode, so its "xla" implementation of the same call runs
instead (our wiring is checked, tokamax's kernel is not).

Shapes are the recipes' scaled down, keeping what matters to the kernels: grouped-query attention
(8:2 heads as Llama 3 405B's 128:8 and Qwen3's 64:4 / 32:8), packed documents (segment ids), bf16
and fp32, MoE groups that are uneven, empty, and leave rows past the last group.
TPU-only variants that cannot run here (TorchTPU's native ops) are listed in NATIVE_ONLY, so a new
variant fails `test_every_tpu_variant_is_classified` until it is checked or listed.
"""

from __future__ import annotations

import sys

import conftest
import jax_bridge
import pytest
import torch
from jax.experimental.pallas import tpu as pltpu

from titan_tpu.kernels import GROUPED_MM, LOSS, OPS, tpu as tpu_kernels
from titan_tpu.kernels.attention import document_ids_from_positions, reference_attention, reference_chunk_attention
from titan_tpu.kernels.grouped_mm import reference_grouped_mm
from titan_tpu.kernels.loss import reference_linear_cross_entropy

# Checked for signature only (test_api.py): TorchTPU's own kernels, no JAX function to run here.
NATIVE_ONLY = {("attention", "splash_sdpa"), ("grouped_mm", "ragged_dot")}
NUMERIC = {("attention", "splash"), ("chunk_attention", "splash"), ("grouped_mm", "gmm"), ("loss", "tokamax")}

# Max |ours - reference| allowed, relative to the reference's largest magnitude (forward, grads).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _on_cpu_through_the_bridge(monkeypatch):
    monkeypatch.setattr(tpu_kernels, "TOKAMAX_IMPLEMENTATION", "xla")
    with tpu_kernels.jax_op_replaced(jax_bridge.jax_op), pltpu.force_tpu_interpret_mode():
        yield


def test_every_tpu_variant_is_classified():
    tpu_only = {(op_name, impl.name) for op_name, op in OPS.items() for impl in op.impls.values()
                if impl.devices == ("tpu",)}
    assert tpu_only == NUMERIC | NATIVE_ONLY
    conftest.SUMMARY.append(f"TPU kernel variants: {len(NUMERIC)} checked numerically in interpret mode "
                            f"({', '.join(sorted(n for _, n in NUMERIC))}), {len(NATIVE_ONLY)} native "
                            f"TorchTPU ops checked by signature only ({', '.join(sorted(n for _, n in NATIVE_ONLY))})")


def _compare(label: str, ours: list[torch.Tensor], ref: list[torch.Tensor], dtype: torch.dtype) -> None:
    errors = []
    for name, a, b in zip(("forward", *(f"grad {i}" for i in range(len(ours) - 1))), ours, ref):
        scale = b.float().abs().max().item()
        err = (a.float() - b.float()).abs().max().item() / max(scale, 1e-30)
        errors.append(err)
        assert err <= TOL[dtype], f"{label}: {name} differs from the reference by {err:.2e} (relative) > {TOL[dtype]}"
    conftest.SUMMARY.append(f"{label}: max relative error forward {errors[0]:.1e}, backward "
                            f"{max(errors[1:]):.1e} (tolerance {TOL[dtype]:.0e})")


def _run(fn, inputs: list[torch.Tensor], grad_out: torch.Tensor, *rest):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves, *rest)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return [out.detach(), *grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, documents", [(8, 2, True), (8, 2, False), (4, 4, True)],
                         ids=["gqa-documents", "gqa-causal", "mha-documents"])
def test_splash_attention(heads, kv_heads, documents, dtype):
    B, S, D = 2, 256, 64
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, heads, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, S, kv_heads, D, generator=gen).to(dtype) for _ in range(2))
    grad = torch.randn(B, S, heads, D, generator=gen).to(dtype)
    ids = None
    if documents:  # row 0: documents of 100, 28 and 128 tokens (not block-aligned); row 1: one
        positions = torch.stack([torch.cat([torch.arange(100), torch.arange(28), torch.arange(128)]), torch.arange(S)])
        ids = document_ids_from_positions(positions)
    ours = _run(tpu_kernels.splash_attention, [q, k, v], grad, ids)
    ref = _run(reference_attention, [q.float(), k.float(), v.float()], grad.float(), ids)
    _compare(f"attention splash {heads}:{kv_heads} heads{' documents' if documents else ''} {dtype}", ours, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_splash_chunk_attention(documents, dtype):
    """Context parallelism's chunk: the last 128 of 384 positions against all 384 keys (splash's
    causal mask offset by 256), GQA 8:2."""
    B, Q, S, D, heads, kv_heads = 2, 128, 384, 64, 8, 2
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, Q, heads, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, S, kv_heads, D, generator=gen).to(dtype) for _ in range(2))
    grad = torch.randn(B, Q, heads, D, generator=gen).to(dtype)
    q_ids = ids = None
    if documents:  # row 0: documents of 200, 100 and 84 tokens (one starts inside the chunk); row 1: one
        positions = torch.stack([torch.cat([torch.arange(200), torch.arange(100), torch.arange(84)]), torch.arange(S)])
        ids = document_ids_from_positions(positions)
        q_ids = ids[:, -Q:]
    ours = _run(tpu_kernels.splash_chunk_attention, [q, k, v], grad, q_ids, ids)
    ref = _run(reference_chunk_attention, [q.float(), k.float(), v.float()], grad.float(), q_ids, ids)
    _compare(f"chunk_attention splash {Q} of {S}{' documents' if documents else ''} {dtype}", ours, ref, dtype)


def test_splash_chunk_attention_at_a_start_known_when_it_runs():
    """One program for every cp rank: the chunk at positions 128..255 of 384 against all 384 keys,
    its start a tensor (one splash kernel per possible start, lax.switch picks), equals the
    reference over the keys up to the chunk's end (the trainer's form); the keys past it get no
    gradient. GQA 4:2 with documents (one starts inside the chunk), fp32; one sequence (interpret
    mode is slow)."""
    B, Q, S, D, heads, kv_heads, start = 1, 128, 384, 64, 4, 2, 128
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, Q, heads, D, generator=gen)
    k, v = (torch.randn(B, S, kv_heads, D, generator=gen) for _ in range(2))
    grad = torch.randn(B, Q, heads, D, generator=gen)
    ids = document_ids_from_positions(torch.cat([torch.arange(200), torch.arange(100), torch.arange(84)])[None])
    q_ids, end = ids[:, start:start + Q], start + Q
    # Starts from 128 on: kernels for 128 and 256 (q_start_min, as a cp tail chunk's).
    ours = _run(tpu_kernels.splash_chunk_attention, [q, k, v], grad, q_ids, ids, torch.tensor(start), 128)
    ref = _run(lambda q, k, v: reference_chunk_attention(q, k[:, :end], v[:, :end], q_ids, ids[:, :end]),
               [q, k, v], grad)
    _compare(f"chunk_attention splash {Q} of {S} at start {start} (a tensor) documents", ours, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gmm_grouped_mm(dtype):
    # 8 experts over 512 rows: uneven, two empty groups, 40 rows past the last group (as an expert-
    # parallel buffer has); weights stored [E, F, D] and passed transposed, as the MoE layer does.
    T, D, F = 512, 128, 256
    sizes = torch.tensor([100, 0, 37, 91, 0, 120, 60, 64])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=gen).to(dtype)
    w_EFD = (torch.randn(8, F, D, generator=gen) * D**-0.5).to(dtype)
    grad = torch.randn(T, F, generator=gen).to(dtype)

    def ours_fn(x, w):
        return tpu_kernels.gmm_grouped_mm(x, w.transpose(1, 2), sizes)

    def ref_fn(x, w):
        return reference_grouped_mm(x, w.transpose(1, 2), sizes)

    ours = _run(ours_fn, [x, w_EFD], grad)
    ref = _run(ref_fn, [x.float(), w_EFD.float()], grad.float())
    assert ours[0][int(sizes.sum()):].abs().max() == 0 and ours[1][int(sizes.sum()):].abs().max() == 0
    _compare(f"grouped_mm gmm uneven groups {dtype}", ours, ref, dtype)
    assert GROUPED_MM.impls["gmm"].fn is tpu_kernels.gmm_grouped_mm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tokamax_loss(dtype):
    N, D, V = 256, 128, 1000  # a vocabulary that is no multiple of 128, as Llama 3's 128,256 is not of 1024
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=gen).to(dtype)
    w = (torch.randn(V, D, generator=gen) * D**-0.5).to(dtype)
    labels = torch.randint(0, V, (N,), generator=gen)
    grad = torch.tensor(0.37)  # the step scales the summed loss by 1 / tokens
    ours = _run(lambda h, w: tpu_kernels.tokamax_linear_cross_entropy(h, w, labels), [h, w], grad)
    ref = _run(lambda h, w: reference_linear_cross_entropy(h, w, labels), [h.float(), w.float()], grad)
    _compare(f"loss tokamax (xla implementation) {dtype}", ours, ref, dtype)
    assert LOSS.impls["tokamax"].fn is tpu_kernels.tokamax_linear_cross_entropy


def test_tokamax_refuses_ignored_labels():
    h, w = torch.randn(8, 128), torch.randn(300, 128)
    labels = torch.tensor([1, 2, -100, 4, 5, 6, 7, 8])
    with pytest.raises(ValueError, match="no ignore index"):
        tpu_kernels.tokamax_linear_cross_entropy(h, w, labels)


def test_tokamax_under_our_command_line(monkeypatch):
    """tokamax parses absl flags from sys.argv when first read; `titan-tpu compile --config ...` and
    the trainer's options are not its flags and used to fail that parse (UnrecognizedFlagError)."""
    import jax.numpy as jnp
    from absl import flags

    from titan_tpu.kernels import tpu_jax

    monkeypatch.setattr(sys, "argv", ["titan-tpu", "compile", "--config", "configs/llama3_8b_tpu.toml", "--one"])
    flags.FLAGS.unparse_flags()
    try:
        x, w = jnp.ones((8, 128), jnp.float32), jnp.ones((128, 256), jnp.float32) / 128
        loss = tpu_jax.linear_cross_entropy(x, jnp.arange(8), w, "xla")
    finally:
        if not flags.FLAGS.is_parsed():
            flags.FLAGS(sys.argv[:1], known_only=True)
    assert abs(float(loss) - 8 * float(jnp.log(256.0))) < 1e-4  # equal logits: log(V) per token
