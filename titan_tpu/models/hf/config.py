"""Reading a Hugging Face model's config: a directory's config.json or a causal-LM model type,
with `--model.hf_overrides`; `HFArgs`, what identifies an HF-backend model in the trainer and its
checkpoints; and the few facts the other parts of the backend read from a config (the model
class, the MoE shape, a logit transformation)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from pathlib import Path
from typing import Any


def causal_lm_types() -> list[str]:
    """The `model_type`s of transformers' causal-LM auto mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def parse_overrides(text: str) -> dict[str, Any]:
    """``'{"hidden_size": 64}'`` or ``hidden_size=64,num_hidden_layers=2`` -> a dict (values as JSON
    where they parse, else strings)."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"model.hf_overrides is not valid JSON ({e}); write e.g. "
                             "'{\"hidden_size\": 64}' or hidden_size=64,num_hidden_layers=2") from None
        if not isinstance(value, dict):
            raise ValueError("model.hf_overrides must be a JSON object, e.g. '{\"hidden_size\": 64}'")
        return value
    out = {}
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"model.hf_overrides item {item!r} is not key=value; write e.g. "
                             "hidden_size=64,num_hidden_layers=2")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def text_config(config):
    """The config of the language model inside a composite config (itself for a plain one): what
    AutoModelForCausalLM builds. MusicGen has two text configs; its decoder is the language model."""
    try:
        return config.get_text_config()
    except ValueError:  # several text configs (MusicGen: text_encoder and decoder)
        return config.get_text_config(decoder=True)


def _has(config, key: str) -> bool:
    """Whether `config` has `key`; per-layer attributes of heterogeneous configs (Gemma 4) refuse a
    global read but are keys all the same."""
    try:
        return hasattr(config, key)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError
        return key in config.to_dict()


def _cut_per_layer(values: dict, old_layers: int, new_layers: int) -> dict:
    """The entries of a config dict that describe each of its `old_layers` layers, for
    `new_layers` layers: per-layer lists cut (or repeated) and {layer index: ...} tables cut.
    `id2label` is keyed by label index, not layer, and is left alone."""
    cut = {}
    for key, value in values.items():
        if isinstance(value, list) and len(value) == old_layers:
            cut[key] = (value * new_layers)[:new_layers]
        elif (isinstance(value, dict) and value and key != "id2label"
              and all(str(k).isdigit() for k in value)):
            cut[key] = {k: v for k, v in value.items() if int(k) < new_layers}
    return cut


def load_hf_config(spec: str, overrides: dict[str, Any] | None = None):
    """A transformers config from a model directory (its config.json) or a causal-LM model type,
    with `overrides` applied (to the text config of composite models). One-line errors for a
    directory without config.json, an unknown type (with close names) and a config that is neither
    a causal LM nor a vision-language model of models/hf/vision.py."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not spec:
        raise ValueError("model.name = hf needs --model.hf_config: a Hugging Face model directory or a model type "
                         "such as llama, qwen3, gemma3_text")
    from huggingface_hub.errors import StrictDataclassError

    path = Path(spec).expanduser()
    given, overrides = dict(overrides or {}), dict(overrides or {})
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.hf_config {path} has no config.json; point at a Hugging Face model "
                                    "directory (config.json, *.safetensors)")
        from titan_tpu.models.hub.checkpoint import read_hf_config_json

        read_hf_config_json(path / "config.json")  # a damaged file: one line, not transformers' traceback
        make = functools.partial(AutoConfig.from_pretrained, str(path))
    elif "/" in spec or spec.startswith("."):
        raise FileNotFoundError(f"model.hf_config {spec} is not a directory; give a Hugging Face model directory or a "
                                "model type such as llama")
    else:
        types = causal_lm_types()
        if spec not in types:
            close = difflib.get_close_matches(spec, types, n=5, cutoff=0.5)
            hint = f"close names: {', '.join(close)}" if close else "titan-tpu hf-sweep --list shows them all"
            raise ValueError(f"model.hf_config {spec!r} is not a causal-LM model type of transformers; {hint}")
        make = functools.partial(AutoConfig.for_model, spec)
    try:
        config = make()
        # Overrides go through the constructor, so values derived from them (per-layer lists such
        # as layer_types) follow, and so do the model's own checks; keys of a composite model's
        # text config go to that config, which goes to the constructor as a dict.
        text = text_config(config)
        text_keys = {} if text is config else {
            k: overrides.pop(k) for k in list(overrides) if not _has(config, k) and _has(text, k)}
        if layers := overrides.get("num_hidden_layers"):
            per_layer = _cut_per_layer(config.to_dict(), getattr(config, "num_hidden_layers", -1), layers)
            for key, value in per_layer.items():
                overrides.setdefault(key, value)
        if text_keys:
            text_dict = text.to_dict()
            text_dict.update(text_keys)
            if layers := text_keys.get("num_hidden_layers"):
                text_dict.update(_cut_per_layer(text_dict, text.num_hidden_layers, layers))
            name = next(k for k, v in vars(config).items() if v is text)  # text_config, decoder, ...
            overrides[name] = text_dict
        config = make(**overrides) if overrides else config
    except (ValueError, TypeError, KeyError, StrictDataclassError) as e:
        # StrictDataclassError: a config's own validate_architecture (its cause is the last line)
        last = str(e).strip().splitlines()
        raise ValueError(f"model.hf_config {spec} with model.hf_overrides {given} is not a valid config: "
                         f"{last[-1].strip() if last else type(e).__name__}") from None
    from titan_tpu.models.hf.vision import is_vision_language, unsupported_vision_error

    if (error := unsupported_vision_error(config)) is not None:
        raise error
    if not is_vision_language(config) and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model.hf_config {spec}: model_type {config.model_type!r} is not a causal LM in transformers "
                         "(AutoModelForCausalLM cannot build it); train a decoder-only language model")
    return config


@dataclasses.dataclass
class HFArgs:
    """What identifies an HF-backend model in the trainer and its checkpoints (the dense/MoE
    `TransformerArgs` role): the spec given, and the resolved config as a dict."""

    hf_config: str
    config: dict
    vocab_size: int
    max_seq_len: int
    moe: None = None  # our MoE machinery (expert parallelism, expert bias) does not apply

    def transformers_config(self):
        from transformers import AutoConfig

        config = dict(self.config)
        return AutoConfig.for_model(config.pop("model_type"), **config)


def hf_args_from_spec(spec: str, overrides_text: str = "") -> HFArgs:
    return hf_args_from_config(load_hf_config(spec, parse_overrides(overrides_text)), spec)


def hf_args_from_config(config, spec: str = "") -> HFArgs:
    text = text_config(config)
    max_len = getattr(text, "max_position_embeddings", None) or 1 << 20
    # to_dict, not to_json_string: the latter spells infinities as {"__float__": "Infinity"}.
    return HFArgs(hf_config=spec or config.model_type, config=json.loads(json.dumps(config.to_dict(), default=str)),
                  vocab_size=int(text.vocab_size), max_seq_len=int(max_len))


def _model_class(config) -> type:
    """The class `auto_model_class(config)` builds for `config`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    from titan_tpu.models.hf.vision import is_vision_language

    if is_vision_language(config):
        return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def auto_model_class(config) -> type:
    """AutoModelForImageTextToText for a vision-language config (its vision tower included; Gemma 3's
    causal-LM class is the same one), else AutoModelForCausalLM, which reduces a composite config
    to its text model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from titan_tpu.models.hf.vision import is_vision_language

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def _moe_shape(text_config) -> tuple[int, int] | None:
    """(experts, experts per token) of an MoE config; None for a dense one."""
    num_experts = (getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)
                   or getattr(text_config, "n_routed_experts", None))
    top_k = getattr(text_config, "num_experts_per_tok", None)
    ffn = getattr(text_config, "ffn_config", None)  # DBRX keeps them in a sub-config
    if ffn is not None and not (num_experts and top_k):
        num_experts, top_k = getattr(ffn, "moe_num_experts", None), getattr(ffn, "moe_top_k", None)
    return (int(num_experts), int(top_k)) if num_experts and top_k else None


def _logit_transform(text_config) -> str | None:
    """The config key of a transformation the model applies to its logits (soft-capping, a scale,
    a multiplier), if any."""
    for key, value in text_config.to_dict().items():
        names_logits = "logit" in key and not key.startswith(("attn", "attention", "router"))
        names_head = "multiplier" in key and ("lm_head" in key or "output" in key or "logit" in key)
        if (names_logits or names_head) and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and value not in (0, 1):
            return key
    return None
