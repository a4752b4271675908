"""Generation tokens/s against transformers' `generate`, in one run, on the same weights.

One model of a native family (llama3 debug by default: 6.2M parameters, fp32), our native model and
transformers' model of its HF conversion; a batch of prompts of different lengths, greedy, a fixed
number of new tokens (no stop token). Contenders, alternated round by round so that a neighbour
slowing the machine hits them alike:

* ours eager: `titan_tpu.generate.generate`, static-shape cache, the decode step eager;
* ours compiled: the same with the decode step compiled by Inductor (compiled once, in a warm-up
  generation not timed; its compile time is printed);
* transformers: `model.generate` with its default dynamic cache (eager), the peer.

tokens/s = new tokens of the batch / wall time of the whole generation (prefill included); each
contender's median over the rounds. The greedy tokens of every contender are checked equal.
--profile prints torch.profiler's table of one compiled generation and one of transformers'.

    python bench/generate.py                        # llama3 debug, 4 prompts, 128 new tokens
    python bench/generate.py --flavor debug --batch 1 --new-tokens 64 --threads 1 --profile
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from titan_tpu.device_cpu import _cpu_model


def build(name: str, flavor: str, seed: int):
    """(our model, transformers' model) with the same random weights."""
    import transformers

    from titan_tpu.models.hub.adapter import hf_config_from_model_args, to_hf_state_dict
    from titan_tpu.models.registry import build_model, get_model_args

    args = get_model_args(name, flavor)
    torch.manual_seed(seed)
    ours = build_model(args).eval()
    config = transformers.AutoConfig.for_model(**hf_config_from_model_args(name, args))
    theirs = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    missing, unexpected = theirs.load_state_dict(to_hf_state_dict(ours.state_dict(), args), strict=False)
    assert not unexpected and all(key == "lm_head.weight" for key in missing), (missing, unexpected)
    return ours, theirs.eval(), args


def prompts_for(vocab_size: int, batch: int, shortest: int, longest: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(shortest, longest, batch).round().int().tolist()
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_inputs(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(map(len, prompts))
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, P - len(prompt):] = torch.tensor(prompt)
        mask[b, P - len(prompt):] = 1
    return ids, mask


def contenders(ours, theirs, prompts: list[list[int]], new_tokens: int) -> dict:
    from titan_tpu.generate import generate

    ids, mask = hf_inputs(prompts)

    def transformers_generate():
        with torch.no_grad():
            out = theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        return out[:, ids.shape[1]:]

    return {
        "ours eager": lambda: generate(ours, prompts, max_new_tokens=new_tokens).tokens_BN,
        "ours compiled": lambda: generate(ours, prompts, max_new_tokens=new_tokens,
                                          compile_backend="inductor").tokens_BN,
        "transformers": transformers_generate,
    }


def profile(fn, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="llama3")
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--shortest", type=int, default=16, help="shortest prompt (tokens)")
    parser.add_argument("--longest", type=int, default=64, help="longest prompt (tokens)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--profile", action="store_true")
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    ours, theirs, args = build(a.name, a.flavor, seed=0)
    prompts = prompts_for(args.vocab_size, a.batch, a.shortest, a.longest)
    runs = contenders(ours, theirs, prompts, a.new_tokens)
    started = time.perf_counter()
    outputs = {name: fn() for name, fn in runs.items()}  # warm-up; compiles the decode step
    print(f"warm-up (compiling the decode step included): {time.perf_counter() - started:.1f} s")
    reference = outputs["transformers"]
    for name, tokens in outputs.items():
        print(f"  {name}: greedy tokens {'equal to' if torch.equal(tokens, reference) else 'DIFFER from'} "
              "transformers'")

    seconds = {name: [] for name in runs}
    for _ in range(a.rounds):
        for name, fn in runs.items():
            started = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - started)
    tokens = a.batch * a.new_tokens
    print(f"\n{a.name}/{a.flavor} fp32, batch {a.batch} (prompts {a.shortest}-{a.longest} tokens), {a.new_tokens} new "
          f"tokens, greedy; {_cpu_model()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}; median of {a.rounds} interleaved rounds")
    median = {name: statistics.median(s) for name, s in seconds.items()}
    peer = tokens / median["transformers"]
    for name, s in median.items():
        spread = f"{min(seconds[name]):.3f}-{max(seconds[name]):.3f} s"
        print(f"  {name:<14} {tokens / s:8.1f} tokens/s  ({spread})  {tokens / s / peer:.2f}x transformers")
    if a.profile:
        print("\nours compiled:\n" + profile(runs["ours compiled"], 20))
        print("\ntransformers:\n" + profile(runs["transformers"], 20))


if __name__ == "__main__":
    main()
