"""Training throughput of titan-tpu's eager trainer against a plain Hugging Face transformers loop.

Both train the same architecture (the Llama 3 debug flavor by default; `--model qwen3_moe` for the
mixture of experts against transformers' Qwen3MoeForCausalLM, both adding the balancing loss) at
the same batch, in fp32 (or bf16, --dtype), with AdamW and gradient clipping, on the same random
token batches. They are measured interleaved (each round one step of each contender, back to back,
in alternating order) so that machine noise hits both alike; the ratio of a pass is the median of
the per-round ratios. The ratio also moved by a few percent from one process to the next, so two
processes run, one per contender order, and the headline ratio is the geometric mean of the two.

    python bench/throughput.py                       # reference case: debug flavor, batch 8 x seq 256
    python bench/throughput.py --rounds 24 --threads 2 --batch 8 --seq 256
    python bench/throughput.py --graph --dim 512 --layers 8 --seq 512 --batch 4   # larger CPU model
    python bench/throughput.py --model qwen3_moe --graph --memory   # MoE debug model, and peak memory
    python bench/throughput.py --dtype bfloat16 --graph   # bf16 mixed precision vs transformers under autocast

--dtype bfloat16: ours computes in bf16 from fp32 master weights (docs/mixed_precision.md), the
transformers loop runs its fp32 model under torch.autocast("cpu", dtype=torch.bfloat16), what a
transformers user does; MFU is against the measured bf16 matmul peak. On a CPU without bf16
instructions (no avx512_bf16/amx_bf16) it prints why and measures nothing.

Prints one line per contender (tokens/s, TFLOP/s, MFU against the stated peak) and the ratio
ours / Hugging Face. MFU uses titan_tpu's flops_per_token (6N + 6*L*H*hd*S) for both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from titan_tpu.device import get_backend
from titan_tpu.device_cpu import cpu_bf16_support
from titan_tpu.models.common.transformer import Transformer
from titan_tpu.models.hub.adapter import hf_config_from_model_args, to_hf_state_dict
from titan_tpu.models.registry import flops_per_token, get_model_args
from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def our_model(args, dtype: torch.dtype):
    """The model as the trainer builds it on one device: fp32 masters computed in `dtype`."""
    with torch.device("meta"):
        model = Transformer(args)
    return materialize_and_init(model, None, mode="none", mp=MixedPrecision(param_dtype=dtype),
                                device=torch.device("cpu"), seed=0)


def titan_eager(args, batches, *, lr, max_norm, dtype=torch.float32):
    model = our_model(args, dtype)
    optimizer = AdamW(dict(model.named_parameters()), beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    step = EagerStep(model, optimizer, max_norm=max_norm)

    def run(i):
        return step([batches[i % len(batches)]], lr).loss

    return run, model


def titan_graph(args, batches, *, lr, max_norm, dtype=torch.float32):
    """Our step captured whole (forward, backward, clipping, AdamW) and compiled by Inductor."""
    from titan_tpu.graph.compile import GraphStep

    model = our_model(args, dtype)
    optimizer = AdamW(dict(model.named_parameters()), beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    step = GraphStep(model, optimizer, max_norm=max_norm, example_batch=batches[0], backend="inductor")

    def run(i):
        return step([batches[i % len(batches)]], lr).loss

    return run, step.capture_seconds + step.compile_seconds


HF_CLASSES = {"llama3": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def hf_loop(args, batches, *, lr, max_norm, init_from, name="llama3", dtype=torch.float32):
    """The loop a transformers user writes: model(...).logits, cross-entropy (+ the router's
    balancing loss for MoE), backward, clip, AdamW; in bf16 the forward and loss under autocast
    with the fp32 weights."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[name])
    config = config_cls(**{k: v for k, v in hf_config_from_model_args(name, args).items()
                           if k not in ("architectures", "model_type", "torch_dtype", "dtype")})
    model = model_cls(config).float()
    # Same start: our weights in HF's layout (transformers' own loader fuses MoE experts on load).
    hf_sd = to_hf_state_dict(init_from.state_dict(), args)
    if args.moe is not None:
        hf_sd = _fuse_experts(hf_sd, args)
    model.load_state_dict(hf_sd, strict=False)
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95), eps=1e-8)

    def run(i):
        inputs, labels = batches[i % len(batches)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = model(input_ids=inputs, output_router_logits=args.moe is not None)
            loss = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten())
            total = loss if args.moe is None else loss + args.moe.aux_loss_coef * out.aux_loss
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return run


def _fuse_experts(hf_sd: dict, args) -> dict:
    """Hub layout (one tensor per expert) -> transformers 5.x's in-memory fused experts."""
    out = {k: v for k, v in hf_sd.items() if ".mlp.experts." not in k}
    for i in range(args.n_layers):
        if not args.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp.experts."
        experts = range(args.moe.num_experts)
        out[p + "gate_up_proj"] = torch.stack([torch.cat([hf_sd[f"{p}{j}.gate_proj.weight"],
                                                          hf_sd[f"{p}{j}.up_proj.weight"]]) for j in experts])
        out[p + "down_proj"] = torch.stack([hf_sd[f"{p}{j}.down_proj.weight"] for j in experts])
    return out


def bench_batches(args, model_args) -> list:
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq + 1), generator=g)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


def measure(args, *, hf_first: bool) -> dict:
    """One interleaved measurement in this process: per-round seconds per step of each contender."""
    torch.set_num_threads(args.threads)
    model_args = bench_model_args(args)
    batches = bench_batches(args, model_args)

    dtype = DTYPES[args.dtype]
    ours, ours_built = titan_eager(model_args, batches, lr=3e-4, max_norm=1.0, dtype=dtype)
    hf = hf_loop(model_args, batches, lr=3e-4, max_norm=1.0, init_from=ours_built, name=args.model, dtype=dtype)
    contenders = {OURS: ours, HF: hf}
    names = [HF, OURS] if hf_first else [OURS, HF]
    compile_s = None
    if args.graph:
        contenders[GRAPH], compile_s = titan_graph(model_args, batches, lr=3e-4, max_norm=1.0, dtype=dtype)
        names.append(GRAPH)
    # Same weights and data: the first losses must agree, or the comparison is not like for like
    # (in bf16 to its precision: autocast keeps the residual stream in fp32, cast weights do not).
    first = {name: contenders[name](0) for name in names}
    if abs(first[OURS] - first[HF]) > (1e-4 if dtype == torch.float32 else 2e-2) * abs(first[HF]):
        raise SystemExit(f"first-step losses differ: {first}; the comparison is not like for like")
    for name in names:
        for i in range(1, args.warmup):
            contenders[name](i)

    seconds = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            start = time.perf_counter()
            for i in range(args.steps_per_round):
                contenders[name](i)
            seconds[name].append((time.perf_counter() - start) / args.steps_per_round)
    return {"seconds": seconds, "first_loss": first[OURS], "peak": get_backend("cpu").peak_flops(dtype),
            "peak_description": get_backend("cpu").peak_description(dtype), "capture_compile_s": compile_s}


def peak_memory(args, contender: str) -> dict:
    """One contender alone in this (fresh) process: the peak RSS of its training steps over the
    memory resident before them (activations, gradients, temporaries), after 2 warm-up steps."""
    torch.set_num_threads(args.threads)
    model_args = bench_model_args(args)
    batches = bench_batches(args, model_args)
    dtype = DTYPES[args.dtype]
    if contender == GRAPH:
        run, _ = titan_graph(model_args, batches, lr=3e-4, max_norm=1.0, dtype=dtype)
    else:
        run, model = titan_eager(model_args, batches, lr=3e-4, max_norm=1.0, dtype=dtype)
        if contender == HF:
            run = hf_loop(model_args, batches, lr=3e-4, max_norm=1.0, init_from=model, name=args.model, dtype=dtype)
            del model
    backend = get_backend("cpu")
    for i in range(2):
        run(i)
    before = backend.memory_stats()["memory_gb"]
    backend.reset_peak_memory()
    for i in range(3):
        run(i)
    peak = backend.memory_stats()["max_memory_gb"]
    return {"resident_gb": before, "peak_gb": peak, "step_gb": peak - before}


OURS, HF, GRAPH = "titan-tpu eager", "hf transformers", "titan-tpu graph"


def bench_model_args(args):
    """The flavor's args, with --dim / --layers / --ffn-dim overriding its size (e.g. the larger
    CPU model of the graph-mode target: --dim 512 --layers 8 --seq 512)."""
    model_args = get_model_args(args.model, args.flavor)
    changes = {"max_seq_len": max(model_args.max_seq_len, args.seq)}
    if args.dim:
        changes["dim"] = args.dim
        changes["ffn_hidden_dim"] = args.ffn_dim or 3 * args.dim
    elif args.ffn_dim:
        changes["ffn_hidden_dim"] = args.ffn_dim
    if args.layers:
        changes["n_layers"] = args.layers
    return dataclasses.replace(model_args, **changes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3", choices=["llama3", "qwen3", "qwen3_moe"])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--dim", type=int, help="model width instead of the flavor's (heads kept)")
    parser.add_argument("--layers", type=int, help="number of layers instead of the flavor's")
    parser.add_argument("--ffn-dim", type=int, help="feed-forward width (default 3 x dim with --dim)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="compute dtype; bfloat16: ours from fp32 masters vs transformers under autocast")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--steps-per-round", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--graph", action="store_true",
                        help="also measure graph mode (whole step captured, compiled with Inductor)")
    parser.add_argument("--memory", action="store_true",
                        help="also the peak memory of each contender's steps, each in a fresh process")
    parser.add_argument("--pass-order", choices=["ours-first", "hf-first"], help=argparse.SUPPRESS)
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.pass_order:  # a child process: measure and hand the numbers back as one JSON line
        print(json.dumps(measure(args, hf_first=args.pass_order == "hf-first")))
        return
    if args.memory_of:
        print(json.dumps(peak_memory(args, args.memory_of)))
        return

    supported, why = cpu_bf16_support()
    if args.dtype == "bfloat16":
        if not supported:
            print(f"skipped: --dtype bfloat16 needs a CPU with bf16 matmul instructions ({why}); without them "
                  "bf16 runs ~100x slower than fp32 and the comparison would measure the emulation")
            return
    # The ratio moved by up to +-5% from one process to the next here (memory placement, which
    # contender ran first), more than the per-round noise, so the benchmark runs one process per
    # contender order and combines the two.
    passes = {}
    for order in ("ours-first", "hf-first"):
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--pass-order", order],
                               capture_output=True, text=True, check=True)
        passes[order] = json.loads(child.stdout.strip().splitlines()[-1])

    model_args = bench_model_args(args)
    tokens_per_step = args.batch * args.seq
    fpt = flops_per_token(model_args, args.seq)
    size = f" (dim {model_args.dim}, {model_args.n_layers} layers, ffn {model_args.ffn_hidden_dim})"
    how = "fp32" if args.dtype == "float32" else "bf16 (ours: fp32 masters cast; transformers: autocast)"
    print(f"{args.model}/{args.flavor}{size}, batch {args.batch} x seq {args.seq}, {how}, {args.threads} threads, "
          f"AdamW + clipping; 2 processes (one per contender order) x {args.rounds} interleaved rounds x "
          f"{args.steps_per_round} steps")
    print(f"CPU: {why}")
    ratios = []
    for order, result in passes.items():
        peak = result["peak"]
        print(f"pass {order} (first-step loss {result['first_loss']:.5f}; MFU peak: {result['peak_description']})")
        if result["capture_compile_s"] is not None:
            print(f"  graph mode: capture + compile {result['capture_compile_s']:.1f} s (not in the rates below)")
        rates = {}
        for name in result["seconds"]:
            step_s = statistics.median(result["seconds"][name])
            rates[name] = tokens_per_step / step_s
            print(f"  {name:18s} {rates[name]:10,.0f} tokens/s  {rates[name] * fpt / 1e12:7.4f} TFLOP/s  "
                  f"MFU {100 * rates[name] * fpt / peak:5.1f}%  ({step_s * 1000:.0f} ms/step)")
        # The speed of this shared machine drifts by tens of percent within seconds; the two
        # contenders' steps in one round run back to back and see the same drift, so the median
        # of the per-round ratios is the robust figure.
        paired = sorted(h / o for o, h in zip(result["seconds"][OURS], result["seconds"][HF]))
        ratios.append(statistics.median(paired))
        print(f"  ratio {ratios[-1]:.3f}x (median of per-round ratios; they range {paired[0]:.3f}..{paired[-1]:.3f})")
        if GRAPH in result["seconds"]:
            graph_s = result["seconds"][GRAPH]
            for peer in (OURS, HF):
                r = statistics.median(p / g for p, g in zip(result["seconds"][peer], graph_s))
                print(f"  graph / {peer}: {r:.3f}x (median of per-round ratios)")
    print(f"ratio titan-tpu eager / hf transformers: {math.sqrt(ratios[0] * ratios[1]):.3f}x "
          "(geometric mean of the two orders)")
    if args.memory:
        names = [OURS, HF] + ([GRAPH] if args.graph else [])
        memory = {}
        for name in names:
            child = subprocess.run([sys.executable, __file__, *[a for a in sys.argv[1:] if a != "--memory"],
                                    "--memory-of", name], capture_output=True, text=True, check=True)
            memory[name] = json.loads(child.stdout.strip().splitlines()[-1])
        print("peak memory (RSS) of the process during training steps, each contender alone in a fresh process:")
        for name, m in memory.items():
            print(f"  {name:18s} peak {m['peak_gb']:.3f} GB "
                  f"({m['peak_gb'] / memory[HF]['peak_gb']:.2f}x transformers); "
                  f"resident before the steps {m['resident_gb']:.3f} GB")


if __name__ == "__main__":
    main()
