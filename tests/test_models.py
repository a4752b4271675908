"""Model construction, flavor tables, parameter counts, init and forward."""

import dataclasses

import pytest
import torch

from titan_tpu.models.common import RopeScaling, Transformer, TransformerArgs
from titan_tpu.models.common.rope import apply_rope, rope_cache, rope_rows
from titan_tpu.models.registry import MODEL_FLAVORS, build_model, get_model_args, num_params


def _meta_count(args: TransformerArgs) -> tuple[int, int]:
    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.tok_embeddings.weight.numel()


def test_llama3_debug_param_count():
    args = get_model_args("llama3", "debug")
    assert num_params(args) == 6_163_712
    model = build_model(args, seed=0)
    assert sum(p.numel() for p in model.parameters()) == 6_163_712


@pytest.mark.parametrize(
    "name,flavor", [(n, f) for n, flavors in MODEL_FLAVORS.items() for f in flavors]
)
def test_every_flavor_builds_on_meta_and_counts_match(name, flavor):
    args = get_model_args(name, flavor)
    total, non_embedding = _meta_count(args)
    assert num_params(args) == total
    assert num_params(args, exclude_embedding=True) == non_embedding


@pytest.mark.parametrize(
    "name,flavor,billions",
    [
        # Totals (embedding included) as published for the HF checkpoints.
        ("llama3", "1B", 1.24),
        ("llama3", "3B", 3.21),
        ("llama3", "8B", 8.03),
        ("llama3", "70B", 70.55),
        ("llama3", "405B", 405.85),
        ("qwen3", "0.6B", 0.60),
        ("qwen3", "1.7B", 1.72),
        ("qwen3", "4B", 4.02),
        ("qwen3", "8B", 8.19),
        ("qwen3", "14B", 14.77),
        ("qwen3", "32B", 32.76),
    ],
)
def test_flavor_sizes_match_published(name, flavor, billions):
    assert num_params(get_model_args(name, flavor)) / 1e9 == pytest.approx(billions, abs=0.01)


def test_flavor_spot_checks():
    assert num_params(get_model_args("llama3", "8B")) == 8_030_261_248  # Llama 3.1 8B exactly
    # Qwen3 model cards give non-embedding counts: 0.44B for 0.6B, 6.95B for 8B (both the
    # embedding and, when untied, lm_head excluded; our exclude_embedding keeps the output).
    q06 = get_model_args("qwen3", "0.6B")
    assert num_params(q06, exclude_embedding=True) / 1e9 == pytest.approx(0.44, abs=0.01)
    assert q06.hd == 128 and q06.dim // q06.n_heads == 64 and q06.tie_embeddings and q06.qk_norm
    q8 = get_model_args("qwen3", "8B")
    q8_body = num_params(q8, exclude_embedding=True) - q8.dim * q8.vocab_size
    assert q8_body / 1e9 == pytest.approx(6.95, abs=0.01)
    assert not q8.tie_embeddings
    l1 = get_model_args("llama3", "1B")
    assert l1.tie_embeddings and l1.rope_scaling.factor == 32.0
    assert get_model_args("llama3", "405B").rope_scaling.factor == 8.0


def test_get_model_args_returns_a_copy():
    args = get_model_args("llama3", "debug")
    args.max_seq_len = 7
    args.rope_scaling.factor = 2.0
    fresh = get_model_args("llama3", "debug")
    assert fresh.max_seq_len == 16384 and fresh.rope_scaling.factor == 8.0


def test_unknown_name_and_flavor_list_choices():
    with pytest.raises(ValueError, match="debug.*1B.*8B"):
        get_model_args("llama3", "7B")
    with pytest.raises(ValueError, match="llama3, qwen3"):
        get_model_args("gpt2", "debug")


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(dim=250), "head_dim"),
        (dict(head_dim=15), "head dim"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(rope_scaling=dict(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)),
         "rope_scaling"),
    ],
)
def test_args_validation(change, field):
    base = dataclasses.asdict(get_model_args("llama3", "debug"))
    base.update(change)
    with pytest.raises(ValueError, match=field):
        TransformerArgs(**base)


def test_rope_scaling_accepts_dict():
    args = dataclasses.replace(get_model_args("llama3", "debug"), rope_scaling={"factor": 4.0})
    assert args.rope_scaling == RopeScaling(factor=4.0)


def test_init_is_deterministic_for_a_seed():
    args = get_model_args("qwen3", "debug")
    a = build_model(args, seed=3).state_dict()
    b = build_model(args, seed=3).state_dict()
    c = build_model(args, seed=4).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    # Norms start at one; depth-scaled init makes later layers' wo smaller.
    assert torch.equal(a["layers.0.attention.q_norm.weight"], torch.ones(64))
    model = build_model(args, seed=3)
    std0 = model.layers["0"].attention.wo.weight.std()
    std5 = model.layers["5"].attention.wo.weight.std()
    assert std5 < std0


def test_init_weights_resets_the_rope_buffer():
    model = build_model(get_model_args("llama3", "debug"), seed=0)
    expected = model.rope_cache.clone()
    model.rope_cache.zero_()
    model.init_weights()
    torch.testing.assert_close(model.rope_cache, expected, rtol=0, atol=0)
    assert "rope_cache" not in model.state_dict()


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_forward_shape_and_dtype(name):
    args = dataclasses.replace(get_model_args(name, "debug"), n_layers=2)
    model = build_model(args, seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 33))
    logits = model(tokens)
    assert logits.shape == (2, 33, args.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert (model.output is None) == args.tie_embeddings
    names = set(dict(model.named_parameters()))
    assert "layers.1.attention.wq.weight" in names and "layers.1.feed_forward.w2.weight" in names
    assert ("layers.0.attention.q_norm.weight" in names) == args.qk_norm


def test_forward_is_causal():
    args = dataclasses.replace(get_model_args("qwen3", "debug"), n_layers=2)
    model = build_model(args, seed=0)
    tokens = torch.randint(0, args.vocab_size, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % args.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[:, :10], model(changed)[:, :10])


def test_sequence_longer_than_rope_table_is_rejected():
    args = dataclasses.replace(get_model_args("llama3", "debug"), n_layers=1, max_seq_len=8)
    model = build_model(args, seed=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_rope_rotates_interleaved_pairs():
    # Pair (x0, x1) at position p must be rotated by p * inv_freq[0] = p (for theta -> inv 1).
    table = rope_cache(head_dim=4, max_seq_len=3, theta=10000.0, scaling=None)
    x = torch.tensor([1.0, 0.0, 1.0, 0.0]).expand(1, 3, 1, 4)
    out = apply_rope(x, table)[0, :, 0]
    p = torch.arange(3.0)
    torch.testing.assert_close(out[:, 0], torch.cos(p))
    torch.testing.assert_close(out[:, 1], torch.sin(p))
    torch.testing.assert_close(out[:, 2], torch.cos(p / 100.0))
    torch.testing.assert_close(out[:, 3], torch.sin(p / 100.0))


def _rope_real_arithmetic(x_BSHD, rope_SP2):
    """Reference: rotate each pair (a, b) to (a cos - b sin, a sin + b cos) without complex numbers."""
    cos, sin = rope_SP2[: x_BSHD.shape[1], None, :, 0], rope_SP2[: x_BSHD.shape[1], None, :, 1]
    a, b = x_BSHD.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def test_complex_rope_matches_real_arithmetic_forward_and_backward():
    table = rope_cache(head_dim=16, max_seq_len=40, theta=500000.0, scaling=RopeScaling())
    x = torch.randn(2, 33, 3, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = apply_rope(x, rope_rows(table, 33)), _rope_real_arithmetic(x_ref, table)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    bf16 = apply_rope(x.detach().bfloat16(), rope_rows(table, 33))  # bf16 in, bf16 out, angles in fp32
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), ref.detach(), rtol=2e-2, atol=2e-2)


def test_rope_with_per_token_positions_restarts_each_document():
    table = rope_cache(head_dim=16, max_seq_len=40, theta=10000.0, scaling=None)
    x = torch.randn(2, 12, 3, 16)
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])
    rows = rope_rows(table, 12, positions)
    assert rows.shape == (2, 12, 8, 2)
    out = apply_rope(x, rows)
    # The second document of row 0 is rotated as if it started the window.
    torch.testing.assert_close(out[0, 5:], apply_rope(x[0:1, 5:], rope_rows(table, 7))[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1], apply_rope(x[1:2], rope_rows(table, 12))[0], rtol=0, atol=0)
