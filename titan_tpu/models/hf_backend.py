"""The Transformers backend: train any Hugging Face causal LM through the project's model contract.

``--model.name hf --model.hf_config DIR_OR_TYPE`` builds the model that transformers' own modeling
code defines (`AutoModelForCausalLM.from_config`, so composite configs reduce to their text model as
transformers does) and wraps it in `HFCausalLM`, which speaks the contract the trainer, SimpleFSDP,
the graph trainer and checkpoints use for native models::

    model(tokens_BS)                          -> logits [B, S, V]
    model(tokens_BS, labels_BS, positions_BS) -> LossOutput(ce_sum, aux_loss, expert_load)
    init_plan() / init_weights() / init_buffers(device)     (meta build, sharded init)

What the wrapper adds to the HF model:

* Attention through our kernel registry: an attention function registered with transformers'
  `AttentionInterface` under the name "titan_tpu" (with a mask function in `AttentionMaskInterface`
  that leaves causal and document masks to us, sdpa's masks otherwise). It runs our `attention`
  kernel for causal (and document-masked)
  attention and hands everything it does not cover (sliding windows, soft-capping, attention sinks,
  dropout, non-causal modules, other masks) to transformers' own sdpa function. Models that do not
  route attention through the interface keep their own.
* Loss through our chunked loss kernel when the model's logits are exactly its output embedding
  applied to its base model's last hidden state (checked numerically once, after initialisation:
  models that scale, soft-cap or bias their logits fail the check and use their own logits).
* Document masks: with packed documents the per-token positions go to the model as `position_ids`
  (RoPE restarts per document) and the document ids to our attention kernel.
* Activation checkpointing per decoder layer (the classes in `_no_split_modules`).
* Experts through our `grouped_mm` kernel: transformers' `ExpertsInterface` where the model uses it,
  else a static-shape form of the model's own experts class (`GRAPH_SAFE_FORWARDS`: DBRX,
  LongCat-Flash, whose loops over `nonzero()` graph capture cannot trace).
* Meta-device build: parameters are created on the meta device while buffers are computed for real
  (non-persistent buffers such as RoPE `inv_freq` are neither initialised nor loaded after
  `to_empty`, a known trap); their values are kept and restored by `init_buffers`. Small
  parameters keep their construction values too (a learned activation's scalars set in
  `__init__` that the model's `_init_weights` does not touch); the model's own init runs after.

Parameter names are the HF model's own, under the prefix ``hf_model.``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titan_tpu.files import usual_permissions
from titan_tpu.kernels import KernelConfig, document_ids_from_positions
from titan_tpu.models.common.activation_checkpoint import checkpointed
from titan_tpu.models.common.transformer import LossOutput
from titan_tpu.tensors import copy_full_

__all__ = ["ATTENTION_NAME", "HFArgs", "HFCausalLM", "build_hf_model", "export_hf", "hf_args_from_config",
           "hf_args_from_spec", "hf_flops_per_token", "load_hf_config", "load_pretrained_weights"]

ATTENTION_NAME = "titan_tpu"
PREFIX = "hf_model."

# Set by HFCausalLM.forward for the attention function below: the kernels to use and the
# document ids of the batch (None for plain causal windows).
_CALL_CONTEXT: contextvars.ContextVar[tuple[KernelConfig, torch.Tensor | None] | None] = contextvars.ContextVar(
    "titan_tpu_hf_call", default=None)


# ---------------------------------------------------------------------------------------------
# Configs: a directory or a model type, with overrides
# ---------------------------------------------------------------------------------------------


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
    directory without config.json, an unknown type (with close names) and a config that is not a
    causal LM."""
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
        from titan_tpu.models.hf_checkpoint import read_hf_config_json

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
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
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


# ---------------------------------------------------------------------------------------------
# Attention through the kernel registry
# ---------------------------------------------------------------------------------------------


def _titan_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, S, D], key/value [B, K, S, D] ->
    ([B, S, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("sparse_indices") is not None:
        raise NotImplementedError(f"{type(module).__name__} passes sparse_indices (a sparse-attention indexer); the "
                                  "titan_tpu attention does not apply them; build such a model with sdpa attention")
    context = _CALL_CONTEXT.get()
    document_ids = context[1] if context is not None else None
    plain_causal = (
        context is not None and not dropout and getattr(module, "is_causal", True)
        and kwargs.get("sliding_window") is None and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None and kwargs.get("sinks") is None and kwargs.get("position_bias") is None
        and query.shape[2] == key.shape[2] and query.shape[1] % key.shape[1] == 0
        # A mask without documents is something other than causal (e.g. chunked attention).
        and (attention_mask is None or document_ids is not None)
    )
    if not plain_causal:
        if attention_mask is None and document_ids is not None:
            attention_mask = _document_mask(query, document_ids)  # our mask function left it to us
        if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
            # Features sdpa lacks: the model's own eager attention (its modeling module defines one).
            eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if eager is not None:
                mask = _additive_mask(attention_mask, query, document_ids, getattr(module, "is_causal", True))
                return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kernels = context[0]
    head_dim = query.shape[-1]
    if scaling is not None and scaling != head_dim**-0.5:
        query = query * (scaling * head_dim**0.5)  # our kernels scale by 1/sqrt(D)
    impl = kernels.attention_impl(query.device.type, documents=document_ids is not None)
    out_BSHD = impl.fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), document_ids)
    return out_BSHD, None


def _grouped_experts(hidden_TD: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor, *,
                     num_experts: int,
                     expert_ffn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Mixture of experts with static shapes: the token-expert pairs sorted by expert (stable
    argsort), `expert_ffn(x_ND, group_sizes_E)` on the sorted rows (grouped matmuls), weighted, back
    in token order and summed over k as transformers does. Group sizes come from scatter_add, never
    from `nonzero`, so graph mode captures it."""
    T, K = top_k_index_TK.shape
    expert_N = top_k_index_TK.reshape(-1)
    order_N = torch.argsort(expert_N, stable=True)
    group_sizes_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_N.device).scatter_add(
        0, expert_N, torch.ones_like(expert_N))
    y_ND = expert_ffn(hidden_TD[order_N // K], group_sizes_E)
    y_ND = y_ND * top_k_weights_TK.reshape(-1)[order_N].unsqueeze(-1)
    inverse_N = torch.argsort(order_N)
    return y_ND[inverse_N].view(T, K, -1).sum(dim=1).to(hidden_TD.dtype)


def _grouped_mm() -> Callable:
    context = _CALL_CONTEXT.get()
    kernels = context[0] if context is not None else KernelConfig()
    return kernels.grouped_mm_fn


def _titan_experts(module: nn.Module, hidden_TD: torch.Tensor, top_k_index_TK: torch.Tensor,
                   top_k_weights_TK: torch.Tensor) -> torch.Tensor:
    """transformers' experts contract (stacked expert weights, one routing per token) through our
    `grouped_mm` kernel (`_grouped_experts`), which graph mode captures in fp32; transformers' own
    grouped_mm path cannot (its fake kernel demands bf16). Variants it does not cover (expert
    parallel sentinels, biases) use transformers' batched_mm form."""
    from transformers.integrations.moe import batched_mm_experts_forward

    if getattr(module, "_is_expert_parallel", False) or getattr(module, "has_bias", False):
        return batched_mm_experts_forward(module, hidden_TD, top_k_index_TK, top_k_weights_TK)
    grouped_mm = _grouped_mm()(hidden_TD.device.type)

    def as_EDF(weight: torch.Tensor) -> torch.Tensor:  # HF stores [E, out, in] unless transposed
        return weight if module.is_transposed else weight.transpose(1, 2)

    def expert_ffn(x_ND: torch.Tensor, group_sizes_E: torch.Tensor) -> torch.Tensor:
        if module.has_gate:
            h_NF = module._apply_gate(grouped_mm(x_ND, as_EDF(module.gate_up_proj), group_sizes_E))
        else:
            h_NF = module.act_fn(grouped_mm(x_ND, as_EDF(module.up_proj), group_sizes_E))
        y_ND = grouped_mm(h_NF, as_EDF(module.down_proj), group_sizes_E)
        if getattr(module, "has_post_expert_norm", False):
            y_ND = module.post_expert_norm(y_ND)
        return y_ND

    return _grouped_experts(hidden_TD, top_k_index_TK, top_k_weights_TK, num_experts=module.num_experts,
                            expert_ffn=expert_ffn)


def _dbrx_experts(module: nn.Module, hidden_states: torch.Tensor, top_k_index_TK: torch.Tensor,
                  top_k_weights_TK: torch.Tensor) -> torch.Tensor:
    """`DbrxExperts.forward` (a loop over `nonzero()`'s experts) with static shapes: its weights
    `mlp.w1`, `mlp.v1`, `mlp.w2` [E * F, D] viewed per expert, the same gated MLP
    (act(x w1^T) * (x v1^T)) w2, through `_grouped_experts`."""
    mlp, E, F_, D = module.mlp, module.num_experts, module.ffn_hidden_size, module.hidden_size
    grouped_mm = _grouped_mm()(hidden_states.device.type)
    w1_EDF = mlp.w1.view(E, F_, D).transpose(1, 2)
    v1_EDF = mlp.v1.view(E, F_, D).transpose(1, 2)
    w2_EFD = mlp.w2.view(E, F_, D)

    def expert_ffn(x_ND: torch.Tensor, group_sizes_E: torch.Tensor) -> torch.Tensor:
        h_NF = mlp.activation_fn(grouped_mm(x_ND, w1_EDF, group_sizes_E)) * grouped_mm(x_ND, v1_EDF, group_sizes_E)
        return grouped_mm(h_NF, w2_EFD, group_sizes_E)

    out_TD = _grouped_experts(hidden_states.reshape(-1, D), top_k_index_TK, top_k_weights_TK, num_experts=E,
                              expert_ffn=expert_ffn)
    return out_TD.view(hidden_states.shape[0], -1, D)


def _longcat_flash_experts(module: nn.Module, hidden_TD: torch.Tensor, top_k_index_TK: torch.Tensor,
                           top_k_weights_TK: torch.Tensor) -> torch.Tensor:
    """`LongcatFlashExperts.forward` (a loop over `nonzero()`'s experts) with static shapes: routed
    experts 0..R-1 through grouped_mm (`gate_up_proj` [R + Z, 2I, D], whose zero-expert rows are
    unused, and `down_proj` [R, D, I]); the Z zero-computation experts after them are the identity.
    Sorted by expert, the zero experts' rows come last, past the routed groups, where grouped_mm
    gives zeros; those rows take the identity instead."""
    R = module.num_routed_experts
    if R == 0 or module.gate_up_proj is None:
        return (hidden_TD.unsqueeze(1) * top_k_weights_TK.unsqueeze(-1)).sum(dim=1).to(hidden_TD.dtype)
    grouped_mm = _grouped_mm()(hidden_TD.device.type)
    gate_up_EDF = module.gate_up_proj[:R].transpose(1, 2)
    down_EFD = module.down_proj.transpose(1, 2)

    def expert_ffn(x_ND: torch.Tensor, group_sizes_E: torch.Tensor) -> torch.Tensor:
        gate_NF, up_NF = grouped_mm(x_ND, gate_up_EDF, group_sizes_E[:R]).chunk(2, dim=-1)
        y_ND = grouped_mm(module.act_fn(gate_NF) * up_NF, down_EFD, group_sizes_E[:R])
        routed_N = torch.arange(x_ND.shape[0], device=x_ND.device) < group_sizes_E[:R].sum()
        return torch.where(routed_N.unsqueeze(-1), y_ND, x_ND)

    return _grouped_experts(hidden_TD, top_k_index_TK, top_k_weights_TK, num_experts=module.total_experts,
                            expert_ffn=expert_ffn)


# Graph-safe forwards for modules of models that do not reach their experts through transformers'
# ExpertsInterface, keyed by class name: the same parameters (names and layouts unchanged) and the
# same math with static shapes. They replace the forward of our wrapped instances only (as
# activation checkpointing does); transformers' classes stay untouched, so verify's numerics check
# compares each form against the unmodified model. A new entry needs a verify test (graph and
# numerics) in tests/test_verify.py.
GRAPH_SAFE_FORWARDS: dict[str, Callable[..., torch.Tensor]] = {
    "DbrxExperts": _dbrx_experts,
    "LongcatFlashExperts": _longcat_flash_experts,
}


def _use_graph_safe_forwards(hf_model: nn.Module) -> list[str]:
    """Bind GRAPH_SAFE_FORWARDS to the model's modules of those classes; the class names used."""
    used = set()
    for module in hf_model.modules():
        form = GRAPH_SAFE_FORWARDS.get(type(module).__name__)
        if form is not None:
            module.forward = functools.partial(form, module)
            used.add(type(module).__name__)
    return sorted(used)


def _document_mask(query: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
    """Boolean [B or 1, 1, S, S]: causal, and within each document when there are documents."""
    from titan_tpu.kernels.attention import allowed_BSS

    return allowed_BSS(query.shape[2], document_ids, query.device).unsqueeze(1)


def _titan_mask(*args, attention_mask: torch.Tensor | None = None, local_size: int | None = None, **kwargs):
    """The mask function of our attention name: None (causal, and the documents of the batch,
    which our attention reads from the call context) when there is no padding mask and no local
    window; sdpa's boolean mask otherwise. sdpa's own function never skips while tracing (it
    cannot tell packed position ids from plain ones then), which would leave graph mode without
    our kernels."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and local_size is None and _CALL_CONTEXT.get() is not None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, local_size=local_size, **kwargs)


def _additive_mask(attention_mask: torch.Tensor | None, query: torch.Tensor, document_ids: torch.Tensor | None,
                   causal: bool) -> torch.Tensor | None:
    """The masks of our attention name are sdpa's (boolean, or None where is_causal will do); an
    eager attention function adds a float mask and applies no causality of its own."""
    if attention_mask is None:
        if not causal:
            return None
        attention_mask = _document_mask(query, document_ids)
    if attention_mask.dtype != torch.bool:
        return attention_mask
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    return torch.where(attention_mask, zero, torch.finfo(query.dtype).min)


@functools.cache
def register_attention() -> None:
    """Make "titan_tpu" a transformers attention and experts implementation (once per process)."""
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _titan_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _titan_mask)
    ExpertsInterface.register(ATTENTION_NAME, _titan_experts)


# ---------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------


# Parameters up to this size keep the value their module's __init__ gave them (see below).
_KEEP_INIT_VALUE_NUMEL = 1 << 16


@contextlib.contextmanager
def _parameters_on_meta(kept: dict[int, torch.Tensor]) -> Iterator[None]:
    """Inside: every registered parameter moves to the meta device; buffers stay real. Constructing
    a model then costs no parameter memory (one parameter at a time, transiently), and buffers
    computed in `__init__` (RoPE tables) keep their values. Small parameters' construction values
    go into `kept` (by id of the meta parameter): some modules set a parameter in `__init__` (a
    learned activation's scalars, a norm's offset) that the model's `_init_weights` never touches."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            if param.numel() <= _KEEP_INIT_VALUE_NUMEL:
                kept[id(meta)] = param.detach().clone()
            module._parameters[name] = meta

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class HFCausalLM(nn.Module):
    """A transformers causal LM under the project's model contract (see the module docstring)."""

    def __init__(self, hf_model: nn.Module, *, ac_mode: str = "none", kernels: KernelConfig | None = None,
                 init_values: dict[int, torch.Tensor] | None = None):
        super().__init__()
        self.hf_model = hf_model
        # Construction values of small parameters by name, restored before the model's own init.
        by_id = init_values or {}
        # Frozen parameters (requires_grad=False, e.g. a router's expert bias that the model moves
        # outside the gradient) become persistent buffers under the same names: the optimizer and
        # the captured step train parameters only, and state dicts keep their names.
        frozen = {}
        for module_name, module in hf_model.named_modules():
            for name, param in list(module._parameters.items()):
                if param is not None and not param.requires_grad:
                    full_name = f"{module_name}.{name}" if module_name else name
                    value = by_id.get(id(param))
                    frozen[full_name] = value if value is not None else torch.zeros(param.shape, dtype=param.dtype)
                    del module._parameters[name]
                    module.register_buffer(name, param.detach())
        self._param_init_values = {name: by_id[id(p)] for name, p in hf_model.named_parameters() if id(p) in by_id}
        self.kernels = kernels or KernelConfig()
        self.scan_layers = False
        # Buffer values as computed at construction, restored after to_empty (init_buffers).
        self._buffer_values = {name: b.detach().clone() for name, b in hf_model.named_buffers()}
        self._buffer_values.update(frozen)
        self.use_chunked_loss = False  # decided by check_chunked_loss() once the weights are real
        self.graph_safe_forwards = _use_graph_safe_forwards(hf_model)
        self.decoder_layers = _decoder_layers(hf_model)
        if ac_mode != "none":
            for layer in self.decoder_layers:
                _checkpoint_forward(layer, ac_mode)
        text = text_config(hf_model.config)
        self._router = _router_settings(text)

    # --- the init contract (parallel/simple_fsdp.materialize_and_init) -----------------------

    def init_plan(self) -> list[tuple[str, nn.Module, Callable[[], None]]]:
        # One piece: transformers' init walks the whole model (composite models dispatch per
        # sub-model), so a rank materialises the model at full size once while initialising.
        return [("hf_model", self.hf_model, self._init_hf_weights)]

    @torch.no_grad()
    def _init_hf_weights(self) -> None:
        model = self.hf_model
        for module in model.modules():  # init runs only on modules not yet marked initialised
            module.__dict__.pop("_is_hf_initialized", None)
        self.init_buffers()  # rotary inits read them; restore first
        for name, value in self._param_init_values.items():
            model.get_parameter(name).copy_(value)
        model.initialize_weights()
        model.tie_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        self._init_hf_weights()
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = next(self.parameters()).device
        for name, value in self._buffer_values.items():
            owner, _, leaf = name.rpartition(".")
            module = self.hf_model.get_submodule(owner) if owner else self.hf_model
            module._buffers[leaf] = value.to(device)

    # --- checkpoint layout hooks (identity: no stacked layers) ----------------------------------

    def stacked_parameter_names(self) -> set[str]:
        return set()

    def to_per_layer(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(named)

    def from_per_layer(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(named)

    def expert_bias_names(self) -> list[str]:
        return []  # transformers' routers move their own biases, if any, outside the gradient

    def updated_expert_biases(self, biases: dict[str, torch.Tensor],
                              expert_load_LE: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    # --- forward ------------------------------------------------------------------------------

    def _model_kwargs(self, tokens_BS: torch.Tensor, positions_BS: torch.Tensor | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"input_ids": tokens_BS, "use_cache": False}
        if positions_BS is not None:
            kwargs["position_ids"] = positions_BS
        if self._router is not None:
            kwargs["output_router_logits"] = True
        return kwargs

    def forward(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor | None = None, *,
                positions_BS: torch.Tensor | None = None) -> torch.Tensor | LossOutput:
        document_ids = None if positions_BS is None else document_ids_from_positions(positions_BS)
        token = _CALL_CONTEXT.set((self.kernels, document_ids))
        try:
            kwargs = self._model_kwargs(tokens_BS, positions_BS)
            if labels_BS is None:
                return self.hf_model(**kwargs).logits
            if self.use_chunked_loss:
                out = self.hf_model.base_model(**kwargs)
                h_BSD = out[0]
                loss_fn = self.kernels.loss_fn(h_BSD.device.type)
                w_VD = self.hf_model.get_output_embeddings().weight
                ce_sum = loss_fn(h_BSD.flatten(0, 1), w_VD, labels_BS.flatten())
            else:
                out = self.hf_model(**kwargs)
                ce_sum = F.cross_entropy(out.logits.flatten(0, 1).float(), labels_BS.flatten(), ignore_index=-100,
                                         reduction="sum")
            aux = self._aux_loss(out, ce_sum)
            return LossOutput(ce_sum, aux, ce_sum.new_zeros(0, 0))
        finally:
            _CALL_CONTEXT.reset(token)

    def _aux_loss(self, out, ce_sum: torch.Tensor) -> torch.Tensor:
        """The MoE load-balancing loss, coefficient applied, as transformers computes it."""
        router_logits = getattr(out, "router_logits", None)
        if self._router is None or router_logits is None or len(router_logits) == 0:
            return ce_sum.new_zeros(())
        balancing_loss, num_experts, top_k, coef = self._router
        # In fp32 whatever the compute dtype, as transformers' routers take their softmax in fp32.
        router_logits = (router_logits.float() if isinstance(router_logits, torch.Tensor)
                         else tuple(t.float() for t in router_logits))
        aux = balancing_loss(router_logits, num_experts=num_experts, top_k=top_k, attention_mask=None)
        return coef * aux.to(ce_sum.dtype)

    @torch.no_grad()
    def check_chunked_loss(self, vocab_size: int) -> bool:
        """Use the loss kernel when logits == output_embeddings(base_model(x)[0]) for this model;
        decided on a small real batch (all ranks run it together under data parallelism)."""
        output = self.hf_model.get_output_embeddings()
        base = getattr(self.hf_model, "base_model", None)
        self.use_chunked_loss = False
        if not isinstance(output, nn.Linear) or output.bias is not None or base is None or base is self.hf_model:
            return False
        if _logit_transform(text_config(self.hf_model.config)):
            return False  # e.g. soft-capping: too close to identity at init for the check below to see
        device = next(self.parameters()).device
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab_size, (1, 8), generator=generator).to(device)
        token = _CALL_CONTEXT.set((self.kernels, None))
        try:
            kwargs = self._model_kwargs(tokens, None)
            logits = self.hf_model(**kwargs).logits.float()
            hidden = base(**kwargs)[0]
            if not isinstance(hidden, torch.Tensor) or hidden.shape[:2] != tokens.shape:
                return False
            ours = F.linear(hidden, output.weight).float()
        except Exception:  # a model whose base model cannot be called alone keeps its own logits
            return False
        finally:
            _CALL_CONTEXT.reset(token)
        self.use_chunked_loss = bool(torch.allclose(ours, logits, rtol=1e-4, atol=1e-4))
        return self.use_chunked_loss


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


def _decoder_layers(hf_model: nn.Module) -> list[nn.Module]:
    """The decoder layers: instances of the classes the model names in `_no_split_modules`."""
    names = set(getattr(hf_model, "_no_split_modules", None) or [])
    return [m for m in hf_model.modules() if type(m).__name__ in names]


def _checkpoint_forward(layer: nn.Module, mode: str) -> None:
    """Activation checkpointing of one decoder layer, whatever its forward's signature: the
    keyword arguments ride along in a closure (non-reentrant checkpointing and the traced tagger
    both handle tensors reached that way)."""
    forward = layer.forward

    def checkpointed_forward(*args, **kwargs):
        return checkpointed(functools.partial(forward, **kwargs), mode)(*args)

    layer.forward = checkpointed_forward


def _moe_shape(text_config) -> tuple[int, int] | None:
    """(experts, experts per token) of an MoE config; None for a dense one."""
    num_experts = (getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)
                   or getattr(text_config, "n_routed_experts", None))
    top_k = getattr(text_config, "num_experts_per_tok", None)
    ffn = getattr(text_config, "ffn_config", None)  # DBRX keeps them in a sub-config
    if ffn is not None and not (num_experts and top_k):
        num_experts, top_k = getattr(ffn, "moe_num_experts", None), getattr(ffn, "moe_top_k", None)
    return (int(num_experts), int(top_k)) if num_experts and top_k else None


def _router_settings(text_config) -> tuple[Callable, int, int, float] | None:
    """(load_balancing_loss_func, experts, top_k, coefficient) for MoE models whose config asks for
    the balancing loss and whose modeling module defines it in the common form; None otherwise."""
    import importlib

    num_experts, top_k = _moe_shape(text_config) or (None, None)
    coef = getattr(text_config, "router_aux_loss_coef", None)
    # As transformers trains: the balancing loss only when the config asks for router logits
    # (output_router_logits, false in most published configs; --model.hf_overrides turns it on).
    if not (num_experts and top_k and coef) or not getattr(text_config, "output_router_logits", False):
        return None
    try:
        model_type = text_config.model_type
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return None
    balancing_loss = getattr(module, "load_balancing_loss_func", None)
    if balancing_loss is None:
        return None
    import inspect

    try:  # the common form (Mixtral, Qwen-MoE, ...); other forms are not called
        inspect.signature(balancing_loss).bind((), num_experts=1, top_k=1, attention_mask=None)
    except TypeError:
        return None
    return balancing_loss, int(num_experts), int(top_k), float(coef)


def _model_class(config) -> type:
    """The class AutoModelForCausalLM builds for `config`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


# Models that build their attention mask from the mask function's output, so they need the
# materialised causal mask our mask function leaves out (None: "causal, use the kernel").
_KEEP_SDPA = {
    "doge": "adds its learned dynamic mask (dt_states) to the causal mask it is given",
}


def _has_sparse_indexer(text) -> bool:
    """Whether some layer selects its keys with an indexer that reads the attention mask (DeepSeek
    V3.2's index_topk, Qwen4-Exp's indexer_budget, layers named "indexed_attention")."""
    layer_types = getattr(text, "layer_types", None) or []
    return bool(getattr(text, "index_topk", None) or getattr(text, "indexer_budget", None)
                or "indexed_attention" in layer_types)


def _attention_implementation(model_class: type) -> str:
    """Our attention where the model looks attention functions up by name (AttentionInterface);
    sdpa where it picks an attention class from a fixed table of its own (Falcon's
    FALCON_ATTENTION_CLASSES), which has no entry for ours; its own eager attention where it does not
    support sdpa (our attention speaks sdpa's mask convention, where None may mean causal)."""
    if not getattr(model_class, "_supports_sdpa", False):
        return "eager"
    module = sys.modules[model_class.__module__]
    tables = [v for k, v in vars(module).items() if k.endswith("ATTENTION_CLASSES") and isinstance(v, dict)]
    return "sdpa" if any(ATTENTION_NAME not in table for table in tables) else ATTENTION_NAME


def build_hf_model(args: HFArgs, *, kernels: KernelConfig | None = None, ac_mode: str = "none",
                   dtype: torch.dtype = torch.float32) -> HFCausalLM:
    """The wrapped model with parameters on the meta device (buffers real): materialise and
    initialise it with `parallel.simple_fsdp.materialize_and_init` (one device or sharded)."""
    from transformers import AutoModelForCausalLM

    register_attention()
    config = args.transformers_config()
    # transformers' own switches; sub-configs (the text model of a composite) follow.
    attention = _attention_implementation(_model_class(config))
    if config.model_type in _KEEP_SDPA:
        attention = "sdpa"
    if _has_sparse_indexer(text_config(config)) and attention == ATTENTION_NAME:
        # A sparse-attention indexer (DeepSeek V3.2, GLM-MoE-DSA) folds its top-k selection into
        # the mask for eager and sdpa only; any other implementation gets `sparse_indices` to apply
        # itself, which our kernels do not: such models keep sdpa (or eager, where sdpa is not
        # supported: DeepSeek V4).
        attention = "sdpa"
    for target in {id(c): c for c in (config, text_config(config))}.values():
        target._attn_implementation = attention
        target._experts_implementation = ATTENTION_NAME
    kept: dict[int, torch.Tensor] = {}
    with _parameters_on_meta(kept):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    hf_model.train()
    return HFCausalLM(hf_model, ac_mode=ac_mode, kernels=kernels, init_values=kept)


def hf_flops_per_token(model: HFCausalLM, seq_len: int) -> tuple[float, str]:
    """(FLOPs per trained token, how they were counted): 6 x the non-embedding parameters a token
    uses (the output projection counted; MoE experts scaled by top_k / experts, an estimate) plus
    6 x layers x heads x head_dim x seq_len for causal attention, from the config when it names
    them."""
    text = text_config(model.hf_model.config)
    embeddings = model.hf_model.get_input_embeddings()
    output = model.hf_model.get_output_embeddings()
    # The stored weights: reading `.weight` under data parallelism or a compute cast returns a new
    # (gathered, cast) tensor each time.
    stored_embeddings = embeddings._parameters.get("weight") if embeddings is not None else None
    skip = {id(stored_embeddings)} if stored_embeddings is not None else set()
    tied = (output is not None and stored_embeddings is not None
            and output._parameters.get("weight") is stored_embeddings)
    moe = _moe_shape(text)
    n = 0.0
    for name, p in model.named_parameters():
        if id(p) in skip:
            continue
        share = moe[1] / moe[0] if moe is not None and ".experts." in f".{name}." else 1.0
        n += p.numel() * share
    if tied:
        n += embeddings.weight.numel()
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (
        text.hidden_size // heads if heads and hasattr(text, "hidden_size") else None)
    how = "6N + 6 L H hd S from the config"
    attention = 0.0
    if layers and heads and head_dim:
        attention = 6.0 * layers * heads * head_dim * seq_len
    else:
        how = "6N only (the config names no attention shape)"
    if moe is not None:
        how += "; MoE experts counted at top_k / experts (an estimate)"
    return 6.0 * n + attention, how


# ---------------------------------------------------------------------------------------------
# Weights in and out of Hugging Face directories
# ---------------------------------------------------------------------------------------------


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
    from transformers import AutoConfig, AutoModelForCausalLM

    from titan_tpu.models.hf_checkpoint import check_safetensors_file

    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        check_safetensors_file(file)  # truncated or damaged: one line naming the file
    config = AutoConfig.from_pretrained(str(hf_dir))
    try:
        return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, output_loading_info=True,
                                                    attn_implementation=reference_attention(config))
    except (RuntimeError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        weights = isinstance(e, RuntimeError) or any(w in first for w in ("size mismatch", "shape", "safetensors"))
        what = "the weights in {} do not fit its config.json" if weights else "transformers cannot load {}"
        raise ValueError(f"{what.format(hf_dir)} ({first[:300]})") from None


def export_hf(args: HFArgs, state_dict: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    """Write `state_dict` (our names, full tensors) as an HF directory with save_pretrained, which
    from_pretrained loads (transformers applies its own checkpoint layout on the way out)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = args.transformers_config()
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
