"""Expert parallelism: the experts of each MoE layer spread over `ep` ranks, tokens brought to them.

Layout. EP is carved out of the data-parallel shard axis, as in TorchTitan: the expert mesh is the
dense mesh [dp_shard, pp, cp, tp] with dp_shard split into (dp_shard / ep, ep), axes
("dp_shard_mod_ep", "ep", "pp", "cp", "tp"), the size-1 ones left out. Under pipeline stages the
ep group is inside a stage (ranks that share a pp index), and a scanned stack of experts is split
over pp on its layer dim like every stacked weight (parallel/pipeline.py). Each expert weight [E, F, D] is a
DTensor on it, sharded on the expert dim over `ep` and, like any other weight under SimpleFSDP, on
its next dim over dp_shard_mod_ep (placements (Shard(1), Shard(0)); one dim later for scanned
[L, E, F, D] stacks), and whole on cp and tp. At compute time a rank all-gathers its experts over
dp_shard_mod_ep only and keeps the ep shard: its E / ep local experts, whole. Their gradients
reduce-scatter back over dp_shard_mod_ep (Partial) and stay sharded over ep. Non-expert weights
keep their plain SimpleFSDP layout on the dense mesh.

With context or tensor parallelism the cp and tp ranks of a data-parallel rank hold different tokens
when the MoE layer runs (cp: the rank's chunks of each sequence; tp: its sequence shard, the MoE
layer running between the sequence-parallel collectives, tensor_parallel.py), so to the experts they
are more data ranks: each routes its own tokens, the ep group of ranks that share (dp_shard_mod_ep,
cp, tp) coordinates exchanges them, and the experts' gradients are partial sums over cp and tp,
all-reduced there as a norm's are (simple_fsdp.py). Why not split the experts' hidden dim over tp
(Megatron's expert tensor parallelism): under ep the experts' weights are already divided E / ep
ways, and a tp split would add a gather and a reduce-scatter of the routed rows per layer in
exchange for memory that a larger ep buys without new collectives (docs/moe.md).

Dispatch, static-shaped (graph mode and XLA need it): every rank routes its own tokens, then the
ep group all-gathers the tokens and their routing (T tokens -> ep * T), each rank runs its local
experts over the gathered rows (the MoE layer sorts its local experts' rows first and leaves the
rest outside every group, which the grouped matmul turns into zeros), and a reduce-scatter sums
the partial outputs back to the ranks that own the tokens. This is MaxText's "ring of experts"
collective pattern: more bytes than an all-to-all with exact splits, but every shape is known
before the data is, so the collectives are ordinary static graph nodes. Both collectives are the
autograd-aware functional ones, so the backward is a reduce-scatter and an all-gather.

Dispatch by all-to-all (`--parallelism.ep_dispatch all_to_all`, `AllToAllDispatch`): each token
travels once to each rank that holds at least one of its k experts (not to every rank), with its
routing; the receiving rank runs its experts over the rows it got (the other experts named in a
row's routing are not local there and give zeros, as above), and the outputs come back the same
way and are added to their tokens. Three ways to move the rows, one per situation:
* eager (CPU, CUDA): exact. The per-destination row counts are exchanged first (a small
  all-to-all), read on the host, and the rows sent with `all_to_all_single` and those split
  sizes: only real rows travel, nothing dropped.
* captured (graph mode: fake tensors, no data-dependent sizes): a worst-case static buffer. A
  rank can send at most its T tokens to each peer, so every peer gets a fixed chunk of T rows:
  the needed rows first, then padding routed to an expert the receiver does not hold with weight
  0 (it computes nothing for them and returns zeros). Dropless and static, but the padding
  travels: the same bytes as the all-gather path. CPU/CUDA collectives have no ragged variant.
* TPU: `torch.tpu.ops.ragged_all_to_all`, the same worst-case buffer of which only the real
  rows travel (sizes and offsets are tensors). Written against torch-tpu 0.2.0's signature,
  selected on TPU devices and in a step captured for the JAX lowering (`titan-tpu compile`, where
  it is `jax.lax.ragged_all_to_all`); checked on CPU against an emulation of the op's contract
  (tests/test_moe.py) and lowered to JAX against our eager step (tests/tpu/), not yet run on a TPU.

The collectives are our own autograd Functions (forward and context apart, `setup_context`),
not torch's `*_autograd` functional collectives: those are torch.library autograd registrations
whose generated Function has no setup_context (torch 2.13), which torch.func refuses, and the
backward of scanned layers with full checkpointing recomputes each layer under torch.func.vjp
(models/common/scan.py).

The rank on ep (the first local expert, the padding's expert) is `rank_in` (parallel/group_rank.py):
an int, or in a step captured as one program for every rank the group_rank op (the mesh axis
index once lowered).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from titan_tpu.kernels import kernel_device_type
from titan_tpu.parallel.axes import CP_AXIS, EP_AXES, EP_AXIS, PP_AXIS, TP_AXIS
from titan_tpu.parallel.group_rank import rank_in
from titan_tpu.parallel.tensor_parallel import _GatherAlong, _ReduceScatterAlong, _wait

__all__ = ["EP_AXES", "EP_DISPATCH", "AllToAllDispatch", "ExpertParallelDispatch", "make_dispatch",
           "expert_placements", "build_expert_mesh"]

EP_DISPATCH = ("all_gather", "all_to_all")


def build_expert_mesh(device_type: str, *, dp_shard: int, ep: int, pp: int = 1, cp: int = 1,
                      tp: int = 1) -> DeviceMesh:
    """The (dp_shard / ep, ep, pp, cp, tp) mesh over all ranks (size-1 pp, cp and tp left out), laid
    over the dense mesh [dp_shard, pp, cp, tp] (global ranks row-major): the ep ranks of a group are
    dp_shard neighbours of one pipeline stage, pp x cp x tp ranks apart."""
    sizes = {EP_AXES[0]: dp_shard // ep, EP_AXES[1]: ep, PP_AXIS: pp, CP_AXIS: cp, TP_AXIS: tp}
    kept = {axis: size for axis, size in sizes.items() if axis in EP_AXES or size > 1}
    ranks = torch.arange(dp_shard * pp * cp * tp).view(*kept.values())
    return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(kept))


def expert_placements(stacked: bool, axes: tuple[str, ...] = EP_AXES) -> tuple[Placement, ...]:
    """Expert weights [E, F, D] (or stacked [L, E, F, D]) on the expert mesh of `axes`: rows over
    dp_shard_mod_ep, experts over ep, a stack's layers over pp (each pipeline stage its own rows),
    whole on cp and tp."""
    offset = 1 if stacked else 0
    by_axis = {EP_AXES[0]: Shard(1 + offset), EP_AXES[1]: Shard(0 + offset), PP_AXIS: Shard(0)}
    assert stacked or PP_AXIS not in axes, "pipeline stages split a scanned stack (run/setup.py)"
    return tuple(by_axis.get(axis, Replicate()) for axis in axes)


class ExpertParallelDispatch:
    """What an MoE layer calls to reach experts on other ranks (see moe.ExpertDispatch, the
    single-rank default with the same methods)."""

    def __init__(self, expert_mesh: DeviceMesh):
        self.mesh = expert_mesh
        self.group = (expert_mesh, EP_AXES.index(EP_AXIS))
        self.size = expert_mesh.size(EP_AXES.index(EP_AXIS))
        self.rank = expert_mesh.get_local_rank(EP_AXIS)

    def ep_rank(self) -> int | Tensor:
        """This rank on ep: an int, or the group_rank op in a step captured as one program."""
        return rank_in(self.mesh.get_group(EP_AXIS), self.rank)

    def first_local_expert(self, num_experts: int) -> int | Tensor:
        return self.ep_rank() * (num_experts // self.size)

    def gather(self, x_TD: Tensor, chosen_TK: Tensor, weights_TK: Tensor,
               num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
        """Every ep rank's tokens, routing choices and routing weights, rank by rank."""
        x_all = _GatherAlong.apply(x_TD, self.group, 0)
        chosen_all = _wait(funcol.all_gather_tensor(chosen_TK, 0, self.group))
        weights_all = _GatherAlong.apply(weights_TK, self.group, 0)
        return x_all, chosen_all, weights_all

    def combine(self, out_ND: Tensor) -> Tensor:
        """Sum the ranks' partial outputs and hand each rank the rows of its own tokens."""
        return _ReduceScatterAlong.apply(out_ND, self.group, 0)


def make_dispatch(expert_mesh: DeviceMesh, kind: str) -> ExpertParallelDispatch:
    """The dispatch named by `parallelism.ep_dispatch`."""
    if kind not in EP_DISPATCH:
        raise ValueError(f"parallelism.ep_dispatch = {kind!r}: use one of {', '.join(EP_DISPATCH)}")
    return AllToAllDispatch(expert_mesh) if kind == "all_to_all" else ExpertParallelDispatch(expert_mesh)


class AllToAllDispatch(ExpertParallelDispatch):
    """Each token to the ranks holding its experts only (module docstring). `gather` keeps what
    the matching `combine` needs (MoE layers call the two in pairs, one layer at a time).
    ragged: use ragged_all_to_all (None: on TPU devices only; tests set it to run the path)."""

    def __init__(self, expert_mesh: DeviceMesh, ragged: bool | None = None):
        super().__init__(expert_mesh)
        self.ragged = ragged

    def gather(self, x_TD: Tensor, chosen_TK: Tensor, weights_TK: Tensor,
               num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
        T, ep = x_TD.shape[0], self.size
        per_rank = num_experts // ep
        # needed_RT[r, t]: token t has at least one expert on rank r (sent once however many).
        needed_TR = torch.zeros(T, ep, dtype=torch.int64, device=x_TD.device).scatter(
            1, chosen_TK // per_rank, torch.ones_like(chosen_TK))
        needed_RT = needed_TR.t()
        # Padding (static buffers) carries an expert of the next rank with weight 0: never local
        # to the receiver, so it runs no expert there and comes back as zeros.
        if self.ragged if self.ragged is not None else kernel_device_type(x_TD.device.type) in ("tpu", "jax"):
            return self._ragged_gather(x_TD, chosen_TK, weights_TK, needed_RT, ((self.ep_rank() + 1) % ep) * per_rank)
        if _is_traced(x_TD):
            # Chunk r of the send buffer: the tokens rank r needs first (stable), then the others
            # as padding. T rows per peer whatever the routing.
            pad_expert_R = ((torch.arange(ep, device=x_TD.device) + 1) % ep) * per_rank
            slot_RT = torch.argsort(1 - needed_RT, dim=1, stable=True)
            token_S = slot_RT.flatten()
            valid_S = needed_RT.gather(1, slot_RT).flatten().bool()
            pad_S = pad_expert_R.repeat_interleave(T)
            chosen_SK = torch.where(valid_S[:, None], chosen_TK[token_S], pad_S[:, None])
            weights_SK = weights_TK[token_S] * valid_S[:, None].to(weights_TK.dtype)
            send = recv = None  # equal chunks
        else:
            send_counts_R = needed_RT.sum(dim=1)
            recv_counts_R = funcol.all_to_all_single(send_counts_R, None, None, self.group)
            send, recv = send_counts_R.tolist(), recv_counts_R.tolist()  # host sync: exact sizes
            token_S = needed_RT.flatten().nonzero().squeeze(1) % T  # rank-major
            chosen_SK, weights_SK = chosen_TK[token_S], weights_TK[token_S]
        self._pending = (token_S, send, recv, T, None)
        x_MD = _AllToAllRows.apply(x_TD[token_S], recv, send, self.group)
        chosen_MK = _wait(funcol.all_to_all_single(chosen_SK, recv, send, self.group))
        weights_MK = _AllToAllRows.apply(weights_SK, recv, send, self.group)
        return x_MD, chosen_MK, weights_MK

    def combine(self, out_MD: Tensor) -> Tensor:
        """The experts' outputs back to the ranks that sent the rows, added to their tokens."""
        token_S, send, recv, T, ragged = self._pending
        self._pending = None
        if ragged is not None:
            counts_RR, group_name = ragged
            y_SD = _RaggedAllToAll.apply(out_MD, counts_RR.t().contiguous(), self.ep_rank(), group_name)
        else:
            y_SD = _AllToAllRows.apply(out_MD, send, recv, self.group)
        # Padding rows came back as zeros (their weight was 0), so adding them changes nothing.
        return torch.zeros(T, out_MD.shape[1], dtype=out_MD.dtype, device=out_MD.device).index_add(0, token_S, y_SD)

    # -- TPU: ragged all-to-all (unrun on a TPU) ------------------------------------------------

    def _ragged_gather(self, x_TD, chosen_TK, weights_TK, needed_RT, pad_expert: int | Tensor):
        """Real rows packed by destination at the front of a worst-case buffer [ep * T]; the
        sizes and offsets that ragged_all_to_all takes are tensors, so nothing is read on the host."""
        T, ep = x_TD.shape[0], self.size
        key_S = torch.where(needed_RT.bool(), torch.arange(ep, device=x_TD.device)[:, None], ep).flatten()
        token_S = torch.argsort(key_S, stable=True) % T  # needed rows by destination, then the rest
        counts_RR = _wait(funcol.all_gather_tensor(needed_RT.sum(dim=1)[None], 0, self.group))  # [sender, receiver]
        group_name = self.mesh.get_group(EP_AXIS).group_name
        rank = self.ep_rank()
        self._pending = (token_S, None, None, T, (counts_RR, group_name))
        x_MD = _RaggedAllToAll.apply(x_TD[token_S], counts_RR, rank, group_name)
        chosen_SK = chosen_TK[token_S]
        chosen_MK = _ragged_exchange(chosen_SK, torch.zeros_like(chosen_SK) + pad_expert, counts_RR, rank, group_name)
        weights_MK = _RaggedAllToAll.apply(weights_TK[token_S], counts_RR, rank, group_name)
        return x_MD, chosen_MK, weights_MK


def _ragged_exchange(operand: Tensor, output: Tensor, counts_RR: Tensor, rank: int | Tensor,
                     group_name: str) -> Tensor:
    """Rank s sends counts_RR[s, r] rows to rank r: its rows packed by destination at the front of
    `operand`, received packed by sender at the front of `output` (the rest of `output` kept)."""
    send_R, recv_R = _pick(counts_RR, rank), _pick(counts_RR.t(), rank)
    in_off_R = torch.cumsum(send_R, 0) - send_R
    out_off_R = _pick(torch.cumsum(counts_RR, 0) - counts_RR, rank)  # after the rows of lower senders
    from titan_tpu.kernels.tpu import ragged_all_to_all

    return ragged_all_to_all(operand, output, in_off_R, send_R, out_off_R, recv_R, group_name)


def _pick(m_RR: Tensor, rank: int | Tensor) -> Tensor:
    """Row `rank` of m; a tensor rank by index_select (indexing with a 0-dim tensor reads its value
    into Python, which a capture cannot)."""
    return m_RR[rank] if isinstance(rank, int) else m_RR.index_select(0, rank.reshape(1)).squeeze(0)


class _RaggedAllToAll(torch.autograd.Function):
    """ragged_all_to_all into a zero buffer of the operand's shape; the gradient returns by the
    same exchange with the traffic matrix transposed (each receiver sends back what it got).
    rank: an int, or a 0-dim tensor (group_rank) in a step captured as one program."""

    @staticmethod
    def forward(operand, counts_RR, rank, group_name):
        return _ragged_exchange(operand, torch.zeros_like(operand), counts_RR, rank, group_name)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, counts_RR, rank, ctx.group_name = inputs
        ctx.save_for_backward(counts_RR, *([rank] if isinstance(rank, Tensor) else []))
        ctx.rank = None if isinstance(rank, Tensor) else rank

    @staticmethod
    def backward(ctx, grad):
        counts_RR, *rank = ctx.saved_tensors
        rank = rank[0] if rank else ctx.rank
        grad = grad.contiguous()
        back_RR = counts_RR.t().contiguous()
        return _ragged_exchange(grad, torch.zeros_like(grad), back_RR, rank, ctx.group_name), None, None, None


# The ep collectives with their backward, as Functions torch.func accepts (module docstring); the
# all-gather and reduce-scatter are tensor_parallel.py's, along dim 0.


class _AllToAllRows(torch.autograd.Function):
    """all_to_all_single on dim 0 (split sizes None: equal chunks); backward: the same exchange
    with the two split lists swapped."""

    @staticmethod
    def forward(x, output_split_sizes, input_split_sizes, group):
        return _wait(funcol.all_to_all_single(x.contiguous(), output_split_sizes, input_split_sizes, group))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.output_split_sizes, ctx.input_split_sizes, ctx.group = inputs

    @staticmethod
    def backward(ctx, grad):
        grad = _wait(funcol.all_to_all_single(grad.contiguous(), ctx.input_split_sizes, ctx.output_split_sizes,
                                              ctx.group))
        return grad, None, None, None


def _is_traced(x: Tensor) -> bool:
    """Being captured (graph mode traces with fake tensors): no data-dependent sizes allowed."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(x)
