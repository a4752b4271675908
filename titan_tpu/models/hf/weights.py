"""Weights in and out of Hugging Face directories: transformers' own from_pretrained and
save_pretrained, so its checkpoint conversions apply both ways, with one-line errors."""

from __future__ import annotations

from pathlib import Path

import torch

from titan_tpu.files import usual_permissions
from titan_tpu.models.hf.config import HFArgs, _model_class, auto_model_class
from titan_tpu.models.hf.model import PREFIX, HFCausalLM
from titan_tpu.tensors import copy_full_


def has_weights(hf_dir: str | Path) -> bool:
    path = Path(hf_dir)
    return path.is_dir() and any(path.glob("*.safetensors"))


@torch.no_grad()
def load_pretrained_weights(model: HFCausalLM, hf_dir: str | Path) -> None:
    """Copy the weights of an HF directory into `model` (plain or sharded parameters).

    transformers' own from_pretrained reads the directory, so its checkpoint conversions (renamed
    or fused tensors of newer modeling code) apply; every rank reads it and keeps its shard. A
    directory whose weights do not fit the config (a missing tensor, another shape) is a one-line
    error."""
    hf_dir = Path(hf_dir)
    loaded, info = read_pretrained(hf_dir)
    problems = [f"missing {k}" for k in info.get("missing_keys", [])]
    problems += [f"{k}: {tuple(a)} in the files, the config wants {tuple(b)}"
                 for k, a, b in info.get("mismatched_keys", [])]
    if problems:
        raise ValueError(f"the weights in {hf_dir} do not fit its config.json: {problems[0]}"
                         f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}")
    source = loaded.state_dict()
    for name, target in model.state_dict().items():
        key = name[len(PREFIX):]
        if key not in source:
            continue  # a buffer transformers does not save
        copy_full_(target, source[key])
    del loaded, source


def reference_attention(config) -> str:
    """The attention transformers' own model of `config` runs with when we only read its weights or
    compare against it: sdpa where the model class supports it, its eager attention otherwise
    (Gemma 2, BLOOM: asking those for sdpa is an error, not a fallback)."""
    return "sdpa" if getattr(_model_class(config), "_supports_sdpa", False) else "eager"


def read_pretrained(hf_dir: Path):
    """transformers' own from_pretrained of `hf_dir` in fp32 -> (model, loading info). A file that does
    not fit the config (another shape, an unreadable tensor) is a one-line error blaming the weights;
    anything else transformers refuses is reported as transformers' own message."""
    from transformers import AutoConfig

    from titan_tpu.models.hub.checkpoint import check_safetensors_file

    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        check_safetensors_file(file)  # truncated or damaged: one line naming the file
    config = AutoConfig.from_pretrained(str(hf_dir))
    try:
        return auto_model_class(config).from_pretrained(str(hf_dir), dtype=torch.float32, output_loading_info=True,
                                                    attn_implementation=reference_attention(config))
    except (RuntimeError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        weights = isinstance(e, RuntimeError) or any(w in first for w in ("size mismatch", "shape", "safetensors"))
        what = "the weights in {} do not fit its config.json" if weights else "transformers cannot load {}"
        raise ValueError(f"{what.format(hf_dir)} ({first[:300]})") from None


def export_hf(args: HFArgs, state_dict: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    """Write `state_dict` (our names, full tensors) as an HF directory with save_pretrained, which
    from_pretrained loads (transformers applies its own checkpoint layout on the way out)."""
    from transformers.initialization import no_init_weights

    config = args.transformers_config()
    with no_init_weights():
        model = auto_model_class(config).from_config(config, dtype=torch.float32)
    own = {k[len(PREFIX):]: v for k, v in state_dict.items() if k.startswith(PREFIX)}
    missing, unexpected = model.load_state_dict(own, strict=False)
    buffers = {n for n, _ in model.named_buffers()}
    missing = [k for k in missing if k not in buffers]
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not fit {config.model_type}: "
                         f"{('missing ' + missing[0]) if missing else ('unexpected ' + unexpected[0])}")
    model.tie_weights()
    out_dir = Path(out_dir)
    model.save_pretrained(str(out_dir))
    usual_permissions(out_dir)  # safetensors writes 0600 files; an export is for others to read too
    return out_dir
