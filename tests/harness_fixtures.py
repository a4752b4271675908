"""Offline lm-eval tasks for the benchmark tests (test_harness.py, test_harness_export.py) and the
speed bench: three task YAMLs over JSON-lines files of their own (multiple choice by log-likelihood,
rolling perplexity, generation with exact match and `until`), and lm-eval request instances."""

from __future__ import annotations

import json

import torch

WORDS = "the cat sat on a mat and dog ran to big red house with blue door".split()
TASKS = ["tiny_choice", "tiny_rolling", "tiny_generate"]


def sentence(rng: torch.Generator, n: int) -> str:
    return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (n,), generator=rng))


def write_tasks(root, cache, *, scale: int = 1) -> None:
    """The three task YAMLs under `root` (their datasets cached under `cache`); `scale` times the rows."""
    rng = torch.Generator().manual_seed(0)
    rows = {
        "choice": [{"question": sentence(rng, 6), "choices": [sentence(rng, k) for k in (1, 2, 3, 4)],
                    "label": i % 4} for i in range(6 * scale)],
        "rolling": [{"text": sentence(rng, n)} for n in (5, 40, 90) * scale],  # 90 words: several 64-token windows
        "generate": [{"question": sentence(rng, 4), "answer": w} for w in ("cat", "mat", "dog", "the") * scale],
    }
    common = {"dataset_path": "json", "test_split": "test"}
    specs = {
        "choice": {"output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
                   "doc_to_choice": "choices", "doc_to_target": "label",
                   "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]},
        "rolling": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                    "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")]},
        "generate": {"output_type": "generate_until", "doc_to_text": "{{question}} =", "doc_to_target": "{{answer}}",
                     "generation_kwargs": {"until": ["\n", " on"], "do_sample": False, "max_gen_toks": 6},
                     "metric_list": [{"metric": "exact_match"}]},
    }
    for name, spec in specs.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
        task = {"task": f"tiny_{name}", **common, **spec,
                "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(cache)}}
        (root / f"tiny_{name}.yaml").write_text(json.dumps(task))  # JSON is YAML


def our_tasks(tasks_dir):
    """The three tasks alone (lm-eval's own, some 15,000, take seconds to index)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks_dir), include_defaults=False)


def instances(request_type: str, arguments: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=request_type, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


def loglikelihood_requests(seed: int = 1) -> tuple[list[tuple[str, str]], list[tuple[str]]]:
    """(context, continuation) pairs, special tokens in the text among them, and documents of 3 to 130 words."""
    rng = torch.Generator().manual_seed(seed)
    pairs = [("the cat sat", " on"), ("the cat sat ", "on a mat"), ("", "the dog"), ("red house", " with blue door"),
             ("a<|im_end|>b", " c"), ("", "<|im_end|> a"), ("<|endoftext|>the cat", " sat"),
             (sentence(rng, 80), " ran to the big red house"), ("dog", "s"), ("the cat sat", " on"),
             ("the cat sat", " in")]
    return pairs, [(sentence(rng, n),) for n in (3, 50, 130)]


GREEDY_CONTEXTS = ["the cat sat on", "red", "a big dog ran to the house with", "blue door"]


def greedy_pairs(lm, contexts: list[str]) -> list[tuple[str, str]]:
    """(context, continuation) requests whose continuation is `lm`'s greedy next token (generated,
    then kept where it encodes back to one token after its context): their greedy flag is True. An
    untrained model's flags are all False otherwise, and flags all False on both sides compare equal
    whatever the greedy check computes."""
    texts = lm.generate_until(instances("generate_until", [(c, {"until": [], "max_gen_toks": 1, "do_sample": False})
                                                           for c in contexts]))
    return [(c, t) for c, t in zip(contexts, texts) if t and len(lm._encode_pair(c, t)[1]) == 1]


def assert_requests_equal(ours, hflm, pairs: list[tuple[str, str]], documents: list[tuple[str]]) -> None:
    """Our model class and lm-eval's HF backend answer the same log-likelihood and rolling requests:
    the same greedy flags (some True, some False: `greedy_pairs` adds the True ones), log-probabilities
    within 1e-4."""
    import pytest

    pairs = pairs + greedy_pairs(hflm, GREEDY_CONTEXTS)
    expected = hflm.loglikelihood(instances("loglikelihood", pairs))
    got = ours.loglikelihood(instances("loglikelihood", pairs))
    flags = [g for _, g in expected]
    assert True in flags and False in flags, flags  # else a wrong greedy check could compare equal
    assert [g for _, g in got] == flags
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in expected], abs=1e-4)
    expected = hflm.loglikelihood_rolling(instances("loglikelihood_rolling", documents))
    assert ours.loglikelihood_rolling(instances("loglikelihood_rolling", documents)) == pytest.approx(
        expected, abs=1e-4)
