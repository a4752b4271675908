"""Context parallelism's attention on one rank: the head-tail chunks against their key prefixes
(`head_tail_attention` with chunk_attention, what cp runs) beside the form it replaced (the rank's
queries against the whole gathered sequence under one dense [S / cp, S] position mask), forward +
backward time and the bytes autograd keeps, in one process, fp32 on CPU.

Every cp rank does the same work in both forms, so rank 0 stands for all of them. The two forms run
interleaved (each round one call of each, alternating order); times are medians of the rounds.

    python bench/cp_attention.py                        # S 4096, cp 4, 8 heads of 64 on 2 kv heads
    python bench/cp_attention.py --seq 8192 --cp 8 --rounds 5
"""

from __future__ import annotations

import argparse

import torch
from kernels import time_interleaved  # bench/kernels.py, beside this file

from titan_tpu.device_cpu import _cpu_model  # the CPU's name, as the cache keys use it
from titan_tpu.kernels.attention import CHUNK_ATTENTION, masked_sdpa
from titan_tpu.parallel.context_parallel import head_tail_attention, head_tail_positions, sequence_order


def dense_mask_attention(q_BQHD, k_BSKD, v_BSKD, *, cp: int, rank: int):
    """The replaced form: keys in rank order (as the all-gather hands them), one boolean mask from
    the global positions of the rank's queries against every key."""
    S = k_BSKD.shape[1]
    q_pos = head_tail_positions(S, cp, rank)
    k_pos = torch.cat([head_tail_positions(S, cp, r) for r in range(cp)])
    allowed = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).unsqueeze(0)
    return masked_sdpa(q_BQHD, k_BSKD, v_BSKD, allowed)


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for fn's backward."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    B, S, cp, rank = a.batch, a.seq, a.cp, 0
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S // cp, a.heads, a.head_dim, generator=g, requires_grad=True)
    k_ranks = torch.randn(B, S, a.kv_heads, a.head_dim, generator=g, requires_grad=True)  # gathered, rank order
    v_ranks = torch.randn(B, S, a.kv_heads, a.head_dim, generator=g, requires_grad=True)
    grad = torch.randn(B, S // cp, a.heads, a.head_dim, generator=g)
    chunk = CHUNK_ATTENTION.impls["sdpa"].fn

    forms = {
        "dense mask (replaced)": lambda: dense_mask_attention(q, k_ranks, v_ranks, cp=cp, rank=rank),
        "head-tail chunks (sdpa)": lambda: head_tail_attention(
            chunk, q, sequence_order(k_ranks, cp), sequence_order(v_ranks, cp), cp=cp, rank=rank),
    }
    outputs = {name: fn() for name, fn in forms.items()}
    torch.testing.assert_close(*outputs.values(), rtol=1e-5, atol=1e-5)  # the same attention

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(), (q, k_ranks, v_ranks), grad)

    seconds = time_interleaved({name: fwd_bwd(fn) for name, fn in forms.items()}, a.rounds)
    kept = {name: saved_bytes(fn) for name, fn in forms.items()}
    base = "dense mask (replaced)"
    print(f"cp attention, rank {rank} of cp {cp}: batch {B}, seq {S}, {a.heads} heads of {a.head_dim} on "
          f"{a.kv_heads} kv heads, fp32, {torch.get_num_threads()} threads, {_cpu_model()}")
    for name in forms:
        print(f"  {name:<26} fwd+bwd {seconds[name] * 1e3:8.1f} ms ({seconds[base] / seconds[name]:.2f}x speed)   "
              f"kept {kept[name] / 2**20:8.1f} MiB ({kept[name] / kept[base]:.2f}x)")


if __name__ == "__main__":
    main()
