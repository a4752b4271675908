"""Forward + backward time of every kernel implementation that runs here, per op and shape.

Implementations of one op run interleaved (each round one call of each, in alternating order) and
the result is the median of per-round times, printed with the ratio to the op's reference: how
`auto` was chosen per device (docs/kernels.md). fp32 on CPU.

    python bench/kernels.py                      # the debug model's and the larger CPU model's shapes
    python bench/kernels.py --rounds 30 --threads 2
    python bench/kernels.py --bf16-attention --threads 1   # CPU SDPA on bf16 inputs: bf16 vs fp32 kernel

--bf16-attention (a CPU with bf16 instructions): SDPA forward + backward on bf16 inputs computed
by the bf16 kernel against the same inputs cast to fp32 and the output cast back, per head dim:
where `sdpa` on CPU computes bf16 in fp32 (kernels/attention.py CPU_FP32_ATTENTION_MAX_HEAD_DIM).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from titan_tpu.kernels import ATTENTION, LOSS, document_ids_from_positions

# (name, B, S, H, K, D): the llama3 debug flavor at batch 8 x 256 and the larger CPU model of the
# throughput target (dim 512, 8 heads of 64) at batch 4 x 512.
ATTENTION_SHAPES = [("debug 8x256, 16 heads of 16", 8, 256, 16, 16, 16),
                    ("larger 4x512, 8 heads of 64", 4, 512, 8, 8, 64)]
# (name, N tokens, D, V)
LOSS_SHAPES = [("debug 2048 tokens, vocab 2048", 2048, 256, 2048),
               ("qwen3 vocab, 2048 tokens", 2048, 1024, 151_936)]


def time_interleaved(fns: dict, rounds: int) -> dict[str, float]:
    for fn in fns.values():  # warm-up
        fn()
    seconds = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            start = time.perf_counter()
            fns[name]()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def attention_case(B, S, H, K, D, documents: bool):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, D, generator=g, requires_grad=True)
    k = torch.randn(B, S, K, D, generator=g, requires_grad=True)
    v = torch.randn(B, S, K, D, generator=g, requires_grad=True)
    grad = torch.randn(B, S, H, D, generator=g)
    positions = torch.arange(S).remainder(S // 3 + 1).expand(B, S) if documents else None
    doc_ids = document_ids_from_positions(positions) if documents else None

    def make(impl):
        def run():
            q.grad = k.grad = v.grad = None
            impl.fn(q, k, v, doc_ids).backward(grad)
        return run

    needs = frozenset({"documents"}) if documents else frozenset()
    return {name: make(ATTENTION.impls[name]) for name in ATTENTION.available("cpu", needs)}


def loss_case(N, D, V):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g, requires_grad=True)
    w = (torch.randn(V, D, generator=g) * D**-0.5).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)

    def make(impl):
        def run():
            h.grad = w.grad = None
            impl.fn(h, w, labels).backward()
        return run

    return {name: make(LOSS.impls[name]) for name in LOSS.available("cpu")}


# (B, S, H, D) for --bf16-attention: the debug shape, then wider heads at similar work.
BF16_ATTENTION_SHAPES = [(8, 256, 16, 16), (8, 256, 8, 32), (8, 256, 4, 64), (4, 512, 2, 128)]


def bf16_attention_case(B, S, H, D):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g).bfloat16().requires_grad_() for _ in range(3))
    grad = torch.randn(B, H, S, D, generator=g).bfloat16()

    def make(dtype):
        def run():
            q.grad = k.grad = v.grad = None
            F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True) \
                .to(torch.bfloat16).backward(grad)
        return run

    return {"bf16": make(torch.bfloat16), "in fp32": make(torch.float32)}


def report(title: str, times: dict[str, float]) -> None:
    ref = times["reference"]
    print(f"{title}:")
    for name, t in times.items():
        print(f"  {name:10s} {t * 1000:8.2f} ms   reference / this {ref / t:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16-attention", action="store_true",
                        help="SDPA on bf16 inputs: the bf16 kernel against the fp32 one, per head dim")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.bf16_attention:
        from titan_tpu.device_cpu import cpu_bf16_support

        print(f"CPU: {cpu_bf16_support()[1]}; SDPA forward + backward on bf16 inputs, causal, {args.threads} "
              f"threads, median of {args.rounds} interleaved rounds")
        for B, S, H, D in BF16_ATTENTION_SHAPES:
            t = time_interleaved(bf16_attention_case(B, S, H, D), args.rounds)
            print(f"  batch {B} x seq {S}, {H} heads of {D}: bf16 {t['bf16'] * 1000:7.2f} ms, in fp32 "
                  f"{t['in fp32'] * 1000:7.2f} ms: fp32 / bf16 speed {t['bf16'] / t['in fp32']:.2f}x")
        return
    print(f"fp32, {args.threads} threads, forward + backward, median of {args.rounds} interleaved rounds")
    for name, B, S, H, K, D in ATTENTION_SHAPES:
        for documents in (False, True):
            label = f"attention {name}" + (", documents" if documents else ", causal")
            report(label, time_interleaved(attention_case(B, S, H, K, D, documents), args.rounds))
    for name, N, D, V in LOSS_SHAPES:
        report(f"loss {name}", time_interleaved(loss_case(N, D, V), max(3, args.rounds // 4)))


if __name__ == "__main__":
    main()
