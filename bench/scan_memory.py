"""Peak memory of a scanned, fully sharded training step at 4 and at 16 layers, re-sharded after
the forward or not, beside what the growth should be.

Issue 15's check: with weights gathered one layer at a time inside the loop, the peak of a
scanned + fully_shard step grows with depth by no more than the extra layers' own shards
(parameters, gradients, AdamW's two moments), their saved activations and one layer's gathered
weights; gathering the whole stack before the loop (reshard off) adds every extra layer's gathered
weights as well.

Two gloo ranks on this CPU, Llama 3 debug blocks, eager mode (the scanned layers run as a Python
loop), fp32. Memory is counted, not sampled: a dispatch mode records the storage of every tensor
an op returns during one step and the peak of the bytes still referenced (CPython frees by
reference count, so the figure is exact and repeatable), plus what the step starts with (this
rank's parameter shards and AdamW moments).

    python bench/scan_memory.py [--batch 4 --seq 256]
    python bench/scan_memory.py --one-process [--model qwen3 --batch 2 --seq 128]

--one-process: one eager scanned step of a whole model (qwen3 debug: 6 layers) in one process,
AC none / full / selective: the bytes allocated in the step, its peak, the stacked weights' bytes,
and the ops that allocated most (the eager loop used to index w[i] per layer, whose backward
allocated a zero-filled [L, ...] gradient per layer: aten.select_backward).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class PeakLiveBytes(TorchDispatchMode):
    """Peak over a region of the bytes held by storages that ops created in it, and the bytes of
    all the storages they created (allocated: what the allocator was asked for)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self.allocated = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if type(t) in (torch.Tensor, torch.nn.Parameter):
                storage = t.untyped_storage()
                known = self.live.get(storage.data_ptr())
                if known is None or known[0].expired():  # new storage (not a view, not in place)
                    self.allocated += storage.nbytes()
                self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def measure(n_layers: int, reshard: bool, batch: int, seq: int) -> dict:
    from titan_tpu.models.common.transformer import Transformer
    from titan_tpu.models.registry import get_model_args
    from titan_tpu.parallel.mesh import ParallelDims
    from titan_tpu.parallel.simple_fsdp import MixedPrecision, local_bytes, materialize_and_init
    from titan_tpu.train.optim import AdamW
    from titan_tpu.train.step import EagerStep

    torch.set_num_threads(1)
    args = dataclasses.replace(get_model_args("llama3", "debug"), n_layers=n_layers, max_seq_len=seq)
    dims = ParallelDims(world_size=dist.get_world_size())
    with torch.device("meta"):
        model = Transformer(args, scan_layers=True)
    model = materialize_and_init(model, dims.build_mesh("cpu"), mode=dims.mode, mp=MixedPrecision(),
                                 device=torch.device("cpu"), seed=0, reshard_after_forward=reshard)
    optimizer = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
    step = EagerStep(model, optimizer, max_norm=1.0, dp_size=dims.world_size)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=g)
    batch_ = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    step([batch_], 1e-4)  # creates the AdamW moments
    resident = local_bytes(model.parameters()) + sum(local_bytes(s.values()) for s in optimizer.state.values())
    with PeakLiveBytes() as mode:
        step([batch_], 1e-4)
    return {"resident": resident, "step_peak": mode.peak, "peak": resident + mode.peak, "allocated": mode.allocated}


def one_process(model_name: str, batch: int, seq: int) -> None:
    import collections

    from titan_tpu.models.registry import build_model, get_model_args
    from titan_tpu.train.optim import AdamW
    from titan_tpu.train.step import EagerStep

    class ByOp(PeakLiveBytes):
        def __init__(self):
            super().__init__()
            self.by_op = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.allocated
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.by_op[str(func)] += self.allocated - before
            return out

    torch.set_num_threads(1)
    args = dataclasses.replace(get_model_args(model_name, "debug"), max_seq_len=seq)
    mb = 1e6
    print(f"{model_name} debug ({args.n_layers} layers), scanned, eager, one process, fp32, batch {batch} x seq {seq}; "
          "one step counted at dispatch (after two warm-up steps)")
    print("| AC | stacked weights | allocated in the step | peak of the step | most allocating ops (MB) |")
    print("| --- | --- | --- | --- | --- |")
    for ac in ("none", "full", "selective"):
        model = build_model(args, seed=0, scan_layers=True, ac_mode=ac)
        optimizer = AdamW(dict(model.named_parameters()), layer_stacked=model.stacked_parameter_names())
        step = EagerStep(model, optimizer, max_norm=1.0)
        tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
        batch_ = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        losses = [step([batch_], 1e-3).loss for _ in range(2)]
        with ByOp() as mode:
            losses.append(step([batch_], 1e-3).loss)
        stacked = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                      if n in model.stacked_parameter_names())
        top = ", ".join(f"{op.removeprefix('aten.')} {n / mb:.1f}" for op, n in mode.by_op.most_common(4))
        print(f"| {ac} | {stacked / mb:.1f} MB | {mode.allocated / mb:.1f} MB | {mode.peak / mb:.1f} MB | {top} |")
        print(f"losses (hex, to compare runs bitwise): {[x.hex() for x in losses]}")


def run_all(batch: int, seq: int) -> dict:
    return {(n, r): measure(n, r, batch, seq) for r in (False, True) for n in (4, 16)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, help="rows per rank (4; --one-process: 2)")
    parser.add_argument("--seq", type=int, help="sequence length (256; --one-process: 128)")
    parser.add_argument("--one-process", action="store_true", help="one eager scanned step of --model in one process")
    parser.add_argument("--model", default="qwen3", help="with --one-process: the model's debug flavor (qwen3)")
    a = parser.parse_args()
    if a.one_process:
        one_process(a.model, a.batch or 2, a.seq or 128)
        return
    a.batch, a.seq = a.batch or 4, a.seq or 256

    from titan_tpu.models.common.activation_memory import activation_bytes
    from titan_tpu.models.registry import get_model_args
    from titan_tpu.parallel.spawn import run_ranks

    results = run_ranks(run_all, world_size=2, args=(a.batch, a.seq), timeout_s=1800)[0]
    args = get_model_args("llama3", "debug")
    with torch.device("meta"):
        from titan_tpu.models.common.transformer import TransformerBlock

        block = sum(p.numel() for p in TransformerBlock(args).parameters())
    extra, world = 12, 2
    shards = extra * 4 * block * 4 / world  # parameters, gradients, exp_avg, exp_avg_sq: fp32 shards
    acts = extra * activation_bytes(dataclasses.replace(args, max_seq_len=a.seq), tokens=a.batch * a.seq,
                                    ac_mode="none", dtype_bytes=4).saved_per_layer[0]
    one_layer = block * 4  # one layer's weights gathered, fp32
    bound = shards + acts + one_layer
    mb = 2**20
    print(f"llama3 debug blocks ({block:,} parameters each), scanned, fully_shard on 2 gloo ranks, eager, fp32, "
          f"batch {a.batch} x seq {a.seq}; rank 0, peak of one step (counted at dispatch) plus resident shards "
          "and moments")
    print(f"allowed growth 4 -> 16 layers: extra layers' shards + grads + AdamW moments {shards / mb:.2f} MB "
          f"+ saved activations {acts / mb:.2f} MB + one layer gathered {one_layer / mb:.2f} MB = {bound / mb:.2f} MB")
    print("| reshard_after_forward | peak at 4 layers | peak at 16 layers | growth | growth - allowed "
          "| allocated in the step at 4 / 16 layers |")
    print("| --- | --- | --- | --- | --- | --- |")
    for reshard in (False, True):
        p4, p16 = results[(4, reshard)]["peak"], results[(16, reshard)]["peak"]
        a4, a16 = results[(4, reshard)]["allocated"], results[(16, reshard)]["allocated"]
        growth = p16 - p4
        print(f"| {str(reshard).lower()} | {p4 / mb:.2f} MB | {p16 / mb:.2f} MB | {growth / mb:.2f} MB | "
              f"{(growth - bound) / mb:+.2f} MB ({'within' if growth <= bound else 'over'}) "
              f"| {a4 / mb:.2f} / {a16 / mb:.2f} MB |")
    print(f"(the whole 12 extra layers gathered, what reshard off keeps: {extra * one_layer / mb:.2f} MB)")


if __name__ == "__main__":
    main()
