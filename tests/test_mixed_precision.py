"""Mixed precision (docs/mixed_precision.md): model.dtype is the compute dtype everywhere.

fp32 master parameters and AdamW state, cast for compute, on one device as on many, eager and graph
mode; bf16 on the CPU only where it has bf16 instructions; MFU against the compute dtype's peak.

This machine class may lack bf16 instructions (bf16 matmuls ~100x slower than fp32 there), so the
numerics tests run bf16 through the functions themselves (the trainer would refuse it, which is
tested too) on tiny models, where bf16 costs about what fp32 does on any CPU. The 300-step
comparison of the debug models is bench/mixed_precision.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

import titan_tpu.device as dev
import titan_tpu.device_cpu as device_cpu
from titan_tpu.config import build_config
from titan_tpu.models.common.transformer import Transformer
from titan_tpu.models.registry import get_model_args
from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
from titan_tpu.run.setup import prepare_run
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep

BF16 = MixedPrecision(param_dtype=torch.bfloat16)
SEQ = 16
STEPS = 8
LR = 3e-3
LLAMA_DEBUG = "configs/llama3_debug.toml"


def tiny_args(name: str = "llama3", **changes):
    base = get_model_args(name, "debug")
    sizes = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128, max_seq_len=SEQ)
    if name == "qwen3":
        sizes["head_dim"] = 16
    if name == "qwen3_moe":
        sizes["head_dim"] = 16
        sizes["moe"] = dataclasses.replace(base.moe, num_experts=4, top_k=2, hidden_dim=32)
    return dataclasses.replace(base, **{**sizes, **changes})


def tiny_model(args=None, *, mp: MixedPrecision | None = BF16, mesh=None, mode: str = "none", **options):
    with torch.device("meta"):
        model = Transformer(args or tiny_args(), **options)
    return materialize_and_init(model, mesh, mode=mode, mp=mp, device=torch.device("cpu"), seed=0)


def batches(steps: int = STEPS, rows: int = 4, vocab: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences following x[t+1] = (5 x[t] + 1) mod V from random starts: the model learns the
    rule within a few steps, so the loss moves and a diverging run would show."""
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (steps, rows), generator=g)]
    for _ in range(SEQ):
        tokens.append((5 * tokens[-1] + 1) % vocab)
    seqs = torch.stack(tokens, dim=-1)
    return [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seqs]


def eager_losses(model, data, *, lr: float = LR) -> list[float]:
    step = EagerStep(model, AdamW(dict(model.named_parameters())), max_norm=1.0)
    return [step([b], lr).loss for b in data]


# ---------------------------------------------------------------------------------------------
# One device: fp32 masters, computed in bf16
# ---------------------------------------------------------------------------------------------


def test_one_device_stores_fp32_masters_and_computes_in_bf16():
    model = tiny_model()
    optimizer = AdamW(dict(model.named_parameters()))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.layers["0"].attention.wq.weight.dtype == torch.bfloat16  # read for compute
    assert {t.dtype for t in model.state_dict().values()} == {torch.float32}  # checkpoints keep masters
    inputs, labels = batches(1)[0]
    assert model(inputs).dtype == torch.bfloat16
    out = model(inputs, labels)
    assert out.ce_sum.dtype == torch.float32
    out.ce_sum.backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    optimizer.step({n: p.grad for n, p in model.named_parameters()}, lr=LR)
    assert {t.dtype for t in optimizer.state["exp_avg"].values()} == {torch.float32}
    assert {t.dtype for t in optimizer.state["exp_avg_sq"].values()} == {torch.float32}
    # fp32 compute leaves the model as it was: plain parameters, no cast on read.
    fp32 = tiny_model(mp=MixedPrecision())
    assert type(fp32.layers["0"].attention.wq) is torch.nn.Linear


def test_bf16_mixed_precision_trains_like_fp32():
    data = batches()
    fp32 = eager_losses(tiny_model(mp=MixedPrecision()), data)
    bf16 = eager_losses(tiny_model(), data)
    assert fp32[-1] < fp32[0] - 0.5  # it learns
    # Stated tolerance: 3% of the loss per step over 8 steps (bf16 keeps 8 bits of mantissa).
    torch.testing.assert_close(bf16, fp32, rtol=3e-2, atol=0)


@pytest.fixture
def bf16_cpu(monkeypatch):
    """The explicit test-only path: pretend this CPU has bf16 instructions, so the config and the
    trainer accept model.dtype bfloat16 on training.device cpu."""
    monkeypatch.setattr(device_cpu, "cpu_bf16_support", lambda: (True, "a test says so"))


def test_trainer_keeps_updates_below_bf16_resolution(bf16_cpu, train_overrides):
    """A learning rate of 1e-5 moves the norm weights (1.0 at init) by about 1e-5 a step, far
    below bf16's resolution at 1.0 (2**-8 below, 2**-7 above): stored in bf16 (pure bf16
    training) they never move; fp32 master weights keep every step."""
    from titan_tpu.loops import assemble

    lr, steps = 1e-5, 3
    cfg = build_config(LLAMA_DEBUG, train_overrides(
        model__dtype="bfloat16", training__steps=steps, training__batch_size=1, training__seq_len=8,
        optimizer__lr=lr, lr_scheduler__warmup_steps=0, lr_scheduler__decay_ratio=0.0,
        validation__enabled="false", checkpoint__enabled="false"))
    trainer = assemble(cfg)
    assert trainer.components.compute_dtype == torch.bfloat16
    assert trainer.components.model.norm.weight.dtype == torch.bfloat16  # computed in bf16
    stored = trainer.components.model.norm._parameters["weight"]
    for _ in range(steps):
        trainer.train_step()
    moved = (stored.float() - 1.0).abs()
    assert (moved > 0).float().mean() > 0.9, "updates below bf16's resolution were lost"
    assert moved.max() <= steps * lr * 1.01  # Adam's step is at most lr per step (no decay on norms)
    assert stored.dtype == torch.float32
    assert {t.dtype for t in trainer.components.optimizer.state["exp_avg_sq"].values()} == {torch.float32}


# ---------------------------------------------------------------------------------------------
# Graph mode, scan and checkpointing in bf16
# ---------------------------------------------------------------------------------------------


# Scan and full checkpointing, each on its own: the two paths that store or recompute bf16
# activations differently from the unrolled model (which both runs still compare against, in
# eager). Their combination is covered in fp32 by test_scan_ac.py; each case here costs an
# Inductor compile (~30 s on a 2-core CPU).
GRAPH_CASES = {"scan": {"scan_layers": True}, "full-ac": {"ac_mode": "full"}}


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_graph_inductor_bf16_equals_eager_bf16(case):
    from titan_tpu.graph.compile import GraphStep

    options = GRAPH_CASES[case]
    data = batches(4)
    eager = eager_losses(tiny_model(**options), data)
    if options:  # scan (real-arithmetic RoPE) and checkpointing: the unrolled eager run to bf16's rounding
        torch.testing.assert_close(eager, eager_losses(tiny_model(), data), rtol=1e-2, atol=0)
    model = tiny_model(**options)
    step = GraphStep(model, AdamW(dict(model.named_parameters())), max_norm=1.0, example_batch=data[0],
                     backend="inductor")
    graph = [step([b], LR).loss for b in data]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    # Stated tolerance: 1e-2 relative per step (Inductor fuses bf16 elementwise work in fp32 and
    # rounds once where eager rounds after every op).
    torch.testing.assert_close(graph, eager, rtol=1e-2, atol=0)


# ---------------------------------------------------------------------------------------------
# One device equals 2 fully_shard ranks
# ---------------------------------------------------------------------------------------------


def _fully_shard_bf16_losses() -> list[float]:
    dims = ParallelDims(dp_replicate=1, world_size=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    dp_rank, dp_size = dp_rank_and_size(mesh)
    model = tiny_model(mesh=mesh, mode=dims.mode)
    optimizer = AdamW(dict(model.named_parameters()))
    step = EagerStep(model, optimizer, max_norm=1.0, dp_size=dp_size)
    rows = 4 // dp_size
    losses = [step([tuple(t[dp_rank * rows:(dp_rank + 1) * rows] for t in b)], LR).loss for b in batches()]
    masters = {p.to_local().dtype for p in model.parameters()}
    return losses, masters


@pytest.mark.multiprocess
def test_one_device_equals_two_fully_shard_ranks_in_bf16():
    one = eager_losses(tiny_model(), batches())
    results = run_distributed(_fully_shard_bf16_losses, world_size=2)
    for losses, masters in results:
        assert masters == {torch.float32}
        # Stated tolerance: 1e-2 relative per step. Both hold fp32 masters and compute in bf16;
        # they differ in how the bf16 gradient is summed (one matmul over 4 rows against two
        # over 2 rows, reduced in fp32).
        torch.testing.assert_close(losses, one, rtol=1e-2, atol=0)


# ---------------------------------------------------------------------------------------------
# MoE: router and balancing loss in fp32
# ---------------------------------------------------------------------------------------------


def test_moe_router_and_balancing_loss_stay_fp32_in_bf16():
    """The router's probabilities, the expert statistics and the balancing loss are fp32 in a bf16
    run (as transformers takes its router softmax in fp32); the bf16 run's losses are those of fp32
    to a stated tolerance."""
    args = tiny_args("qwen3_moe")
    inputs, labels = batches(1)[0]
    fp32, bf16 = tiny_model(args, mp=MixedPrecision()), tiny_model(args)
    ref, out = fp32(inputs, labels), bf16(inputs, labels)
    h_BSD, stats_L2E = bf16.hidden_states(inputs)
    assert h_BSD.dtype == torch.bfloat16
    assert stats_L2E.dtype == out.aux_loss.dtype == torch.float32
    assert out.aux_loss.item() > 0
    # Router probabilities sum to one per token, exactly in fp32 (bf16 sums would miss by ~1e-2).
    torch.testing.assert_close(stats_L2E[:, 1].sum(dim=-1), torch.full((args.n_layers,), float(inputs.numel())),
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=2e-2, atol=0)
    torch.testing.assert_close(out.ce_sum, ref.ce_sum, rtol=1e-2, atol=0)


# ---------------------------------------------------------------------------------------------
# The HF backend against transformers' own autocast
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_hf_backend_bf16_matches_transformers_autocast(model_type):
    """Our HF backend in bf16 (fp32 masters cast for compute) against what a transformers user
    runs: the same fp32 model under torch.autocast("cpu", dtype=torch.bfloat16). Autocast keeps
    the residual stream in fp32 where the cast weights keep it in bf16, so they agree to bf16's
    precision, not bitwise: stated tolerance 2e-2 relative on the loss and the balancing loss."""
    pytest.importorskip("transformers")
    from titan_tpu.models.hf.config import hf_args_from_config
    from titan_tpu.models.hf.model import build_hf_model
    from titan_tpu.tools import hf_sweep

    config = hf_sweep.tiny_config(model_type)
    if model_type == "qwen3_moe":
        config.output_router_logits = True  # transformers adds the balancing loss only then
    args = hf_args_from_config(config)
    ours = materialize_and_init(build_hf_model(args), None, mode="none", mp=BF16, device="cpu", seed=0)
    ours.check_chunked_loss(args.vocab_size)
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    ref = hf_sweep._reference_model(config, ours.state_dict())
    inputs, labels = hf_sweep.sweep_batch()
    out = ours(inputs, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = ref(input_ids=inputs, use_cache=False)
        ref_ce = torch.nn.functional.cross_entropy(ref_out.logits.flatten(0, 1).float(), labels.flatten())
    torch.testing.assert_close(out.ce_sum / labels.numel(), ref_ce, rtol=2e-2, atol=0)
    if model_type == "qwen3_moe":
        assert out.aux_loss.dtype == torch.float32
        expected = config.router_aux_loss_coef * ref_out.aux_loss.float()
        torch.testing.assert_close(out.aux_loss, expected, rtol=2e-2, atol=0)


# ---------------------------------------------------------------------------------------------
# bf16 on the CPU: detected, allowed where present, refused in one line where absent
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, supported", [({"avx2", "avx512_bf16"}, True), ({"amx_bf16", "amx_tile"}, True),
                                              ({"avx2", "avx512f", "avx512bw"}, False)])
def test_cpu_bf16_is_detected_from_the_cpu_flags(monkeypatch, flags, supported):
    monkeypatch.setattr(device_cpu, "_cpu_flags", lambda: flags)
    assert device_cpu.cpu_bf16_support()[0] is supported


def test_cpu_bf16_detection_on_this_machine():
    flags = device_cpu._cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo here")
    supported, why = device_cpu.cpu_bf16_support()
    assert supported == bool(flags & {"avx512_bf16", "amx_bf16"})
    assert "/proc/cpuinfo" in why


def test_bf16_on_a_cpu_without_it_is_one_line_that_says_why(monkeypatch, train_overrides):
    monkeypatch.setattr(device_cpu, "_cpu_flags", lambda: {"avx2", "fma"})
    with pytest.raises(ValueError) as error:
        prepare_run(build_config(LLAMA_DEBUG, train_overrides(model__dtype="bfloat16")))
    message = str(error.value)
    assert "\n" not in message
    assert "avx512_bf16" in message and "~100x slower" in message and "use model.dtype = float32" in message
    # training.device auto that becomes the CPU: the trainer refuses it the same way.
    from titan_tpu.loops import assemble

    cfg = build_config(LLAMA_DEBUG, train_overrides(model__dtype="bfloat16", training__device="auto"))
    if dev.get_backend("auto").name == "cpu":
        with pytest.raises(ValueError, match="bf16 matmul instructions"):
            assemble(cfg)


def test_bf16_is_allowed_on_a_cpu_with_it(monkeypatch, train_overrides):
    monkeypatch.setattr(device_cpu, "_cpu_flags", lambda: {"avx2", "avx512_bf16"})
    cfg = build_config(LLAMA_DEBUG, train_overrides(model__dtype="bfloat16"))
    assert cfg.model.dtype == "bfloat16"
    # The default stays fp32 on the CPU.
    from titan_tpu.parallel.simple_fsdp import default_mixed_precision

    assert default_mixed_precision("cpu").param_dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# MFU against the compute dtype's peak
# ---------------------------------------------------------------------------------------------


def test_cpu_peak_is_measured_in_the_compute_dtype(monkeypatch):
    measured = []

    def fake_measure(dtype=torch.float32):
        measured.append(dtype)
        return {torch.float32: 200e9, torch.bfloat16: 800e9}[dtype]

    monkeypatch.delenv("TITAN_TPU_PEAK_FLOPS", raising=False)
    monkeypatch.setattr(device_cpu, "_cpu_peak_memo", {})
    monkeypatch.setattr(device_cpu, "measure_cpu_matmul_flops", fake_measure)
    monkeypatch.setattr(device_cpu, "cpu_bf16_support", lambda: (True, "a test says so"))
    backend = dev.get_backend("cpu")
    assert backend.peak_flops(torch.bfloat16) == 800e9 and backend.peak_flops(torch.float32) == 200e9
    assert backend.peak_description(torch.bfloat16).startswith("cpu bf16 matmul, measured 800 GFLOP/s")
    assert backend.peak_description(torch.float32).startswith("cpu fp32 matmul, measured 200 GFLOP/s")
    assert measured == [torch.bfloat16, torch.float32]  # once each


def test_cpu_bf16_peak_is_not_measured_without_bf16_instructions(monkeypatch):
    monkeypatch.setattr(device_cpu, "_cpu_peak_memo", {})
    monkeypatch.setattr(device_cpu, "_cpu_flags", lambda: {"avx2"})
    with pytest.raises(ValueError, match="bf16 matmul instructions"):
        device_cpu.cpu_peak_flops(torch.bfloat16)


def test_accelerator_peak_is_the_bf16_table_and_says_so_for_fp32(monkeypatch):
    monkeypatch.delenv("TITAN_TPU_PEAK_FLOPS", raising=False)
    backend = dev.Backend(name="tpu", device=torch.device("cpu"), process_group_backend="gloo", compile_backend="tpu")
    monkeypatch.setattr(dev, "_detect_tpu_kind", lambda device: "TPU v6 lite")
    assert backend.peak_flops(torch.bfloat16) == 918e12
    assert "bf16 dense" in backend.peak_description(torch.bfloat16)
    assert "computes in fp32" not in backend.peak_description(torch.bfloat16)
    assert backend.peak_flops(torch.float32) == 918e12
    assert "computes in fp32: MFU against the bf16 peak" in backend.peak_description(torch.float32)


# ---------------------------------------------------------------------------------------------
# The planner follows the same rule
# ---------------------------------------------------------------------------------------------


def test_plan_counts_fp32_masters_and_bf16_copies_on_one_device(bf16_cpu, monkeypatch):
    from titan_tpu.plan import hardware, plan_config
    from titan_tpu.plan.setting import for_planning

    def plan(dtype: str):
        return plan_config(for_planning(LLAMA_DEBUG, ["--training.device", "cpu", "--model.dtype", dtype]),
                           hardware.cpu_hardware(measure=False, dtype=dtype))

    fp32, bf16 = plan("float32"), plan("bfloat16")
    total = bf16.params["total"]
    for p in (fp32, bf16):  # fp32 masters, gradients and both moments, whatever the compute dtype
        assert p.memory["parameters"] == p.memory["gradients"] == p.memory["optimizer_state"] / 2 == total * 4
    with torch.device("meta"):
        block_params = sum(p.numel() for p in Transformer(get_model_args("llama3", "debug")).layers.parameters())
    assert fp32.memory["gathered_weights"] == 0  # fp32 weights are used in place
    assert bf16.memory["gathered_weights"] == block_params * 2  # the bf16 copies, forward to backward
    # The CPU's peak is measured in the compute dtype.
    monkeypatch.setattr(device_cpu, "cpu_peak_flops",
                        lambda dtype=torch.float32: {torch.bfloat16: 8e11}.get(dtype, 2e11))
    monkeypatch.setattr(hardware, "measure_cpu_memory_bandwidth", lambda: 1e10)
    measured = hardware.cpu_hardware(dtype="bfloat16")
    assert measured.peak_flops == 8e11 and "bf16 matmul peak 800 GFLOP/s" in measured.source
