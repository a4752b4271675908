"""Next-token cross-entropy of a model over given token sequences (``titan-tpu eval``).

The model is any that ``titan-tpu train`` takes: a native name/flavor (weights from a training
checkpoint or an HF directory, or a seeded init), an HF directory of any causal-LM type, or an HF
type with overrides. An HF directory whose config the native adapter reads (Llama, Qwen3,
Qwen3-MoE without unsupported features) runs natively; every other one through the Transformers
backend. The text is a token file, or a corpus cut into windows with the model's tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F


def load_token_file(path: str | Path, *, vocab_size: int, max_len: int) -> list[list[int]]:
    """Read a JSON list of token-id lists and check every id and length against the model."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file {path} does not exist; pass a JSON list of lists of token ids")
    try:
        sequences = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"token file {path} is not valid JSON: {e}") from None
    if not isinstance(sequences, list) or not sequences or not all(isinstance(s, list) for s in sequences):
        raise ValueError(f"token file {path} must hold a non-empty JSON list of lists of token ids")
    for i, seq in enumerate(sequences):
        if len(seq) < 2:
            raise ValueError(f"sequence {i} in {path} has {len(seq)} tokens; each needs at least 2 to predict one")
        if len(seq) > max_len + 1:
            raise ValueError(f"sequence {i} in {path} has {len(seq)} tokens; the model takes at most {max_len + 1}")
        bad = [t for t in seq if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"sequence {i} in {path} has token id {bad[0]!r} outside the vocabulary [0, {vocab_size})")
    return sequences


@torch.no_grad()
def sequence_losses(model: torch.nn.Module, sequences: list[list[int]], *, device: torch.device) -> list[float]:
    """Mean next-token cross-entropy of each sequence (one forward per sequence: lengths differ)."""
    model.eval()
    losses = []
    for seq in sequences:
        tokens = torch.tensor(seq, dtype=torch.long, device=device)[None]
        logits = model(tokens[:, :-1])
        losses.append(F.cross_entropy(logits[0].float(), tokens[0, 1:]).item())
    return losses


@dataclasses.dataclass
class EvalModel:
    """A model ready for evaluation: model(tokens_BS) -> logits_BSV, in eval mode."""

    label: str  # how the output names it: llama3/debug, hf:DIR, ...
    backend: str  # native | hf
    model: torch.nn.Module
    vocab_size: int
    max_len: int  # longest input (tokens) its position tables cover
    weights: str  # where the weights came from
    tokenizer: str | None  # a tokenizer.json that goes with the weights, if one is known


def native_hf_dir(hf_dir: str | Path) -> bool:
    """Whether the native adapter reads this HF directory's config (so the native model runs it)."""
    from titan_tpu.models.hf_adapter import model_args_from_hf_config

    try:
        model_args_from_hf_config(json.loads((Path(hf_dir) / "config.json").read_text()))
    except (ValueError, KeyError, TypeError):
        return False
    return True


def _tokenizer_beside(*dirs: Path) -> str | None:
    found = [d / "tokenizer.json" for d in dirs if (d / "tokenizer.json").is_file()]
    return str(found[0]) if found else None


def _hf_backend_model(args, *, kernels, device: torch.device, seed: int, state_dict: dict | None = None,
                      hf_dir: Path | None = None) -> torch.nn.Module:
    from titan_tpu.models.hf_backend import build_hf_model, load_pretrained_weights
    from titan_tpu.parallel.simple_fsdp import materialize_and_init

    model = materialize_and_init(build_hf_model(args, kernels=kernels), None, mode="none", mp=None, device=device,
                                 seed=seed)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=False)
    elif hf_dir is not None:
        load_pretrained_weights(model, hf_dir)
    return model


def _from_checkpoint(checkpoint: str | Path, cfg, device: torch.device) -> EvalModel:
    """A training checkpoint (step, checkpoints/ or run directory) of any model: its own args."""
    from titan_tpu.convert import resolve_checkpoint
    from titan_tpu.models.common.transformer import Transformer, TransformerArgs
    from titan_tpu.train.checkpoint import load_full_state_dict, read_checkpoint_meta

    step_dir = resolve_checkpoint(checkpoint)
    meta = read_checkpoint_meta(step_dir)
    state_dict = load_full_state_dict(step_dir)
    if meta.get("lora"):  # a LoRA run: evaluate the adapted model, its adapters folded into the weights
        from titan_tpu.models.lora import merge_lora_state_dict

        state_dict = merge_lora_state_dict(state_dict, scaling=meta["lora"]["alpha"] / meta["lora"]["rank"])
    tokenizer = _tokenizer_beside(step_dir.parent.parent)  # <run>/checkpoints/step-N -> <run>
    if meta["model_name"] == "hf":
        from titan_tpu.models.hf_backend import HFArgs

        args = HFArgs(**meta["model_args"])
        model = _hf_backend_model(args, kernels=cfg.kernels, device=device, seed=0, state_dict=state_dict)
        return EvalModel(f"hf:{args.hf_config}", "hf", model, args.vocab_size, args.max_seq_len, str(step_dir),
                         tokenizer)
    args = TransformerArgs(**meta["model_args"])
    with torch.device("meta"):
        model = Transformer(args, kernels=cfg.kernels)
    model.load_state_dict({k: v.to(device=device, dtype=torch.float32) for k, v in state_dict.items()},
                          strict=True, assign=True)
    model.init_buffers(device)
    return EvalModel(meta["model_name"], "native", model, args.vocab_size, args.max_seq_len, str(step_dir), tokenizer)


def load_eval_model(cfg, *, checkpoint: str | Path | None = None, device: torch.device) -> EvalModel:
    """The model of a run config (model section as `train` reads it), in fp32 on `device`, with the
    weights of `checkpoint` (a training checkpoint or an HF directory) when given, else the weights
    its HF directory holds, else a seeded init (training.seed)."""
    from titan_tpu.config import model_args_from_config, model_label
    from titan_tpu.models.hf_checkpoint import load_model_from_hf
    from titan_tpu.models.registry import build_model

    hf_files = checkpoint is not None and (Path(checkpoint) / "config.json").is_file() and any(
        Path(checkpoint).glob("*.safetensors"))  # a run directory has a config.json too, but no safetensors
    if hf_files:
        if native_hf_dir(checkpoint) or cfg.model.name != "hf":
            name, args, model = load_model_from_hf(checkpoint, device=device, dtype=torch.float32)
            return EvalModel(name, "native", model, args.vocab_size, args.max_seq_len, str(checkpoint),
                             _tokenizer_beside(Path(checkpoint)))
        cfg.model.hf_config = str(checkpoint)
    elif checkpoint is not None:
        return _from_checkpoint(checkpoint, cfg, device)
    args = model_args_from_config(cfg)
    seed = cfg.training.seed
    if cfg.model.name == "hf":
        from titan_tpu.models.hf_backend import has_weights

        spec = cfg.model.hf_config
        hf_dir = Path(spec).expanduser() if has_weights(spec) else None
        model = _hf_backend_model(args, kernels=cfg.kernels, device=device, seed=seed, hf_dir=hf_dir)
        weights = str(hf_dir) if hf_dir else f"initialised (seed {seed})"
        tokenizer = _tokenizer_beside(Path(spec).expanduser()) if Path(spec).expanduser().is_dir() else None
        return EvalModel(model_label(cfg), "hf", model, args.vocab_size, args.max_seq_len, weights, tokenizer)
    model = build_model(args, device=device, dtype=torch.float32, seed=seed, kernels=cfg.kernels)
    return EvalModel(model_label(cfg), "native", model, args.vocab_size, args.max_seq_len, f"initialised (seed {seed})",
                     None)


def text_sequences(source: str, *, tokenizer_path: str | None, vocab_size: int, seq_len: int, max_tokens: int,
                   text_field: str = "text") -> list[list[int]]:
    """A corpus (file, directory or .jsonl, as data.source) tokenized with `tokenizer_path`, documents
    joined by end-of-text, cut into consecutive windows of seq_len + 1 tokens (each token predicted
    once), at most `max_tokens` tokens in all."""
    from titan_tpu.data.corpus import iter_documents
    from titan_tpu.data.tokenizer import load_tokenizer

    if not tokenizer_path:
        raise ValueError("eval --text needs a tokenizer: pass --data.tokenizer_path TOKENIZER_JSON, or a model "
                         "directory or checkpoint run that holds tokenizer.json")
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {tokenizer_path} has {tokenizer.vocab_size} tokens but the model's vocabulary is "
                         f"{vocab_size}; pass the tokenizer made for this model with --data.tokenizer_path")
    stream: list[int] = []
    for doc in iter_documents(source, text_field=text_field):
        stream += tokenizer.encode(doc) + [tokenizer.eos_id]
        if len(stream) >= max_tokens + 1:
            break
    stream = stream[:max_tokens + 1]
    windows = [stream[i:i + seq_len + 1] for i in range(0, max(len(stream) - 1, 0), seq_len)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise ValueError(f"eval --text {source} holds no text; give a file, directory or .jsonl with text in it")
    return windows


def evaluate(loaded: EvalModel, sequences: list[list[int]]) -> dict:
    """Token-weighted mean loss and perplexity, with the per-sequence losses."""
    device = next(loaded.model.parameters()).device
    losses = sequence_losses(loaded.model, sequences, device=device)
    counts = [len(s) - 1 for s in sequences]
    mean = sum(loss * n for loss, n in zip(losses, counts)) / sum(counts)  # token-weighted
    return {"model": loaded.label, "backend": loaded.backend, "weights": loaded.weights,
            "num_sequences": len(sequences), "num_tokens": sum(counts), "loss": mean, "perplexity": math.exp(mean),
            "per_sequence_loss": losses}


def run_eval(cfg, *, checkpoint: str | None, token_file: str | None, text: str | None, seq_len: int,
             max_tokens: int) -> dict:
    """`titan-tpu eval`: the model of `cfg` (and `checkpoint`) over a token file or a text corpus."""
    from titan_tpu.device import get_backend

    if (token_file is None) == (text is None):
        raise ValueError("titan-tpu eval needs exactly one of --token-file (JSON lists of token ids) and --text "
                         "(a text file, directory or .jsonl)")
    loaded = load_eval_model(cfg, checkpoint=checkpoint, device=get_backend(cfg.training.device).device)
    if token_file is not None:
        sequences = load_token_file(token_file, vocab_size=loaded.vocab_size, max_len=loaded.max_len)
    else:
        tokenizer = cfg.data.tokenizer_path or loaded.tokenizer
        sequences = text_sequences(text, tokenizer_path=tokenizer, vocab_size=loaded.vocab_size,
                                   seq_len=min(seq_len, loaded.max_len), max_tokens=max_tokens,
                                   text_field=cfg.data.text_field)
    return evaluate(loaded, sequences)
