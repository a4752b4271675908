"""Expert parallelism's two dispatches (`--parallelism.ep_dispatch all_gather | all_to_all`) on one
MoE layer, forward + backward, on ep gloo ranks of this CPU: the bytes each rank sends into the
ep group's collectives (counted by watching every functional collective the step calls) beside
the planner's count (parallel/plan_terms.py `ep_dispatch_bytes`), and their speed as a ratio.

Every rank holds E / ep experts and routes its own T tokens with the layer's router; both
dispatches run in the same processes, interleaved (each round one step of each, alternating
order); times are medians of the rounds. Eager mode: the all-to-all sends exact split sizes.

    python bench/ep_dispatch.py                    # ep 2 and 4, T 2048, D 512, E 16, top-4
    python bench/ep_dispatch.py --ranks 2 --tokens 4096 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_tpu.device_cpu import _cpu_model  # the CPU's name, as the cache keys use it
from titan_tpu.models.common.moe import MoE, MoEArgs
from titan_tpu.parallel.expert_parallel import EP_DISPATCH, build_expert_mesh, make_dispatch
from titan_tpu.parallel.plan_terms import ep_dispatch_bytes
from titan_tpu.parallel.spawn import run_ranks


class CollectiveBytes(TorchDispatchMode):
    """Bytes this rank sends into functional collectives while active: an all-gather sends its
    input to the other ranks, a reduce-scatter all but the rank's own 1 / n of its input, an
    all-to-all its input less the chunk it keeps (split sizes when given, else equal chunks)."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank, self.sent, self.calls = rank, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        op = name.split(".")[-1]
        if name.startswith("_c10d_functional") and op not in ("wait_tensor", "_wrap_tensor_autograd"):
            x = args[0]
            nbytes = x.numel() * x.element_size()
            if op == "all_gather_into_tensor":
                self.sent += nbytes * (args[1] - 1)
            elif op == "reduce_scatter_tensor":
                self.sent += nbytes * (args[2] - 1) // args[2]
            elif op == "all_to_all_single":
                splits, n = args[2], _group_size(args[3])
                kept = splits[self.rank] * nbytes // max(x.shape[0], 1) if splits else nbytes // n
                self.sent += nbytes - kept
            else:
                raise AssertionError(f"uncounted collective {name}")
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _group_size(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def _worker(tokens: int, dim: int, experts: int, top_k: int, hidden: int, rounds: int) -> dict:
    import torch.distributed as dist

    rank, ep = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layer = MoE(dim=dim, args=MoEArgs(num_experts=experts, top_k=top_k, hidden_dim=hidden, load_balance="none"))
    layer.init_weights(std=0.02, depth_std=0.02)
    local = experts // ep
    for name in ("w1", "w2", "w3"):  # this rank's experts only, as expert parallelism keeps them
        w = getattr(layer.experts, name)
        setattr(layer.experts, name, torch.nn.Parameter(w.detach()[rank * local:(rank + 1) * local].clone()))
    mesh = build_expert_mesh("cpu", dp_shard=ep, ep=ep)
    x_BSD = torch.randn(1, tokens, dim, generator=torch.Generator().manual_seed(1 + rank), requires_grad=True)
    dispatches = {kind: make_dispatch(mesh, kind) for kind in EP_DISPATCH}

    def step(kind: str):
        layer.dispatch_slot.dispatch = dispatches[kind]
        out, _ = layer(x_BSD)
        out.square().sum().backward()
        return out.detach()

    result = {"bytes": {}, "calls": {}, "times": {k: [] for k in EP_DISPATCH}}
    outputs = {}
    for kind in EP_DISPATCH:  # one counted step each (also the warm-up)
        counter = CollectiveBytes(rank)
        with counter:
            outputs[kind] = step(kind)
        result["bytes"][kind], result["calls"][kind] = counter.sent, counter.calls
    result["max_diff"] = (outputs["all_to_all"] - outputs["all_gather"]).abs().max().item()
    for r in range(rounds):
        for kind in (EP_DISPATCH if r % 2 == 0 else EP_DISPATCH[::-1]):
            dist.barrier()
            start = time.perf_counter()
            step(kind)
            dist.barrier()
            result["times"][kind].append(time.perf_counter() - start)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    a = parser.parse_args()
    print(f"CPU: {_cpu_model()}; one MoE layer, T {a.tokens} tokens per rank, D {a.dim}, E {a.experts}, "
          f"top-{a.top_k}, F {a.hidden}, fp32, eager, forward + backward, 1 thread per rank")
    for ep in a.ranks:
        results = run_ranks(_worker, world_size=ep, args=(a.tokens, a.dim, a.experts, a.top_k, a.hidden, a.rounds),
                            timeout_s=600)
        print(f"ep {ep}: all_to_all vs all_gather outputs differ by at most {max(r['max_diff'] for r in results):.2g}")
        for kind in EP_DISPATCH:
            measured = statistics.mean(r["bytes"][kind] for r in results)
            # forward + backward: the planner counts one way per pass (plan_terms.py)
            planned = 2 * ep_dispatch_bytes(kind, tokens=a.tokens, dim=a.dim, top_k=a.top_k, num_experts=a.experts,
                                            ep=ep, compute_bytes=4)
            median = statistics.median(t for r in results for t in r["times"][kind])
            print(f"  {kind:10s}: {measured / 1e6:8.2f} MB sent per rank per step (planner {planned / 1e6:8.2f} MB, "
                  f"measured / planned {measured / planned:.3f}), {results[0]['calls'][kind]} calls, "
                  f"median {median * 1e3:.1f} ms")
        ratio = statistics.median(t for r in results for t in r["times"]["all_gather"]) / \
            statistics.median(t for r in results for t in r["times"]["all_to_all"])
        print(f"  all_to_all is {ratio:.2f}x the speed of all_gather (time all_gather / time all_to_all)")


if __name__ == "__main__":
    main()
