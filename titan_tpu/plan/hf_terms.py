"""The planner's terms of a Transformers-backend model (``model.name = hf``): measured on the model
built on the meta device, not written as formulas, since transformers' layers are not ours
(docs/planner.md, "Transformers-backend models").

`hf_terms` builds the model as the run builds it (models/hf/model.py `build_hf_model` in the
compute dtype, the vision tower frozen unless model.train_vision, LoRA's adapters with the base
frozen) on the meta device and reads, at no memory cost:

* its parameter elements by part (`HFParams`: the embedding, the output projection unless tied,
  each decoder layer, the vision tower and its projector, the rest) and which of them train;
* what its forward keeps for the backward per decoder layer, outside them and as the loss's input
  (models/hf/activations.py, on fake tensors), at one and two rows of the run's seq_len and image
  slots: the activations of a micro-batch of any rows are the fixed part plus rows x the per-row
  part (`HFTerms.activations`), in each activation-checkpointing mode;
* the trainer's FLOPs per token (models/hf/flops.py, the vision tower and projector on a row's
  image slots included), and the decoder layers' forward FLOPs, which full checkpointing reruns.

The layout's terms (parallel/plan_terms.py: stored shards, gathered weights, full-size gradients,
AdamW's moments and temporary, the collectives) and the loss kernel's (kernels/loss.py) then read
these numbers where a native model's read its args (plan/setting.py `Setting`). A vision-language
model is planned with every image slot of every row filled (an empty slot runs through the tower
as a filled one does). The measurement is cached per model, seq_len, dtype, images and LoRA, so
`plan --search` measures a model once.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_tpu.models.common.activation_memory import ActivationBytes
from titan_tpu.models.hf.activations import SavedBytes
from titan_tpu.models.hf.hooks import interface_experts

__all__ = ["HFParams", "HFTerms", "hf_terms"]


@dataclass(frozen=True)
class HFParams:
    """Parameter elements of an hf model by part (LoRA's adapters in `adapters` and in the layers
    they sit in), and what trains."""

    embedding: int
    output: int  # the output projection; 0 when tied to the embedding
    layers: tuple[int, ...]  # each decoder layer (the model's checkpointed units), adapters included
    layers_trained: tuple[int, ...]  # of each decoder layer, the trained elements (their gradients)
    vision_tower: int  # a vision-language model's vision encoder (its projector apart); 0 for text-only
    projector: int  # the projector from the tower into the language model
    other: int  # the rest: the final norm, ...
    trained: int  # elements with gradients and AdamW moments
    adapters: int  # LoRA's adapter elements
    largest_trained: int  # the largest trained tensor: the largest full-size gradient
    tensors: int  # parameter tensors: SimpleFSDP's per-parameter collectives
    # transformers' stacked experts (models/hf/hooks.py `interface_experts`), in `layers`: what
    # --parallelism.ep spreads (stored 1 / dp_shard, gathered and computed E / ep)
    experts: int = 0
    experts_trained: int = 0  # of them, the trained elements (LoRA leaves them frozen)

    @property
    def total(self) -> int:
        return self.embedding + self.output + sum(self.layers) + self.vision_tower + self.projector + self.other

    def parts(self) -> dict[str, int]:
        """The plan's `params["parts"]`."""
        return {"embedding": self.embedding, "output": self.output, "decoder_layers": sum(self.layers),
                "vision_tower": self.vision_tower, "projector": self.projector, "other": self.other,
                "trained": self.trained}


@dataclass(frozen=True)
class HFTerms:
    """What the planner reads of an hf model (the module docstring)."""

    params: HFParams
    dim: int  # the hidden size: the width of the loss's input
    vocab_size: int
    chunked_loss: bool  # the loss kernel reads the hidden state (else transformers' logits: the reference loss)
    one_row: SavedBytes
    two_rows: SavedBytes
    flops_per_token: float
    flops_how: str
    recompute_flops_per_token: float  # the decoder layers' forward, per token
    moe_layers: int = 0  # experts modules of transformers' stacked experts (what ep's token dispatch crosses)
    num_experts: int = 0  # experts per such module
    top_k: int = 0  # experts per token

    def activations(self, *, rows: int, ac_mode: str, traced: bool, adapter_outputs: bool = True) -> ActivationBytes:
        """Activations of a micro-batch of `rows` rows: what the layers keep in `ac_mode` (full: the
        layer input, and traced, the attention kernel's outputs too; selective: the input and the
        matmuls' and attention's outputs, LoRA's up-projections' among them unless `adapter_outputs`
        is false, as in a step XLA compiles whole: models/hf/activations.py), the largest layer's
        intermediates while recomputed, and outside the layers what the forward keeps with the final
        hidden state (the loss's input)."""

        def at(read) -> int:  # linear in the rows: measured at one and two
            one, two = read(self.one_row), read(self.two_rows)
            return one + (rows - 1) * (two - one)

        n = len(self.one_row.layers)
        whole = [at(lambda m, i=i: m.layers[i].saved) for i in range(n)]
        inputs = [at(lambda m, i=i: m.layers[i].layer_input) for i in range(n)]
        seeded = [at(lambda m, i=i: m.layers[i].seeded_outputs) for i in range(n)]
        matmul = [at(lambda m, i=i: m.layers[i].matmul_outputs + adapter_outputs * m.layers[i].adapter_outputs)
                  for i in range(n)]
        if ac_mode == "none":
            saved, recompute = whole, 0
        elif ac_mode == "full":
            saved, recompute = [x + (s if traced else 0) for x, s in zip(inputs, seeded)], max(whole, default=0)
        else:
            saved, recompute = [x + s + m for x, s, m in zip(inputs, seeded, matmul)], max(whole, default=0)
        head = at(lambda m: m.outside) + at(lambda m: m.hidden)
        return ActivationBytes(saved_per_layer=tuple(saved), recompute=recompute, head=head)


def hf_terms(setup, *, dtype: str) -> HFTerms:
    """The measured terms of the run setup's hf model in the compute dtype `dtype`, cached."""
    cfg, spec = setup.cfg, setup.spec
    m = cfg.model
    key = (repr(spec.args), cfg.training.seq_len, dtype, repr(cfg.lora), m.train_vision, m.max_images, m.image_size,
           repr(cfg.kernels))
    if key not in _MEASURED:
        _MEASURED[key] = _measure(setup, dtype=dtype)
    return _MEASURED[key]


_MEASURED: dict[tuple, HFTerms] = {}


def _measure(setup, *, dtype: str) -> HFTerms:
    import torch

    from titan_tpu.models.hf.activations import measure_saved_bytes
    from titan_tpu.models.hf.config import _moe_shape, text_config
    from titan_tpu.models.hf.flops import hf_flops_per_token

    cfg, spec = setup.cfg, setup.spec
    seq_len = cfg.training.seq_len
    model = _meta_model(setup, dtype=getattr(torch, dtype))
    images = {rows: _image_rows(setup, rows) for rows in (1, 2)}
    fpt, how = hf_flops_per_token(model, seq_len, images=images[1])
    measured = {rows: measure_saved_bytes(model, torch.zeros(rows, seq_len, dtype=torch.long), images[rows])
                for rows in (1, 2)}
    recompute = sum(layer.forward_flops for layer in measured[1].layers) / seq_len
    text = text_config(model.hf_model.config)
    experts = interface_experts(model.hf_model)
    _, top_k = _moe_shape(text) or (0, 0)
    return HFTerms(params=_params(model), dim=int(text.hidden_size),
                   vocab_size=spec.args.vocab_size, chunked_loss=model.chunked_loss_may_apply(), one_row=measured[1],
                   two_rows=measured[2], flops_per_token=fpt, flops_how=how, recompute_flops_per_token=recompute,
                   moe_layers=len(experts), num_experts=experts[0].num_experts if experts else 0,
                   top_k=top_k if experts else 0)


def _meta_model(setup, *, dtype):
    """The model on the meta device as the run builds it, in the compute dtype, without activation
    checkpointing (the measurement derives every mode from one forward), LoRA's adapters added and
    the base frozen."""
    from titan_tpu.models.converters import enabled_converters
    from titan_tpu.models.hf.model import build_hf_model
    from titan_tpu.models.lora import freeze_base

    cfg = setup.cfg
    model = build_hf_model(setup.spec.args, kernels=_kernels_here(cfg.kernels), ac_mode="none", dtype=dtype,
                           train_vision=cfg.model.train_vision)
    for converter in enabled_converters(cfg):
        converter.convert(model, cfg)
    if cfg.lora.enabled:
        freeze_base(model)
    return model


def _kernels_here(kernels):
    """The run's kernels, each one that cannot run on this CPU (a TPU recipe's splash, tokamax)
    replaced by this CPU's pick of the same op, which keeps what it keeps for the backward (the
    attention output and its log-sum-exp; the loss's gradients) and reads the same hidden state."""
    import dataclasses

    from titan_tpu.kernels import OPS

    here = {}
    for field, op in OPS.items():
        choice = getattr(kernels, field)
        if choice != "auto" and op.impls[choice].why_not("cpu", frozenset()) is not None:
            here[field] = op.resolve("auto", "cpu").name
    return dataclasses.replace(kernels, **here)


def _image_rows(setup, rows: int):
    """`rows` rows' image slots, every slot filled, as the data loader lays them out for this model
    (data/images.py), or None for a text-only model."""
    import numpy as np
    import torch

    from titan_tpu.data.images import ImageProcessorView, stack_rows

    directory = setup.spec.image_model_dir()
    if directory is None:
        return None
    m = setup.cfg.model
    view = ImageProcessorView(directory, max_images=m.max_images, image_size=m.image_size)
    inputs_S = np.zeros(setup.cfg.training.seq_len, dtype=np.int64)
    row = {"inputs": inputs_S, "labels": inputs_S, "pixel_values": torch.zeros(view.max_images, *view.pixel_shape),
           "slots": torch.ones(view.max_images, dtype=torch.bool),
           **view.format.row_extras(view, inputs_S, view.config.image_token_id)}
    return stack_rows([row] * rows, view).images


def _params(model) -> HFParams:
    """The meta model's parameter elements by part (`HFParams`)."""
    from titan_tpu.models.lora import is_adapter_key

    hf_model = model.hf_model
    embedding = hf_model.get_input_embeddings().weight
    output = hf_model.get_output_embeddings()
    output = output.weight if output is not None and output.weight is not embedding else None
    tower = projector = ()
    if model.vision is not None:
        projector = tuple(hf_model.get_submodule(model.vision.projector).parameters())
        tower = tuple(p for p in hf_model.get_submodule(model.vision.tower).parameters()
                      if all(p is not q for q in projector))
    seen = {id(p) for p in (embedding, *([output] if output is not None else []), *tower, *projector)}
    layers, layers_trained = [], []
    for layer in model.decoder_layers:
        own = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        layers.append(sum(p.numel() for p in own))
        layers_trained.append(sum(p.numel() for p in own if p.requires_grad))
    named = dict(model.named_parameters())  # tied parameters once
    other = sum(p.numel() for p in named.values() if id(p) not in seen)
    trained = [p for p in named.values() if p.requires_grad]
    experts = [p for module in interface_experts(hf_model) for p in module.parameters(recurse=False)]
    return HFParams(embedding=embedding.numel(), output=output.numel() if output is not None else 0,
                    layers=tuple(layers), layers_trained=tuple(layers_trained),
                    vision_tower=sum(p.numel() for p in tower), projector=sum(p.numel() for p in projector),
                    other=other, trained=sum(p.numel() for p in trained),
                    adapters=sum(p.numel() for name, p in named.items() if is_adapter_key(name)),
                    largest_trained=max((p.numel() for p in trained), default=0), tensors=len(named),
                    experts=sum(p.numel() for p in experts),
                    experts_trained=sum(p.numel() for p in experts if p.requires_grad))
