"""Conversion between training checkpoints and Hugging Face model directories."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from titan_tpu.data.tokenizer import tokenizer_files
from titan_tpu.export_files import copy_processor_files, write_export_files
from titan_tpu.train.checkpoint import STATE_FILE, Checkpointer, load_full_state_dict, read_checkpoint_meta

# What `convert --to-hf --dtype` writes.
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory as given, or the newest complete one under a checkpoints/ or run directory."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    for candidate in (path, path / "checkpoints"):
        latest = Checkpointer(candidate).latest()
        if latest is not None:
            return latest
    raise FileNotFoundError(f"no complete checkpoint found at {path}; pass a step-XXXXXXXX directory, a "
                            "checkpoints/ directory or a run directory")


def checkpoint_to_hf(checkpoint: str | Path, hf_dir: str | Path, *, overwrite: bool = False,
                     merge_lora: bool = False, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Export the model weights in `dtype` (bfloat16 by default, as models are served), and the run's
    tokenizer when there is one with the special-token ids and generation defaults serving reads
    (export_files.py), as an HF directory. A LoRA run's adapters are folded into the
    weights they adapt (merge_lora), the plain model. The weights are read from the checkpoint
    block by block as they are written (train/checkpoint_sources.py): a native model's export
    holds one tensor at a time, never the model (a Transformers-backend model is written by
    transformers, from memory)."""
    from titan_tpu.models.lora import merge_lora_sources
    from titan_tpu.models.spec import checkpoint_spec
    from titan_tpu.train.checkpoint_sources import CheckpointTensors

    step_dir = resolve_checkpoint(checkpoint)
    meta = read_checkpoint_meta(step_dir)
    spec = checkpoint_spec(meta["model_name"], meta["model_args"])
    lora = meta.get("lora")
    if lora and not merge_lora:
        raise ValueError(f"checkpoint {step_dir} holds LoRA adapters; pass --merge-lora to fold them into the "
                         "weights, or export them alone with --to-peft DIR")
    if merge_lora and not lora:
        raise ValueError(f"--merge-lora: checkpoint {step_dir} holds no LoRA adapters (trained without "
                         "lora.enabled); leave --merge-lora out")
    if dtype not in EXPORT_DTYPES.values():
        raise ValueError(f"an export in {dtype} is not supported; use one of {', '.join(EXPORT_DTYPES)}")
    # Only the model's tensors: the optimizer moments (twice the model's size) are not read.
    try:
        sources = CheckpointTensors(step_dir).sources()
    except Exception as e:
        raise ValueError(f"checkpoint {step_dir} cannot be read ({e}); it is damaged: export an earlier one") from None
    if lora:
        sources = merge_lora_sources(sources, scaling=lora["alpha"] / lora["rank"])
    out = spec.export_hf(sources, Path(hf_dir), dtype=dtype, overwrite=overwrite)
    run_dir = step_dir.parent.parent  # <run>/checkpoints/step-N -> <run>
    if (run_dir / "tokenizer.json").is_file():  # what AutoTokenizer, lm-eval's HF backend and vLLM read
        write_export_files(out, tokenizer_json=run_dir / "tokenizer.json",
                           chat_template_choice=_run_chat_template(run_dir))
    image_model_dir = spec.image_model_dir()
    if image_model_dir is not None:
        copy_processor_files(out, image_model_dir)
    return out


def _run_chat_template(run_dir: Path) -> str:
    """The run's data.chat_template (its config.json in the run directory), "" when it names none."""
    path = run_dir / "config.json"
    try:
        return str(json.loads(path.read_text()).get("data", {}).get("chat_template") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def hf_to_checkpoint(hf_dir: str | Path, checkpoint_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write a weights-only step-0 checkpoint, usable as --checkpoint.initial_load_path, in the
    directory's dtype (fp8 weights dequantised to float32). Streamed: DCP plans the files from the
    shapes, and each tensor is read from the safetensors files when its turn comes to be written
    (train/checkpoint_sources.py), so one tensor is in memory at a time."""
    from titan_tpu.models.hub.checkpoint import hf_native_sources
    from titan_tpu.train.checkpoint_sources import SourcesSavePlanner, placeholder

    ckpt = Checkpointer(checkpoint_dir)
    if ckpt.latest() is not None and not overwrite:
        raise FileExistsError(f"{checkpoint_dir} already holds checkpoints; "
                              "pass --overwrite or choose another directory")
    name, args, sources = hf_native_sources(hf_dir)
    placeholders = {key: placeholder(source) for key, source in sources.items()}
    planner = SourcesSavePlanner({f"model.{key}": source for key, source in sources.items()})
    saved = ckpt.save(0, {"step": 0, "model": placeholders, "model_name": name, "model_args": dataclasses.asdict(args),
                          "base_weights": {"hf_dir": str(Path(hf_dir).absolute())}}, planner=planner)
    tokenizer = Path(hf_dir) / "tokenizer.json"
    if tokenizer.is_file():  # beside the checkpoints: a run started from them finds it (run/setup.py)
        for source in tokenizer_files(tokenizer):
            shutil.copyfile(source, Path(checkpoint_dir) / source.name)
    return saved


def checkpoint_to_peft(checkpoint: str | Path, out_dir: str | Path, *, overwrite: bool = False,
                       base_model: str | None = None, log: Callable[[str], None] = print) -> Path:
    """Export a LoRA run's adapters as a peft adapter directory (adapter_config.json and
    adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads onto the base model.
    Its base_model_name_or_path is `base_model` when given, else the Hugging Face directory the run
    started from (the checkpoint records it), so `peft.AutoPeftModelForCausalLM` loads the adapter
    by itself; when the run had no such base, one line through `log` says why it is left empty."""
    from safetensors.torch import save_file

    from titan_tpu.files import usual_permissions
    from titan_tpu.models.lora import is_adapter_key
    from titan_tpu.models.spec import checkpoint_spec

    step_dir = resolve_checkpoint(checkpoint)
    meta = read_checkpoint_meta(step_dir)
    lora = meta.get("lora")
    if not lora:
        raise ValueError(f"--to-peft: checkpoint {step_dir} holds no LoRA adapters (trained without lora.enabled); "
                         "export the model with --to-hf DIR")
    out_dir = Path(out_dir)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} already exists and is not empty; pass --overwrite or choose another "
                              "directory")
    spec = checkpoint_spec(meta["model_name"], meta["model_args"])
    state_dict = load_full_state_dict(step_dir)
    adapters = spec.hf_adapters({k: v for k, v in state_dict.items() if is_adapter_key(k)})
    # peft's names: base_model.model.<module>.lora_A.weight; its target_modules regex names each layer.
    tensors = {f"base_model.model.{name}.weight": t.float().contiguous() for name, t in adapters.items()}
    modules = sorted({name.rpartition(".")[0] for name in adapters})
    if base_model is None:
        base_model, why_not = _recorded_base(meta, step_dir)
        if why_not:
            log(f"note: {why_not}")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["rank"], "lora_alpha": lora["alpha"],
              "lora_dropout": lora["dropout"], "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "target_modules": "|".join(re.escape(m) for m in modules), "base_model_name_or_path": base_model}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    usual_permissions(out_dir)
    return out_dir


def hub_id_of_cached(hf_dir: Path) -> str | None:
    """The Hub id of a directory in the Hugging Face cache (.../models--ORG--NAME/snapshots/REVISION),
    as peft and transformers name a model they downloaded; None for any other directory."""
    snapshots, repo = hf_dir.parent, hf_dir.parent.parent
    if snapshots.name != "snapshots" or not repo.name.startswith("models--"):
        return None
    return repo.name.removeprefix("models--").replace("--", "/")


def _recorded_base(meta: dict, step_dir: Path) -> tuple[str | None, str]:
    """(the base a LoRA checkpoint's adapters adapt, as peft names it, or None; why it is None)."""
    if "base_weights" not in meta:  # written before checkpoints recorded their base
        return None, (f"checkpoint {step_dir} does not record the model its adapters adapt; base_model_name_or_path "
                      "is left empty: pass --base-model with the Hugging Face directory (or Hub id) of that base")
    base = meta["base_weights"]
    if base is None:
        return None, ("the adapters were trained on a randomly initialised model (the run had no "
                      "checkpoint.initial_load_path and no Hugging Face weights), so they adapt no pretrained base; "
                      "base_model_name_or_path is left empty")
    if "hf_dir" in base:
        hub_id = hub_id_of_cached(Path(base["hf_dir"]))
        if hub_id:
            return hub_id, ""
        return base["hf_dir"], (f"base_model_name_or_path is the local directory {base['hf_dir']}, which loads on this "
                                "machine only: to share the adapter, export with --base-model ORG/NAME, the Hub id "
                                "that directory holds")
    return None, (f"the adapters' base is the training checkpoint {base['checkpoint']}, which peft cannot load: export "
                  f"it with titan-tpu convert --checkpoint {base['checkpoint']} --to-hf DIR and pass --base-model DIR")
