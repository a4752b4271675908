"""API conformance: every TorchTPU use in the project's source against the real torch-tpu package.

The uses are found by reading the source (tests/tpu_call_sites.py), so a new call is checked
without being listed anywhere. For each: the name exists in the package imported here (torch_tpu
auto-loads with `import torch`; on a CPU machine it imports and shows no device), and a call's
arguments bind to the real signature (`inspect.signature(...).bind`), keyword names included.
Then the JAX functions the kernels hand to `torch.tpu.pallas.jax_op` go through the real jax_op
(it derives a torch schema from their annotations and refuses what it cannot map) and its fake
kernel, which exports the JAX function for TPU: that lowers the Pallas kernels with Mosaic's TPU
rules on this CPU, at shapes like the recipes' scaled down.
"""

from __future__ import annotations

import importlib
import inspect

import conftest
import pytest
import torch
from tpu_call_sites import find_sites

SITES = find_sites()


def _resolve(name: str):
    """The object a dotted TorchTPU name refers to, read from the real package."""
    if name.startswith("torch_tpu"):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                obj = getattr(obj, attr)
            return obj
        raise ImportError(name)
    obj = torch
    for attr in name.split(".")[1:]:
        obj = getattr(obj, attr)
    return obj


def test_sites_were_found():
    # The finder itself: the kernels' calls must be among them, or the check below checks nothing.
    names = {s.name for s in SITES}
    assert {"torch.tpu.ops.splash_sdpa", "torch.tpu.pallas.jax_op", "torch.tpu.ops.ragged_dot"} <= names
    conftest.SUMMARY.append(f"torch_tpu call sites checked against torch-tpu {_version()}: "
                            f"{len(SITES)} uses ({sum(s.called for s in SITES)} calls bound) "
                            f"of {len(names)} distinct names")


def _version() -> str:
    from importlib.metadata import version

    return version("torch-tpu")


def _pybind_signature(obj) -> inspect.Signature | None:
    """The signature a pybind11 function writes as its docstring's first line
    (`build_mlir(result_tensors: ..., use_stablehlo_bounds: bool = False) -> ...`), which
    inspect cannot read; None for a function with several overloads or none written."""
    import ast

    first = (getattr(obj, "__doc__", None) or "").split("\n", 1)[0]
    name = getattr(obj, "__name__", "")
    if not first.startswith(f"{name}(") or "Overloaded" in (obj.__doc__ or ""):
        return None
    arguments = first[len(name):first.rindex(") -> ") + 1] if ") -> " in first else first[len(name):]
    try:
        tree = ast.parse(f"def f{arguments}: pass").body[0].args
    except SyntaxError:
        return None
    plain = tree.posonlyargs + tree.args
    defaults = [inspect.Parameter.empty] * (len(plain) - len(tree.defaults)) + list(tree.defaults)
    parameters = [inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
                  for a, d in zip(plain, defaults)]
    parameters += [inspect.Parameter(a.arg, inspect.Parameter.KEYWORD_ONLY,
                                     default=inspect.Parameter.empty if d is None else d)
                   for a, d in zip(tree.kwonlyargs, tree.kw_defaults)]
    return inspect.Signature(parameters)


def test_pybind_signatures_are_read_from_the_docstring():
    from torch_tpu._internal.compile import tpu_torch_compile

    signature = _pybind_signature(tpu_torch_compile.build_mlir)
    assert list(signature.parameters) == ["result_tensors", "argument_tensors", "use_stablehlo_bounds"]
    signature.bind(None, None)
    with pytest.raises(TypeError):
        signature.bind(None, None, donated_inputs=None)


@pytest.mark.parametrize("site", SITES, ids=[f"{s.where()}:{s.name}" for s in SITES])
def test_site_matches_real_api(site):
    try:
        obj = _resolve(site.name)
    except (AttributeError, ImportError) as e:
        pytest.fail(f"{site.where()}: {site.name} does not exist in torch-tpu {_version()} ({e})")
    if not site.called:
        return
    assert not site.starred, f"{site.where()}: {site.name} called with *args/**kwargs; spell the arguments out"
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        signature = _pybind_signature(obj)
        if signature is None:
            pytest.fail(f"{site.where()}: {site.name} has no signature to check against")
    try:
        signature.bind(*[None] * site.num_positional, **{k: None for k in site.keywords})
    except TypeError as e:
        pytest.fail(f"{site.where()}: {site.name}({site.num_positional} positional, keywords "
                    f"{list(site.keywords)}) does not bind to {signature}: {e}")


def test_dynamo_backend_tpu_is_registered():
    """compile.backend tpu looks up the Dynamo backend "tpu" (graph/compile.py)."""
    from torch._dynamo import lookup_backend

    assert callable(lookup_backend("tpu"))


# -- the JAX functions through the real jax_op ------------------------------------------------------


@pytest.fixture(scope="module")
def real_ops():
    from torch.tpu.pallas import jax_op

    from titan_tpu.kernels import tpu as tpu_kernels

    return tpu_kernels._ops(jax_op)  # registers titan_tpu::* ops: jax_op checks every signature


def test_jax_op_accepts_every_kernel_function(real_ops):
    schemas = {name: str(op._opoverload._schema) for name, op in vars(real_ops).items()}
    assert "Tensor q_segment_ids_BQ, Tensor kv_segment_ids_BS" in schemas["splash"]
    assert "SymInt block" in schemas["splash"]
    assert schemas["splash_vjp"].endswith("-> (Tensor, Tensor, Tensor)")
    assert schemas["gmm_vjp"].endswith("-> (Tensor, Tensor)") and "str implementation" in schemas["lce"]
    conftest.SUMMARY.append(f"jax_op registered {len(schemas)} kernel functions: " + ", ".join(sorted(schemas)))


def _fake(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype)


def test_splash_lowers_for_tpu(real_ops):
    """The real op's fake kernel exports the JAX function for TPU (Mosaic lowering rules), bf16,
    GQA 8 query heads on 2 kv heads, head dim 128, sequence 1024 (block 512)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = _fake(1, 8, 1024, 128), _fake(1, 2, 1024, 128)
        ids = _fake(1, 1024, dtype=torch.int32)
        o = real_ops.splash(q, k, k, ids, ids, 512)
        dq, dk, dv = real_ops.splash_vjp(q, k, k, ids, ids, o, 512)
        # Context parallelism's chunk: the last 512 queries over 1024 keys (the mask offset by 512).
        q_chunk, ids_chunk = _fake(1, 8, 512, 128), _fake(1, 512, dtype=torch.int32)
        o_chunk = real_ops.splash(q_chunk, k, k, ids_chunk, ids, 512)
        dq_chunk, dk_chunk, _ = real_ops.splash_vjp(q_chunk, k, k, ids_chunk, ids, o_chunk, 512)
        # One program for every cp rank: the chunk's start a tensor, one kernel per place (lax.switch).
        start = _fake((), dtype=torch.int32)
        o_at = real_ops.splash_at(q_chunk, k, k, ids_chunk, ids, start, 0, 512)
        dq_at, dk_at, _ = real_ops.splash_at_vjp(q_chunk, k, k, ids_chunk, ids, start, o_at, 0, 512)
    assert o.shape == q.shape and dq.shape == q.shape and dk.shape == dv.shape == k.shape
    assert o.dtype == torch.bfloat16
    assert o_chunk.shape == dq_chunk.shape == q_chunk.shape and dk_chunk.shape == k.shape
    assert o_at.shape == dq_at.shape == q_chunk.shape and dk_at.shape == k.shape


def test_gmm_lowers_for_tpu(real_ops):
    """As above for megablox: 1024 rows, model dim 256, expert ffn dim 384, 8 experts, bf16."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w, sizes = _fake(1024, 256), _fake(8, 256, 384), _fake(8, dtype=torch.int32)
        y = real_ops.gmm(x, w, sizes, 128)
        gx, gw = real_ops.gmm_vjp(x, w, sizes, y, 128)
    assert y.shape == (1024, 384) and gx.shape == x.shape and gw.shape == w.shape


def test_tokamax_lowering_cannot_be_checked_here(real_ops):
    """tokamax's Mosaic kernel refuses to trace off a TPU ("Not supported on cpu"): its TPU lowering
    is NOT checked here. This test pins that fact, so the day it traces, the check gets added."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(NotImplementedError, match="Not supported on cpu"):
        real_ops.lce(_fake(256, 128), _fake(256, dtype=torch.int32), _fake(128, 512), "mosaic_tpu")


def test_torch_tpu_reads_our_reverse_scan_mark():
    """graph/reverse_scan.py marks the scanned backward with TorchTPU's reverse-scan key
    (torch_tpu/_internal/compile/scan.py, SCAN_REVERSE_ANNOTATION) so that TorchTPU builds it as a
    reverse loop without the flipped stacks: the key is the package's, and its own reader finds it
    on a body we marked."""
    from torch_tpu._internal.compile import scan as tpu_scan

    from titan_tpu.graph.capture import capture_train_step
    from titan_tpu.graph.reverse_scan import SCAN_REVERSE, mark_reverse_scans
    from titan_tpu.models.common.transformer import TransformerArgs
    from titan_tpu.models.registry import build_model
    from titan_tpu.train.optim import AdamW

    assert tpu_scan.SCAN_REVERSE_ANNOTATION == SCAN_REVERSE
    args = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden_dim=128,
                           max_seq_len=32)
    model = build_model(args, seed=0, scan_layers=True, ac_mode="full")
    opt = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    batch = (torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long))
    gm = capture_train_step(model, max_norm=1.0, adamw_hparams=opt.hparams, decay=opt.decay,
                            example_batch=batch).graph_module
    assert mark_reverse_scans(gm) == 1
    bodies = [getattr(gm, n.args[0].target) for n in gm.graph.nodes if n.target is torch.ops.higher_order.scan]
    assert [tpu_scan._body_asks_for_reverse(body) for body in bodies] == [False, True]
