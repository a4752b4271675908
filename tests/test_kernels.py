"""The kernel layer: every implementation that runs here against its op's reference, forward and
gradients, eagerly and captured into a graph; selection and its errors; document masking."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from titan_tpu.kernels import ATTENTION, CHUNK_ATTENTION, LOSS, KernelConfig, describe, document_ids_from_positions
from titan_tpu.kernels.loss import auto_chunk_tokens
from titan_tpu.models.common.transformer import TransformerArgs
from titan_tpu.models.registry import build_model
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep

FP32_TOL = 1e-5
BF16_TOL = 3e-2  # bf16 has 8 bits of mantissa: ~0.4% per rounding, a few roundings deep


def run_here(op) -> list[str]:
    return op.available("cpu")


def attention_inputs(B=2, S=24, H=4, K=2, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, S, K, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, S, K, D, generator=g).to(dtype).requires_grad_()
    return q, k, v


def two_documents(B=2, S=24) -> torch.Tensor:
    """Per-token positions: row 0 holds documents of 10 and 14 tokens, row 1 of 5, 7 and 12."""
    rows = [list(range(10)) + list(range(14)), list(range(5)) + list(range(7)) + list(range(12))]
    return torch.tensor(rows)[:B, :S]


def value_and_grads(fn, *inputs, grad_out):
    out = fn(*inputs)
    grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad_out)
    return out.detach(), [g.detach() for g in grads]


def traced(fn):
    """fn captured by make_fx (forward + backward, as the graph trainer captures a step) and run."""
    def fwd_bwd(*args):
        *inputs, grad_out = args
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        with torch.enable_grad():
            out = fn(*leaves)
            grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad_out)
        return [out, *grads]

    def run(*inputs, grad_out):
        graph = make_fx(fwd_bwd, tracing_mode="fake")(*inputs, grad_out)
        out, *grads = graph(*[t.detach() for t in inputs], grad_out)
        return out, grads

    return run


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", run_here(ATTENTION))
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("captured", [False, True])
def test_attention_matches_reference_fp32(impl, documents, captured):
    q, k, v = attention_inputs()
    doc_ids = document_ids_from_positions(two_documents()) if documents else None
    grad_out = torch.randn_like(q)
    reference = ATTENTION.impls["reference"].fn
    want, want_grads = value_and_grads(lambda q, k, v: reference(q, k, v, doc_ids), q, k, v, grad_out=grad_out)
    fn = ATTENTION.impls[impl].fn
    if captured and documents:  # the traced function takes the ids as an input (make_fx refuses closures)
        got, got_grads = traced(fn)(q, k, v, doc_ids, grad_out=grad_out)
    elif captured:
        got, got_grads = traced(fn)(q, k, v, grad_out=grad_out)
    else:
        got, got_grads = value_and_grads(lambda q, k, v: fn(q, k, v, doc_ids), q, k, v, grad_out=grad_out)
    torch.testing.assert_close(got, want, rtol=0, atol=FP32_TOL)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=FP32_TOL)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("documents", [False, True])
def test_flex_forward_matches_reference_on_cpu(documents):
    """flex is registered for CUDA only (no backward on CPU), but its forward runs here: this
    checks its block mask (causal, per-document) against the reference."""
    q, k, v = (t.detach() for t in attention_inputs())
    doc_ids = document_ids_from_positions(two_documents()) if documents else None
    with torch.no_grad():
        got = ATTENTION.impls["flex"].fn(q, k, v, doc_ids)
        want = ATTENTION.impls["reference"].fn(q, k, v, doc_ids)
    torch.testing.assert_close(got, want, rtol=0, atol=FP32_TOL)


@pytest.mark.parametrize("impl", run_here(ATTENTION))
def test_attention_bf16_is_close_to_the_fp32_reference(impl):
    q, k, v = attention_inputs(dtype=torch.bfloat16)
    doc_ids = document_ids_from_positions(two_documents())
    got = ATTENTION.impls[impl].fn(q, k, v, doc_ids)
    want = ATTENTION.impls["reference"].fn(q.float(), k.float(), v.float(), doc_ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=BF16_TOL)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("head_dim", [16, 32])
def test_cpu_sdpa_computes_small_head_dims_in_fp32(documents, head_dim):
    """bf16 SDPA on CPU at head_dim <= 16 is the fp32 kernel on the bf16 inputs, rounded to bf16
    (faster there, kernels/attention.py); larger head dims stay the bf16 kernel. Forward and
    gradients, against SDPA called in that dtype directly."""
    from titan_tpu.kernels.attention import CPU_FP32_ATTENTION_MAX_HEAD_DIM

    q, k, v = attention_inputs(D=head_dim, dtype=torch.bfloat16)
    doc_ids = document_ids_from_positions(two_documents()) if documents else None
    grad_out = torch.randn_like(q)
    fn = ATTENTION.impls["sdpa"].fn
    got, got_grads = value_and_grads(lambda q, k, v: fn(q, k, v, doc_ids), q, k, v, grad_out=grad_out)
    dtype = torch.float32 if head_dim <= CPU_FP32_ATTENTION_MAX_HEAD_DIM else torch.bfloat16

    def direct(q, k, v):
        return fn(q.to(dtype), k.to(dtype), v.to(dtype), doc_ids).to(torch.bfloat16)

    want, want_grads = value_and_grads(direct, q, k, v, grad_out=grad_out)
    assert got.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got_grads)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_masks_and_document_ids():
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 0, 1, 2, 3]])
    assert document_ids_from_positions(positions).tolist() == [[1, 1, 1, 2, 2], [1, 2, 2, 2, 2]]
    q, k, v = attention_inputs(B=1, S=6, H=2, K=2, D=4)
    # A query that sees only itself returns its own value row.
    positions = torch.zeros(1, 6, dtype=torch.long)  # every token its own document
    o = ATTENTION.impls["reference"].fn(q, k, v, document_ids_from_positions(positions))
    torch.testing.assert_close(o, v.detach(), rtol=0, atol=1e-6)


# Chunk attention (context parallelism): the last Q of S positions against all S keys.


@pytest.mark.parametrize("documents", [False, True])
def test_chunk_reference_is_the_last_rows_of_full_attention(documents):
    q, k, v = (t.detach() for t in attention_inputs())
    ids = document_ids_from_positions(two_documents()) if documents else None
    full = ATTENTION.impls["reference"].fn(q, k, v, ids)
    for Q in (1, 8, 24):
        got = CHUNK_ATTENTION.impls["reference"].fn(q[:, -Q:], k, v, None if ids is None else ids[:, -Q:], ids)
        torch.testing.assert_close(got, full[:, -Q:], rtol=0, atol=FP32_TOL)


@pytest.mark.parametrize("impl", run_here(CHUNK_ATTENTION))
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("captured", [False, True])
def test_chunk_attention_matches_reference_fp32(impl, documents, captured):
    q, k, v = attention_inputs()
    q = q[:, -8:].detach().requires_grad_()  # the last 8 of 24 positions
    ids = document_ids_from_positions(two_documents()) if documents else None
    q_ids = None if ids is None else ids[:, -8:]
    grad_out = torch.randn_like(q)
    reference = CHUNK_ATTENTION.impls["reference"].fn
    want, want_grads = value_and_grads(lambda q, k, v: reference(q, k, v, q_ids, ids), q, k, v, grad_out=grad_out)
    fn = CHUNK_ATTENTION.impls[impl].fn
    if captured and documents:
        got, got_grads = traced(fn)(q, k, v, q_ids, ids, grad_out=grad_out)
    elif captured:
        got, got_grads = traced(fn)(q, k, v, grad_out=grad_out)
    else:
        got, got_grads = value_and_grads(lambda q, k, v: fn(q, k, v, q_ids, ids), q, k, v, grad_out=grad_out)
    torch.testing.assert_close(got, want, rtol=0, atol=FP32_TOL)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=FP32_TOL)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("documents", [False, True])
def test_flex_chunk_forward_matches_reference_on_cpu(documents):
    q, k, v = (t.detach() for t in attention_inputs())
    ids = document_ids_from_positions(two_documents()) if documents else None
    q_ids = None if ids is None else ids[:, -8:]
    with torch.no_grad():
        got = CHUNK_ATTENTION.impls["flex"].fn(q[:, -8:], k, v, q_ids, ids)
        want = CHUNK_ATTENTION.impls["reference"].fn(q[:, -8:], k, v, q_ids, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=FP32_TOL)


# ---------------------------------------------------------------------------------------------
# Output projection + cross-entropy
# ---------------------------------------------------------------------------------------------


def loss_inputs(N=300, D=32, V=97, dtype=torch.float32, ignore=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * D**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    if ignore:
        labels[::7] = -100
    return h, w, labels


@pytest.mark.parametrize("impl", run_here(LOSS))
@pytest.mark.parametrize("chunk_tokens", [0, 64, 1000])
@pytest.mark.parametrize("captured", [False, True])
def test_loss_matches_reference_fp32(impl, chunk_tokens, captured):
    h, w, labels = loss_inputs()
    grad_out = torch.tensor(0.37)
    reference = LOSS.impls["reference"].fn
    want, want_grads = value_and_grads(lambda h, w: reference(h, w, labels), h, w, grad_out=grad_out)
    fn = lambda h, w, labels: LOSS.impls[impl].fn(h, w, labels, chunk_tokens=chunk_tokens)  # noqa: E731
    if captured:
        got, got_grads = traced(fn)(h, w, labels, grad_out=grad_out)
    else:
        got, got_grads = value_and_grads(lambda h, w: fn(h, w, labels), h, w, grad_out=grad_out)
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=FP32_TOL)
    for g, w_ in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w_, rtol=0, atol=FP32_TOL)


def test_chunked_loss_bf16_is_close_to_the_fp32_reference():
    h, w, labels = loss_inputs(dtype=torch.bfloat16)
    got = LOSS.impls["chunked"].fn(h, w, labels, chunk_tokens=64)
    want = LOSS.impls["reference"].fn(h.float(), w.float(), labels)
    torch.testing.assert_close(got, want, rtol=BF16_TOL, atol=0)
    got.backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16


def test_chunked_loss_without_grad_keeps_no_gradients():
    h, w, labels = loss_inputs()
    with torch.no_grad():
        loss = LOSS.impls["chunked"].fn(h, w, labels, chunk_tokens=64)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, LOSS.impls["reference"].fn(h, w, labels).detach())


def test_chunked_loss_with_a_frozen_output_projection_matches_the_reference():
    """LoRA freezes the output projection: the kernel gives h's gradient and computes no [V, D]
    weight gradient (no buffer, no matmuls) for it."""
    h, w, labels = loss_inputs()
    w.requires_grad_(False)
    LOSS.impls["chunked"].fn(h, w, labels, chunk_tokens=64).backward()
    h_ref = h.detach().clone().requires_grad_()
    LOSS.impls["reference"].fn(h_ref, w, labels).backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=0, atol=FP32_TOL)
    assert w.grad is None


def test_auto_chunk_size():
    assert auto_chunk_tokens(8192, 2048) == 8192  # small vocabulary: one chunk
    chunk = auto_chunk_tokens(8192, 151_936)  # Qwen3: ~64M logits per chunk, whole tiles
    assert chunk % 128 == 0 and chunk * 151_936 <= 1 << 26


# ---------------------------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------------------------


def test_auto_picks_an_available_implementation_and_names_are_checked():
    cfg = KernelConfig()
    assert cfg.attention_impl("cpu", documents=False).name in run_here(ATTENTION)
    assert cfg.attention_impl("cpu", documents=True).name in run_here(ATTENTION)
    assert cfg.attention_impl("tpu", documents=True).name == "reference"  # splash needs TorchTPU, absent here
    with pytest.raises(ValueError,
                       match="kernels.attention = 'nope' is not a known implementation; use auto or one of"):
        KernelConfig(attention="nope").validate()
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        KernelConfig(loss_chunk_tokens=-1).validate()


@pytest.mark.parametrize("choice, op", [(dict(attention="splash"), "attention"), (dict(loss="tokamax"), "loss")])
def test_an_implementation_that_cannot_run_here_is_one_clear_line(choice, op):
    with pytest.raises(ValueError) as err:
        KernelConfig(**choice).check_device("cpu", documents=False)
    message = str(err.value)
    assert "cannot run here" in message and "available on cpu:" in message and "reference" in message, message
    assert "\n" not in message


def test_cuda_only_selection_without_cuda_is_refused_by_the_trainer_config(tmp_path):
    from titan_tpu.config import build_config

    with pytest.raises(ValueError, match="kernels.attention = 'fused' is not a known implementation"):
        build_config(None, ["--kernels.attention", "fused"])
    cfg = build_config(None, ["--kernels.attention", "splash", "--training.device", "cpu"])
    with pytest.raises(ValueError, match="kernels.attention = splash cannot run here"):
        cfg.kernels.check_device("cpu", documents=cfg.data.document_mask)


def test_describe_lists_every_implementation_and_the_auto_choice():
    text = describe("cpu")
    for op in (ATTENTION, LOSS):
        for name in op.impls:
            assert name in text
    assert "auto (documents)" in text and "not here:" in text


# ---------------------------------------------------------------------------------------------
# Document masking end to end: two packed documents give each the logits it gets alone
# ---------------------------------------------------------------------------------------------


def tiny_args() -> TransformerArgs:
    return TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128,
                           max_seq_len=64, qk_norm=True)


@pytest.mark.parametrize("impl", run_here(ATTENTION))
@pytest.mark.parametrize("scan", [False, True])
def test_packed_documents_get_the_logits_they_get_alone(impl, scan):
    model = build_model(tiny_args(), seed=0, scan_layers=scan, kernels=KernelConfig(attention=impl))
    g = torch.Generator().manual_seed(3)
    first, second = torch.randint(0, 256, (1, 13), generator=g), torch.randint(0, 256, (1, 19), generator=g)
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(13), torch.arange(19)]).unsqueeze(0)
    with torch.no_grad():
        logits = model(packed, positions_BS=positions)
        alone = [model(first), model(second)]
    torch.testing.assert_close(logits[:, :13], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[:, 13:], alone[1], rtol=0, atol=1e-5)
    # Without the mask the second document sees the first: the logits differ.
    with torch.no_grad():
        assert not torch.allclose(model(packed)[:, 13:], alone[1], atol=1e-3)


@pytest.mark.parametrize("impl", run_here(ATTENTION))
def test_packed_documents_in_a_captured_training_step(impl):
    """Graph mode: the captured step with document positions trains exactly like eager."""
    from titan_tpu.graph import GraphStep

    kernels = KernelConfig(attention=impl)
    g = torch.Generator().manual_seed(4)
    positions = torch.cat([torch.arange(13), torch.arange(19)]).expand(2, 32).contiguous()
    batches = []
    for _ in range(3):
        tokens = torch.randint(0, 256, (2, 33), generator=g)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), positions))

    def losses(make_step):
        model = build_model(tiny_args(), seed=0, kernels=kernels)
        step = make_step(model, AdamW(dict(model.named_parameters())))
        return [step([b], 1e-3).loss for b in batches]

    eager = losses(lambda m, o: EagerStep(m, o, max_norm=1.0))
    graph = losses(lambda m, o: GraphStep(m, o, max_norm=1.0, example_batch=batches[0], backend="aot_eager"))
    assert max(abs(a - b) for a, b in zip(eager, graph)) <= 1e-6
    # And the mask matters: the same tokens without positions train differently.
    unmasked = [(x, y) for x, y, _ in batches]
    model = build_model(tiny_args(), seed=0, kernels=kernels)
    plain = EagerStep(model, AdamW(dict(model.named_parameters())), max_norm=1.0)
    assert abs(plain([unmasked[0]], 1e-3).loss - eager[0]) > 1e-4


def test_kernel_choice_does_not_change_the_model_loss():
    """The model's own loss (hidden states + output weight through the loss kernel) equals
    cross-entropy of its logits, for every pair of implementations that runs here."""
    args = dataclasses.replace(tiny_args(), n_layers=1)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    reference = build_model(args, seed=0, kernels=KernelConfig(attention="reference", loss="reference"))
    want = torch.nn.functional.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(),
                                             reduction="sum")
    for attention in run_here(ATTENTION):
        for loss in run_here(LOSS):
            model = build_model(args, seed=0, kernels=KernelConfig(attention=attention, loss=loss,
                                                                   loss_chunk_tokens=16))
            got = model(tokens[:, :-1], tokens[:, 1:]).ce_sum
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-4, msg=f"{attention} + {loss}")
