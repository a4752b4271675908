"""The Transformers backend against the native model: the same Llama, the same weights, the same step.

The native `llama3` debug model (models/common/transformer.py) and transformers' LlamaForCausalLM
built through our backend (`--model.name hf`, models/hf/) with the native model's
weights, both trained by our EagerStep (or both by the graph trainer with --graph) on the same
random batches, fp32 CPU. The steps are interleaved (each round one step of each, the order
alternating) so the machine's drift hits both alike; the ratio is the median of the per-round
ratios, printed as HF backend / native (target >= 0.95).

    python bench/hf_backend.py                 # llama3 debug, batch 8 x seq 256, eager
    python bench/hf_backend.py --graph         # both captured and compiled with Inductor
    python bench/hf_backend.py --dim 512 --layers 8 --seq 512 --batch 4
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from titan_tpu.models.hub.adapter import hf_config_from_model_args, to_hf_state_dict
from titan_tpu.models.registry import build_model, flops_per_token, get_model_args
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep


def hf_backend_model(native, args):
    """LlamaForCausalLM through our backend, holding `native`'s weights."""
    import transformers

    from titan_tpu.models.hf.config import hf_args_from_config
    from titan_tpu.models.hf.model import PREFIX, build_hf_model
    from titan_tpu.parallel.simple_fsdp import materialize_and_init

    values = {k: v for k, v in hf_config_from_model_args("llama3", args).items()
              if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    hf_args = hf_args_from_config(transformers.LlamaConfig(**values))
    model = materialize_and_init(build_hf_model(hf_args), None, mode="none", mp=None, device="cpu", seed=0)
    weights = {PREFIX + k: v for k, v in to_hf_state_dict(native.state_dict(), args).items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing, unexpected)
    model.check_chunked_loss(args.vocab_size)
    return model


def stepper(model, batches, *, graph: bool):
    optimizer = AdamW(dict(model.named_parameters()), beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    if graph:
        from titan_tpu.graph.compile import GraphStep

        step = GraphStep(model, optimizer, max_norm=1.0, example_batch=batches[0], backend="inductor")
    else:
        step = EagerStep(model, optimizer, max_norm=1.0)
    return lambda i: step([batches[i % len(batches)]], 3e-4).loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--graph", action="store_true", help="both contenders in graph mode (Inductor)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model_args = get_model_args("llama3", "debug")
    changes = {"max_seq_len": max(model_args.max_seq_len, args.seq)}
    if args.dim:
        changes.update(dim=args.dim, ffn_hidden_dim=3 * args.dim)
    if args.layers:
        changes["n_layers"] = args.layers
    model_args = dataclasses.replace(model_args, **changes)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq + 1), generator=g)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))

    native = build_model(model_args, seed=0)
    hf = hf_backend_model(native, model_args)
    contenders = {"native llama3": stepper(native, batches, graph=args.graph),
                  "hf backend": stepper(hf, batches, graph=args.graph)}
    first = {name: run(0) for name, run in contenders.items()}
    if abs(first["native llama3"] - first["hf backend"]) > 1e-4 * abs(first["native llama3"]):
        raise SystemExit(f"first-step losses differ: {first}; the comparison is not like for like")
    for run in contenders.values():
        run(1)
    names = list(contenders)
    seconds = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            start = time.perf_counter()
            contenders[name](r + 2)
            seconds[name].append(time.perf_counter() - start)

    tokens = args.batch * args.seq
    fpt = flops_per_token(model_args, args.seq)
    print(f"llama3 (dim {model_args.dim}, {model_args.n_layers} layers), batch {args.batch} x seq {args.seq}, fp32, "
          f"{args.threads} threads, {'graph mode' if args.graph else 'eager'}; {args.rounds} interleaved rounds; "
          f"first-step loss {first['native llama3']:.5f} (both)")
    for name in names:
        step_s = statistics.median(seconds[name])
        print(f"  {name:14s} {tokens / step_s:10,.0f} tokens/s  {tokens * fpt / step_s / 1e12:.4f} TFLOP/s  "
              f"({step_s * 1000:.0f} ms/step)")
    ratios = [n / h for n, h in zip(seconds["native llama3"], seconds["hf backend"])]
    print(f"ratio hf backend / native: {statistics.median(ratios):.3f}x (median of per-round ratios; "
          f"they range {min(ratios):.3f}..{max(ratios):.3f})")


if __name__ == "__main__":
    main()
