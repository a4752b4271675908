"""Our hooks into transformers: the "titan_tpu" attention, mask and experts implementations
(registered with transformers' AttentionInterface, AttentionMaskInterface and ExpertsInterface),
the graph-safe forms of expert classes that do not use the interface (`GRAPH_SAFE_FORWARDS`), and
the choice of attention implementation per model class."""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from titan_tpu.kernels import KernelConfig
from titan_tpu.kernels.grouped_mm import group_ids
from titan_tpu.models.common.moe import ExpertDispatch
from titan_tpu.models.hf.config import _moe_shape, text_config

ATTENTION_NAME = "titan_tpu"


class CallContext(NamedTuple):
    """What one call of the wrapped model hands our hooks (set by `HFCausalLM.hooks_context`)."""

    kernels: KernelConfig
    document_ids: torch.Tensor | None  # the batch's documents; None for plain causal windows
    # How the experts reach tokens of other ranks under expert parallelism; None: every expert here.
    dispatch: ExpertDispatch | None = None


_CALL_CONTEXT: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar("titan_tpu_hf_call", default=None)


def _call_context() -> CallContext | None:
    """`_CALL_CONTEXT`'s value; None while Dynamo compiles, which cannot trace a ContextVar: the
    only Dynamo-compiled calls are generation's decode steps (titan_tpu/generate), which set none."""
    return None if torch.compiler.is_compiling() else _CALL_CONTEXT.get()


def _titan_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, S, D], key/value [B, K, S, D] ->
    ([B, S, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("sparse_indices") is not None:
        raise NotImplementedError(f"{type(module).__name__} passes sparse_indices (a sparse-attention indexer); the "
                                  "titan_tpu attention does not apply them; build such a model with sdpa attention")
    context = _call_context()
    document_ids = context.document_ids if context is not None else None
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
    kernels = context.kernels
    head_dim = query.shape[-1]
    if scaling is not None and scaling != head_dim**-0.5:
        query = query * (scaling * head_dim**0.5)  # our kernels scale by 1/sqrt(D)
    impl = kernels.attention_impl(query.device.type, documents=document_ids is not None)
    out_BSHD = impl.fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), document_ids)
    return out_BSHD, None


def _grouped_experts(hidden_TD: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor, *,
                     num_experts: int, expert_ffn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     num_local: int | None = None, dispatch: ExpertDispatch | None = None) -> torch.Tensor:
    """Mixture of experts with static shapes: the token-expert pairs sorted by expert (stable
    argsort), `expert_ffn(x_ND, group_sizes_L)` on the sorted rows (grouped matmuls over this rank's
    `num_local` experts, default all), weighted, back in token order and summed over k as
    transformers does. Group sizes come from scatter_add, never from `nonzero`, so graph mode
    captures it.

    Under expert parallelism (`dispatch`, parallel/expert_parallel.py), as the native MoE layer
    (models/common/moe.py): the rows of the ep group's tokens are gathered, sorted by expert counted
    from this rank's first one (modulo E), so its experts' rows are a prefix in groups of their own;
    the other ranks' rows fall past the last group and are zeroed (whatever a bias or a norm in
    `expert_ffn` made of them), and `dispatch.combine` sums the ranks' partial outputs back to the
    tokens' own ranks. Without, every expert is here and nothing moves."""
    dispatch = dispatch or ExpertDispatch()
    num_local = num_experts if num_local is None else num_local
    x_MD, chosen_MK, weights_MK = dispatch.gather(hidden_TD, top_k_index_TK, top_k_weights_TK, num_experts)
    M, K = chosen_MK.shape
    key_N = (chosen_MK.reshape(-1) - dispatch.first_local_expert(num_experts)) % num_experts
    order_N = torch.argsort(key_N, stable=True)
    group_sizes_E = torch.zeros(num_experts, dtype=torch.int64, device=key_N.device).scatter_add(
        0, key_N, torch.ones_like(key_N))
    y_ND = expert_ffn(x_MD[order_N // K], group_sizes_E[:num_local])
    if num_local < num_experts:
        local_N = torch.arange(y_ND.shape[0], device=y_ND.device) < group_sizes_E[:num_local].sum()
        y_ND = torch.where(local_N.unsqueeze(-1), y_ND, 0)
    y_ND = y_ND * weights_MK.reshape(-1)[order_N].unsqueeze(-1)
    inverse_N = torch.argsort(order_N)
    out_MD = y_ND[inverse_N].view(M, K, -1).sum(dim=1).to(hidden_TD.dtype)
    return dispatch.combine(out_MD)


def _grouped_mm() -> Callable:
    context = _call_context()
    kernels = context.kernels if context is not None else KernelConfig()
    return kernels.grouped_mm_fn


def _titan_experts(module: nn.Module, hidden_TD: torch.Tensor, top_k_index_TK: torch.Tensor,
                   top_k_weights_TK: torch.Tensor) -> torch.Tensor:
    """transformers' experts contract (stacked expert weights, one routing per token) through our
    `grouped_mm` kernel (`_grouped_experts`), which graph mode captures in fp32; transformers' own
    grouped_mm path cannot (its fake kernel demands bf16). Per-expert biases are added to each row
    by its expert. Under our expert parallelism (the call context's dispatch) the weights read are
    this rank's experts, a prefix numbered from `dispatch.first_local_expert`. transformers' own
    expert-parallel sentinels use its batched_mm form."""
    from transformers.integrations.moe import batched_mm_experts_forward

    if getattr(module, "_is_expert_parallel", False):
        return batched_mm_experts_forward(module, hidden_TD, top_k_index_TK, top_k_weights_TK)
    context = _call_context()
    dispatch = context.dispatch if context is not None else None
    grouped_mm = _grouped_mm()(hidden_TD.device.type)
    # Read once: under SimpleFSDP each read of a parameter gathers it (the ep shard stays local).
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    up_weight, down_weight = getattr(module, up_name), module.down_proj
    up_bias = getattr(module, f"{up_name}_bias") if module.has_bias else None
    down_bias = module.down_proj_bias if module.has_bias else None
    num_local = down_weight.shape[0]
    if num_local != module.num_experts and dispatch is None:
        raise RuntimeError(f"{type(module).__name__} holds {num_local} of its {module.num_experts} experts (expert "
                           "parallelism) but this call has no expert dispatch; call the model through HFCausalLM")

    def as_EDF(weight: torch.Tensor) -> torch.Tensor:  # HF stores [E, out, in] unless transposed
        return weight if module.is_transposed else weight.transpose(1, 2)

    def linear(x_ND: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               group_sizes_L: torch.Tensor) -> torch.Tensor:
        y_NF = grouped_mm(x_ND, as_EDF(weight), group_sizes_L)
        if bias is None:
            return y_NF
        # Each row's expert; rows past the last group (other ranks' experts) take the last one's
        # bias, and `_grouped_experts` zeroes them.
        expert_N = group_ids(group_sizes_L, x_ND.shape[0]).clamp(max=num_local - 1)
        return y_NF + bias[expert_N]

    def expert_ffn(x_ND: torch.Tensor, group_sizes_L: torch.Tensor) -> torch.Tensor:
        h_NF = linear(x_ND, up_weight, up_bias, group_sizes_L)
        h_NF = module._apply_gate(h_NF) if module.has_gate else module.act_fn(h_NF)
        y_ND = linear(h_NF, down_weight, down_bias, group_sizes_L)
        if getattr(module, "has_post_expert_norm", False):
            y_ND = module.post_expert_norm(y_ND)
        return y_ND

    return _grouped_experts(hidden_TD, top_k_index_TK, top_k_weights_TK, num_experts=module.num_experts,
                            expert_ffn=expert_ffn, num_local=num_local, dispatch=dispatch)


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


def interface_experts(hf_model: nn.Module) -> list[nn.Module]:
    """The experts modules transformers runs through its ExpertsInterface: instances of classes
    decorated with `use_experts_implementation`, which sets these attributes on each of them.
    `_titan_experts` serves them, and expert parallelism can spread their stacked weights."""
    return [m for m in hf_model.modules() if hasattr(m, "is_concatenated") and hasattr(m, "_is_expert_parallel")]


def expert_parallel_refusal(hf_model: nn.Module, ep: int) -> str | None:
    """Why `--parallelism.ep ep` cannot spread `hf_model`'s experts (one line), None when it can:
    every experts module must be one of transformers' stacked experts (`interface_experts`), each
    parameter stacked per expert, and ep must divide the experts."""
    name = type(hf_model).__name__
    own_loops = sorted({type(m).__name__ for m in hf_model.modules() if type(m).__name__ in GRAPH_SAFE_FORWARDS})
    if own_loops:
        return (f"parallelism.ep = {ep} cannot spread the experts of {name}: {own_loops[0]} runs them in its own "
                "forward, not through transformers' experts interface; set parallelism.ep 1")
    experts = interface_experts(hf_model)
    if not experts and _moe_shape(text_config(hf_model.config)) is None:
        return f"parallelism.ep = {ep} spreads MoE experts; {name} has none: set parallelism.ep 1 or use an MoE model"
    if not experts:
        return (f"parallelism.ep = {ep} cannot spread the experts of {name}: they are not transformers' stacked "
                "experts (use_experts_implementation), the only ones it shards; set parallelism.ep 1")
    for module in experts:
        for param_name, param in module.named_parameters(recurse=False):
            if param.shape[0] != module.num_experts:
                return (f"parallelism.ep = {ep} cannot spread the experts of {name}: {type(module).__name__}."
                        f"{param_name} {tuple(param.shape)} is not stacked per expert; set parallelism.ep 1")
        if module.num_experts % ep:
            return f"parallelism.ep = {ep} must divide the {module.num_experts} experts of {name}"
    return None


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

    context = _call_context()
    # transformers forbids the skip for masks other than causal ones: a packed batch's, whose
    # documents our attention reads from the context, and one that lets some tokens see ahead
    # (Gemma 3's image tokens attend to their whole image), which must be materialised.
    causal = kwargs.get("allow_is_causal_skip", True) or (context is not None and context.document_ids is not None)
    if attention_mask is None and local_size is None and context is not None and causal:
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
