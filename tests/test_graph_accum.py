"""Graph mode with gradient accumulation and with chat data: the same numbers as EagerStep.

A tiny fp32 model (dim 64, 3 layers, vocab 256, seq 32) learning a deterministic token rule, so
the loss moves and a wrong gradient would show. Accumulation: 20 steps of 2 micro-batches of 2
rows, plain, scanned, and with full activation checkpointing, on one process, and scanned and with
full checkpointing on two fully_shard ranks, against EagerStep with the same micro-batches (1e-5). Chat: labels with
IGNORE_INDEX tokens, one conversation per row (padded) or several packed with restarting
positions, so every step trains a different number of tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from titan_tpu.graph import GraphStep
from titan_tpu.models.common.transformer import Transformer, TransformerArgs
from titan_tpu.models.registry import build_model
from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import IGNORE_INDEX, EagerStep

SEED = 0
# 10 steps: a wrong accumulated gradient shows in the first step; the eager reference still drops its
# loss by more than 1.0 (which its fixture checks); 20 only cost time.
STEPS = 10
MICRO, ROWS, SEQ = 2, 2, 32  # micro-batches per step, rows per micro-batch (per rank), tokens per row
TOL = 1e-5
VARIANTS = {"plain": dict(scan_layers=False, ac_mode="none"), "scan": dict(scan_layers=True, ac_mode="none"),
            "full_ac": dict(scan_layers=False, ac_mode="full")}
REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor.default"


def tiny_args() -> TransformerArgs:
    return TransformerArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128,
                           max_seq_len=SEQ)


def token_rule_rows(rows: int, *, seed: int = 1) -> torch.Tensor:
    """[STEPS, rows, SEQ + 1] tokens with x[t+1] = (5 x[t] + 1) mod V from random starts."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 256, (STEPS, rows), generator=g)]
    for _ in range(SEQ):
        tokens.append((5 * tokens[-1] + 1) % 256)
    return torch.stack(tokens, dim=-1)


def step_batches(rows: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, MICRO micro-batches of `rows` rows each."""
    tokens = token_rule_rows(MICRO * rows)
    return [[(t[i * rows:(i + 1) * rows, :-1].contiguous(), t[i * rows:(i + 1) * rows, 1:].contiguous())
             for i in range(MICRO)] for t in tokens]


def lr(step: int) -> float:
    return 3e-3 * min(1.0, step / 3)


def make_step(model, *, mode: str, example, micro: int, dp_size: int = 1):
    """mode: "eager" (EagerStep), or a graph compile backend ("eager_graph": the backend "eager")."""
    opt = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    if mode == "eager":
        return EagerStep(model, opt, max_norm=1.0, dp_size=dp_size)
    return GraphStep(model, opt, max_norm=1.0, example_batch=example, backend=mode.removesuffix("_graph"),
                     dp_size=dp_size, grad_accum_steps=micro)


def train(model, steps_batches, *, mode: str, dp_size: int = 1):
    """(results per step, the step function)."""
    step = make_step(model, mode=mode, example=steps_batches[0][0], micro=len(steps_batches[0]), dp_size=dp_size)
    return [step(b, lr(i + 1)) for i, b in enumerate(steps_batches)], step


def max_diffs(results, reference) -> tuple[float, float]:
    loss = max(abs(a.loss - b.loss) for a, b in zip(results, reference))
    norm = max(abs(a.grad_norm - b.grad_norm) for a, b in zip(results, reference))
    return loss, norm


@pytest.fixture(scope="module")
def eager_accumulation() -> dict:
    out = {}
    for name, variant in VARIANTS.items():
        model = build_model(tiny_args(), seed=SEED, **variant)
        results, _ = train(model, step_batches(ROWS), mode="eager")
        out[name] = results, {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = [r.loss for r in out["plain"][0]]
    assert losses[-1] < losses[0] - 1.0  # it learns: a wrong gradient would show
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_graph_accumulation_equals_eager(eager_accumulation, variant):
    reference, reference_params = eager_accumulation[variant]
    model = build_model(tiny_args(), seed=SEED, **VARIANTS[variant])
    results, step = train(model, step_batches(ROWS), mode="aot_eager")
    loss_diff, norm_diff = max_diffs(results, reference)
    print(f"{variant}: {MICRO} micro-batches, max |loss - eager| {loss_diff:.2e}, |grad_norm - eager| {norm_diff:.2e}; "
          f"capture {step.capture_seconds:.2f} s")
    assert loss_diff <= TOL and norm_diff <= TOL
    assert [r.num_tokens for r in results] == [r.num_tokens for r in reference]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), reference_params[name], atol=TOL, rtol=0)


def test_accumulation_program_does_not_grow_with_the_micro_batch_count():
    """The micro-batch program is the model once: the same graph for 2 and for 4 micro-batches
    (compile time does not grow with the count)."""
    sizes = {}
    for micro in (2, 4):
        model = build_model(tiny_args(), seed=SEED)
        step = make_step(model, mode="aot_eager", example=step_batches(ROWS)[0][0], micro=micro)
        sizes[micro] = (len(step.captured.graph_module.graph.nodes), len(step.captured_update.graph_module.graph.nodes))
    assert sizes[2] == sizes[4], sizes


def test_wrong_micro_batch_count_is_one_clear_error():
    model = build_model(tiny_args(), seed=SEED)
    batches = step_batches(ROWS)[0]
    step = make_step(model, mode="eager", example=batches[0], micro=2)
    graph = make_step(model, mode="aot_eager", example=batches[0], micro=2)
    with pytest.raises(ValueError, match="grad_accum_steps") as err:
        graph(batches[:1], 1e-3)
    assert "\n" not in str(err.value)
    step(batches, 1e-3)  # the eager step takes any count; the graph step was captured for 2


def test_trainer_derives_accumulation_from_global_batch_tokens_in_graph_mode(train_overrides):
    """The trainer's wiring: global_batch_tokens sets 2 micro-batches of 2 rows x 128 tokens on
    one process, and graph mode (the captured graphs run as traced) trains like eager mode."""
    from test_train import LLAMA_DEBUG

    from titan_tpu.config import build_config
    from titan_tpu.loops import assemble

    common = dict(training__steps=3, validation__enabled="false", checkpoint__enabled="false",
                  training__batch_size=2, training__global_batch_tokens=2 * 2 * 128, parallelism__dp_shard=1)
    eager = assemble(build_config(LLAMA_DEBUG, train_overrides(**common)))
    graph = assemble(build_config(LLAMA_DEBUG, train_overrides(training__mode="graph", compile__backend="eager",
                                                              **common)))
    assert eager.components.run.grad_accum_steps == graph.components.run.grad_accum_steps == 2
    assert eager.cfg.training.grad_accum_steps == 1  # the config's own key: the run's resolution holds the 2
    assert graph.components.step_fn.grad_accum_steps == 2
    for _ in range(3):
        a, b = eager.train_step(), graph.train_step()
        assert a.num_tokens == b.num_tokens == 2 * 2 * 128
        assert abs(a.loss - b.loss) <= TOL and abs(a.grad_norm - b.grad_norm) <= TOL


# ---------------------------------------------------------------------------------------------
# Two gloo ranks, fully_shard: one spawn for both variants; reference: eager on one process with
# the same global micro-batches (each rank holds every second row of each)
# ---------------------------------------------------------------------------------------------

SHARDED_VARIANTS = ("scan", "full_ac")


def _sharded_worker() -> dict:
    dims = ParallelDims(world_size=dist.get_world_size())  # dp_shard = 2: fully_shard
    mesh = dims.build_mesh("cpu")
    dp_rank, dp_size = dp_rank_and_size(mesh)
    batches = [[(x[dp_rank::dp_size], y[dp_rank::dp_size]) for x, y in step] for step in step_batches(ROWS * dp_size)]
    out = {}
    for name in SHARDED_VARIANTS:
        with torch.device("meta"):
            model = Transformer(tiny_args(), **VARIANTS[name])
        model = materialize_and_init(model, mesh, mode=dims.mode, mp=MixedPrecision(), device=torch.device("cpu"),
                                     seed=SEED)
        # The "eager" backend runs the captured graphs as traced: what is tested is the capture.
        results, step = train(model, batches, mode="eager_graph", dp_size=dp_size)
        out[name] = dict(losses=[r.loss for r in results], norms=[r.grad_norm for r in results],
                         params={n: p.full_tensor() for n, p in model.named_parameters()},
                         collectives=dict(step.collectives_per_step()),
                         micro_collectives=dict(step.captured.collective_counts()))
    return out


@pytest.mark.multiprocess
def test_graph_accumulation_equals_eager_on_two_fully_shard_ranks():
    ranks = run_distributed(_sharded_worker, world_size=2, timeout_s=300)
    for name in SHARDED_VARIANTS:
        model = build_model(tiny_args(), seed=SEED, **VARIANTS[name])
        reference, _ = train(model, step_batches(ROWS * 2), mode="eager")
        counts, micro = ranks[0][name]["collectives"], ranks[0][name]["micro_collectives"]
        print(f"{name}: reduce-scatters per step {counts.get(REDUCE_SCATTER, 0)} "
              f"({MICRO} micro-batches x {micro.get(REDUCE_SCATTER, 0)}); all collectives per step {counts}")
        # Each micro-batch reduce-scatters its gradients (docs/graph_mode.md says why).
        assert counts.get(REDUCE_SCATTER, 0) == MICRO * micro.get(REDUCE_SCATTER, 0) > 0
        for rank, graph in enumerate(ranks):
            loss_diff = max(abs(a.loss - b) for a, b in zip(reference, graph[name]["losses"]))
            norm_diff = max(abs(a.grad_norm - b) for a, b in zip(reference, graph[name]["norms"]))
            print(f"  rank {rank}: max |loss - eager| {loss_diff:.2e}, |grad_norm - eager| {norm_diff:.2e}")
            assert loss_diff <= TOL and norm_diff <= TOL
            for pname, p in model.named_parameters():
                torch.testing.assert_close(graph[name]["params"][pname], p.detach(), atol=TOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# Chat data: IGNORE_INDEX labels, a varying trained count per step
# ---------------------------------------------------------------------------------------------


def chat_batches(*, packed: bool, micro: int) -> list[list[tuple[torch.Tensor, ...]]]:
    """Chat-like micro-batches: conversations whose first part (the prompt) and last label are
    not trained. Packed: several conversations per row, positions restarting at each (a document
    mask). Not packed: one conversation per row, the rest of the row padding, no positions."""
    g = torch.Generator().manual_seed(2)
    tokens = token_rule_rows(micro * ROWS, seed=3)
    steps = []
    for t in tokens:
        inputs, labels = t[:, :-1].clone(), t[:, 1:].clone()
        positions = torch.zeros_like(inputs)
        for row in range(inputs.shape[0]):
            at = 0
            while at < SEQ:
                n = min(int(torch.randint(6 if packed else 8, SEQ, (), generator=g)), SEQ - at)
                prompt = int(torch.randint(1, n, (), generator=g)) if n > 1 else 1
                labels[row, at:at + prompt] = IGNORE_INDEX
                labels[row, at + n - 1] = IGNORE_INDEX  # the label across a conversation's end
                positions[row, at:at + n] = torch.arange(n)
                at += n
                if not packed:
                    inputs[row, at:] = 0
                    labels[row, at:] = IGNORE_INDEX
                    break
        batch = (inputs, labels, positions) if packed else (inputs, labels)
        steps.append([tuple(x[i * ROWS:(i + 1) * ROWS] for x in batch) for i in range(micro)])
    return steps


@pytest.mark.parametrize("packed, micro", [(False, 1), (True, 1), (True, 2)])
def test_chat_in_graph_mode_equals_eager(packed, micro):
    batches = chat_batches(packed=packed, micro=micro)
    counts = {sum(int((b[1] != IGNORE_INDEX).sum()) for b in step) for step in batches}
    assert len(counts) > 1  # the trained count varies between steps: it cannot be a traced constant
    runs = {}
    for mode in ("eager", "aot_eager"):
        model = build_model(tiny_args(), seed=SEED)
        runs[mode], _ = train(model, batches, mode=mode)
    loss_diff, norm_diff = max_diffs(runs["aot_eager"], runs["eager"])
    print(f"chat packed={packed} micro-batches={micro}: max |loss - eager| {loss_diff:.2e}, "
          f"|grad_norm - eager| {norm_diff:.2e}")
    assert loss_diff <= TOL and norm_diff <= TOL
    assert [r.num_tokens for r in runs["aot_eager"]] == [r.num_tokens for r in runs["eager"]]
