"""The checks of `titan-tpu verify` (tools/verify.py runs them and writes the report).

Each check takes the Subject (tools/subject.py) and returns a Result: a status (PASS, WARN, FAIL, or
SKIP with the reason it could not run), the measured number and the threshold it was held to. The
reference is always unmodified transformers reading the subject's directory, in fp32; training
checks compare our own modes with each other (graph vs eager, 2 ranks vs 1, ...).

A vision-language subject's rows hold an image in their one image slot (`token_batch`): a coloured
shape (data/shapes.py) at the smallest size its processor takes, its image tokens after the first
few text tokens; ours reads the slot as training does, transformers' own model the same image as
its processor would give it (`reference_logits`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from titan_tpu.tools.hf_sweep import _loss_and_grads
from titan_tpu.tools.subject import Subject

# Bands (fp32): per-token KL of the next-token distributions, relative differences of losses,
# gradients and weights. bf16 runs would use KL < 1e-3 PASS, < 1e-2 WARN (not run here: CPU fp32).
KL_PASS, KL_WARN = 1e-6, 1e-3
REL_PASS, REL_WARN = 1e-5, 1e-3
TOP1_PASS = 0.99
SHORT, LONG = 32, 512
TRAIN_STEPS, LR = 20, 1e-3
BATCH, SEQ = 2, 32
SHAPE_TEXT = 48  # the text tokens of a coloured-shape row: the question and the longest answer


@dataclasses.dataclass
class Result:
    check: str
    status: str  # PASS | WARN | FAIL | SKIP
    measured: str
    threshold: str = ""
    seconds: float = 0.0
    details: dict = dataclasses.field(default_factory=dict)


def band(value: float, passed: float, warned: float) -> str:
    return "PASS" if value < passed else "WARN" if value < warned else "FAIL"


def worst(*statuses: str) -> str:
    order = ["PASS", "SKIP", "WARN", "FAIL"]
    return max(statuses, key=order.index)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's scale (at least 1), as hf-sweep measures."""
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item() if b.numel() else 0.0


# ---------------------------------------------------------------------------------------------
# Models: ours (native or the Transformers backend) and transformers' own
# ---------------------------------------------------------------------------------------------


@functools.cache
def _corpus_bytes(n: int) -> bytes:
    from titan_tpu.data.corpus import iter_documents

    data = bytearray()
    for doc in iter_documents(None, max_bytes=n):
        data += doc.encode()
    return bytes(data)


def corpus_tokens(vocab_size: int, n: int, *, offset: int = 0) -> torch.Tensor:
    """`n` tokens of the embedded corpus as bytes (mod the vocabulary): real text, no tokenizer."""
    data = _corpus_bytes(max(1 << 16, offset + n))
    return torch.tensor(list(data[offset:offset + n]), dtype=torch.long) % vocab_size


def vocab_size(subject: Subject) -> int:
    return subject.model.args.vocab_size


def max_len(subject: Subject) -> int:
    return subject.model.args.max_seq_len


def seeded_model(subject: Subject, *, ac_mode: str = "none", scan: bool = False, seed: int = 0, mesh=None,
              parallel_dims=None, mp=None) -> torch.nn.Module:
    """Our model of the subject with the seeded init of the training checks (the same weights in
    every mode), through models/spec.py `build` as train builds it, on the CPU in fp32."""
    from titan_tpu.config import Config
    from titan_tpu.models.spec import build

    cfg = Config()
    cfg.model.scan_layers, cfg.activation_checkpoint.mode = scan, ac_mode
    cfg.training.seq_len = max_len(subject)  # position tables over the whole window, as the checks use it
    return build(subject.model, cfg, device="cpu", seed=seed, mesh=mesh, parallel_dims=parallel_dims, mp=mp,
                 own_weights=False)


def loaded_model(subject: Subject) -> torch.nn.Module:
    """Our model with the directory's weights, fp32, as train and eval load it."""
    model = seeded_model(subject)
    subject.model.load_hf_weights(model, subject.hf_dir)
    return model


def reference_model(subject: Subject) -> torch.nn.Module:
    from titan_tpu.models.hf.weights import read_pretrained

    model, _ = read_pretrained(subject.hf_dir)
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Batches: token rows, and a vision-language subject's rows with an image
# ---------------------------------------------------------------------------------------------

IMAGE_AT = 4  # text tokens before a row's image


def image_tokens(subject: Subject) -> int:
    """The tokens an image takes in a row (0 for a text-only subject)."""
    view = subject.image_view()
    return view.tokens_per_image if view is not None else 0


def _picture(view, index: int):
    """The `index`-th coloured shape at the processor's side (the answers in turn)."""
    import random

    from titan_tpu.data.shapes import ANSWERS, draw_shape, place_shape

    colour, shape = ANSWERS[index % len(ANSWERS)].split()
    return draw_shape(shape, colour, side=view.side, place=place_shape(random.Random(index), side=view.side))


def _image_row(view, text_S: torch.Tensor, *, picture: int) -> dict:
    """One row of a vision-language subject: `text_S` (S + 1 tokens) with an image's tokens after its
    first IMAGE_AT, the next-token labels (none for an image token), the picture in the one slot."""
    import numpy as np

    from titan_tpu.data.batch import IGNORE_INDEX

    image_id = view.config.image_token_id
    text_S = text_S.masked_fill(text_S == image_id, 0)  # a text byte that is the image token's id
    tokens_S = torch.cat([text_S[:IMAGE_AT], torch.full((view.tokens_per_image,), image_id), text_S[IMAGE_AT:]])
    inputs_S, labels_S = tokens_S[:-1].numpy(), tokens_S[1:].numpy()
    labels_S = np.where(labels_S == image_id, IGNORE_INDEX, labels_S)
    pixels = view.pixels(_picture(view, picture))["pixel_values"]
    return {"inputs": inputs_S, "labels": labels_S, "pixel_values": pixels[None],
            "slots": torch.ones(1, dtype=torch.bool), **view.format.row_extras(view, inputs_S, image_id)}


def token_batch(subject: Subject, tokens_BS: torch.Tensor, *, first_picture: int = 0):
    """Rows of S + 1 tokens as a micro-batch of next-token rows (data/batch.py `TokenBatch`); a
    vision-language subject's with an image each (pictures from `first_picture` on)."""
    from titan_tpu.data.batch import TokenBatch
    from titan_tpu.data.images import stack_rows

    view = subject.image_view()
    if view is None:
        return TokenBatch(tokens_BS[:, :-1].contiguous(), tokens_BS[:, 1:].contiguous())
    rows = [_image_row(view, t, picture=first_picture + b) for b, t in enumerate(tokens_BS)]
    return stack_rows(rows, view)


def our_logits(model, batch) -> torch.Tensor:
    images = {"images": batch.images} if batch.images is not None else {}
    return model(batch.inputs_BS, **images)


def reference_logits(model, batch) -> torch.Tensor:
    """transformers' own model on `batch`, its images as transformers' processor lays them out."""
    images = batch.images
    if images is None:
        return model(input_ids=batch.inputs_BS, use_cache=False).logits
    pixels = images.pixel_values.flatten(0, 1)[images.slots_BM.flatten()]
    inputs = {"pixel_values": pixels}
    if images.grid_thw is not None:  # Qwen2.5-VL: the patches of all images in one list, their grids, token types
        inputs = {"pixel_values": pixels.flatten(0, 1), "image_grid_thw": images.grid_thw.flatten(0, 1),
                  "mm_token_type_ids": (batch.inputs_BS == model.config.image_token_id).int()}
    if images.token_types_BS is not None:  # Gemma 3: its image tokens attend to their whole image
        inputs["token_type_ids"] = images.token_types_BS
    return model(input_ids=batch.inputs_BS, use_cache=False, **inputs).logits


def _cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten(), ignore_index=-100)


# ---------------------------------------------------------------------------------------------
# a. preflight
# ---------------------------------------------------------------------------------------------


def _experts_path(model) -> str:
    """Which code runs an HF-backend model's experts: our grouped_mm (through transformers'
    experts interface or one of our graph-safe forms) or the model's own."""
    classes = sorted({type(m).__name__ for m in model.hf_model.modules() if type(m).__name__.endswith("Experts")})
    if model.graph_safe_forwards:
        return f"our grouped_mm through a graph-safe form of {', '.join(model.graph_safe_forwards)}"
    if any("has_gate" in vars(m) for m in model.hf_model.modules()):  # set by use_experts_implementation
        return "our grouped_mm (experts interface)"
    return f"falls back to the model's own {', '.join(classes) or 'expert code'}"


def _features(subject: Subject, experts: str | None = None) -> list[tuple[str, str, str]]:
    """(feature, value, supported | falls back (to what) | blocker) from the working config;
    `experts` says which code runs an HF-backend model's experts."""
    from transformers import AutoConfig

    from titan_tpu.models.hf.config import _logit_transform, _model_class, _moe_shape, text_config
    from titan_tpu.models.hf.hooks import ATTENTION_NAME, _attention_implementation, _has_sparse_indexer

    config = text_config(AutoConfig.from_pretrained(str(subject.hf_dir)))
    d = config.to_dict()
    native = subject.backend == "native"
    ours = "supported" if native else None
    attn = _attention_implementation(_model_class(AutoConfig.from_pretrained(str(subject.hf_dir))))
    kinds = sorted(set(d.get("layer_types") or ["full_attention"]))
    rows = []
    for kind in kinds:
        if native or (attn == ATTENTION_NAME and kind == "full_attention"):
            how = "supported (our attention kernel)"
        elif attn != ATTENTION_NAME:
            how = f"falls back to transformers' {attn} attention"
        else:
            how = "falls back to transformers' sdpa (our kernel is plain causal)"
        rows.append((f"attention: {kind}", "yes", how))
    if d.get("sliding_window") and "sliding_attention" not in kinds:
        rows.append(("attention: sliding window", str(d["sliding_window"]), ours or "falls back to sdpa"))
    if d.get("kv_lora_rank"):
        rows.append(("attention: MLA", f"kv_lora_rank {d['kv_lora_rank']}", "falls back to the model's own code"))
    if _has_sparse_indexer(config):
        rows.append(("attention: sparse indexer", "yes", "falls back to sdpa (the indexer folds into its mask)"))
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "per layer"
    partial = d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    rows.append(("RoPE", f"{rope_type}{f', partial {partial}' if partial else ''}", ours or "the model's own code"))
    moe = _moe_shape(config)
    if moe:
        rows.append(("MoE router", f"{moe[0]} experts, top {moe[1]}", ours or "the model's own router"))
        rows.append(("MoE experts", "stacked", ours or experts or "the model's own code"))
        shared = d.get("n_shared_experts") or d.get("shared_expert_intermediate_size")
        if shared:
            rows.append(("MoE shared experts", str(shared), "the model's own code"))
    rows.append(("tied embeddings", str(bool(d.get("tie_word_embeddings", False))), ours or "supported"))
    cap = _logit_transform(config)
    if cap:
        rows.append(("logit transform", f"{cap} = {d[cap]}", "the model's own logits (no chunked loss)"))
    biases = [k for k in ("attention_bias", "mlp_bias", "bias", "use_bias") if d.get(k)]
    if biases:
        rows.append(("biases", ", ".join(biases), ours or "the model's own code"))
    return rows


def check_preflight(subject: Subject) -> Result:
    from titan_tpu.models.registry import flops_per_token, num_active_params, num_params

    seq = 4096
    if subject.backend == "native" or subject.real_args is not None:
        args = subject.real_args or subject.native_args()
        total, active = num_params(args), num_active_params(args)
        flops, how = flops_per_token(args, seq), "6N + 6 L H hd S"
        experts = None
    else:
        from transformers import AutoConfig

        from titan_tpu.models.hf.config import _moe_shape, hf_args_from_config, text_config as text_of
        from titan_tpu.models.hf.flops import hf_flops_per_token
        from titan_tpu.models.hf.model import build_hf_model

        real = dict(subject.real_config or {})
        args = hf_args_from_config(AutoConfig.for_model(real.pop("model_type"), **real)) if real else subject.hf_args()
        model = build_hf_model(args)  # parameters on the meta device: no memory at any size
        total = sum(p.numel() for p in model.parameters())
        flops, how = hf_flops_per_token(model, seq)
        moe = _moe_shape(text_of(model.hf_model.config))
        experts = _experts_path(model)
        active = total if moe is None else int(sum(
            p.numel() * (moe[1] / moe[0] if ".experts." in n else 1) for n, p in model.named_parameters()))
    rows = _features(subject, experts)
    blockers = [r for r in rows if r[2].startswith("blocker")]
    measured = (f"backend {subject.backend}{f' ({subject.native_name})' if subject.native_name else ''}; "
                f"{total / 1e9:.3g}B parameters, {active / 1e9:.3g}B active; {flops / 1e9:.3g} GFLOP/token "
                f"at seq {seq} ({how}); weights: {subject.weights}")
    return Result("preflight", "FAIL" if blockers else "PASS", measured, "no blocker",
                  details={"features": [{"feature": f, "value": v, "support": s} for f, v, s in rows],
                           "parameters": total, "active_parameters": active, "flops_per_token": flops})


# ---------------------------------------------------------------------------------------------
# b. weights: HF -> ours -> HF
# ---------------------------------------------------------------------------------------------


def _file_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _compare_sets(before: dict, after: dict) -> tuple[float, str, list[str], list[str]]:
    """(max |difference|, the tensor where it is, missing names, extra names)."""
    missing = sorted(set(before) - set(after))
    extra = sorted(set(after) - set(before))
    diff, worst = 0.0, ""
    for k in sorted(set(before) & set(after)):
        a, b = before[k].float(), after[k].float()
        d = float("inf") if a.shape != b.shape else (a - b).abs().max().item() if a.numel() else 0.0
        if d > diff:
            diff, worst = d, k
    return diff, worst, missing, extra


def check_weights(subject: Subject) -> Result:
    if subject.backend == "native":
        from titan_tpu.models.hub.adapter import from_hf_state_dict, fuse_experts, to_hf_state_dict
        from titan_tpu.models.hub.checkpoint import load_hf_checkpoint

        stored = _file_tensors(subject.hf_dir)
        stored.pop("lm_head.weight", None) if subject.native_args().tie_embeddings else None
        _, args, native = load_hf_checkpoint(subject.hf_dir)
        back = to_hf_state_dict(native, args)  # the hub layout: one tensor per expert
        fused = any(k.endswith("experts.gate_up_proj") for k in stored)
        layouts = {"file": (stored, fuse_experts(back, args) if fused else back)}
        if args.moe is not None:  # the other expert layout, in memory through the same mapping
            if fused:
                layouts["per-expert"] = (back, to_hf_state_dict(from_hf_state_dict(back, args), args))
            else:
                other = fuse_experts(back, args)
                layouts["fused"] = (other, fuse_experts(to_hf_state_dict(from_hf_state_dict(other, args), args), args))
    else:
        from titan_tpu.models.hf.weights import export_hf, load_pretrained_weights

        model = seeded_model(subject, seed=1)
        load_pretrained_weights(model, subject.hf_dir)
        with tempfile.TemporaryDirectory() as tmp:
            export_hf(subject.hf_args(), model.state_dict(), Path(tmp) / "export")
            exported = _file_tensors(Path(tmp) / "export")
        layouts = {"file": (_file_tensors(subject.hf_dir), exported)}
    diffs = {name: _compare_sets(*pair) for name, pair in layouts.items()}
    worst_diff, worst_name = max((d, w) for d, w, _, _ in diffs.values())
    problems = [f"{name}: missing {m[0]}" for name, (_, _, m, _) in diffs.items() if m]
    problems += [f"{name}: extra {e[0]}" for name, (_, _, _, e) in diffs.items() if e]
    measured = (f"max |difference| {worst_diff:g}{f' ({worst_name})' if worst_diff else ''} "
                f"over {', '.join(diffs)} layout(s)")
    if problems:
        measured += "; " + "; ".join(problems[:3])
    return Result("weights", "PASS" if worst_diff == 0 and not problems else "FAIL", measured,
                  "difference 0, no missing or extra tensor")


# ---------------------------------------------------------------------------------------------
# c. numerics against transformers
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def _logit_metrics(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    log_p = F.log_softmax(ref.double(), dim=-1)
    log_q = F.log_softmax(ours.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # per token, KL(transformers || ours)
    return {"kl_max": kl.max().item(), "kl_mean": kl.mean().item(),
            "logit_max_diff": (ours.float() - ref.float()).abs().max().item(),
            "top1": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def check_numerics(subject: Subject) -> Result:
    ours, ref = loaded_model(subject), reference_model(subject)
    ours.eval()
    vocab, longest = vocab_size(subject), max_len(subject)
    lengths = {"short": SHORT, "long": min(LONG, longest)}
    details, status = {}, "PASS"
    image = image_tokens(subject)  # a vision-language row's image tokens count in its length
    for name, n in lengths.items():
        batch = token_batch(subject, corpus_tokens(vocab, n - image + 1, offset=1000)[None])
        with torch.no_grad():
            metrics = _logit_metrics(our_logits(ours, batch), reference_logits(ref, batch))
        details[name] = {"tokens": n, **metrics}
        status = worst(status, band(metrics["kl_max"], KL_PASS, KL_WARN))
        if metrics["top1"] < TOP1_PASS:
            status = worst(status, "WARN")
    if lengths["long"] < LONG:
        status = worst(status, "WARN")
        details["long"]["note"] = f"the model takes {longest} positions, fewer than {LONG}"
    # loss and the first step's gradients, in training mode (dropout is 0 in tiny configs)
    loss_diff, grad_diff, grad_name = _loss_and_grad_diff(subject)
    details.update(loss_rel_diff=loss_diff, grad_rel_diff=grad_diff, grad_worst=grad_name)
    status = worst(status, band(loss_diff, REL_PASS, REL_WARN), band(grad_diff, REL_PASS, REL_WARN))
    s, lg = details["short"], details["long"]
    with_image = f", {image} of them an image's" if image else ""
    measured = (f"KL max {s['kl_max']:.2e} ({SHORT} tokens{with_image}) / {lg['kl_max']:.2e} ({lg['tokens']} tokens); "
                f"max |logit diff| {max(s['logit_max_diff'], lg['logit_max_diff']):.2e}; top-1 agreement "
                f"{min(s['top1'], lg['top1']):.4f}; loss rel diff {loss_diff:.1e}; gradients rel diff {grad_diff:.1e}"
                f"{f' ({grad_name})' if grad_name else ''}")
    threshold = (f"KL < {KL_PASS:g} PASS, < {KL_WARN:g} WARN; top-1 >= {TOP1_PASS}; loss and gradients < "
                 f"{REL_PASS:g} PASS, < {REL_WARN:g} WARN (fp32; bf16 bands: KL < 1e-3 PASS, < 1e-2 WARN)")
    return Result("numerics", status, measured, threshold, details=details)


def _loss_and_grad_diff(subject: Subject) -> tuple[float, float, str]:
    ours, ref = loaded_model(subject), reference_model(subject)
    ours.train()
    ref.train()
    batch = token_batch(subject, corpus_tokens(vocab_size(subject), BATCH * (SEQ + 1), offset=5000).view(BATCH, -1))
    torch.manual_seed(1)
    our_loss = _cross_entropy(our_logits(ours, batch), batch.labels_BS)
    torch.manual_seed(1)
    ref_loss = _cross_entropy(reference_logits(ref, batch), batch.labels_BS)
    our_loss.backward()
    ref_loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    if subject.backend == "native":
        from titan_tpu.models.hub.adapter import fuse_experts, to_hf_state_dict

        args = subject.native_args()
        grads = to_hf_state_dict(grads, args)
        if any(n.endswith("experts.gate_up_proj") for n, _ in ref.named_parameters()):
            grads = fuse_experts(grads, args)
    else:
        from titan_tpu.models.hf.model import PREFIX

        grads = {n[len(PREFIX):]: g for n, g in grads.items()}
    worst_diff, worst_name = 0.0, ""
    for name, p in ref.named_parameters():
        if p.grad is None or name not in grads:
            continue
        diff = rel_diff(grads[name], p.grad)
        if diff > worst_diff:
            worst_diff, worst_name = diff, name
    return rel_diff(our_loss, ref_loss), worst_diff, worst_name


# ---------------------------------------------------------------------------------------------
# d. training
# ---------------------------------------------------------------------------------------------


def _text(subject: Subject, rows: int) -> torch.Tensor:
    """[rows, S + 1] tokens of the training checks' rows: the corpus's, or for a vision-language
    subject coloured-shape rows' (`_shape_text`, each row's picture drawn by `token_batch`)."""
    if subject.vision:
        return _shape_text(vocab_size(subject), rows)
    return corpus_tokens(vocab_size(subject), rows * (SEQ + 1)).view(rows, SEQ + 1)


def _batches(subject: Subject, n: int) -> list:
    """`n` micro-batches of BATCH rows (`_text`)."""
    text = _text(subject, n * BATCH)
    return [token_batch(subject, text[i * BATCH:(i + 1) * BATCH], first_picture=i * BATCH) for i in range(n)]


def _shape_text(vocab: int, rows: int) -> torch.Tensor:
    """[rows, SHAPE_TEXT + 1] tokens: each row the shapes data's question and its picture's answer
    (data/shapes.py, the answers in turn, as `_picture` draws them) as bytes, padded with spaces."""
    from titan_tpu.data.shapes import ANSWERS, QUESTION

    texts = [f"{QUESTION} {ANSWERS[i % len(ANSWERS)]}.".ljust(SHAPE_TEXT + 1).encode() for i in range(rows)]
    return torch.tensor([list(t) for t in texts], dtype=torch.long) % vocab


def _step_fn(model, *, graph: bool = False, example=None):
    from titan_tpu.train.optim import AdamW, trained_parameters
    from titan_tpu.train.step import EagerStep

    optimizer = AdamW(trained_parameters(model), layer_stacked=model.stacked_parameter_names())
    if graph:
        from titan_tpu.graph.compile import GraphStep

        return GraphStep(model, optimizer, max_norm=1.0, example_batch=example, backend="eager"), optimizer
    return EagerStep(model, optimizer, max_norm=1.0), optimizer


def _run(model, batches, **kwargs) -> list[float]:
    step, _ = _step_fn(model, example=batches[0], **kwargs)
    return [step([b], LR).loss for b in batches]


def check_train(subject: Subject) -> Result:
    losses = _run(seeded_model(subject), _batches(subject, TRAIN_STEPS))
    first, last = losses[0], sum(losses[-3:]) / 3
    ok = last < 0.95 * first and all(math.isfinite(x) for x in losses)
    return Result("train", "PASS" if ok else "FAIL", f"loss {first:.4f} -> {last:.4f} (mean of the last 3) over "
                  f"{TRAIN_STEPS} steps", "last < 0.95 x first", details={"losses": losses})


def check_rerun(subject: Subject) -> Result:
    batches = _batches(subject, 3)
    a, b = _run(seeded_model(subject), batches), _run(seeded_model(subject), batches)
    diff = max(abs(x - y) for x, y in zip(a, b))
    return Result("rerun", "PASS" if a == b else "FAIL", f"max |loss difference| {diff:g} over 3 steps", "bitwise (0)")


def _params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _after_one_step(model, batch, **kwargs) -> tuple[float, dict]:
    loss = _run(model, [batch], **kwargs)[0]
    return loss, _params(model)


def _step_diff(a: tuple[float, dict], b: tuple[float, dict]) -> tuple[float, str]:
    loss_diff = abs(a[0] - b[0]) / max(1.0, abs(b[0]))
    diffs = {n: rel_diff(v, b[1][n]) for n, v in a[1].items() if n in b[1]}
    name = max(diffs, key=diffs.get) if diffs else ""
    return max(loss_diff, diffs.get(name, 0.0)), name


def check_graph(subject: Subject) -> Result:
    from titan_tpu.graph.capture_errors import CaptureError

    batch = _batches(subject, 1)[0]
    eager = _after_one_step(seeded_model(subject), batch)
    try:
        graph = _after_one_step(seeded_model(subject), batch, graph=True)
    except CaptureError as e:
        return Result("graph", "FAIL", str(e).splitlines()[0][:300], "capture succeeds; equal to eager")
    diff, name = _step_diff(graph, eager)
    return Result("graph", band(diff, REL_PASS, REL_WARN), f"loss and weights after one step: rel diff {diff:.1e}"
                  f"{f' (worst: {name})' if diff else ''}", f"< {REL_PASS:g} PASS, < {REL_WARN:g} WARN")


def check_ac(subject: Subject) -> Result:
    batch = _batches(subject, 1)[0]
    diff, name = _step_diff(_after_one_step(seeded_model(subject, ac_mode="full"), batch),
                            _after_one_step(seeded_model(subject), batch))
    return Result("ac", band(diff, REL_PASS, REL_WARN), f"full activation checkpointing vs none, one step: rel diff "
                  f"{diff:.1e}", f"< {REL_PASS:g} PASS, < {REL_WARN:g} WARN")


def check_scan(subject: Subject) -> Result:
    if subject.backend != "native":
        return Result("scan", "SKIP", "scan-over-layers is a native-model mode; an hf model runs its own layer loop")
    batch = _batches(subject, 1)[0]
    scanned = seeded_model(subject, scan=True)
    loss = _run(scanned, [batch])[0]
    per_layer = scanned.to_per_layer(_params(scanned))
    diff, name = _step_diff((loss, per_layer), _after_one_step(seeded_model(subject), batch))
    return Result("scan", band(diff, REL_PASS, REL_WARN), f"scanned vs unrolled layers, one step: rel diff {diff:.1e}",
                  f"< {REL_PASS:g} PASS, < {REL_WARN:g} WARN")


def check_resume(subject: Subject) -> Result:
    from titan_tpu.train.checkpoint import Checkpointer, load

    batches = _batches(subject, 4)
    straight = _run(seeded_model(subject), batches)
    model = seeded_model(subject)
    step, optimizer = _step_fn(model)
    first = [step([b], LR).loss for b in batches[:2]]
    with tempfile.TemporaryDirectory() as tmp:
        path = Checkpointer(Path(tmp)).save(2, {"step": 2, "model": model.state_dict(),
                                                "optimizer": optimizer.state_dict()})
        fresh = seeded_model(subject, seed=7)  # other weights: the checkpoint must replace them all
        step, optimizer = _step_fn(fresh)
        state = {"model": fresh.state_dict(), "optimizer": optimizer.state_dict()}
        load(path, state)
        optimizer.load_state_dict(state["optimizer"])
        resumed = first + [step([b], LR).loss for b in batches[2:]]
    diff = max(abs(x - y) for x, y in zip(straight, resumed))
    return Result("resume", "PASS" if straight == resumed else "FAIL", f"4 steps straight vs 2 + checkpoint + 2: max "
                  f"|loss difference| {diff:g}", "bitwise (0)")


def check_export(subject: Subject) -> Result:
    """Train 2 steps, export as an HF directory, from_pretrained it (AutoModelForImageTextToText for a
    vision-language model): the trained weights exactly, and our logits on a batch."""
    from transformers import AutoConfig

    from titan_tpu.models.hf.config import auto_model_class

    model = seeded_model(subject)
    batches = _batches(subject, 3)
    _run(model, batches[:2])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "export"
        if subject.backend == "native":
            from titan_tpu.models.hub.adapter import fuse_experts, to_hf_state_dict
            from titan_tpu.models.hub.checkpoint import save_hf_checkpoint

            args = subject.native_args()
            save_hf_checkpoint(out, name=subject.native_name, args=args, state_dict=model.state_dict())
            expected = to_hf_state_dict(model.state_dict(), args)
        else:
            from titan_tpu.models.hf.model import PREFIX
            from titan_tpu.models.hf.weights import export_hf

            export_hf(subject.hf_args(), model.state_dict(), out)
            expected = {k[len(PREFIX):]: v for k, v in model.state_dict().items()}
        auto = auto_model_class(AutoConfig.from_pretrained(str(out)))
        reloaded = auto.from_pretrained(str(out), dtype=torch.float32).eval()
        loaded = reloaded.state_dict()
    if subject.backend == "native" and any(k.endswith("gate_up_proj") for k in loaded):
        expected = fuse_experts(expected, args)
    common = [k for k in expected if k in loaded]
    diff = max(((expected[k].float() - loaded[k].float()).abs().max().item() for k in common), default=0.0)
    missing = [k for k in expected if k not in loaded and not k.endswith("inv_freq")]
    model.eval()
    with torch.no_grad():
        logits = rel_diff(our_logits(model, batches[2]), reference_logits(reloaded, batches[2]))
    status = worst("PASS" if diff == 0 and common and not missing else "FAIL", band(logits, REL_PASS, REL_WARN))
    return Result("export", status, f"{len(common)} tensors, max |difference| {diff:g}"
                  f"{f'; missing after from_pretrained: {missing[0]}' if missing else ''}; {auto.__name__} of it "
                  f"gives our logits{' on an image batch' if subject.vision else ''}: rel diff {logits:.1e}",
                  f"difference 0; logits < {REL_PASS:g} PASS, < {REL_WARN:g} WARN")


def _fsdp_rank(subject: Subject, halves: list, num_tokens: int) -> dict:
    import torch.distributed as dist

    from titan_tpu.parallel.mesh import ParallelDims
    from titan_tpu.parallel.simple_fsdp import MixedPrecision

    dims = ParallelDims(dp_replicate=1, dp_shard=2, world_size=2)
    model = seeded_model(subject, mesh=dims.build_mesh("cpu"), parallel_dims=dims, mp=MixedPrecision())
    rank = dist.get_rank()
    batch = halves[rank]
    loss, grads = _loss_and_grads(model, batch.inputs_BS, batch.labels_BS, images=batch.images, num_tokens=num_tokens,
                                  dp_size=2)
    dist.all_reduce(loss)
    return {"loss": loss.item(), "grads": grads if rank == 0 else None}


def check_fsdp(subject: Subject) -> Result:
    from titan_tpu.parallel.spawn import run_ranks

    text, half = _text(subject, BATCH), BATCH // 2
    halves = [token_batch(subject, text[rows], first_picture=rows.start)
              for rows in (slice(0, half), slice(half, BATCH))]
    num_tokens = sum(int(h.trained_tokens()) for h in halves)
    model = seeded_model(subject)
    loss = sum(_loss_and_grads(model, h.inputs_BS, h.labels_BS, images=h.images, num_tokens=num_tokens, dp_size=2)[0]
               for h in halves)
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ranks = run_ranks(_fsdp_rank, world_size=2, args=(subject, halves, num_tokens), timeout_s=240)
    diff = abs(ranks[0]["loss"] - loss.item()) / max(1.0, abs(loss.item()))
    for name, grad in ranks[0]["grads"].items():  # a gradient one side lacks is one the other holds as zeros
        diff = max(diff, rel_diff(grad, expected[name]) if name in expected else grad.abs().max().item())
    return Result("fsdp", band(diff, REL_PASS, REL_WARN), f"2 fully_shard ranks vs one process: loss and gradients rel "
                  f"diff {diff:.1e}", f"< {REL_PASS:g} PASS, < {REL_WARN:g} WARN")


# ---------------------------------------------------------------------------------------------
# e. plan
# ---------------------------------------------------------------------------------------------


def check_plan(subject: Subject, hardware: str) -> Result:
    """titan-tpu plan of the real-size model: a native one from its args, an hf one (a vision-language
    one with an image in every row's slot) measured by the planner on the model built on the meta
    device (plan/hf_terms.py)."""
    import json

    from titan_tpu.data.images import DEFAULT_DYNAMIC_SIDE
    from titan_tpu.plan import plan_config, resolve_hardware
    from titan_tpu.plan.setting import TPU_NAMES, for_planning
    from titan_tpu.tools.subject import image_sides

    hw, chips = resolve_hardware(hardware)
    mode = "graph" if hw.name in TPU_NAMES else "eager"  # a TPU runs the captured step (docs/tpu.md)
    run = ["--training.device", "cpu", "--training.batch_size", "1", "--training.mode", mode,
           "--parallelism.dp_shard", "-1", "--activation_checkpoint.mode", "full"]
    if subject.native_name is not None:
        args = subject.real_args or subject.native_args()
        checked = for_planning(None, ["--model.name", subject.native_name, "--training.seq_len", "8", *run])
        # The planned length, against these args rather than the debug flavor's: a variant of the checked config.
        seq_len = min(4096, args.max_seq_len)
        cfg = dataclasses.replace(checked, training=dataclasses.replace(checked.training, seq_len=seq_len))
        plan = plan_config(cfg, hw, chips=chips, model_args=args)
    else:
        from titan_tpu.models.hf.config import hf_args_from_spec

        source, overrides = subject.real_hf_config, json.dumps(subject.overrides)
        seq = min(4096, hf_args_from_spec(source, overrides).max_seq_len)
        if subject.vision:  # the run's default side (448 on Qwen2.5-VL), or the largest this processor takes
            run += ["--model.image_size", str(min(DEFAULT_DYNAMIC_SIDE, image_sides(source)[1]))]
        cfg = for_planning(None, ["--model.name", "hf", "--model.hf_config", source, "--model.hf_overrides", overrides,
                                  "--training.seq_len", str(seq), *run])
        plan = plan_config(cfg, hw, chips=chips)
    images = f", {cfg.model.max_images} image slot a row" if subject.vision else ""
    measured = (f"{hardware}: peak {plan.peak_bytes / 1e9:.1f} GB of {plan.capacity_bytes / 1e9:.1f} GB per device, "
                f"{'fits' if plan.fits else 'does not fit'}; predicted MFU {plan.mfu:.1f}% "
                f"({plan.tokens_per_s:,.0f} tokens/s, batch 1 x {cfg.training.seq_len} per device{images}, full AC, "
                f"{mode} mode)")
    if plan.advice:
        measured += "; " + plan.advice[0]
    return Result("plan", "PASS" if plan.fits else "WARN", measured, "fits in device memory",
                  details={"plan": dataclasses.asdict(plan)})
