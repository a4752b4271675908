"""Decoder-only transformer shared by Llama 3 and Qwen3 (dense).

Plain single-device PyTorch: no distributed or device logic. The module tree and parameter names
follow TorchTitan exactly (tok_embeddings, layers.{i}.attention.wq, ..., norm, output) so native
checkpoints are interchangeable with TorchTitan's.
"""

import contextlib
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_tpu.kernels import KernelConfig, document_ids_from_positions
from titan_tpu.model_contract import PER_LAYER_GATHER, GradientReducer, LossOutput, stored_weights
from titan_tpu.models.common.activation_checkpoint import checkpointed
from titan_tpu.models.common.attention import Attention
from titan_tpu.models.common.feed_forward import FeedForward
from titan_tpu.models.common.functional_block import FunctionalBlock, read_weights
from titan_tpu.models.common.kv_cache import KVCache, LayerCache
from titan_tpu.models.common.mla import MLA, MLAArgs
from titan_tpu.models.common.moe import ExpertDispatchSlot, MoE, MoEArgs, aux_loss_from_stats, updated_expert_bias
from titan_tpu.models.common.mtp import MTPLayer, mtp_tokens
from titan_tpu.models.common.norms import RMSNorm
from titan_tpu.models.common.rope import (
    RopeScaling,
    apply_rope,
    apply_rope_real,
    rope_cache,
    rope_rows,
    softmax_scale_factor,
)
from titan_tpu.models.common.scan import StackedBlocks, StackedRuns

__all__ = ["MLAArgs", "MoEArgs", "RopeScaling", "TransformerArgs", "TransformerBlock", "Transformer"]


@dataclass
class TransformerArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden_dim: int
    head_dim: int | None = None  # None -> dim // n_heads (Qwen3 sets it explicitly)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_embeddings: bool = False  # True: no `output` module; logits use tok_embeddings.weight
    max_seq_len: int = 4096  # length of the RoPE table
    moe: MoEArgs | None = None  # mixture-of-experts feed-forward (Qwen3-MoE); ffn_hidden_dim serves dense layers
    # Multi-head latent attention (DeepSeek-V3) instead of grouped-query attention; head_dim is then
    # its RoPE part (qk_rope_head_dim, the RoPE table's width) and n_kv_heads equals n_heads.
    mla: MLAArgs | None = None
    # Multi-token prediction (DeepSeek-V3, models/common/mtp.py): depths D after the main model, each
    # one block of the model's kind (the block at layer index n_layers + k - 1: MoE in DeepSeek-V3);
    # the loss adds mtp_loss_scaling_factor * the mean of their cross-entropies.
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1

    def __post_init__(self):
        # Accept plain dicts for the nested args so TOML/JSON configs and checkpoints can spell them.
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if isinstance(self.moe, dict):
            self.moe = MoEArgs(**self.moe)
        if isinstance(self.mla, dict):
            self.mla = MLAArgs(**self.mla)
        if self.mla is not None:
            if self.head_dim not in (None, self.mla.qk_rope_head_dim) or self.n_kv_heads != self.n_heads:
                raise ValueError(f"model mla needs head_dim = mla.qk_rope_head_dim ({self.mla.qk_rope_head_dim}) and "
                                 f"n_kv_heads = n_heads ({self.n_heads}), got {self.head_dim} and {self.n_kv_heads}")
            self.head_dim = self.mla.qk_rope_head_dim
        for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim",
                      "max_seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model {field} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"model n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads}); change one of them"
            )
        if self.head_dim is None and self.dim % self.n_heads != 0:
            raise ValueError(
                f"model dim ({self.dim}) must be divisible by n_heads ({self.n_heads}), "
                "or set head_dim explicitly"
            )
        if self.head_dim is not None and self.head_dim <= 0:
            raise ValueError(f"model head_dim must be a positive integer, got {self.head_dim!r}")
        if self.hd % 2 != 0:
            raise ValueError(f"model head dim ({self.hd}) must be even for RoPE")
        if not isinstance(self.mtp_num_layers, int) or self.mtp_num_layers < 0:
            raise ValueError(f"model mtp_num_layers must be an integer >= 0, got {self.mtp_num_layers!r}")
        if self.mtp_loss_scaling_factor < 0:
            raise ValueError(f"model mtp_loss_scaling_factor must be >= 0, got {self.mtp_loss_scaling_factor}")
        if self.norm_eps <= 0:
            raise ValueError(f"model norm_eps must be positive, got {self.norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"model rope_theta must be positive, got {self.rope_theta}")
        s = self.rope_scaling
        if s is not None and (s.factor <= 0 or s.high_freq_factor <= s.low_freq_factor):
            raise ValueError(
                "model rope_scaling needs factor > 0 and high_freq_factor > low_freq_factor, "
                f"got {s}"
            )

    @property
    def hd(self) -> int:
        """Effective head dimension."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer_id)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then h + feed_forward(norm(h)), the feed-forward
    being a mixture of experts (`moe`) in MoE layers.

    Returns (h, statistics): the MoE layer's [2, E] statistics (moe.py), an empty tensor for a
    dense block, so every block has one signature (loops, checkpointing and scan stay uniform)."""

    def __init__(self, args: TransformerArgs, *, rope_fn=apply_rope, kernels: KernelConfig | None = None,
                 moe_layer: bool = False, dispatch_slot: ExpertDispatchSlot | None = None):
        super().__init__()
        if args.mla is not None:
            self.attention = MLA(dim=args.dim, n_heads=args.n_heads, args=args.mla, rope_fn=rope_fn, kernels=kernels,
                                 softmax_scale_factor=softmax_scale_factor(args.rope_scaling))
        else:
            self.attention = Attention(
                dim=args.dim,
                n_heads=args.n_heads,
                n_kv_heads=args.n_kv_heads,
                head_dim=args.hd,
                qk_norm=args.qk_norm,
                norm_eps=args.norm_eps,
                rope_fn=rope_fn,
                kernels=kernels,
            )
        if moe_layer:
            self.moe = MoE(dim=args.dim, args=args.moe, kernels=kernels, dispatch_slot=dispatch_slot)
            self.feed_forward = None
        else:
            self.feed_forward = FeedForward(dim=args.dim, hidden_dim=args.ffn_hidden_dim)
            self.moe = None
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x_BSD: torch.Tensor, rope_xSP2: torch.Tensor, document_ids_BS: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h_BSD = x_BSD + self.attention(self.attention_norm(x_BSD), rope_xSP2, document_ids_BS, cache)
        if self.moe is None:
            return h_BSD + self.feed_forward(self.ffn_norm(h_BSD)), h_BSD.new_zeros(0)
        out_BSD, stats_2E = self.moe(self.ffn_norm(h_BSD))
        return h_BSD + out_BSD, stats_2E


class Transformer(nn.Module):
    """The model. Two execution options leave the architecture (and checkpoints) unchanged:

    scan_layers: store the blocks stacked and run them with torch's scan op (models/common/scan.py)
    instead of a Python loop, so a compiler sees one block whatever the depth.
    ac_mode: activation checkpointing per block, "none" | "full" | "selective"
    (models/common/activation_checkpoint.py).
    kernels: the implementation of attention and of the output projection + loss (titan_tpu/kernels).

    Called as ``model(tokens_BS)`` it returns logits; as ``model(tokens_BS, labels_BS)`` the summed
    cross-entropy, computed by the loss kernel from the final hidden states and the output weight
    (`hidden_states`, `output_weight`) without necessarily materialising the logits. With
    ``positions_BS`` (per-token positions restarting at 0 where a packed document starts) RoPE
    follows them and attention stays within each document.
    """

    def __init__(self, args: TransformerArgs, *, scan_layers: bool = False, ac_mode: str = "none",
                 kernels: KernelConfig | None = None):
        super().__init__()
        self.args = args
        self.scan_layers = scan_layers
        self.kernels = kernels = kernels or KernelConfig()
        # One dispatch holder for every MoE layer and block template (expert parallelism swaps it).
        self.expert_dispatch = slot = ExpertDispatchSlot()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        moe_layers = [args.is_moe_layer(i) for i in range(args.n_layers)]
        if scan_layers:
            # One stack per run of identical blocks (models/common/scan.py): one for most models,
            # DeepSeek-V3's dense first layers and then its MoE layers as two.
            runs = [(functools.partial(TransformerBlock, args, rope_fn=apply_rope_real, kernels=kernels,
                                       moe_layer=moe, dispatch_slot=slot), len(list(group)))
                    for moe, group in itertools.groupby(moe_layers)]
            if len(runs) == 1:
                self.layers = StackedBlocks(runs[0][0], args.n_layers, init_layer=_init_block_at, ac_mode=ac_mode)
            else:
                self.layers = StackedRuns(runs, init_layer=_init_block_at, ac_mode=ac_mode)
        else:
            # A ModuleDict keyed "0".."L-1" (as TorchTitan) keeps layer names stable when a
            # pipeline stage deletes the layers it does not own.
            self.layers = nn.ModuleDict({str(i): TransformerBlock(args, kernels=kernels, moe_layer=moe,
                                                                  dispatch_slot=slot)
                                         for i, moe in enumerate(moe_layers)})
            # Checkpointed blocks run as functions of their weights, so that the recomputation in
            # the backward uses the same weights (see functional_block.py); one template per kind.
            self._checkpointed_blocks: dict[bool, CheckpointedBlock] = {}  # by "is an MoE block"
            if ac_mode != "none":
                for moe in set(moe_layers):
                    self._checkpointed_blocks[moe] = CheckpointedBlock(
                        FunctionalBlock(functools.partial(TransformerBlock, args, kernels=kernels, moe_layer=moe,
                                                          dispatch_slot=slot)), ac_mode)
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = (
            None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        )
        self.mtp, self._mtp_checkpointed = self._build_mtp(ac_mode, slot)
        # Non-persistent: derived from args, never saved. Under `torch.device("meta")` this is a
        # free meta tensor; init_weights()/init_buffers() recompute it after materialisation.
        self.register_buffer("rope_cache", self._compute_rope_cache(), persistent=False)
        # This rank's pipeline stage under parallelism.pp > 1 (parallel/pipeline.py PipelineStage).
        self.pipeline = None

    def _build_mtp(self, ac_mode: str, slot: ExpertDispatchSlot) -> tuple[nn.ModuleDict | None, dict]:
        """The multi-token-prediction depths ("0".."D-1"), each block the kind of layer index
        n_layers + k, and their checkpointed templates (by "is an MoE block") under ac_mode."""
        a = self.args
        if not a.mtp_num_layers:
            return None, {}
        kinds = [a.is_moe_layer(a.n_layers + k) for k in range(a.mtp_num_layers)]
        make = functools.partial(TransformerBlock, a, kernels=self.kernels, dispatch_slot=slot)
        mtp = nn.ModuleDict({str(k): MTPLayer(a.dim, eps=a.norm_eps, block=make(moe_layer=moe))
                             for k, moe in enumerate(kinds)})
        checkpointed = {} if ac_mode == "none" else {
            moe: CheckpointedBlock(FunctionalBlock(functools.partial(make, moe_layer=moe)), ac_mode)
            for moe in set(kinds)}
        return mtp, checkpointed

    def block_templates(self) -> list[nn.Module]:
        """The meta-device blocks that checkpointed or scanned layers run as functions of their
        weights (functional_block.py), beside the blocks in `layers`: whatever changes how a block
        computes (tensor parallelism's plan) applies to these too."""
        if self.scan_layers:
            return [stack._block_fn.template for _, stack in self.stacks()]
        return [block.block_fn.template for block in self._checkpointed_blocks.values()]

    def _compute_rope_cache(self, device: torch.device | None = None) -> torch.Tensor:
        a = self.args
        with torch.device(device) if device is not None else contextlib.nullcontext():
            return rope_cache(
                head_dim=a.hd, max_seq_len=a.max_seq_len, theta=a.rope_theta, scaling=a.rope_scaling
            )

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the RoPE table (fp32) on `device` (default: where the embeddings live).

        Needed after `to_empty()` or `load_state_dict(assign=True)` from a meta-built model,
        because non-persistent buffers are neither initialised nor loaded.
        """
        if device is None:
            # Via parameters(), not `.weight`: under data parallelism reading the attribute
            # would all-gather the embedding just to learn its device.
            device = next(self.parameters()).device
        table = self._compute_rope_cache(torch.device(device))
        old = self.rope_cache
        same_layout = (old.shape, old.dtype, old.device) == (table.shape, table.dtype, table.device)
        if not old.is_meta and same_layout:
            old.copy_(table)  # in place: anything holding the buffer sees the new values
        else:
            self.rope_cache = table

    # Per-parameter dicts (optimizer moments) in the checkpoint layout. Identity when unrolled.

    def stacks(self) -> list[tuple[str, StackedBlocks]]:
        """(name, stack) of the scanned stacks in layer order: `layers` itself, or the runs of
        `StackedRuns` (`layers.run0`, ...) when the blocks differ; empty unless scan_layers."""
        if not self.scan_layers:
            return []
        return self.layers.stacks("layers.") if isinstance(self.layers, StackedRuns) else [("layers", self.layers)]

    def stacked_parameter_names(self) -> set[str]:
        """Names of the parameters that carry a leading layer axis (empty unless scan_layers)."""
        return {f"layers.{n}" for n in self.layers.param_names} if self.scan_layers else set()

    def to_per_layer(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stacked entries -> per-layer views (`layers.{i}.<name>`), as the state dict shows them."""
        return self.layers.to_per_layer(named, "layers.") if self.scan_layers else dict(named)

    def from_per_layer(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.layers.from_per_layer(named, "layers.") if self.scan_layers else dict(named)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter in place and the RoPE buffer, from torch's global RNG.

        TorchTitan-style: truncated normal (cut at 3 std) with std 0.02 for the input-side
        projections; wo, w2 and w3 get 0.02 / sqrt(2 * (layer_id + 1)) so deeper residual
        branches start smaller; the output projection std dim**-0.5 gives O(1) logits; norms 1.
        Embeddings are N(0, 1) when untied (RMSNorm rescales them anyway); when tied they double
        as the output projection, so they take the output projection's std instead.
        """
        for _, _, init in self.init_plan():
            init()
        self.init_buffers()

    def init_plan(self) -> list[tuple[str, nn.Module, Callable[[], None]]]:
        """The parameter-owning pieces in init order: (name, module, init function).

        Running the functions in this order is `init_weights` (minus the RoPE buffer). Sharded
        initialisation walks the same list, materialising and initialising one piece at a time at
        full size and sharding it before the next, so it consumes the global RNG exactly as one
        process does and gets bitwise the same weights without ever holding the whole model.
        """
        plan = [("tok_embeddings", self.tok_embeddings, self._init_tok_embeddings)]
        if self.scan_layers:  # a piece per stack, each initialised layer by layer in order
            plan += [(name, stack, stack.init_weights) for name, stack in self.stacks()]
        else:
            for layer_id, (name, layer) in enumerate(self.layers.items()):
                init = functools.partial(_init_block, layer, layer_id=layer_id)
                plan.append((f"layers.{name}", layer, init))
        plan.append(("norm", self.norm, self.norm.reset_parameters))
        if self.output is not None:
            plan.append(("output", self.output, self._init_output))
        # Last, so that the main model's weights are drawn as without MTP.
        for k, layer in (self.mtp or {}).items():
            plan.append((f"mtp.{k}", layer, functools.partial(_init_mtp_layer, layer,
                                                              layer_id=self.args.n_layers + int(k))))
        return plan

    def _init_tok_embeddings(self) -> None:
        if self.args.tie_embeddings:
            _trunc_normal(self.tok_embeddings.weight, self.args.dim**-0.5)
        else:
            nn.init.normal_(self.tok_embeddings.weight)

    def _init_output(self) -> None:
        _trunc_normal(self.output.weight, self.args.dim**-0.5)

    def forward(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor | None = None, *,
                positions_BS: torch.Tensor | None = None, document_ids_BS: torch.Tensor | None = None,
                per_sequence: bool = False) -> torch.Tensor | LossOutput:
        """Logits [B, S, V] in the parameters' dtype; with labels, a `LossOutput`: the summed
        next-token cross-entropy from the loss kernel, the MoE balancing loss and expert loads.
        positions_BS and document_ids_BS: see `hidden_states`. per_sequence: the cross-entropy
        summed per row, ce_sum [B] (a sequence's negative log-likelihood: preference objectives),
        and no multi-token prediction."""
        if self.pipeline is not None:
            return self._pipelined_loss(tokens_BS, labels_BS, positions_BS=positions_BS,
                                        document_ids_BS=document_ids_BS, per_sequence=per_sequence)
        h_BSD, stats_L2E = self.hidden_states(tokens_BS, positions_BS=positions_BS, document_ids_BS=document_ids_BS)
        w_VD = self.output_weight()
        if labels_BS is None:
            return F.linear(h_BSD, w_VD)
        loss_fn = self.kernels.loss_fn(h_BSD.device.type)
        if per_sequence:
            ce_sum = sequence_ce_sums(loss_fn, h_BSD, w_VD, labels_BS)
        else:
            ce_sum = loss_fn(h_BSD.flatten(0, 1), w_VD, labels_BS.flatten())
        mtp = {}
        if self.mtp is not None and not per_sequence:
            mtp_ce_sum, stats_L2E = self._mtp_loss(h_BSD, stats_L2E, tokens_BS, labels_BS, w_VD, loss_fn,
                                                   positions_BS=positions_BS, document_ids_BS=document_ids_BS)
            mtp = {"mtp_ce_sum": mtp_ce_sum, "mtp_weight": self.args.mtp_loss_scaling_factor}
        moe = self.args.moe
        if moe is None or stats_L2E.shape[0] == 0:  # dense, or MoE args whose layers are all dense
            return LossOutput(ce_sum, ce_sum.new_zeros(()) if per_sequence else torch.zeros_like(ce_sum),
                              ce_sum.new_zeros(0, 0), **mtp)
        aux = ce_sum.new_zeros(())
        if moe.load_balance == "aux_loss":
            aux = moe.aux_loss_coef * aux_loss_from_stats(stats_L2E, top_k=moe.top_k)
        return LossOutput(ce_sum, aux, stats_L2E[:, 0].detach(), **mtp)

    def _pipelined_loss(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor | None, *,
                        positions_BS: torch.Tensor | None, document_ids_BS: torch.Tensor | None,
                        per_sequence: bool) -> LossOutput:
        """The summed cross-entropy with the layers split into pipeline stages (parallel/pipeline.py):
        the stages pass the batch's micro-batches along, the last stage's outputs are shared out
        over the stages by token, each computes the loss of its share, every stage reports the sum."""
        if labels_BS is None or per_sequence:
            raise ValueError("a model split into pipeline stages (parallelism.pp > 1) computes the summed "
                             "next-token loss only, not logits or per-sequence sums; run it with pp 1 for those")
        rope, document_ids_BS = self._rope_and_documents(tokens_BS.shape[1], positions_BS, document_ids_BS)
        *ahead, stack = [stack for _, stack in self.stacks()]
        h_BSD = self.tok_embeddings(tokens_BS)
        for dense in ahead:  # DeepSeek-V3's dense first layers: whole on every stage, ahead of the stages
            h_BSD, _ = dense(h_BSD, rope, document_ids_BS)
        h_BSD, stats_R2E = self.pipeline.run(stack, h_BSD, rope, document_ids_BS)
        # The final norm before the share-out: under tp its hook gathers the sequence shards.
        h_ND, labels_N = self.pipeline.loss_share(self.norm(h_BSD), labels_BS)
        loss_fn = self.kernels.loss_fn(h_ND.device.type)
        ce_sum = self.pipeline.loss_everywhere(loss_fn(h_ND, self.output_weight(), labels_N))
        if stats_R2E is None:  # dense blocks
            return LossOutput(ce_sum, torch.zeros_like(ce_sum), ce_sum.new_zeros(0, 0))
        # MoE: this stage's layers' statistics of the whole batch (every micro-batch's), each layer's
        # loads summed over the stages, and the balancing loss of every layer as one process computes
        # it: linear in the router probabilities given the (detached) loads, so each stage's term of
        # its own layers, summed over the stages, is the whole, differentiable in the stage's share.
        stats_L2E = self.pipeline.layer_statistics(stats_R2E)
        load_LE = self.pipeline.sum_over_stages(stats_L2E[:, 0])
        moe = self.args.moe
        aux = ce_sum.new_zeros(())
        if moe.load_balance == "aux_loss":
            share = aux_loss_from_stats(torch.stack([load_LE, stats_L2E[:, 1]], dim=1), top_k=moe.top_k)
            aux = self.pipeline.loss_everywhere(moe.aux_loss_coef * share)
        return LossOutput(ce_sum, aux, load_LE)

    def _mtp_loss(self, h_BSD: torch.Tensor, stats_L2E: torch.Tensor, tokens_BS: torch.Tensor,
                  labels_BS: torch.Tensor, w_VD: torch.Tensor, loss_fn, *, positions_BS: torch.Tensor | None,
                  document_ids_BS: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MTP depths' summed cross-entropies, their mean over depths; the MoE statistics with
        the MTP blocks' rows appended), from the main model's final hidden states (models/common/mtp.py)."""
        rope = rope_rows(self.rope_cache, tokens_BS.shape[1], positions_BS)
        if document_ids_BS is None and positions_BS is not None:
            document_ids_BS = document_ids_from_positions(positions_BS)
        ce_sums, moe_stats = [], [stats_L2E] if stats_L2E.numel() else []
        for depth, layer in enumerate(self.mtp.values(), start=1):
            next_BS, targets_BS = mtp_tokens(tokens_BS, labels_BS, positions_BS, depth=depth)
            x_BSD = layer.block_input(h_BSD, self.tok_embeddings(next_BS))
            h_BSD, layer_stats = self._run_block(layer.block, x_BSD, rope, document_ids_BS, self._mtp_checkpointed)
            ce_sums.append(loss_fn(layer.norm(h_BSD).flatten(0, 1), w_VD, targets_BS.flatten()))
            if layer.block.moe is not None:
                moe_stats.append(layer_stats.unsqueeze(0))
        stats_L2E = torch.cat(moe_stats) if moe_stats else stats_L2E
        return torch.stack(ce_sums).mean(), stats_L2E

    def gradient_reducer(self) -> GradientReducer | None:
        """This rank's pipeline stage sums the gradients of the weights every stage holds (model contract)."""
        return self.pipeline

    def expert_load_layers(self) -> list[int]:
        """The block of each expert_load row: the MoE blocks in order, then the MoE blocks of
        multi-token prediction (depth k is block n_layers + k, as `_build_mtp` and HF's DeepSeek-V3
        number it; a per-sequence forward runs no MTP depth and reports the main blocks' rows only)."""
        return [i for i in range(self.args.n_layers + self.args.mtp_num_layers) if self.args.is_moe_layer(i)]

    def expert_bias_names(self) -> list[str]:
        """Buffers moved by auxiliary-loss-free balancing, in expert_load's layer order."""
        if self.args.moe is None or self.args.moe.load_balance != "expert_bias":
            return []
        mtp = [f"mtp.{k}.block.moe.expert_bias" for k, layer in (self.mtp or {}).items() if layer.block.moe is not None]
        if self.scan_layers:  # stacked [layers of the stack, E], then the MTP blocks' [E]
            return [f"{name}.moe.expert_bias" for name, stack in self.stacks()
                    if stack._block_fn.template.moe is not None] + mtp
        return [f"layers.{i}.moe.expert_bias" for i in range(self.args.n_layers) if self.args.is_moe_layer(i)] + mtp

    def updated_expert_biases(self, biases: dict[str, torch.Tensor],
                              expert_load_LE: torch.Tensor) -> dict[str, torch.Tensor]:
        """New values of `expert_bias_names()` after a step whose (global) expert loads were
        `expert_load_LE`; pure, so the graph trainer traces it like the optimizer update."""
        rate = self.args.moe.bias_update_rate
        names = self.expert_bias_names()
        if self.scan_layers and self.pipeline is not None:
            return self._pipelined_expert_biases(biases, expert_load_LE)
        if self.scan_layers:  # each stack's rows of expert_load_LE in layer order, then one row per MTP block
            stacked = [name for name in names if name.startswith("layers.")]
            sizes = [biases[name].shape[0] for name in stacked] + [1] * (len(names) - len(stacked))
            loads = expert_load_LE.split(sizes)
            return {name: updated_expert_bias(biases[name], load if name in stacked else load[0], rate)
                    for name, load in zip(names, loads)}
        return {name: updated_expert_bias(biases[name], expert_load_LE[i], rate) for i, name in enumerate(names)}

    def _pipelined_expert_biases(self, biases: dict[str, torch.Tensor],
                                 expert_load_LE: torch.Tensor) -> dict[str, torch.Tensor]:
        """`updated_expert_biases` of a model in pipeline stages: each stack's rows in `row_layers`
        order (stage by stage), a padding row given zero loads (a padding row's bias is never read),
        each row against its own layer's mean (the padding rows' zeros would pull a whole-stack mean
        down); a slice per run of consecutive rows (a stage's chunk), so that the step's graph does not
        grow with depth."""
        rate, names = self.args.moe.bias_update_rate, self.expert_bias_names()
        row_of = {layer: i for i, layer in enumerate(self.expert_load_layers())}
        out = {}
        for name, stack in self.stacks():
            key = f"{name}.moe.expert_bias"
            if key in biases:
                # Runs of consecutive rows (a stage's chunks), padding rows as zeros: slices, not an
                # index tensor (a constant, which the JAX lowering has no way to take).
                runs: list[list[int]] = []  # [first row of expert_load_LE or -1 for padding, count]
                for layer in stack.row_layers:
                    row = row_of[layer] if layer in stack.layer_ids else -1
                    last = runs[-1] if runs else None
                    if last and ((row == -1 and last[0] == -1) or (row != -1 and row == last[0] + last[1])):
                        last[1] += 1
                    else:
                        runs.append([row, 1])
                load_RE = torch.cat([expert_load_LE.new_zeros(n, expert_load_LE.shape[1]) if row == -1
                                     else expert_load_LE[row:row + n] for row, n in runs])
                out[key] = updated_expert_bias(biases[key], load_RE, rate, per_row=True)
        mtp = [name for name in names if name not in out]
        loads = expert_load_LE[len(expert_load_LE) - len(mtp):]
        out.update({name: updated_expert_bias(biases[name], load, rate) for name, load in zip(mtp, loads)})
        return out

    def output_weight(self) -> torch.Tensor:
        """The output projection's weight [V, D] (the embedding when tied), as computed with:
        under data parallelism, the all-gathered tensor."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def hidden_states(self, tokens_BS: torch.Tensor, *, positions_BS: torch.Tensor | None = None,
                      document_ids_BS: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, S] -> (final hidden states [B, S, D] after the last norm, the MoE layers'
        statistics [L_moe, 2, E]; [0, 0] for a dense model).

        positions_BS: each token's RoPE position (default 0..S-1). document_ids_BS: each token's
        document, attention staying within it; by default derived from positions_BS, read as
        the loader's packed form (positions restart at 0 where a document starts). A caller that
        holds part of a sequence (context parallelism) passes both."""
        rope, document_ids_BS = self._rope_and_documents(tokens_BS.shape[1], positions_BS, document_ids_BS)
        h_BSD = self.tok_embeddings(tokens_BS)
        if self.scan_layers:  # one scan per stack of blocks (models/common/scan.py)
            h_BSD, stats_L2E = self.layers(h_BSD, rope, document_ids_BS)
            stats_L2E = stats_L2E if self.args.moe is not None else stats_L2E.new_zeros(0, 0)
        else:
            moe_stats = []
            for layer in self.layers.values():
                h_BSD, layer_stats = self._run_block(layer, h_BSD, rope, document_ids_BS)
                if layer.moe is not None:
                    moe_stats.append(layer_stats)
            stats_L2E = torch.stack(moe_stats) if moe_stats else h_BSD.new_zeros(0, 0)
        return self.norm(h_BSD), stats_L2E

    def _rope_and_documents(self, S: int, positions_BS: torch.Tensor | None,
                            document_ids_BS: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The RoPE rows of a batch of S tokens and each token's document (see `hidden_states`)."""
        if S > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {S} exceeds the model's max_seq_len {self.args.max_seq_len}; "
                "raise model max_seq_len or shorten the sequences"
            )
        if document_ids_BS is None and positions_BS is not None:
            document_ids_BS = document_ids_from_positions(positions_BS)
        return rope_rows(self.rope_cache, S, positions_BS), document_ids_BS

    @property
    def decodes_with_cache(self) -> bool:
        """Whether `cached_hidden_states` runs: unrolled layers without activation checkpointing."""
        return not self.scan_layers and not self._checkpointed_blocks

    def cached_hidden_states(self, tokens_BS: torch.Tensor, *, positions_BS: torch.Tensor,
                             cache: KVCache) -> torch.Tensor:
        """`hidden_states` for decoding: each token at its row's position, its keys and values
        written into `cache` and its attention over the cached positions up to its own
        (models/common/kv_cache.py). Unrolled layers without checkpointing, as generation builds them."""
        assert self.decodes_with_cache, "decode with the plain layer loop"
        rope = rope_rows(self.rope_cache, tokens_BS.shape[1], positions_BS)
        h_BSD = self.tok_embeddings(tokens_BS)
        for layer, layer_cache in zip(self.layers.values(), cache.at(positions_BS), strict=True):
            h_BSD, _ = layer(h_BSD, rope, None, layer_cache)
        return self.norm(h_BSD)

    def kv_cache(self, *, batch: int, length: int) -> KVCache:
        """An empty decode cache of `length` positions for `batch` rows, in the weights' dtype."""
        weight = self.tok_embeddings.weight
        shapes = [layer.attention.cache_entry_shapes() for layer in self.layers.values()]
        return KVCache.empty(shapes, batch=batch, length=length, dtype=weight.dtype, device=weight.device)

    def _run_block(self, layer: TransformerBlock, h_BSD: torch.Tensor, rope: torch.Tensor,
                   document_ids_BS: torch.Tensor | None,
                   checkpointed: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One unrolled block: the module itself, or under activation checkpointing its kind's
        `CheckpointedBlock` (dense or MoE; from `checkpointed`, by default the layers'), which runs
        it as a function of its weights."""
        checkpointed = self._checkpointed_blocks if checkpointed is None else checkpointed
        checkpointed_block = checkpointed.get(layer.moe is not None)
        if checkpointed_block is None:
            return layer(h_BSD, rope, document_ids_BS)
        return checkpointed_block(layer, h_BSD, rope, document_ids_BS)


def sequence_ce_sums(loss_fn, h_BSD: torch.Tensor, w_VD: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Each row's summed cross-entropy [B], through the loss kernel one row at a time (the kernel
    sums over the tokens it is given; a row at a time keeps its chunking and never the logits)."""
    return torch.stack([loss_fn(h_BSD[b], w_VD, labels_BS[b]) for b in range(h_BSD.shape[0])])


class CheckpointedBlock:
    """One kind of block (dense or MoE) under activation checkpointing, run as a function of a
    layer's weights (functional_block.py), so that the recomputation in the backward uses the same
    weights. The weights are the layer's parameters read as attributes (under data parallelism the
    gathered tensors), or, when a data-parallel wrapper set `PER_LAYER_GATHER` on the layer, its
    stored shards, gathered inside the checkpointed region: the recomputation then gathers them
    again, and the gathered weights are not kept from the forward to the backward."""

    def __init__(self, block_fn: FunctionalBlock, ac_mode: str):
        self.block_fn = block_fn
        self._run = checkpointed(block_fn, ac_mode)
        self._gather_then_run = checkpointed(functools.partial(_gather_then_run, block_fn), ac_mode)

    def __call__(self, layer: TransformerBlock, h_BSD: torch.Tensor, rope: torch.Tensor,
                 document_ids_BS: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        names = self.block_fn.param_names
        gather = getattr(layer, PER_LAYER_GATHER, None)
        if gather is None:
            return self._run(h_BSD, rope, document_ids_BS, *read_weights(layer, names))
        return self._gather_then_run(h_BSD, rope, document_ids_BS, gather, *stored_weights(layer, names))


def _gather_then_run(block_fn: FunctionalBlock, h_BSD, rope, document_ids_BS, gather, *stored):
    return block_fn(h_BSD, rope, document_ids_BS, *gather.gather(list(stored)))


def _init_block_at(layer: TransformerBlock, layer_id: int) -> None:
    _init_block(layer, layer_id=layer_id)


@torch.no_grad()
def _init_block(layer: TransformerBlock, *, layer_id: int) -> None:
    # layer_id is the position in the stack (layers "0".."L-1" today); deeper blocks start smaller.
    depth_std = 0.02 / math.sqrt(2 * (layer_id + 1))
    attn, ffn = layer.attention, layer.feed_forward
    if isinstance(attn, MLA):
        attn.init_weights(std=0.02, depth_std=depth_std)
        attention_linears, attention_norms = (), ()
    else:
        attention_linears, attention_norms = (attn.wq, attn.wk, attn.wv), (attn.q_norm, attn.k_norm)
    for linear in attention_linears + ((ffn.w1,) if ffn is not None else ()):
        _trunc_normal(linear.weight, 0.02)
    for linear in (() if isinstance(attn, MLA) else (attn.wo,)) + ((ffn.w2, ffn.w3) if ffn is not None else ()):
        _trunc_normal(linear.weight, depth_std)
    if layer.moe is not None:
        layer.moe.init_weights(std=0.02, depth_std=depth_std)
    for norm in (layer.attention_norm, layer.ffn_norm) + attention_norms:
        if norm is not None:
            norm.reset_parameters()


@torch.no_grad()
def _init_mtp_layer(layer: MTPLayer, *, layer_id: int) -> None:
    layer.init_weights(std=0.02)
    _init_block(layer.block, layer_id=layer_id)


def _trunc_normal(weight: torch.Tensor, std: float) -> None:
    """`nn.init.trunc_normal_(weight, std=std, a=-3 std, b=3 std)`, bitwise, in less memory.

    torch draws a normal sample and redraws, as a whole new tensor, until no value lies outside
    [a, b], replacing the outliers with `torch.where`: about four full-size temporaries (an 8B
    model's output projection, 2.1 GB, took 8 GB more to initialise). The same draws here, with one
    temporary (the redraw, which must be whole to take the generator's values in the same order)
    and a boolean mask, the outliers replaced in place."""
    if weight.is_meta:
        return
    with torch.no_grad():
        # The bounds in the weight's dtype, as torch compares them.
        lo, hi = weight.new_tensor(-3 * std, device="cpu").item(), weight.new_tensor(3 * std, device="cpu").item()
        weight.normal_(0.0, std)
        while True:
            outside = (weight < lo) | (weight > hi)
            if not outside.any():
                return
            redrawn = torch.empty_like(weight).normal_(0.0, std)
            weight[outside] = redrawn[outside]
            del redrawn
