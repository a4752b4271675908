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
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from titan_tpu.files import is_hf_model_dir

if TYPE_CHECKING:
    from titan_tpu.models.spec_base import ModelSpec


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

    spec: ModelSpec  # what runs: its label names it in the output, its args give the vocabulary and window
    model: torch.nn.Module
    weights: str  # where the weights came from
    tokenizer: str | None  # a tokenizer.json that goes with the weights, if one is known

    @property
    def vocab_size(self) -> int:
        return self.spec.args.vocab_size

    @property
    def max_len(self) -> int:
        """Longest input (tokens) its position tables cover."""
        return self.spec.args.max_seq_len


def native_hf_dir(hf_dir: str | Path) -> bool:
    """Whether the native adapter reads this HF directory's config (so the native model runs it)."""
    from titan_tpu.models.spec import spec_for_hf_dir

    return spec_for_hf_dir(hf_dir).kind == "native"


def _tokenizer_beside(*dirs: Path) -> str | None:
    found = [d / "tokenizer.json" for d in dirs if (d / "tokenizer.json").is_file()]
    return str(found[0]) if found else None


def _eval_build(spec: ModelSpec, cfg, *, device: torch.device, seed: int, own_weights: bool = True) -> torch.nn.Module:
    """The spec's model as eval runs it: fp32 on one device, the plain layer loop without
    activation checkpointing, position tables over the model's whole window."""
    from titan_tpu.models.spec import build

    view = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=False),
                               activation_checkpoint=dataclasses.replace(cfg.activation_checkpoint, mode="none"),
                               lora=dataclasses.replace(cfg.lora, enabled=False),  # adapters come merged
                               training=dataclasses.replace(cfg.training, seq_len=spec.args.max_seq_len))
    return build(spec, view, device=device, seed=seed, own_weights=own_weights)


def _from_checkpoint(checkpoint: str | Path, cfg, device: torch.device) -> EvalModel:
    """A training checkpoint (step, checkpoints/ or run directory) of any model: its own args."""
    from titan_tpu.convert import resolve_checkpoint
    from titan_tpu.models.spec import checkpoint_spec
    from titan_tpu.train.checkpoint import load_full_state_dict, read_checkpoint_meta

    step_dir = resolve_checkpoint(checkpoint)
    meta = read_checkpoint_meta(step_dir)
    spec = checkpoint_spec(meta["model_name"], meta["model_args"])
    model = _eval_build(spec, cfg, device=device, seed=0, own_weights=False)
    state_dict = load_full_state_dict(step_dir)
    if meta.get("lora"):  # a LoRA run: evaluate the adapted model, its adapters folded into the weights
        from titan_tpu.models.lora import merge_lora_state_dict

        state_dict = merge_lora_state_dict(state_dict, scaling=meta["lora"]["alpha"] / meta["lora"]["rank"])
    result = model.load_state_dict(state_dict, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"checkpoint {step_dir} has tensors {spec.label} lacks, e.g. {result.unexpected_keys[0]}")
    tokenizer = _tokenizer_beside(step_dir.parent.parent)  # <run>/checkpoints/step-N -> <run>
    return EvalModel(spec, model, str(step_dir), tokenizer)


def load_eval_model(cfg, *, checkpoint: str | Path | None = None, device: torch.device,
                    spec: ModelSpec | None = None) -> EvalModel:
    """The model of a run config (model section as `train` reads it), in fp32 on `device`, with the
    weights of `checkpoint` (a training checkpoint or an HF directory) when given, else the weights
    its HF directory holds, else a seeded init (training.seed). spec: the config's model, resolved
    already (the run setup's); default: resolved here."""
    from titan_tpu.models.spec import model_spec, spec_for_weights

    seed = cfg.training.seed
    hf_files = checkpoint is not None and is_hf_model_dir(checkpoint)  # a run directory's config.json is the run's
    if hf_files:
        spec = spec_for_weights(cfg.model, checkpoint)
        model = _eval_build(spec, cfg, device=device, seed=seed, own_weights=False)
        spec.load_hf_weights(model, Path(checkpoint))
        return EvalModel(spec, model, str(checkpoint), _tokenizer_beside(Path(checkpoint)))
    if checkpoint is not None:
        return _from_checkpoint(checkpoint, cfg, device)
    spec = spec or model_spec(cfg.model)
    model = _eval_build(spec, cfg, device=device, seed=seed)
    own = spec.own_weights_path()
    weights = str(own) if own else f"initialised (seed {seed})"
    return EvalModel(spec, model, weights, spec.own_tokenizer_path())


def trained_image_settings(cfg, weights: str) -> dict:
    """model.max_images, model.image_size and data.chat_template of a vision-language model's
    prompts or rows (generate, eval --rows): the command line's, where it left a default and
    `weights` are a training run's checkpoint, that run's own (its config.json)."""
    from titan_tpu.config import DataConfig, ModelConfig

    given = {"max_images": cfg.model.max_images, "image_size": cfg.model.image_size,
             "chat_template": cfg.data.chat_template}
    defaults = {"max_images": ModelConfig.max_images, "image_size": ModelConfig.image_size,
                "chat_template": DataConfig.chat_template}
    step = Path(weights)
    run_config = step.parent.parent / "config.json"
    if step.parent.name != "checkpoints" or not run_config.is_file():
        return given
    run = json.loads(run_config.read_text())
    model, data = run.get("model", {}), run.get("data", {})
    trained = {"max_images": model.get("max_images"), "image_size": model.get("image_size"),
               "chat_template": data.get("chat_template")}
    return {key: trained[key] if value == defaults[key] and trained[key] is not None else value
            for key, value in given.items()}


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
    return {"model": loaded.spec.label, "backend": loaded.spec.kind, "weights": loaded.weights,
            "num_sequences": len(sequences), "num_tokens": sum(counts), "loss": mean, "perplexity": math.exp(mean),
            "per_sequence_loss": losses}


def load_run_model(setup, *, checkpoint: str | None) -> EvalModel:
    """The model of a run setup (run/setup.py) on its training.device, with `checkpoint`'s weights
    (`load_eval_model`)."""
    from titan_tpu.device import get_backend

    cfg = setup.cfg
    return load_eval_model(cfg, checkpoint=checkpoint, device=get_backend(cfg.training.device).device,
                           spec=setup.spec)


def run_eval(setup, *, checkpoint: str | None, token_file: str | None, text: str | None, seq_len: int,
             max_tokens: int) -> dict:
    """`titan-tpu eval`: the model of a run setup (run/setup.py; `checkpoint`'s weights) over a token
    file or a text corpus (a vision-language model's image-text rows: rows.py)."""
    cfg = setup.cfg

    if (token_file is None) == (text is None):
        raise ValueError("titan-tpu eval needs exactly one of --token-file (JSON lists of token ids), --text "
                         "(a text file, directory or .jsonl) and --rows (image-text chat rows)")
    loaded = load_run_model(setup, checkpoint=checkpoint)
    if token_file is not None:
        sequences = load_token_file(token_file, vocab_size=loaded.vocab_size, max_len=loaded.max_len)
    else:
        tokenizer = cfg.data.tokenizer_path or loaded.tokenizer
        sequences = text_sequences(text, tokenizer_path=tokenizer, vocab_size=loaded.vocab_size,
                                   seq_len=min(seq_len, loaded.max_len), max_tokens=max_tokens,
                                   text_field=cfg.data.text_field)
    return evaluate(loaded, sequences)
