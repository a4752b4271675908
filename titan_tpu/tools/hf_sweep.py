"""`titan-tpu hf-sweep`: every causal-LM type of the installed transformers through the Transformers backend.

For each `model_type` of transformers' causal-LM auto mapping: a tiny config (2 layers, or one of
each kind a model's layer_types name, hidden 64, vocab 512, dropout 0; MoE and MLA sizes shrunk
too; TYPE_OVERRIDES where a default config does not build), then four checks on one fixed batch,
fp32 CPU:

* plain: transformers' own model (its default attention) runs a forward and backward. The baseline:
  a type that fails here is not ours to fix.
* eager: our backend (`HFCausalLM`, kernel attention and loss) on the same weights gives the same
  loss as transformers' own forward and the same gradients (1e-5).
* graph: one training step captured with make_fx and run (backend "eager": the captured graph
  itself) equals the eager training step: loss and updated weights (1e-5).
* fsdp2: loss and gradients on 2 fully_shard ranks (SimpleFSDP, gloo), half the batch each, equal
  one process on the whole batch (1e-5).

Every type runs in its own process with a timeout, so a crash or a hang costs one row; `--workers`
processes run at once. The table (one row per type, the first line of any failure) is written as
Markdown with the date and versions: docs/hf_models.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CHECKS = ("plain", "eager", "graph", "fsdp2")
BATCH, SEQ, VOCAB, LAYERS = 4, 32, 512, 2
TOLERANCE = 1e-5

# Sizes set wherever a config has the key (top level and text config). MoE: 4 experts, top-2.
# MLA (DeepSeek-style): small ranks. Token ids are moved into the tiny vocab separately.
TINY_SIZES = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB, "max_position_embeddings": 512,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "sliding_window": 16, "attention_chunk_size": 16,
    # partial rotary (GPT-J, CodeGen), XLNet's head size, the sparse-attention indexer (DeepSeek V3.2),
    # encoder-decoder style decoders (PLBart, Whisper), Gemma 3n's per-layer inputs
    "rotary_dim": 8, "d_head": 16, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 16,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_layers": LAYERS, "decoder_layers": LAYERS,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "hidden_size_per_layer_input": 16, "num_kv_shared_layers": 0,
}

# Keys whose default None means "derived from the others" (not "feature off"): set them anyway.
SET_WHEN_NONE = ("head_dim", "num_key_value_heads")
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")

# What the generic rules above cannot know: a default config that does not build as it is, or a
# constraint between keys of one model. Each entry says why.
TYPE_OVERRIDES = {
    # the default attn_config lacks the rope_theta that DbrxAttention reads, and its clip_qkv None
    # reaches clamp(None, None); MoE sizes live in ffn_config
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
             "d_model": 64},  # the experts' width follows d_model, not its alias hidden_size
    # its depth is num_layers (each holds two attention + MLP sublayers; num_hidden_layers is derived),
    # which the shrinking above does not know; 2 identity experts beside 4 routed ones (default 256)
    "longcat_flash": {"num_layers": 1, "zero_expert_num": 2},
    # the default has no experts at all (None) but builds MoE layers
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # validate_architecture: sliding-window layers' head_dim == qk_nope_head_dim + qk_rope_head_dim
    # and the vision and audio adapters are as wide as the text model
    "dots3_note": {"head_dim": 16, "vision_config": {"adapter_out_dim": 64}, "audio_config": {"adapter_out_dim": 64}},
    "dots3_note_text": {"head_dim": 16},
    # the default rope_parameters is empty; the model reads them per layer type
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # validate_architecture: hidden_size * expand == num_heads * head_dim
    "mamba2": {"num_heads": 8, "n_groups": 1},
    # validate_architecture: one expert per token only
    "zaya": {"num_experts_per_tok": 1},
    # the LM head refuses a model that is not a decoder; axial position embeddings: dims sum to hidden_size,
    # shape multiplies to the training sequence; chunks divide the sequence; a fixed hash seed makes LSH
    # attention deterministic
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [4, 8],
                 "attn_layers": ["local", "lsh"], "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8,
                 "hash_seed": 0},
    # the model refuses to run before a language is chosen
    "xmod": {"default_language": "en_XX"},
    # its config.json spells each layer as (attention, "mlp"): the layer kinds are the attention kinds
    "dory": {"layer_types": ["sliding_attention", "mlp", "full_attention", "mlp"], "num_hidden_layers": 4},
    # the default config has indexed-attention layers but no indexer sizes (None)
    **{name: {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
              "indexer_compress_ratio": 4} for name in ("qwen4_exp", "qwen4_exp_text")},
    # byte-level: four sub-models of their own sizes (the default needs 23 GB) and a hash vocabulary
    "blt": {"encoder_hash_byte_group_vocab": 1024, "local_attention_window_len": 16,
            **{name: {"hidden_size": 64, "hidden_size_global": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 4, "head_dim": 16, "intermediate_size": 128, "sliding_window": 16,
                      "max_position_embeddings": 512, "vocab_size": VOCAB}
               for name in ("patcher_config", "encoder_config", "decoder_config", "global_config")}},
    # layer_types defaults to None, which the model indexes; a conv layer and an attention layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
}


def _every_layer_kind(values: list, layers: int) -> list:
    """A per-layer list (layer_types, mlp_layer_types) cut to `layers` entries that keeps one layer of
    every kind the full model has, so two layers still test sliding and full attention, linear and
    full attention, dense and MoE blocks: the kinds in order of first appearance, then the pattern."""
    kinds = list(dict.fromkeys(values))
    return (kinds + values)[:max(layers, len(kinds))]


def tiny_overrides(model_type: str, config=None) -> dict:
    """The config values that make `model_type` tiny: TINY_SIZES where its config (or text config)
    has the key, one layer of each kind, dropouts 0, token ids inside the tiny vocab, then
    TYPE_OVERRIDES. `config`: a real config to shrink (titan-tpu verify --tiny of a directory);
    default: the type's default config."""
    from transformers import AutoConfig

    from titan_tpu.models.hf.config import text_config

    config = config if config is not None else AutoConfig.for_model(model_type)
    out = {}
    for target in {id(c): c for c in (config, text_config(config))}.values():
        values = target.to_dict()
        for key, value in TINY_SIZES.items():
            if isinstance(getattr(type(target), key, None), property):
                continue  # derived from other keys (Falcon's head_dim)
            try:
                current = getattr(target, key)
            except Exception:  # noqa: BLE001 - per-layer attributes refuse a global read (Gemma 4, Dots 3)
                current = values.get(key)  # the global value, which layers without their own follow
            # 0 or None turns a feature off (no shared experts, no per-layer inputs): keep it off
            present = (current is not None and current != 0) or (key in values and key in SET_WHEN_NONE)
            if present:
                out[key] = value
        if values.get("num_experts_per_tok", 0) is None and any(values.get(k) for k in EXPERT_COUNTS):
            out["num_experts_per_tok"] = TINY_SIZES["num_experts_per_tok"]
        layers = values.get("num_hidden_layers")
        for key, value in values.items():
            if isinstance(value, float) and ("dropout" in key or key.endswith("_pdrop")):
                out[key] = 0.0
            elif key.endswith("token_id") and isinstance(value, int) and value >= VOCAB:
                out[key] = 1
            elif key.endswith("token_id") and isinstance(value, list):
                out[key] = [v if v < VOCAB else 1 for v in value]
            elif (key.endswith("layer_types") and isinstance(value, list) and layers and len(value) == layers
                  and all(isinstance(v, str) for v in value)):
                out[key] = _every_layer_kind(value, LAYERS)
        kinds = [len(v) for k, v in out.items() if k.endswith("layer_types") and isinstance(v, list)]
        if kinds and "num_hidden_layers" in out:
            out["num_hidden_layers"] = max(kinds)
            for key in [k for k in out if k.endswith("layer_types")]:
                out[key] = (out[key] * max(kinds))[:max(kinds)]
    if "qk_rope_head_dim" in out and "head_dim" in out:
        out["head_dim"] = out["qk_rope_head_dim"]  # multi-head latent attention: RoPE runs on these dims
    if "qk_rope_head_dim" in out and "num_key_value_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]  # MLA: one key and value per head
    out.update(TYPE_OVERRIDES.get(model_type, {}))
    return out


def tiny_config(model_type: str):
    """A small config of `model_type` for the sweep and the tests, built as --model.hf_config TYPE
    --model.hf_overrides would build it."""
    from titan_tpu.models.hf.config import load_hf_config

    return load_hf_config(model_type, tiny_overrides(model_type))


def sweep_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's scale (at least 1)."""
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item() if b.numel() else 0.0


def _our_model(args, *, seed: int = 0, mesh=None, parallel_dims=None, mp=None):
    """The Transformers backend's model of `args` (HFArgs) with a seeded init, through models/spec.py
    `build` as train builds it (the chunked-loss check included), on the CPU."""
    from titan_tpu.config import Config
    from titan_tpu.models.hf.spec import HFSpec
    from titan_tpu.models.spec import build

    return build(HFSpec.of_hf_args(args), Config(), device="cpu", seed=seed, mesh=mesh, parallel_dims=parallel_dims,
                 mp=mp, own_weights=False)


def _reference_model(config, state_dict):
    """transformers' own model (its default attention) with our weights."""
    from transformers import AutoModelForCausalLM

    from titan_tpu.models.hf.model import PREFIX

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict({k[len(PREFIX):]: v for k, v in state_dict.items()}, strict=False)
    model.train()
    return model


def check_plain(config) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    inputs, labels = sweep_batch()
    logits = model(input_ids=inputs, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()


def check_eager(config) -> str:
    """Loss and gradients of our backend vs transformers' own forward and backward; returns a note."""
    from titan_tpu.models.hf.config import hf_args_from_config
    from titan_tpu.models.hf.model import PREFIX

    ours = _our_model(hf_args_from_config(config))
    ref = _reference_model(config, ours.state_dict())
    inputs, labels = sweep_batch()
    # The same random numbers for both forwards (PhiMoE's router samples its experts in training).
    torch.manual_seed(1)
    our_loss = ours(inputs, labels).ce_sum / labels.numel()
    torch.manual_seed(1)
    logits = ref(input_ids=inputs, use_cache=False).logits
    ref_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    our_loss.backward()
    ref_loss.backward()
    worst = _close(our_loss, ref_loss)
    if worst > TOLERANCE:
        raise AssertionError(f"loss {our_loss.item():.6f} vs transformers {ref_loss.item():.6f}")
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        ref_p = ref_params.get(name[len(PREFIX):])
        if ref_p is None or ref_p.grad is None or p.grad is None:
            continue
        diff = _close(p.grad, ref_p.grad)
        if diff > TOLERANCE:
            raise AssertionError(f"gradient of {name[len(PREFIX):]} differs by {diff:.1e}")
    return "chunked loss" if ours.use_chunked_loss else "model's logits"


def _train_step(model, batch, *, graph: bool, dp_size: int = 1):
    from titan_tpu.graph.compile import GraphStep
    from titan_tpu.train.optim import AdamW, trained_parameters
    from titan_tpu.train.step import EagerStep

    optimizer = AdamW(trained_parameters(model))
    if graph:
        step = GraphStep(model, optimizer, max_norm=1.0, example_batch=batch, backend="eager", dp_size=dp_size)
    else:
        step = EagerStep(model, optimizer, max_norm=1.0, dp_size=dp_size)
    return step([batch], 1e-3)


def _full_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def check_graph(config) -> None:
    from titan_tpu.models.hf.config import hf_args_from_config

    args = hf_args_from_config(config)
    batch = sweep_batch()
    eager_model, graph_model = _our_model(args), _our_model(args)
    eager = _train_step(eager_model, batch, graph=False)
    graph = _train_step(graph_model, batch, graph=True)
    if abs(eager.loss - graph.loss) > TOLERANCE * max(1.0, abs(eager.loss)):
        raise AssertionError(f"graph loss {graph.loss:.6f} vs eager {eager.loss:.6f}")
    expected = _full_params(eager_model)
    for name, value in _full_params(graph_model).items():
        diff = _close(value, expected[name])
        if diff > TOLERANCE:
            raise AssertionError(f"after one graph step {name} differs from eager by {diff:.1e}")


def _loss_and_grads(model, inputs, labels, *, num_tokens: int, dp_size: int, images=None) -> tuple[torch.Tensor, dict]:
    """The step's loss (as train/step.py forms it) and the full gradients after its backward;
    images: a vision-language batch's (data/batch.py ImageInputs)."""
    from torch.distributed.tensor import DTensor

    out = model(inputs, labels, **({"images": images} if images is not None else {}))
    loss = out.ce_sum / num_tokens + out.aux_loss / dp_size
    loss.backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for n, p in model.named_parameters() if p.grad is not None}  # accumulated over calls
    return loss.detach(), grads


def _fsdp_rank(args) -> dict:
    """One rank of the fsdp2 check: its half of the batch; the summed loss and full gradients."""
    import torch.distributed as dist

    from titan_tpu.parallel.mesh import ParallelDims
    from titan_tpu.parallel.simple_fsdp import MixedPrecision

    dims = ParallelDims(dp_replicate=1, dp_shard=2, world_size=2)
    model = _our_model(args, mesh=dims.build_mesh("cpu"), parallel_dims=dims, mp=MixedPrecision())
    rank = dist.get_rank()
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    inputs, labels = sweep_batch()
    loss, grads = _loss_and_grads(model, inputs[rows].contiguous(), labels[rows].contiguous(),
                                  num_tokens=labels.numel(), dp_size=2)
    dist.all_reduce(loss)
    return {"loss": loss.item(), "grads": grads if rank == 0 else None}


def check_fsdp2(config) -> None:
    """Loss and gradients of 2 fully_shard ranks (half the batch each) vs one process."""
    from titan_tpu.models.hf.config import hf_args_from_config
    from titan_tpu.parallel.spawn import run_ranks

    args = hf_args_from_config(config)
    inputs, labels = sweep_batch()
    # The reference runs the ranks' halves as two micro-batches (gradients accumulate), as the
    # trainer defines data parallelism: the same as the whole batch, except for a balancing loss,
    # which each rank (micro-batch) computes over its own rows.
    model, half = _our_model(args), BATCH // 2
    loss = sum(_loss_and_grads(model, inputs[rows], labels[rows], num_tokens=labels.numel(), dp_size=2)[0]
               for rows in (slice(0, half), slice(half, BATCH)))
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ranks = run_ranks(_fsdp_rank, world_size=2, args=(args,), timeout_s=240)
    if abs(ranks[0]["loss"] - loss.item()) > TOLERANCE * max(1.0, abs(loss.item())):
        raise AssertionError(f"2-rank loss {ranks[0]['loss']:.6f} vs one process {loss.item():.6f}")
    for name, grad in ranks[0]["grads"].items():
        diff = _close(grad, expected[name])
        if diff > TOLERANCE:
            raise AssertionError(f"2-rank gradient of {name} differs from one process by {diff:.1e}")


def sweep_one(model_type: str, checks: tuple[str, ...] = CHECKS) -> dict:
    """The row of one type: {"type", <check>: "pass" | "fail" | "skip", "reason", "note", "seconds"}."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    start = time.perf_counter()
    row: dict = {"type": model_type, "reason": "", "note": ""}
    try:
        config = tiny_config(model_type)
    except Exception as e:  # noqa: BLE001 - every failure becomes the row's reason
        row.update({c: "fail" for c in checks}, reason=f"tiny config: {_first_line(e)}")
        return row
    failed = False
    for check in checks:
        if failed:
            row[check] = "skip"
            continue
        try:
            checks = {"plain": check_plain, "eager": check_eager, "graph": check_graph, "fsdp2": check_fsdp2}
            note = checks[check](config)
            row[check] = "pass"
            if note:
                row["note"] = note
        except Exception as e:  # noqa: BLE001
            row[check] = "fail"
            row["reason"] = row["reason"] or f"{check}: {_first_line(e)}"  # the first failure
            failed = check in ("plain", "eager")  # later checks build on these
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def _run_isolated(model_type: str, checks: tuple[str, ...], timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "titan_tpu.tools.hf_sweep", "--one", model_type, "--checks", ",".join(checks),
               "--json", str(out)]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"type": model_type, **{c: "fail" for c in checks}, "reason": f"timeout after {timeout_s:.0f} s",
                    "note": ""}
        if out.is_file():
            return json.loads(out.read_text())
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        return {"type": model_type, **{c: "fail" for c in checks},
                "reason": f"crashed (exit {done.returncode}): {tail[0][:160]}", "note": ""}


def write_table(rows: list[dict], checks: tuple[str, ...], path: Path, seconds: float) -> None:
    from importlib.metadata import PackageNotFoundError, version

    import transformers

    try:
        ours = version("titan-tpu")
    except PackageNotFoundError:
        ours = "(not installed)"
    totals = {c: sum(r.get(c) == "pass" for r in rows) for c in checks}
    plain_ok = [r for r in rows if r.get("plain") == "pass"]
    lines = [
        "# Hugging Face causal-LM types through the Transformers backend",
        "",
        f"Generated by `titan-tpu hf-sweep` on {datetime.date.today().isoformat()}: transformers "
        f"{transformers.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"titan-tpu {ours}, CPU fp32, "
        f"{len(rows)} types in {seconds / 60:.0f} min. Each type is built tiny ({LAYERS} layers, or one of each "
        f"layer kind where a model has more kinds, hidden 64, vocab {VOCAB}, dropout 0; per-type fixes where a "
        "default config does not build; titan_tpu/tools/hf_sweep.py) and checked on one batch of "
        f"{BATCH} x {SEQ} tokens:",
        "",
        "- **plain**: transformers' own model trains (forward + backward) with that config: the baseline;",
        f"- **eager**: our backend's loss and gradients equal transformers' own ({TOLERANCE:g});",
        f"- **graph**: one training step captured as one graph equals the eager step ({TOLERANCE:g});",
        f"- **fsdp2**: loss and gradients on 2 fully_shard ranks equal one process ({TOLERANCE:g}).",
        "",
        "A check after a failed plain or eager check is skipped. The loss column says whether our chunked "
        "loss kernel ran (the model's logits are its output embedding of the last hidden state) or the "
        "model's own logits did.",
        "",
        "| | " + " | ".join(checks) + " |",
        "| --- | " + " | ".join("---" for _ in checks) + " |",
        f"| passed, of {len(rows)} types | " + " | ".join(str(totals[c]) for c in checks) + " |",
        f"| passed, of the {len(plain_ok)} that train plain | "
        + " | ".join(str(sum(r.get(c) == "pass" for r in plain_ok)) for c in checks) + " |",
        "",
        "| type | " + " | ".join(checks) + " | loss | s | first failure |",
        "| --- | " + " | ".join("---" for _ in checks) + " | --- | --- | --- |",
    ]
    mark = {"pass": "yes", "fail": "**no**", "skip": "-"}
    for r in sorted(rows, key=lambda r: r["type"]):
        reason = r.get("reason", "").replace("|", "\\|").replace("\n", " ")
        cells = " | ".join(mark.get(r.get(c, "skip"), "-") for c in checks)
        lines.append(f"| {r['type']} | {cells} | {r.get('note', '')} | {r.get('seconds', '')} | {reason} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="titan-tpu hf-sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="", help="comma-separated model types (default: every causal-LM type)")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"which checks, of {','.join(CHECKS)}")
    parser.add_argument("--workers", type=int, default=2, help="types checked at once, one process each (2)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per type before it is a failure (600)")
    parser.add_argument("--out", default="docs/hf_models.md", help="the Markdown table (docs/hf_models.md)")
    parser.add_argument("--list", action="store_true", help="print the causal-LM types and exit")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: check one type in this process
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from titan_tpu.models.hf.config import causal_lm_types

    checks = tuple(c for c in args.checks.split(",") if c)
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check {unknown[0]!r}; choose from {', '.join(CHECKS)}")
    if args.one:
        row = sweep_one(args.one, checks)
        Path(args.json).write_text(json.dumps(row))
        return 0
    all_types = causal_lm_types()
    if args.list:
        print("\n".join(all_types))
        return 0
    types = [t for t in args.types.split(",") if t] or all_types
    missing = [t for t in types if t not in all_types]
    if missing:
        raise ValueError(f"{missing[0]!r} is not a causal-LM type of this transformers; see titan-tpu hf-sweep --list")
    start = time.perf_counter()
    rows = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.workers)) as pool:
        futures = {pool.submit(_run_isolated, t, checks, args.timeout): t for t in types}
        for future in concurrent.futures.as_completed(futures):
            row = future.result()
            rows.append(row)
            status = " ".join(f"{c}={row.get(c, '-')}" for c in checks)
            print(f"[{len(rows)}/{len(types)}] {row['type']}: {status} {row.get('reason', '')}", flush=True)
    write_table(rows, checks, Path(args.out), time.perf_counter() - start)
    print(f"table written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
