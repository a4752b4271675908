"""A config resolved for planning (`Setting`): what every term of a plan reads (memory.py,
step_time.py, fp8.py), built once by `resolve_setting`.

* the config and run setup as the machine it is written for would make them (`planning_machine`,
  `setup_for_planning`, `for_planning`) and the hardware it names (`default_hardware`);
* the mesh, how long the code keeps gathered block weights (`code_gather`), LoRA's adapters, and
  the kernels `auto` picks by device kind (`attention_impl`, `loss_impl`, `chunk_attention_impl`,
  `grouped_mm_impl`);
* the model's per-layer counts more than one term reads (`layer_params`, `attention_widths`);
* under pipeline stages (parallelism.pp > 1) the schedule, and the model's args cut to one stage's
  layers (`Setting.args`; the whole model's are `Setting.model_args`): plan/pipeline_terms.py;
* for a Transformers-backend model (model.name hf), whose layers the planner has no formulas for,
  what was measured on it instead (`Setting.hf`, plan/hf_terms.py): the properties below that count
  parameters and layers answer from it, and the terms that count activations, FLOPs and
  collectives read it where a native model's read its args.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titan_tpu.config import Config
from titan_tpu.kernels import ATTENTION, DOCUMENTS
from titan_tpu.kinds import TrainingKind
from titan_tpu.kinds.record import builds_reference_copy
from titan_tpu.models.registry import MODEL_NAMES, largest_param, num_expert_params, num_params
from titan_tpu.parallel.context_parallel import check_context_parallel
from titan_tpu.parallel.pipeline import PipelineSchedule
from titan_tpu.parallel.plan_terms import Layout
from titan_tpu.parallel.tensor_parallel import check_tensor_parallel
from titan_tpu.plan.hardware import Hardware, resolve_hardware
from titan_tpu.plan.pipeline_terms import stage_args
from titan_tpu.run.resolved import ResolvedRun, Target, resolve_run
from titan_tpu.run.setup import RunSetup

if TYPE_CHECKING:
    from titan_tpu.plan.hf_terms import HFTerms

__all__ = ["SEEDED_ATTENTION", "Setting", "TPU_NAMES", "attention_impl", "attention_widths", "chunk_attention_impl",
           "code_gather", "default_hardware", "for_planning", "grouped_mm_impl", "layer_params", "loss_impl",
           "planning_machine", "resolve_setting", "setup_for_planning"]

# Hardware names (hardware.py) of TPU generations: where `auto` picks the TPU kernels.
TPU_NAMES = ("v4", "v5e", "v5p", "v6e", "v7")

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@contextlib.contextmanager
def planning_machine():
    """Config checks as the machine a config is written for would run them. Planning runs
    nothing, so the one check that needs that machine's software (compile.backend tpu wants
    TorchTPU installed) is answered yes; every other check runs as usual."""
    from titan_tpu import device

    saved = device._tpu_installed
    device._tpu_installed = lambda: True
    try:
        yield
    finally:
        device._tpu_installed = saved


def setup_for_planning(toml_path, overrides: list[str] | None = None) -> RunSetup:
    """The run setup as the machine the config is written for would make it (`planning_machine`)."""
    from titan_tpu.config import build_config
    from titan_tpu.run.setup import prepare_run

    with planning_machine():
        return prepare_run(build_config(toml_path, overrides))


def for_planning(toml_path, overrides: list[str] | None = None) -> Config:
    """The config as the machine it is written for would load it (`planning_machine`)."""
    return setup_for_planning(toml_path, overrides).cfg


def default_hardware(cfg: Config, *, measure: bool = True) -> tuple[Hardware, int | None]:
    """The hardware a config names: training.device cpu (or auto here) is this machine; a TPU
    recipe names its slice in job.description ("TPU v5p-2048: 1,024 chips")."""
    t = cfg.training.device
    if t in ("cpu", "auto"):
        return resolve_hardware("cpu", measure=measure, dtype=cfg.model.dtype)
    if t == "tpu":
        from titan_tpu.device_peaks import tpu_generation

        gen = tpu_generation(cfg.job.description)
        chips = re.search(r"([\d,]+) chips", cfg.job.description)
        if gen is None or chips is None:
            raise ValueError("training.device = tpu: name the hardware with --hardware (e.g. v5p-1024) or write "
                             "'TPU v5p-1024: 512 chips' into job.description")
        hw, _ = resolve_hardware(gen, measure=measure)
        return hw, int(chips.group(1).replace(",", ""))
    gpu = re.search(r"\b(h100|h200|b200)\b", cfg.job.description, re.IGNORECASE)
    gpus = re.search(r"([\d,]+) GPUs", cfg.job.description)
    if t == "cuda" and gpu is not None and gpus is not None:  # a GPU recipe: "... 32 H100 ...: 32 GPUs"
        hw, _ = resolve_hardware(gpu.group(1).lower(), measure=measure)
        return hw, int(gpus.group(1).replace(",", ""))
    raise ValueError(f"training.device = {t}: name the GPU with --hardware (one of h100, h200, b200) or write "
                     "'H100: 32 GPUs' into job.description")


def _device_type(hardware: Hardware) -> str:
    """The device type a run on `hardware` computes on (what model.dtype auto resolves by)."""
    if hardware.name == "cpu":
        return "cpu"
    return "tpu" if hardware.name in TPU_NAMES else "cuda"


def code_gather(cfg: Config) -> str:
    """How long the code keeps gathered block weights with this config (parallel/plan_terms.py,
    Layout.gather): "layer" when re-sharded after the forward, "model" when kept: re-sharding off,
    per-parameter collectives (bucket_mb 0), or scanned layers in graph mode without full
    checkpointing (scan's partitioner saves each layer's gathered weights), or tensor parallelism
    without activation checkpointing (parameters gathered one by one) or with scanned layers."""
    p = cfg.parallelism
    assert p.reshard_after_forward != "auto", "plan_config resolves auto first (with_reshard_resolved)"
    if p.reshard_after_forward == "false" or p.bucket_mb <= 0:  # pipeline stages' too (run/resolved.py)
        return "model"
    if p.tp > 1 and cfg.activation_checkpoint.mode == "none":
        # Tensor-parallel weights are gathered per parameter, outside buckets: autograd keeps them,
        # unless a checkpointed block gathers them again in its recomputation.
        return "model"
    if cfg.model.scan_layers and cfg.training.mode == "graph" and cfg.activation_checkpoint.mode != "full":
        return "model"
    if cfg.model.scan_layers and p.tp > 1:
        return "model"  # a tensor-parallel stack is gathered whole before the loop (simple_fsdp._reshard_pieces)
    return "layer"


@dataclass(frozen=True)
class Setting:
    """A config resolved for planning: what every term reads (memory.py, step_time.py,
    fp8.py). Built once by `resolve_setting`."""

    cfg: Config  # the config as the terms read it: the run's accumulation and, under pp, its buckets in it
    run: ResolvedRun  # the run resolved for these devices (run/resolved.py): what the terms do not re-derive
    label: str  # how the plan names the model (the spec's label, e.g. llama3/8B)
    args: object  # the model's TransformerArgs as a device holds it: one pipeline stage's layers under pp
    hardware: Hardware
    devices: int
    layout: Layout
    dtype: str  # the compute dtype's name (model.dtype with auto resolved for the hardware)
    gather: str  # "model" or "layer": what the plan assumes (parallel/plan_terms.py Layout.gather)
    code_gather: str  # what the code does with this config (`code_gather`)
    adapter_params: int = 0  # LoRA's adapter elements (the trained ones under LoRA); 0 without LoRA
    adapted: tuple[tuple[str, int], ...] = ()  # LoRA's adapted linears: (unrolled name, in_features)
    as_compiled: bool = False  # plan `titan-tpu compile`'s program (`plan_run`'s as_compiled)
    fp8: bool = False  # the blocks' linears as fp8 matmuls (the config's [fp8], or `plan_run`'s fp8 what-if)
    fp8_scaling: str = "tensorwise"  # tensorwise | rowwise (kernels/fp8.py)
    fp8_experts: bool = False  # with fp8, the MoE experts' grouped matmuls too (fp8.experts; plan/fp8.py)
    schedule: PipelineSchedule | None = None  # pipeline stages (parallelism.pp > 1), else None
    whole_args: object = None  # the whole model's TransformerArgs where `args` is one stage's; None: `args`
    hf: HFTerms | None = None  # a Transformers-backend model's measured terms (plan/hf_terms.py); None: native

    @property
    def model_args(self):
        """The whole model's args: what the FLOPs per token and the parameter counts describe."""
        return self.whole_args if self.whole_args is not None else self.args

    @property
    def ranks_per_batch(self) -> int:
        """The ranks that share one data-parallel rank's batch: its tp x cp x pp devices."""
        p = self.cfg.parallelism
        return p.tp * p.cp * p.pp

    @property
    def ac(self) -> str:
        return self.cfg.activation_checkpoint.mode

    @property
    def scanned(self) -> bool:
        return self.cfg.model.scan_layers

    @property
    def graph(self) -> bool:
        return self.cfg.training.mode == "graph"

    @property
    def padded_values(self) -> bool:
        """Multi-head latent attention's values padded by the CPU attention kernel (kernels/attention.py)."""
        from titan_tpu.kernels.attention import pads_values

        mla = self.args.mla
        return (mla is not None and self.hardware.name == "cpu" and self.cfg.kernels.attention in ("auto", "sdpa")
                and pads_values("cpu", mla.qk_head_dim, mla.v_head_dim))

    @property
    def traced(self) -> bool:
        # Traced checkpointed blocks keep the attention output too where the attention kernel may
        # draw random numbers (SDPA, for its dropout: activation_checkpoint.py `_policy`); the other
        # kernels are recomputed with the block (XLA's live values of the pipelined llama3_8b_pp_tpu
        # and of qwen2_5_vl_7b_tpu hold no splash output). The scanned full mode is its own autograd
        # function that keeps only the layer inputs. Pipeline stages run their rows block by block
        # (parallel/pipeline.py), as checkpointed blocks.
        seeded = attention_impl(self.cfg.kernels.attention, self.hardware.name,
                                documents=self.run.documents) in SEEDED_ATTENTION
        return self.graph and seeded and not (self.scanned and self.ac == "full" and self.schedule is None)

    @property
    def partitioned(self) -> bool:
        # Scanned layers in graph mode without full checkpointing: scan's own autograd (scan.py);
        # pipeline stages run no scan op.
        return self.scanned and self.graph and self.ac != "full" and self.schedule is None

    @property
    def kind(self) -> TrainingKind:
        """The kind of training (kinds/): its rows per sample and its reference."""
        return self.run.kind

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch of one data-parallel rank (its tp and cp ranks share them): a
        kind's sample may be several rows (a DPO pair is a chosen and a rejected row)."""
        return self.run.micro_batch_rows * self.cfg.training.seq_len

    @property
    def reference_stored(self) -> float:
        """Parameter elements a device stores for the kind's frozen reference copy (sharded as the
        model's); none under LoRA, whose reference is the base model with its adapters off, and
        none for a kind without a reference (kinds/record.py `reference_holder`)."""
        copy = builds_reference_copy(self.kind, self.cfg)
        return self.layout.stored_elements(self.base_params, self.expert_params) if copy else 0.0

    @property
    def base_params(self) -> int:
        """The model's parameter elements beside LoRA's adapters (one stage's under pp)."""
        return self.hf.params.total - self.hf.params.adapters if self.hf else num_params(self.args)

    @property
    def whole_base_params(self) -> int:
        """The whole model's parameter elements beside LoRA's adapters."""
        return self.base_params if self.hf else num_params(self.model_args)

    @property
    def whole_trained(self) -> int:
        """The whole model's elements with gradients and AdamW moments: all of them, LoRA's adapters
        only, or an hf model's trained ones (its vision tower frozen by default)."""
        if self.hf:
            return self.hf.params.trained
        return self.adapter_params if self.lora else self.whole_base_params + self.adapter_params

    @property
    def n_layers(self) -> int:
        """The repeated blocks (one stage's under pp): an hf model's decoder layers."""
        return len(self.hf.params.layers) if self.hf else self.args.n_layers

    @property
    def dim(self) -> int:
        """The hidden size: the width of the loss's input."""
        return self.hf.dim if self.hf else self.args.dim

    @property
    def vocab_size(self) -> int:
        return self.hf.vocab_size if self.hf else self.args.vocab_size

    @property
    def expert_params(self) -> int:
        """The MoE experts' elements: our MoE layers', an hf model's stacked experts (plan/hf_terms.py)."""
        return self.hf.params.experts if self.hf else num_expert_params(self.args)

    @property
    def largest_param(self) -> int:
        """The largest parameter's elements (an hf model's largest trained one): the largest
        full-size gradient of unrolled layers."""
        return self.hf.params.largest_trained if self.hf else largest_param(self.args)

    def layer_gradient_params(self) -> list[float]:
        """Each layer's elements with gradients, in order (then the multi-token-prediction blocks):
        under LoRA the adapters, spread evenly over the blocks of a native model."""
        if self.hf:
            return list(self.hf.params.layers_trained)
        if self.lora:
            blocks = self.args.n_layers + self.args.mtp_num_layers
            return [self.adapter_params / blocks] * blocks
        return layer_params(self.args)

    @property
    def per_layer_stack(self) -> bool:
        """A scanned stack gathered per layer (re-sharding on, bucketed) reduce-scatters per layer
        too; a what-if other than the code's stands for re-sharding on (layer) or off (model)."""
        if self.gather != self.code_gather:
            return self.gather == "layer"
        return self.cfg.parallelism.reshard_after_forward == "true" and self.cfg.parallelism.bucket_mb > 0

    @property
    def block_params(self) -> int:
        if self.hf:
            return sum(self.hf.params.layers)
        args = self.args
        return num_params(args) - (args.dim + args.vocab_size * args.dim * (1 if args.tie_embeddings else 2))

    @property
    def stored(self) -> float:
        """Parameter elements a device stores (LoRA's adapters beside the base weights)."""
        return self.layout.stored_elements(self.base_params + self.adapter_params, self.expert_params)

    @property
    def lora(self) -> bool:
        return self.cfg.lora.enabled

    @property
    def trained(self) -> float:
        """Parameter elements a device keeps gradients and AdamW moments for: all it stores, or
        under LoRA the adapters only (the base is frozen), or an hf model's trained ones."""
        if self.hf:
            return self.layout.stored_elements(self.hf.params.trained)
        return self.layout.stored_elements(self.adapter_params) if self.lora else self.stored


def resolve_setting(setup: RunSetup, hardware: Hardware | None, *, chips: int | None, measure: bool,
                    gather: str | None, model_args) -> Setting:
    """The run setup resolved for planning (see `plan_run` for the arguments)."""
    cfg, spec = setup.cfg, setup.spec
    if not spec.plannable and cfg.parallelism.pp > 1:
        raise ValueError(f"parallelism.pp > 1 splits a native model's layer stack ({', '.join(MODEL_NAMES)}); an hf "
                         "model's layers are transformers' own code: plan it with pp 1")
    if hardware is None:
        hardware, named_chips = default_hardware(cfg, measure=measure)
        chips = chips if chips is not None else named_chips
    devices = chips * hardware.devices_per_chip if chips is not None else None
    args = model_args if model_args is not None else spec.args
    # The run on these devices as it resolves (run/resolved.py): the mesh, the accumulation, the pipeline
    # schedule and what it implies, the compute dtype; the layouts the trainer does not run yet too.
    run = resolve_run(setup, Target(world_size=devices, compute_device_type=_device_type(hardware)), runnable=False,
                      args=args)
    devices, schedule = run.world_size, run.pipeline
    # The terms read the config: the planned copy takes the run's accumulation and, under pp, its buckets
    # and re-sharding (none).
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, global_batch_tokens=0,
                                                                grad_accum_steps=run.grad_accum_steps))
    if schedule is not None:
        parallelism = dataclasses.replace(cfg.parallelism, bucket_mb=run.bucket_mb,
                                          reshard_after_forward=str(run.reshard_after_forward).lower())
        cfg = dataclasses.replace(cfg, parallelism=parallelism)
    _check_parallel_support(cfg, args)
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[run.compute_dtype]
    hf = None
    if not spec.plannable:  # transformers' layers: measured, not written (plan/hf_terms.py)
        from titan_tpu.plan.hf_terms import hf_terms

        hf = hf_terms(dataclasses.replace(setup, cfg=cfg), dtype=dtype)
    # An hf model is one piece (HFCausalLM.init_plan): nothing re-sharded after a layer, so autograd
    # keeps every gathered weight, unless full checkpointing reruns each layer, its gathers included
    # (XLA's live ranges of qwen2_5_vl_7b_tpu: no gathered weight alive at the backward's peak).
    code = ("layer" if cfg.activation_checkpoint.mode == "full" else "model") if hf is not None else code_gather(cfg)
    gather = gather or code
    p = cfg.parallelism
    layout = Layout(**run.dims.config_sizes(), compute_bytes=_DTYPE_BYTES[dtype],
                    reduce_bytes=_DTYPE_BYTES[p.reduce_dtype], gather=gather, ep_dispatch=p.ep_dispatch,
                    # captured CPU/CUDA steps send the all-to-all's static buffer whole; TPU's is ragged
                    ep_padded=cfg.training.mode == "graph" and hardware.name not in TPU_NAMES)
    adapters = ({"adapter_params": hf.params.adapters} if cfg.lora.enabled else {}) if hf else _adapters(cfg, args)
    return Setting(cfg=cfg, run=run, label=spec.label, args=stage_args(args, schedule), hardware=hardware,
                   devices=devices, layout=layout, dtype=dtype, gather=gather, code_gather=code, schedule=schedule,
                   whole_args=args if schedule is not None else None, hf=hf, **adapters)


def _adapters(cfg: Config, args) -> dict:
    """LoRA's adapter elements and adapted linears, read off the unrolled model built on the meta
    device (no memory); nothing without LoRA."""
    if not cfg.lora.enabled:
        return {}
    # A search plans the same model and adapters for every candidate: build the meta model once.
    key = (repr(args), repr(cfg.lora))
    if key not in _ADAPTERS:
        _ADAPTERS[key] = _count_adapters(cfg, args)
    return _ADAPTERS[key]


_ADAPTERS: dict[tuple[str, str], dict] = {}


def _count_adapters(cfg: Config, args) -> dict:
    import torch

    from titan_tpu.models.common.transformer import Transformer
    from titan_tpu.models.lora import apply_lora, is_adapter_key, lora_modules

    with torch.device("meta"):
        model = Transformer(dataclasses.replace(args, max_seq_len=cfg.training.seq_len))
        apply_lora(model, cfg.lora)
    return {"adapter_params": sum(p.numel() for n, p in model.named_parameters() if is_adapter_key(n)),
            "adapted": tuple((name, m.in_features) for name, m in lora_modules(model).items())}


def _check_parallel_support(cfg: Config, args) -> None:
    """The tensor- and context-parallel combinations the code runs, or a one-line error. Pipeline
    stages are planned with tp and cp too, which the trainer does not run with them yet
    (parallel/mesh.py): a plan of what the layout would need."""
    tp, cp = cfg.parallelism.tp, cfg.parallelism.cp
    if tp > 1:
        check_tensor_parallel(args, tp, seq_len=cfg.training.seq_len)
    if cp > 1:
        check_context_parallel(cp, seq_len=cfg.training.seq_len, tp=tp)


def loss_impl(choice: str, hardware_name: str) -> str:
    """The loss kernel `auto` picks (kernels/__init__.py preference order), by device kind."""
    if choice != "auto":
        return choice
    return "tokamax" if hardware_name in TPU_NAMES else "chunked"


# Attention kernels whose op may draw random numbers (torch.Tag.nondeterministic_seeded: SDPA's ops).
SEEDED_ATTENTION = ("sdpa",)


def attention_impl(choice: str, hardware_name: str, *, documents: bool) -> str:
    """The attention kernel `auto` picks on this hardware's device kind, as the kernel registry picks
    it on a machine with every package installed; documents: the batch carries document masks."""
    if choice != "auto":
        return choice
    kind = "tpu" if hardware_name in TPU_NAMES else "cpu" if hardware_name == "cpu" else "cuda"
    return ATTENTION.resolve(choice, kind, DOCUMENTS if documents else frozenset(), installed=True).name


def chunk_attention_impl(choice: str, hardware_name: str) -> str:
    """The chunk_attention kernel (context parallelism) `auto` picks, by device kind."""
    if choice != "auto":
        return choice
    if hardware_name in TPU_NAMES:
        return "splash"
    return "sdpa" if hardware_name == "cpu" else "flex"


def grouped_mm_impl(choice: str, hardware_name: str) -> str:
    """The grouped_mm kernel `auto` picks (kernels/__init__.py preference order), by device kind."""
    if choice != "auto":
        return choice
    return "gmm" if hardware_name in TPU_NAMES else "torch"


def layer_params(args) -> list[int]:
    from titan_tpu.models.registry import _attention_params

    out = []
    for layer_id in range(args.n_layers + args.mtp_num_layers):  # the layers, then the MTP blocks
        if args.is_moe_layer(layer_id):
            ffn = args.dim * args.moe.num_experts + args.moe.num_experts * 3 * args.dim * args.moe.hidden_dim
        else:
            ffn = 3 * args.dim * args.ffn_hidden_dim
        mtp = 3 * args.dim + 2 * args.dim * args.dim if layer_id >= args.n_layers else 0  # norms, eh_proj
        out.append(_attention_params(args) + ffn + 2 * args.dim + mtp)
    return out


def attention_widths(args, tp: int = 1) -> tuple[int, int, int]:
    """Per token, on one of tp ranks: the widths of the queries, keys and values the attention
    kernel reads (what context parallelism gathers: keys and values). Multi-head latent attention
    expands its keys per head to qk_nope_head_dim + qk_rope_head_dim and its values to
    v_head_dim (models/common/mla.py)."""
    if args.mla is not None:
        heads = args.n_heads // tp
        return heads * args.mla.qk_head_dim, heads * args.mla.qk_head_dim, heads * args.mla.v_head_dim
    return args.n_heads * args.hd // tp, args.n_kv_heads * args.hd // tp, args.n_kv_heads * args.hd // tp
