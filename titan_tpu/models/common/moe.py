"""Mixture-of-experts feed-forward: a top-k router over SwiGLU experts, dropless and static-shaped.

Routing (Qwen3-MoE, as transformers computes it): router logits = x @ gate^T (no bias), softmax
over all experts in fp32, the top-k experts by probability (by probability + `expert_bias` when
the auxiliary-loss-free balancing is on; the bias only chooses, it never weights), their
probabilities renormalised to sum to one when `norm_topk_prob`.

Dispatch without data-dependent shapes, so a traced step is one static graph (graph mode, XLA):
every token's k assignments are sorted by expert (a stable argsort), the token rows are gathered
in that order (T * k rows, whatever the routing), the per-expert row counts are a tensor (a
scatter-add, never read into Python), the experts run as grouped matmuls over the sorted rows
(kernels/grouped_mm.py), and the weighted outputs are added back to their tokens with index_add.
Nothing is dropped: there is no capacity. Under expert parallelism an `ExpertDispatch` brings the
ep group's tokens to this rank's experts and sums the partial outputs back
(parallel/expert_parallel.py); the layer itself only sorts its own experts' rows first.

Balancing (MoEArgs.load_balance):
* "aux_loss": transformers' load_balancing_loss_func, E * sum_e f_e * P_e, with f_e the share of
  assignments to expert e and P_e its mean router probability, both over every MoE layer and
  token of the batch; added to the loss times `aux_loss_coef`.
* "expert_bias": DeepSeek-V3's auxiliary-loss-free balancing (TorchTitan's default): a per-layer
  bias added to the probabilities for choosing the top-k only, moved after every optimizer step by
  `bias_update_rate * sign(mean load - load)` (`updated_expert_bias`); a buffer, so checkpoints
  keep it.
* "none".

Each MoE layer returns, beside its output, its statistics [2, E]: tokens routed to each expert
(no gradient) and the sum of each expert's router probability over the tokens (with gradient, for
the auxiliary loss). The model turns them into the auxiliary loss and the expert-load metrics;
nothing is kept in module state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_tpu.kernels import KernelConfig
from titan_tpu.kernels.grouped_mm import with_linear_layout
from titan_tpu.model_contract import EXPERT_MARKER  # SimpleFSDP lays these weights out for expert parallelism
from titan_tpu.models.common.feed_forward import (
    FeedForward,
    feed_forward_matmul_outputs_per_token,
    feed_forward_saved_per_token,
)

__all__ = ["LOAD_BALANCE", "ExpertDispatch", "ExpertDispatchSlot", "MoE", "MoEArgs",
           "aux_loss_from_stats", "updated_expert_bias"]

LOAD_BALANCE = ("aux_loss", "expert_bias", "none")


@dataclass
class MoEArgs:
    num_experts: int
    top_k: int
    hidden_dim: int  # each expert's SwiGLU width (HF moe_intermediate_size)
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)  # ... and i is not listed here
    load_balance: str = "aux_loss"  # aux_loss | expert_bias | none
    aux_loss_coef: float = 0.001  # HF router_aux_loss_coef
    bias_update_rate: float = 0.001  # expert_bias step size
    # DeepSeek-V3's router and shared experts (the defaults are Qwen3-MoE's: none of them).
    score_func: str = "softmax"  # softmax | sigmoid (each expert's score on its own)
    n_group: int = 1  # experts in n_group equal groups; a token picks topk_group groups first ...
    topk_group: int = 1  # ... by the sum of each group's two best scores, then top_k experts within them
    route_scale: float = 1.0  # routed outputs' weights times this (HF routed_scaling_factor)
    num_shared_experts: int = 0  # a SwiGLU of width num_shared_experts * hidden_dim every token runs

    def __post_init__(self):
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"model moe.score_func must be softmax or sigmoid, got {self.score_func!r}")
        for name in ("n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model moe.{name} must be a positive integer, got {value!r}")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"model moe.n_group ({self.n_group}) must divide num_experts ({self.num_experts}) and be "
                             f">= moe.topk_group ({self.topk_group})")
        if self.n_group > 1 and (self.num_experts // self.n_group < 2
                                 or self.top_k > self.topk_group * self.num_experts // self.n_group):
            raise ValueError(f"model moe.n_group ({self.n_group}) leaves groups of fewer than 2 experts or fewer "
                             f"experts in topk_group groups than top_k ({self.top_k}); lower n_group")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(f"model moe.num_shared_experts must be >= 0, got {self.num_shared_experts!r}")
        for name in ("num_experts", "top_k", "hidden_dim", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model moe.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"model moe.top_k ({self.top_k}) must be <= moe.num_experts ({self.num_experts})")
        if self.load_balance not in LOAD_BALANCE:
            raise ValueError(f"model moe.load_balance must be one of {', '.join(LOAD_BALANCE)}, "
                             f"got {self.load_balance!r}")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0


class ExpertDispatch:
    """How an MoE layer's tokens reach its experts. This default: every expert is on this rank, so
    nothing moves. Expert parallelism installs one with the same methods that gathers the ep
    group's tokens and sums partial outputs back (parallel/expert_parallel.py)."""

    def first_local_expert(self, num_experts: int) -> int:
        return 0

    def gather(self, x_TD: Tensor, chosen_TK: Tensor, weights_TK: Tensor,
               num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
        return x_TD, chosen_TK, weights_TK

    def combine(self, out_ND: Tensor) -> Tensor:
        return out_ND


class ExpertDispatchSlot:
    """One holder shared by every MoE layer of a model (and by the block templates that scan and
    checkpointing run), so that parallelising the model swaps the dispatch in one place."""

    def __init__(self):
        self.dispatch: ExpertDispatch = ExpertDispatch()


class Router(nn.Module):
    """The gate: a linear map to one logit per expert (TorchTitan's name, moe.router.gate)."""

    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)


class GroupedExperts(nn.Module):
    """E SwiGLU experts, weights stacked per expert in nn.Linear's [out, in] layout:
    w1 (gate) [E, F, D], w2 (down) [E, D, F], w3 (up) [E, F, D]."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        setattr(self, EXPERT_MARKER, True)
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def grouped_linear(self, kernels: KernelConfig, device_type: str) -> Callable:
        """(x_ND, w_EFD, group_sizes) -> each row times its expert's w^T, the weights as stored: the
        configured grouped matmul (fp8's Float8GroupedExperts, models/fp8.py, runs it in float8)."""
        return with_linear_layout(kernels.grouped_mm_fn(device_type))


class MoE(nn.Module):
    def __init__(self, *, dim: int, args: MoEArgs, kernels: KernelConfig | None = None,
                 dispatch_slot: ExpertDispatchSlot | None = None):
        super().__init__()
        self.args = args
        self.kernels = kernels or KernelConfig()
        self.dispatch_slot = dispatch_slot or ExpertDispatchSlot()
        self.router = Router(dim, args.num_experts)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts)
        # DeepSeek's shared experts: one SwiGLU every token runs, beside the routed ones.
        self.shared_experts = (FeedForward(dim=dim, hidden_dim=args.num_shared_experts * args.hidden_dim)
                               if args.num_shared_experts else None)
        if args.load_balance == "expert_bias":
            self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x_BSD: Tensor) -> tuple[Tensor, Tensor]:
        """(output [B, S, D], statistics [2, E]: tokens per expert, router probability sums)."""
        E, k = self.args.num_experts, self.args.top_k
        x_TD = x_BSD.flatten(0, 1)
        chosen_TK, weights_TK, probs_TE = self._route(x_TD)
        weights_TK = weights_TK.to(x_BSD.dtype)
        # Statistics of this rank's own routing (before any dispatch).
        tokens_per_expert_E = _counts(chosen_TK.flatten(), E)
        stats_2E = torch.stack([tokens_per_expert_E.to(torch.float32), probs_TE.sum(dim=0)])

        # To the experts: under expert parallelism the ep group's tokens (all_gather) or the rows
        # sent to this rank (all_to_all), else this rank's.
        dispatch = self.dispatch_slot.dispatch
        x_MD, chosen_MK, weights_MK = dispatch.gather(x_TD, chosen_TK, weights_TK, E)
        w1, w2, w3 = self.experts.w1, self.experts.w2, self.experts.w3  # this rank's experts
        num_local = w1.shape[0]
        first = dispatch.first_local_expert(E)

        # Sort the M * k assignments by expert, this rank's experts first (numbered from `first`,
        # modulo E), so they are a prefix whose groups the grouped matmul runs; rows of other
        # ranks' experts fall past the last group and give zeros. Static shapes only.
        key_N = (chosen_MK.flatten() - first) % E  # N = M * k
        order_N = torch.argsort(key_N, stable=True)
        token_N = order_N // k
        group_sizes_L = _counts(key_N, E)[:num_local]
        x_ND = x_MD[token_N]
        linear = self.experts.grouped_linear(self.kernels, x_BSD.device.type)  # x @ w^T, w [E, out, in]
        h_NF = F.silu(linear(x_ND, w1, group_sizes_L)) * linear(x_ND, w3, group_sizes_L)
        y_ND = linear(h_NF, w2, group_sizes_L) * weights_MK.flatten()[order_N].unsqueeze(1)
        out_MD = torch.zeros_like(x_MD).index_add(0, token_N, y_ND)
        out_BSD = dispatch.combine(out_MD).view_as(x_BSD)
        if self.shared_experts is not None:
            out_BSD = out_BSD + self.shared_experts(x_BSD)
        return out_BSD, stats_2E

    def _route(self, x_TD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(chosen experts [T, k], their weights [T, k] fp32, each token's probabilities [T, E] fp32
        for the balancing statistics). softmax: Qwen3-MoE's routing above. sigmoid (DeepSeek-V3):
        each expert's score is sigmoid(logit); with n_group > 1 a token first keeps the topk_group
        groups whose two best scores (bias added) sum highest, then picks top_k experts among
        them; the weights are the chosen scores, renormalised when norm_topk_prob (with
        DeepSeek's 1e-20 guard), times route_scale. The probabilities for the statistics are the
        scores normalised to sum to one per token (DeepSeek-V3's sequence-wise balance loss)."""
        a, k = self.args, self.args.top_k
        logits_TE = self.router.gate(x_TD).float()
        if a.score_func == "softmax":
            probs_TE = scores_TE = logits_TE.softmax(dim=-1)
        else:
            scores_TE = logits_TE.sigmoid()
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
        choice_TE = scores_TE if self.expert_bias is None else scores_TE + self.expert_bias
        if a.n_group > 1:
            T, E = choice_TE.shape
            groups_TGX = choice_TE.view(T, a.n_group, E // a.n_group)
            group_scores_TG = groups_TGX.topk(2, dim=-1).values.sum(dim=-1)
            kept_TG = group_scores_TG.topk(a.topk_group, dim=-1).indices
            mask_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter(1, kept_TG, True)
            choice_TE = groups_TGX.masked_fill(~mask_TG.unsqueeze(-1), float("-inf")).view(T, E)
        chosen_TK = choice_TE.topk(k, dim=-1).indices
        weights_TK = scores_TE.gather(1, chosen_TK)
        if a.norm_topk_prob:
            guard = 1e-20 if a.score_func == "sigmoid" else 0.0
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + guard)
        if a.route_scale != 1.0:
            weights_TK = weights_TK * a.route_scale
        return chosen_TK, weights_TK, probs_TE

    @torch.no_grad()
    def init_weights(self, *, std: float, depth_std: float) -> None:
        """TorchTitan-style: router and gate/up weights N(0, std), down projection depth-scaled."""
        for w, s in ((self.router.gate.weight, std), (self.experts.w1, std), (self.experts.w3, depth_std),
                     (self.experts.w2, depth_std)):
            nn.init.trunc_normal_(w, mean=0.0, std=s, a=-3 * s, b=3 * s)
        if self.shared_experts is not None:
            sh = self.shared_experts
            for w, s in ((sh.w1.weight, std), (sh.w3.weight, depth_std), (sh.w2.weight, depth_std)):
                nn.init.trunc_normal_(w, mean=0.0, std=s, a=-3 * s, b=3 * s)
        if self.expert_bias is not None:
            self.expert_bias.zero_()


def _counts(ids_N: Tensor, n: int) -> Tensor:
    """How many of `ids_N` equal each of 0..n-1 ([n] int64), static-shaped: a scatter-add, not
    bincount (whose length depends on the data) nor F.one_hot (which validates with an .item())."""
    return torch.zeros(n, dtype=torch.int64, device=ids_N.device).scatter_add(0, ids_N, torch.ones_like(ids_N))


def aux_loss_from_stats(stats_L2E: Tensor, *, top_k: int) -> Tensor:
    """transformers' load-balancing loss from the MoE layers' statistics [L, 2, E]:
    E * sum_e f_e * P_e, f_e = assignments to e / (L * T), P_e = probability sum of e / (L * T),
    with T tokens per layer (the assignments of a layer sum to T * k)."""
    num_experts = stats_L2E.shape[-1]
    rows = stats_L2E[:, 0].sum() / top_k  # L * T
    tokens_per_expert_E = stats_L2E[:, 0].sum(dim=0) / rows
    prob_per_expert_E = stats_L2E[:, 1].sum(dim=0) / rows
    return num_experts * (tokens_per_expert_E.detach() * prob_per_expert_E).sum()


def updated_expert_bias(bias_E: Tensor, load_E: Tensor, rate: float, *, per_row: bool = False) -> Tensor:
    """One step of auxiliary-loss-free balancing: raise the bias of underloaded experts, lower
    that of overloaded ones, by `rate` (sign of the difference to the mean load). A stacked [L, E]
    bias takes [L, E] loads and one mean over them all: every layer routes the same tokens x top_k,
    so it is each layer's mean. per_row: each row against its own mean instead (a pipeline's stack,
    whose padding rows hold zero loads)."""
    mean = load_E.mean(dim=-1, keepdim=True) if per_row else load_E.mean()
    return bias_E + rate * torch.sign(mean - load_E)


def active_params_per_token(*, dim: int, args: MoEArgs) -> int:
    """Weights a token's forward touches in one MoE layer: the router, its top-k experts and the
    shared experts."""
    return dim * args.num_experts + (args.top_k + args.num_shared_experts) * 3 * dim * args.hidden_dim



def moe_saved_per_token(*, dim: int, args: MoEArgs, ep: int = 1) -> tuple[int, int]:
    """What `MoE.forward` keeps for its backward per token of this rank, without activation
    checkpointing, as (compute-dtype elements, 4-byte elements); the layer input is counted by
    the block. Router: the fp32 probabilities [E], the chosen experts and their weights. Dispatch
    (k rows per token; under expert parallelism the ep group's tokens, so ep * k rows): the
    gathered rows [D], the two grouped-matmul outputs, silu's output and their product [F each],
    the down projection's output and its weighted copy [D each], and the sort order (int64)."""
    k, rows = args.top_k, args.top_k * ep
    elements = rows * (3 * dim + 4 * args.hidden_dim)
    if args.num_shared_experts:
        elements += feed_forward_saved_per_token(args.num_shared_experts * args.hidden_dim)
    four_byte = args.num_experts + 1 + 2 * k + k + 4 * rows + rows  # probs, sum, chosen (int64), weights, order
    return elements, four_byte


def moe_matmul_outputs_per_token(*, dim: int, args: MoEArgs) -> tuple[int, int]:
    """What selective checkpointing keeps of an MoE layer per token: the router's logits (fp32
    count) — the grouped matmuls are not in its list of saved ops, so the experts are recomputed —
    and the shared experts' three matmul outputs."""
    shared = (feed_forward_matmul_outputs_per_token(dim=dim, hidden_dim=args.num_shared_experts * args.hidden_dim)
              if args.num_shared_experts else 0)
    return shared, args.num_experts
