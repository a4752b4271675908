"""lm-eval requests/s of `titan-tpu eval --tasks` (HarnessLM over our native Llama) against lm-eval's own
Hugging Face backend (HFLM over transformers' Llama) on the same weights, tokenizer and tasks.

    python bench/harness_speed.py [--scale 20] [--batch-size 16] [--repeats 2] [--threads N]

The model: a small Llama (transformers, seeded) saved as an HF directory, which our side runs natively.
The tasks: the three offline ones of the tests (multiple choice by log-likelihood, rolling perplexity,
greedy generation; tests/harness_fixtures.py) with `scale` times their rows, a few hundred requests.
Both answer them in this process, in turn (`repeats` passes each, the fastest kept), through
lm_eval.simple_evaluate; the time is what the model's request methods take (not lm-eval's task
building). Printed: the CPU, each side's requests/s and the ratio, the largest metric difference
(relative: both must score alike), and where each side's time goes (tokenization, forward,
log-softmax, generation), from timers around those calls.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the offline tasks and the test tokenizer

REQUEST_METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


class Timers:
    """Seconds spent in named calls, and requests answered."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.requests = 0

    def wrap(self, owner, attribute: str, name: str, *, count: bool = False) -> None:
        """Time `owner.attribute` (set on the owner, a module or an instance) under `name`."""
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            if count:
                self.requests += len(args[0])
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        setattr(owner, attribute, timed)


@contextlib.contextmanager
def patched(owner, attribute: str):
    """Restores `owner.attribute` afterwards (a module function timed for one pass only)."""
    saved = getattr(owner, attribute)
    try:
        yield
    finally:
        setattr(owner, attribute, saved)


def build(root: Path, *, dim: int, layers: int):
    """(HF directory with the test tokenizer, the transformers model read back from it, its tokenizer)."""
    from data_fixtures import write_chat_tokenizer_dir
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    hf_dir = write_chat_tokenizer_dir(root / "hf")
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=dim, intermediate_size=4 * dim, num_hidden_layers=layers,
                         num_attention_heads=dim // 32, num_key_value_heads=dim // 64, vocab_size=400,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(str(hf_dir))
    return hf_dir, LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval(), tokenizer


def ours(hf_dir: Path, batch_size: int, timers: Timers):
    import titan_tpu.evaluation.harness as harness
    from titan_tpu.data.tokenizer import load_tokenizer
    from titan_tpu.models.hub.checkpoint import load_model_from_hf

    _, args, model = load_model_from_hf(hf_dir)
    lm = harness.HarnessLM(model.float().eval(), load_tokenizer(hf_dir), max_length=args.max_seq_len,
                           batch_size=batch_size)
    timers.wrap(lm, "tok_encode", "tokenization")
    timers.wrap(lm, "_logits", "forward")
    timers.wrap(harness, "generate", "generation")
    for method in REQUEST_METHODS:
        timers.wrap(lm, method, "total", count=True)
    return lm


def reference(hf, tokenizer, batch_size: int, timers: Timers):
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=hf, tokenizer=tokenizer, batch_size=batch_size, device="cpu")
    timers.wrap(lm, "tok_encode", "tokenization")
    timers.wrap(lm, "_model_call", "forward")
    timers.wrap(lm, "_model_generate", "generation")
    for method in REQUEST_METHODS:
        timers.wrap(lm, method, "total", count=True)
    return lm


def score(lm, tasks_dir: Path) -> dict:
    import lm_eval
    from harness_fixtures import TASKS, our_tasks

    return lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=our_tasks(tasks_dir),
                                   log_samples=False)["results"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=20, help="times the test tasks' rows")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="passes of each side; the fastest is kept")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import logging

    import torch.nn.functional as F
    from harness_fixtures import write_tasks

    import titan_tpu.evaluation.harness as harness

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "tasks").mkdir()
        write_tasks(root / "tasks", root / "datasets", scale=args.scale)
        hf_dir, hf, tokenizer = build(root, dim=args.dim, layers=args.layers)

        best: dict[str, Timers] = {}
        results = {}
        for _ in range(args.repeats):  # the sides alternate; each keeps its fastest pass
            for name, make in (("titan-tpu HarnessLM", lambda t: ours(hf_dir, args.batch_size, t)),
                               ("lm-eval HFLM", lambda t: reference(hf, tokenizer, args.batch_size, t))):
                timers = Timers()
                # module functions timed for this pass alone (both sides call F.log_softmax)
                with patched(F, "log_softmax"), patched(harness, "generate"):
                    timers.wrap(F, "log_softmax", "log-softmax")
                    results[name] = score(make(timers), root / "tasks")
                if name not in best or timers.seconds["total"] < best[name].seconds["total"]:
                    best[name] = timers
    ours_results, ref_results = results["titan-tpu HarnessLM"], results["lm-eval HFLM"]
    ours_timers = best["titan-tpu HarnessLM"]
    worst = max(abs(ours_results[task][k] - v) / max(abs(v), 1.0) for task, metrics in ref_results.items()
                for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} torch threads")
    print(f"model: Llama dim {args.dim}, {args.layers} layers, fp32; batch size {args.batch_size}; "
          f"{ours_timers.requests} requests (3 offline tasks x{args.scale})")
    rates = {}
    for name, timers in best.items():
        total = timers.seconds["total"]
        rates[name] = timers.requests / total
        parts = ", ".join(f"{part} {timers.seconds[part]:.2f}s" for part in
                          ("tokenization", "forward", "log-softmax", "generation"))
        print(f"{name:20s} {rates[name]:8.1f} requests/s  ({total:.2f}s: {parts})")
    print(f"ratio (ours / HFLM): {rates['titan-tpu HarnessLM'] / rates['lm-eval HFLM']:.2f}x; "
          f"largest relative metric difference {worst:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
