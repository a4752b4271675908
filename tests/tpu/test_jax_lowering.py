"""The captured step run as JAX (graph/jax_lowering.py) is the step we train with: one whole step
(forward, loss, backward, clipping, AdamW) of the lowered graph on JAX's CPU backend against our
eager step, for the debug models on one device and on 2 dp_shard ranks simulated as a 2-device CPU
mesh (captured on one process under a fake process group, by the run's own assembly:
components/program.py).

The reference is our eager step run in float64 on the same weights and batch: the fp32 eager step
is itself off by ~1e-4 in the gradient norm on CPU (torch's fp32 _foreach_norm sums a 524k-element
gradient with that error; the lowered step's XLA reduction is closer to the exact value), so an
fp32-vs-fp32 comparison could not tell the lowering's errors from torch's. The learning rate is
small enough that Adam's eps-sized gradients (whose update direction is rounding noise in any
fp32 run) move a weight by less than the tolerance, with Adam's eps at 1e-5 (EPS).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from torch.distributed.tensor import Shard

from titan_tpu.components.program import assemble_program, capture_rank, fake_rank
from titan_tpu.components.resolve import resolve
from titan_tpu.components.world import Place, fake_world
from titan_tpu.config import build_config
from titan_tpu.graph.jax_lowering import LOWERINGS, JaxLoweringError, check_lowerable
from titan_tpu.graph.jax_program import global_inputs, jax_mesh, run_on_devices, sharded_step
from titan_tpu.models.registry import build_model
from titan_tpu.parallel.mesh import dp_rank_and_size
from titan_tpu.run.resolved import Target
from titan_tpu.run.setup import RunSetup
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep

aten = torch.ops.aten

BATCH, SEQ = 2, 32  # per device
LR = 1e-4
TOL = 1e-5
# Adam's eps: a gradient near eps moves its weight by up to lr in a direction set by its fp32
# rounding (a gradient that is a sum of cancelling terms); 1e-5 keeps that below the tolerance.
EPS = 1e-5  # max |lowered - reference|, relative to the reference's largest magnitude per tensor


def _config(name: str, layout: dict[str, int], scan: bool = False, batch: int = BATCH, seq: int = SEQ):
    # Scanned layers with full activation checkpointing, as every TPU recipe runs them.
    overrides = ["--model.dtype=float32", f"--optimizer.eps={EPS}", "--parallelism.dp_shard=1",
                 f"--training.batch_size={batch}", f"--training.seq_len={seq}",
                 f"--model.scan_layers={str(scan).lower()}",
                 f"--activation_checkpoint.mode={'full' if scan else 'none'}",
                 *(f"--parallelism.{axis}={size}" for axis, size in layout.items())]
    if "moe" in name and layout.get("dp_shard", 1) > 1:
        # Each rank's balancing loss is of its own batch (averaged over ranks), not of the joint
        # batch a one-process reference sees: the same step only without it.
        overrides.append("--model.moe_load_balance=none")
    return build_config(f"configs/{name}.toml", overrides)


def _capture(cfg, ranks: int, *, rank: int = 0, platform: str = "cpu"):
    """(the run resolved for `ranks` devices of the JAX path on `platform`, rank's step): the run's own
    resolution and assembly, captured as one program for every rank (components/program.py)."""
    run, steps, _ = capture_rank(cfg, Target.for_jax(platform, ranks), rank=rank)
    return run, steps["step"]


def _capture_per_rank(cfg, ranks: int, rank: int):
    """Rank's step captured as the torch-compiled trainer captures it (graph/compile.py GraphStep): per
    rank, its rank a number of the graph, not one program for every rank."""
    from titan_tpu.graph.capture import capture_train_step
    from titan_tpu.graph.spmd import device_step, mesh_axis_sizes

    run = resolve(RunSetup.resolved(cfg), Target(world_size=ranks))
    with fake_rank(run, rank=rank) as (program, place):
        captured = capture_train_step(program.model, max_norm=cfg.training.max_norm,
                                      adamw_hparams=program.optimizer.hparams, decay=program.optimizer.decay,
                                      example_batch=program.example_batch, objective=program.objective)
        return device_step(captured, mesh_axis_sizes(place.mesh, run.dims))


def _batches(vocab: int, ranks: int, batch: int = BATCH, seq: int = SEQ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, vocab, (ranks, batch, seq + 1), generator=torch.Generator().manual_seed(1))
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _inputs(step, model, optimizer, batch) -> list[np.ndarray]:
    """The captured step's flat inputs for this rank's model, fresh moments and `batch` (step 1)."""
    captured = step.captured
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())

    def local(t):
        t = t.detach()
        return (t.to_local() if hasattr(t, "to_local") else t).numpy().copy()

    p = [local(params[n]) for n in captured.param_names]
    return captured.layout.flatten_inputs(
        params=p, exp_avg=[np.zeros_like(x) for x in p], exp_avg_sq=[np.zeros_like(x) for x in p],
        batch=[t.numpy() for t in batch], step=[np.float32(1)], lr=[np.float32(LR)],
        # The step's trained tokens on all ranks (every label counts here: no -100 in these batches).
        num_tokens=[np.int32(batch[1].numel() * captured.dp_size)],
        buffers=[local(buffers[n]) for n in captured.buffer_names])


def _reference(cfg, batches, monkeypatch, *, per_rank: bool = False):
    """Our eager step in float64, one process, on all ranks' rows at once (what dp ranks train); with
    per_rank, each rank's rows as a micro-batch of their own (an MoE's balancing loss is of a rank's rows).
    grad_norm asks _foreach_norm for float32 norms, which torch refuses for float64 gradients
    (narrowing): here the norms stay float64."""
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda tensors, ord=2, dtype=None: foreach_norm(tensors, ord))
    from titan_tpu.models.spec import model_spec

    # Initialised in float32 (the RNG draws other values for float64), then widened; the expert
    # matmuls through the reference kernel (torch's grouped GEMM takes no float64).
    kernels = dataclasses.replace(cfg.kernels, grouped_mm="reference")
    model = build_model(model_spec(cfg.model).args, seed=cfg.training.seed, kernels=kernels,
                        scan_layers=cfg.model.scan_layers).to(torch.float64)
    # Stacked norm weights take no weight decay, as per layer (the optimizer is told which are stacked).
    optimizer = AdamW.from_config(dict(model.named_parameters()), cfg.optimizer,
                                  layer_stacked=model.stacked_parameter_names())
    micro_batches = list(batches) if per_rank else [tuple(torch.cat([b[i] for b in batches]) for i in range(2))]
    result = EagerStep(model, optimizer, max_norm=cfg.training.max_norm)(micro_batches, LR)
    return result, model, optimizer


def _max_rel(ours, reference) -> float:
    reference = np.asarray(reference, dtype=np.float64)
    return float(np.abs(np.asarray(ours, dtype=np.float64) - reference).max() / max(np.abs(reference).max(), 1e-30))


def _shard_of(full: torch.Tensor, spec, rank: int) -> np.ndarray:
    """Global rank `rank`'s part of a full reference tensor, by the parameter's placements: for each
    mesh dim with Shard(d), the chunk of dim d at the rank's coordinate on that mesh dim."""
    full = full.detach().numpy()
    if spec is None:
        return full
    coords = [int(c[0]) for c in torch.nonzero(spec.mesh.mesh == rank, as_tuple=True)]
    for mesh_dim, placement in enumerate(spec.placements):
        if placement.is_shard():
            size = full.shape[placement.dim] // spec.mesh.size(mesh_dim)
            start = coords[mesh_dim] * size
            full = np.take(full, range(start, start + size), axis=placement.dim)
    return full


# (model, layout, scanned layers with full checkpointing, layers: None for the model's own). cp 2
# and ep 2's all_to_all (here the static worst-case buffer of a graph captured on CPU/CUDA; the
# TPU's ragged form is in the kernel test below) scanned, as the TPU recipes run, with one layer:
# its scan body is the code every layer runs, and each layer more only added time.
LAYOUTS = [("llama3_debug", {}, False, None), ("qwen3_debug", {}, False, None), ("qwen3_moe_debug", {}, False, None),
           ("llama3_debug", {"dp_shard": 2}, False, None), ("qwen3_moe_debug", {"dp_shard": 2}, False, None),
           ("llama3_debug", {"tp": 2}, False, None), ("llama3_debug", {"cp": 2}, True, 1),
           ("qwen3_moe_debug", {"dp_shard": 2, "ep": 2}, False, None),
           ("qwen3_moe_debug", {"dp_shard": 2, "ep": 2, "ep_dispatch": "all_to_all"}, True, 1),
           # expert parallelism composed with tensor and context parallelism (4 devices), scanned as the recipes run
           ("qwen3_moe_debug", {"dp_shard": 2, "ep": 2, "tp": 2}, True, 1),
           ("qwen3_moe_debug", {"dp_shard": 2, "ep": 2, "cp": 2}, True, 1),
           ("llama3_debug", {}, True, None)]


def _layout_id(name: str, layout: dict) -> str:
    return f"{name}-{'-'.join(f'{a}{s}' if isinstance(s, int) else s for a, s in layout.items()) or '1dev'}"


def _with_layers(name: str, layers: int | None, monkeypatch) -> None:
    """The debug model `name` cut to `layers` layers for this test (None: as it is)."""
    from titan_tpu.models.registry import MODEL_FLAVORS

    if layers is not None:
        model = _config(name, {}).model
        family, flavor = model.name, model.flavor
        monkeypatch.setitem(MODEL_FLAVORS[family], flavor,
                            dataclasses.replace(MODEL_FLAVORS[family][flavor], n_layers=layers))


@pytest.mark.parametrize("name, layout, scan, layers", LAYOUTS,
                         ids=[f"{_layout_id(n, lay)}{'-scanned' if scan else ''}" for n, lay, scan, _ in LAYOUTS])
def test_lowered_step_equals_eager_step(name, layout, scan, layers, monkeypatch):
    _with_layers(name, layers, monkeypatch)
    _check_lowered_step(name, layout, scan, monkeypatch)


# The TPU's JAX kernels inside the lowered step (kernels/jax_traced.py), run by JAX on CPU: splash
# and megablox's gmm in Pallas's TPU interpret mode, tokamax's loss as its plain-XLA form (its
# Mosaic kernel will not run off a TPU). 128 positions: splash's smallest block. The MoE with
# expert parallelism holds all three kernels (interpret mode is slow: one layout, and the debug
# model cut to one layer, which holds each kernel and its backward: each layer more ran the same
# kernels again and made the check the slowest of make tpu-check).
KERNEL_LAYOUTS = [("qwen3_moe_debug", {"dp_shard": 2, "ep": 2, "ep_dispatch": "all_to_all"})]
KERNEL_LAYERS = 1


@pytest.mark.parametrize("name, layout", KERNEL_LAYOUTS, ids=[_layout_id(n, lay) for n, lay in KERNEL_LAYOUTS])
def test_lowered_step_with_tpu_kernels_equals_eager_step(name, layout, monkeypatch):
    """The step lowered with the TPU kernels as their JAX functions (what `titan-tpu compile` hands
    XLA) equals our eager step with the CPU's kernels (float64), one whole step."""
    from jax.experimental.pallas import tpu as pltpu

    from titan_tpu.kernels.jax_traced import NAMESPACE

    _with_layers(name, KERNEL_LAYERS, monkeypatch)
    with pltpu.force_tpu_interpret_mode():
        step = _check_lowered_step(name, layout, False, monkeypatch, batch=1, seq=128, platform="tpu")
    kernels = {n.target.name().split("::")[1] for n in step.captured.graph_module.graph.nodes
               if n.op == "call_function" and getattr(n.target, "namespace", None) == NAMESPACE}
    # ep all_to_all: TorchTPU's ragged all-to-all (run here by the lowering's all-gather emulation).
    assert kernels == {"splash_attention", "splash_attention_vjp", "tokamax_lce", "tokamax_lce_vjp", "megablox_gmm",
                       "megablox_gmm_vjp", "ragged_all_to_all"}, kernels
    layers = {n.split(".")[1] for n in step.captured.param_names if n.startswith("layers.")}
    assert len(layers) == KERNEL_LAYERS, layers


def per_device_inputs(run, step, ranks: int, batch: int, seq: int) -> tuple[list, list]:
    """(each device's flat inputs of `step`: its rank's model and optimizer state, as the run's assembly
    builds them with real tensors, and its data-parallel rank's batch; the batches of every
    data-parallel rank)."""
    per_device = []
    for rank in range(ranks):
        with fake_world(ranks, rank):
            place = Place.of(run, rank=rank, device=torch.device("cpu"))
            program = assemble_program(run, place)
            dp_rank, dp_size = dp_rank_and_size(place.mesh)
            batches = _batches(cfg_vocab(run.cfg), dp_size, batch, seq)
            per_device.append(_inputs(step, program.model, program.optimizer, batches[dp_rank]))
    return per_device, batches


def _check_lowered_step(name, layout, scan, monkeypatch, batch=BATCH, seq=SEQ, platform="cpu"):
    """One whole step, lowered and run by JAX on a CPU mesh of the layout's ranks, equals our eager
    step (float64, one process, on the batches of all data-parallel ranks). Under tp and cp every
    rank reads its data-parallel rank's batch (both ranks the same one); the model's own hooks
    split it (cp) or not (tp), as in training. scan: scanned layers, whose scan ops (forward and
    backward) lower to lax.scan (XLA's while loop); the reference is the eager step over the same
    stacked weights.

    Captured as `titan-tpu compile` captures, as one program for every rank: cp's and ep's ranks are
    the mesh axis index in the lowered program, and rank 0's program runs on every device, as a
    compile for a slice does. tp's vocabulary offset is still a number per rank: under tp every
    rank's graph is captured and each device reads its own (rank_constants)."""
    cfg = _config(name, layout, scan, batch, seq)
    ranks = int(np.prod([size for size in layout.values() if isinstance(size, int)] or [1])) // layout.get("ep", 1)
    captured = [_capture(cfg, ranks, rank=r, platform=platform) for r in range(ranks if layout.get("tp", 1) > 1 else 1)]
    run, steps = captured[0][0], [step for _, step in captured]
    step = steps[0]
    per_device, batches = per_device_inputs(run, step, ranks, batch, seq)
    outputs = run_on_devices(steps, per_device, jax.devices("cpu"))
    if scan:  # the forward and the backward each one while loop over the layers, not unrolled
        mesh = jax_mesh(step, jax.devices("cpu"))
        text = jax.jit(sharded_step(step, mesh)).lower(*global_inputs(mesh, per_device)).as_text()
        assert text.count("stablehlo.while") == 2, text.count("stablehlo.while")
        # The backward loop runs in reverse over the stacks as they are (graph/reverse_scan.py
        # mark_reverse_scans), as TorchTPU builds it: no reversed copy of any stack. (Context
        # parallelism reverses its tail chunk's sequence order, a flip of its own.)
        if cfg.parallelism.cp == 1:
            assert "stablehlo.reverse" not in text
    result, model, optimizer = _reference(cfg, batches, monkeypatch)
    layout, names = step.captured.layout, step.captured.param_names
    specs = step.captured.dtensor_specs
    params, state = dict(model.named_parameters()), optimizer.state
    errors = {}
    for rank, flat in enumerate(outputs):
        out = layout.unflatten_outputs(flat)
        errors["loss"] = max(errors.get("loss", 0), _max_rel(out["loss"][0], result.loss))
        errors["grad_norm"] = max(errors.get("grad_norm", 0), _max_rel(out["grad_norm"][0], result.grad_norm))
        for group, reference in (("params", params), ("exp_avg", state["exp_avg"]),
                                 ("exp_avg_sq", state["exp_avg_sq"])):
            for n, value in zip(names, out[group]):
                error = _max_rel(value, _shard_of(reference[n], specs.get(n), rank))
                errors[group] = max(errors.get(group, 0), error)
                if error > TOL:
                    print(f"  {group} {n}: {error:.1e} ({specs[n].placements if n in specs else 'plain'})")
    print(f"{name}{' scanned' if scan else ''} on {ranks} device(s) {cfg.parallelism}: max relative error "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) <= TOL, errors
    return step


def cfg_vocab(cfg) -> int:
    from titan_tpu.models.spec import model_spec

    return model_spec(cfg.model).args.vocab_size


def test_context_parallel_ranks_are_one_program(monkeypatch):
    """Captured as one program for every rank, cp's ranks capture the same graph, number for number
    (their place on the sequence is the group_rank op, the mesh axis index once lowered); captured
    as the trainer captures, their chunks attend to key prefixes of rank-dependent lengths, and the
    comparison of the ranks' graphs says in one line that no single SPMD program runs them all."""
    from titan_tpu.graph.jax_lowering import functional_graph, rank_constants

    _with_layers("llama3_debug", 1, monkeypatch)
    cfg = _config("llama3_debug", {"cp": 2})

    def graphs(steps):
        return [functional_graph(s.captured.graph_module, s.captured.example_inputs) for s in steps]

    assert rank_constants(graphs([_capture(cfg, 2, rank=r)[1] for r in range(2)])) == {}
    with pytest.raises(JaxLoweringError, match="no single SPMD program runs them all") as error:
        rank_constants(graphs([_capture_per_rank(cfg, 2, r) for r in range(2)]))
    assert "\n" not in str(error.value)


def test_weights_the_ranks_do_not_divide_are_one_program(monkeypatch):
    """A vocabulary of 2047 rows over 2 dp_shard ranks (torch.chunk's split: 1024 + 1023 rows):
    SimpleFSDP shards the embedding and output on the model dim instead (simple_fsdp._even_blocks),
    so both ranks capture the same program, number for number and shape for shape, and its step
    equals the eager one."""
    from titan_tpu.graph.jax_lowering import functional_graph, rank_constants
    from titan_tpu.models.registry import MODEL_FLAVORS

    monkeypatch.setitem(MODEL_FLAVORS["llama3"], "debug",
                        dataclasses.replace(MODEL_FLAVORS["llama3"]["debug"], n_layers=1, vocab_size=2047))
    cfg = _config("llama3_debug", {"dp_shard": 2})
    steps = [_capture(cfg, 2, rank=r)[1] for r in range(2)]
    specs = steps[0].captured.dtensor_specs
    assert specs["output.weight"].placements == specs["tok_embeddings.weight"].placements == (Shard(1),)
    assert rank_constants([functional_graph(s.captured.graph_module, s.captured.example_inputs) for s in steps]) == {}
    _check_lowered_step("llama3_debug", {"dp_shard": 2}, False, monkeypatch)
    # Split on dim 0 as before: the lowering refuses it in one line (not XLA's sharding mismatch at step 1).
    uneven = dict(specs, **{"output.weight": dataclasses.replace(specs["output.weight"], placements=(Shard(0),))})
    step = dataclasses.replace(steps[0], captured=dataclasses.replace(steps[0].captured, dtensor_specs=uneven))
    with pytest.raises(ValueError, match=r"output\.weight \[2047, 256\] is split unevenly over mesh axis") as err:
        sharded_step(step, jax_mesh(step, jax.devices("cpu")))
    assert "\n" not in str(err.value)


def test_unknown_operator_names_its_module_in_one_line():
    """An op with no JAX lowering: one line naming the op, the module whose forward made it (for a
    backward op, the module whose forward's backward made it), as the capture recorded, and the
    backends that run it instead of the JAX path."""
    _, step = _capture(_config("llama3_debug", {}), 1)
    from titan_tpu.graph.jax_lowering import functional_graph

    graph = functional_graph(step.captured.graph_module, step.captured.example_inputs)
    forward_mm, backward_attention = aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    where = {forward_mm: r"from module layers\.0\.attention\.wq \(Linear\), graph node mm\b",
             # The last layer's backward runs first.
             backward_attention: r"from the backward of module layers\.5\.attention \(Attention\), graph node"}
    for missing, module in where.items():
        saved = LOWERINGS.pop(missing)
        try:
            with pytest.raises(JaxLoweringError, match=str(missing).replace(".", r"\.") + r" \(" + module) as error:
                check_lowerable(graph)
            assert "\n" not in str(error.value)
            # which backends run it instead
            assert "compile.backend jax" in str(error.value) and "--compile.backend inductor" in str(error.value)
        finally:
            LOWERINGS[missing] = saved


def test_compile_debug_recipe_for_v5p():
    """`titan-tpu compile`'s core on the llama3 debug recipe for a 4-chip v5p slice (dp_shard 4):
    XLA's TPU compiler accepts the lowered step, and its per-chip argument bytes are the bytes of
    what one device is handed (its parameter shards, moments, batch, scalars, buffers), give or take
    the TPU's tile padding of small arrays (16 KB of 18.5 MB measured); the donated parameters and
    moments are aliased with their updated outputs (counted once in the peak)."""
    import math

    from titan_tpu.graph.jax_lowering import jax_dtype
    from titan_tpu.plan.hardware import HARDWARE
    from titan_tpu.tools.compile_cmd import compile_step_for_tpu

    cfg = build_config("configs/llama3_debug.toml", ["--training.batch_size=2", "--training.seq_len=64"])
    report = compile_step_for_tpu(cfg, "v5p:2x2x1")
    # The step compile handed XLA: the run's assembly for 4 TPU devices.
    step = capture_rank(cfg, Target.for_jax("tpu", 4), hardware=HARDWARE["v5p"])[1]["step"]
    handed = sum(math.prod(t.shape) * jax_dtype(t.dtype).itemsize for t in step.captured.example_inputs)
    assert handed <= report["memory_per_chip_bytes"]["arguments"] <= 1.01 * handed
    # Parameters and moments are donated: XLA aliases each with its updated output.
    slices, inputs = step.captured.input_slices(), step.captured.example_inputs
    donated = sum(math.prod(t.shape) * jax_dtype(t.dtype).itemsize
                  for group in ("params", "exp_avg", "exp_avg_sq") for t in inputs[slices[group]])
    assert donated <= report["memory_per_chip_bytes"]["aliased"] <= 1.01 * donated
    assert report["fits"] and report["mesh"] == {"dp_shard": 4}
    assert report["collectives"]
    # 64 positions: too few for splash's blocks of 128, so the CPU's attention is lowered instead, and said.
    assert report["kernels"]["attention"].startswith("sdpa (in place of splash: splash attention needs seq_len "
                                                     "divisible by 128"), report["kernels"]
    assert not any("splash" in k for k in report["tpu_kernels"])
    import conftest

    conftest.SUMMARY.append(f"compile llama3_debug for v5p:2x2x1: {report['compile_seconds']:.1f} s, peak "
                            f"{report['peak_per_chip_bytes'] / 2**20:.1f} MiB/chip, XLA FLOPs "
                            f"{report['flops_per_chip']:.3e} vs formula {report['formula_flops_per_chip']:.3e}")
