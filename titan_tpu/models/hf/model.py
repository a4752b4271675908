"""`HFCausalLM`, a transformers causal LM under the project's model contract, and
`build_hf_model`, which builds it on the meta device (see the package docstring)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from titan_tpu.kernels import KernelConfig, document_ids_from_positions
from titan_tpu.model_contract import EXPERT_MARKER, LossOutput
from titan_tpu.models.common.activation_checkpoint import checkpointed
from titan_tpu.models.common.moe import ExpertDispatchSlot
from titan_tpu.models.common.transformer import sequence_ce_sums
from titan_tpu.models.hf.config import (
    HFArgs,
    _logit_transform,
    _model_class,
    _moe_shape,
    auto_model_class,
    text_config,
)
from titan_tpu.models.hf.hooks import (
    _CALL_CONTEXT,
    _KEEP_SDPA,
    ATTENTION_NAME,
    CallContext,
    _attention_implementation,
    _has_sparse_indexer,
    _use_graph_safe_forwards,
    interface_experts,
    register_attention,
)
from titan_tpu.models.hf.vision import (
    freeze_tower,
    merge_image_features,
    use_graph_safe_forwards,
    vision_architecture,
)

if TYPE_CHECKING:
    from titan_tpu.data.batch import ImageInputs

PREFIX = "hf_model."


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
        self.chunked_loss_reason = "not checked yet"
        self.graph_safe_forwards = _use_graph_safe_forwards(hf_model)
        # Expert parallelism: SimpleFSDP lays the stacked experts out on the expert mesh, and the
        # dispatch it installs in the slot reaches `_titan_experts` through the call context.
        for experts in interface_experts(hf_model):
            setattr(experts, EXPERT_MARKER, True)
        self.expert_dispatch = ExpertDispatchSlot()
        self.decoder_layers = _decoder_layers(hf_model)
        if ac_mode != "none":
            for layer in self.decoder_layers:
                _checkpoint_forward(layer, ac_mode)
        text = text_config(hf_model.config)
        self._router = _router_settings(text)
        self.vision = vision_architecture(hf_model.config)  # None for a text-only model
        if self.vision is not None:
            use_graph_safe_forwards(hf_model, self.vision)

    def vision_module_names(self) -> tuple[str, ...]:
        """The vision tower's and projector's module names (ours, under the wrapper); () for a
        text-only model. LoRA's default targets leave them out: adapters go on the language model."""
        if self.vision is None:
            return ()
        return PREFIX + self.vision.tower, PREFIX + self.vision.projector

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

    def gradient_reducer(self) -> None:
        return None  # transformers' layers are never split into stages (run/setup.py refuses pp)

    def expert_load_layers(self) -> list[int]:
        return []  # forward reports no expert loads (transformers' routers keep their counts to themselves)

    def expert_bias_names(self) -> list[str]:
        return []  # transformers' routers move their own biases, if any, outside the gradient

    def updated_expert_biases(self, biases: dict[str, torch.Tensor],
                              expert_load_LE: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    # --- forward ------------------------------------------------------------------------------

    def _model_kwargs(self, tokens_BS: torch.Tensor, positions_BS: torch.Tensor | None,
                      images: ImageInputs | None = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"input_ids": tokens_BS, "use_cache": False}
        if positions_BS is not None:
            kwargs["position_ids"] = positions_BS
        if self._router is not None:
            kwargs["output_router_logits"] = True
        if images is not None:
            del kwargs["input_ids"]
            kwargs["inputs_embeds"] = self.embeddings_with_images(tokens_BS, images)
            kwargs.update(self.vision.language_inputs(images))
            if self._packed_masks_apply(positions_BS, images):
                kwargs["attention_mask"] = self.vision.packed_masks(text_config(self.hf_model.config), images,
                                                                    positions_BS)
        return kwargs

    def _packed_masks_apply(self, positions_BS: torch.Tensor | None, images: ImageInputs | None) -> bool:
        """Whether this batch's attention masks are the architecture's own of packed rows."""
        return (positions_BS is not None and images is not None and self.vision is not None
                and self.vision.packed_masks is not None)

    def embeddings_with_images(self, tokens_BS: torch.Tensor, images: ImageInputs) -> torch.Tensor:
        """The token embeddings with every image token replaced by its image's features (the
        vision tower run on every slot: models/hf/vision.py on the static shapes)."""
        if self.vision is None:
            raise ValueError(f"{self.hf_model.config.model_type} is a text-only model and the batch holds images; "
                             "train a vision-language model or drop the images")
        image_token_id = self.hf_model.config.image_token_id
        # An image token id may lie past the text vocabulary (Gemma 3's): its rows are replaced anyway.
        text_BS = tokens_BS.masked_fill(tokens_BS == image_token_id, 0)
        embeds_BSD = self.hf_model.get_input_embeddings()(text_BS)
        # The tower attends within each image: the text's documents (packed rows) are not its own.
        context = _CALL_CONTEXT.get(None)
        token = _CALL_CONTEXT.set(None if context is None else context._replace(document_ids=None))
        try:
            features_ND = self.vision.features(self.hf_model, images)
        finally:
            _CALL_CONTEXT.reset(token)
        return merge_image_features(embeds_BSD, features_ND, tokens_BS=tokens_BS, image_token_id=image_token_id)

    def forward(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor | None = None, *,
                positions_BS: torch.Tensor | None = None, per_sequence: bool = False,
                images: ImageInputs | None = None) -> torch.Tensor | LossOutput:
        """As the native Transformer's forward: logits, or the summed cross-entropy (per row with
        per_sequence), the balancing loss and no expert loads. `images`: a vision-language
        model's image slots (data/batch.py `ImageInputs`), merged into the token embeddings."""
        document_ids = None if positions_BS is None else document_ids_from_positions(positions_BS)
        if self._packed_masks_apply(positions_BS, images):
            document_ids = None  # the masks hold them (VisionArchitecture.packed_masks)
        with self.hooks_context(document_ids):
            kwargs = self._model_kwargs(tokens_BS, positions_BS, images)
            if labels_BS is None:
                return self.hf_model(**kwargs).logits
            if self.use_chunked_loss:
                out = self.hf_model.base_model(**kwargs)
                h_BSD = out[0]
                loss_fn = self.kernels.loss_fn(h_BSD.device.type)
                w_VD = self.hf_model.get_output_embeddings().weight
                if per_sequence:
                    ce_sum = sequence_ce_sums(loss_fn, h_BSD, w_VD, labels_BS)
                else:
                    ce_sum = loss_fn(h_BSD.flatten(0, 1), w_VD, labels_BS.flatten())
            else:
                out = self.hf_model(**kwargs)
                if per_sequence:
                    ce_sum = F.cross_entropy(out.logits.flatten(0, 1).float(), labels_BS.flatten(), ignore_index=-100,
                                             reduction="none").view(labels_BS.shape).sum(dim=1)
                else:
                    ce_sum = F.cross_entropy(out.logits.flatten(0, 1).float(), labels_BS.flatten(),
                                             ignore_index=-100, reduction="sum")
            aux = self._aux_loss(out, ce_sum)
            return LossOutput(ce_sum, aux, ce_sum.new_zeros(0, 0))

    @contextlib.contextmanager
    def hooks_context(self, document_ids: torch.Tensor | None = None) -> Iterator[None]:
        """Inside: calls of `hf_model` reach our hooks (models/hf/hooks.py) with this model's
        kernels, these documents and its expert dispatch."""
        token = _CALL_CONTEXT.set(CallContext(self.kernels, document_ids, self.expert_dispatch.dispatch))
        try:
            yield
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

    def chunked_loss_may_apply(self) -> bool:
        """What `check_chunked_loss` asks before its check on real weights, from the model's structure
        alone: a bias-free linear output projection over a base model's hidden state, no transformation
        of the logits (the planner's assumption on the meta device, plan/hf_terms.py)."""
        output = self.hf_model.get_output_embeddings()
        base = getattr(self.hf_model, "base_model", None)
        if not isinstance(output, nn.Linear) or output.bias is not None or base is None or base is self.hf_model:
            return False
        # e.g. soft-capping: too close to identity at init for the check on real weights to see
        return not _logit_transform(text_config(self.hf_model.config))

    @torch.no_grad()
    def check_chunked_loss(self, vocab_size: int) -> bool:
        """Use the loss kernel when logits == output_embeddings(base_model(x)[0]) for this model;
        decided on a small real batch (all ranks run it together under data parallelism). Why is
        `chunked_loss_reason`, one line for the run's log."""
        self.use_chunked_loss, self.chunked_loss_reason = self._chunked_loss(vocab_size)
        return self.use_chunked_loss

    def _chunked_loss(self, vocab_size: int) -> tuple[bool, str]:
        if not self.chunked_loss_may_apply():
            return False, "its output layer or logits are not a plain projection of the base model's hidden state"
        output = self.hf_model.get_output_embeddings()
        base = self.hf_model.base_model
        device = next(self.parameters()).device
        if device.type == "meta":
            # No weights to check on (`titan-tpu compile` builds the model on the meta device): the
            # structure's answer, the planner's too (plan/hf_terms.py), so that the compiled program
            # has the loss a run with weights that pass the check will have.
            return True, "from the model's structure (no weights to check on)"
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab_size, (1, 8), generator=generator).to(device)
        try:
            with self.hooks_context():
                kwargs = self._model_kwargs(tokens, None)
                logits = self.hf_model(**kwargs).logits.float()
                hidden = base(**kwargs)[0]
            if not isinstance(hidden, torch.Tensor) or hidden.shape[:2] != tokens.shape:
                return False, "its base model does not return the hidden state the output layer reads"
            ours = F.linear(hidden, output.weight).float()
        except Exception as e:  # noqa: BLE001 - a base model that cannot be called alone keeps its own logits
            reason = (str(e).splitlines() or [""])[0][:120]
            return False, f"its base model cannot be called alone ({type(e).__name__}: {reason})"
        if not torch.allclose(ours, logits, rtol=1e-4, atol=1e-4):
            return False, "its logits differ from the output layer applied to the base model's hidden state"
        return True, "checked on its weights"


def _decoder_layers(hf_model: nn.Module) -> list[nn.Module]:
    """The decoder layers: instances of the classes the model names in `_no_split_modules`."""
    names = set(getattr(hf_model, "_no_split_modules", None) or [])
    return [m for m in hf_model.modules() if type(m).__name__ in names]


def _checkpoint_forward(layer: nn.Module, mode: str) -> None:
    """Activation checkpointing of one decoder layer, whatever its forward's signature: the
    keyword arguments ride along in a closure (non-reentrant checkpointing and the traced tagger
    both handle tensors reached that way). So does the call context of our hooks: the recomputation
    runs in the backward, after `HFCausalLM.hooks_context` has exited, and must take the forward's
    path (our attention with the batch's documents, the experts' dispatch)."""
    forward = layer.forward

    def checkpointed_forward(*args, **kwargs):
        context = _CALL_CONTEXT.get()

        def in_context(*inner):
            token = _CALL_CONTEXT.set(context)
            try:
                return forward(*inner, **kwargs)
            finally:
                _CALL_CONTEXT.reset(token)

        return checkpointed(in_context, mode)(*args)

    layer.forward = checkpointed_forward


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


def build_hf_model(args: HFArgs, *, kernels: KernelConfig | None = None, ac_mode: str = "none",
                   dtype: torch.dtype = torch.float32, train_vision: bool = False) -> HFCausalLM:
    """The wrapped model with parameters on the meta device (buffers real): materialise and
    initialise it with `parallel.simple_fsdp.materialize_and_init` (one device or sharded). A
    vision-language model's vision encoder is frozen (requires_grad False: the optimizer and the
    captured step leave it alone) unless `train_vision`."""
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
        hf_model = auto_model_class(config).from_config(config, dtype=dtype)
    hf_model.train()
    model = HFCausalLM(hf_model, ac_mode=ac_mode, kernels=kernels, init_values=kept)
    if model.vision is not None and not train_vision:
        # After wrapping: the wrapper turns parameters that are frozen at construction into buffers.
        freeze_tower(hf_model, model.vision)
    return model
