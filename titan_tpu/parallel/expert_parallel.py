"""Expert parallelism: the experts of each MoE layer spread over `ep` ranks, tokens brought to them.

Layout. EP is carved out of the data-parallel shard axis, as in TorchTitan: the dp_shard ranks
(all ranks, without replicas) form an expert mesh of shape (dp_shard / ep, ep), axes
("dp_shard_mod_ep", "ep"). Each expert weight [E, F, D] is a DTensor on it, sharded on the expert
dim over `ep` and, like any other weight under SimpleFSDP, on its next dim over the rest
(placements (Shard(1), Shard(0)); one dim later for scanned [L, E, F, D] stacks). At compute time
a rank all-gathers its experts over dp_shard_mod_ep only and keeps the ep shard: its E / ep local
experts, whole. Their gradients reduce-scatter back over dp_shard_mod_ep (Partial) and stay
sharded over ep. Non-expert weights keep their plain SimpleFSDP layout over all dp_shard ranks.

Dispatch, static-shaped (graph mode and XLA need it): every rank routes its own tokens, then the
ep group all-gathers the tokens and their routing (T tokens -> ep * T), each rank runs its local
experts over the gathered rows (the MoE layer sorts its local experts' rows first and leaves the
rest outside every group, which the grouped matmul turns into zeros), and a reduce-scatter sums
the partial outputs back to the ranks that own the tokens. This is MaxText's "ring of experts"
collective pattern: more bytes than an all-to-all with exact splits, but every shape is known
before the data is, so the collectives are ordinary static graph nodes. Both collectives are the
autograd-aware functional ones, so the backward is a reduce-scatter and an all-gather.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard

__all__ = ["EP_AXES", "ExpertParallelDispatch", "expert_placements", "build_expert_mesh"]

EP_AXES = ("dp_shard_mod_ep", "ep")


def build_expert_mesh(device_type: str, *, dp_shard: int, ep: int) -> DeviceMesh:
    """The (dp_shard / ep, ep) mesh over the data-parallel shard ranks: ep groups are
    consecutive ranks (the closest neighbours carry the token traffic)."""
    ranks = torch.arange(dp_shard).view(dp_shard // ep, ep)
    return DeviceMesh(device_type, ranks, mesh_dim_names=EP_AXES)


def expert_placements(stacked: bool) -> tuple[Placement, ...]:
    """Expert weights [E, F, D] (or stacked [L, E, F, D]): rows over dp_shard_mod_ep, experts over ep."""
    offset = 1 if stacked else 0
    return (Shard(1 + offset), Shard(0 + offset))


class ExpertParallelDispatch:
    """What an MoE layer calls to reach experts on other ranks (see moe.ExpertDispatch, the
    single-rank default with the same methods)."""

    def __init__(self, expert_mesh: DeviceMesh):
        self.mesh = expert_mesh
        self.group = (expert_mesh, EP_AXES.index("ep"))
        self.size = expert_mesh.size(EP_AXES.index("ep"))
        self.rank = expert_mesh.get_local_rank("ep")

    def first_local_expert(self, num_experts: int) -> int:
        return self.rank * (num_experts // self.size)

    def gather(self, x_TD: Tensor, chosen_TK: Tensor, weights_TK: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Every ep rank's tokens, routing choices and routing weights, rank by rank."""
        x_all = funcol.all_gather_tensor_autograd(x_TD, 0, self.group)
        chosen_all = funcol.all_gather_tensor(chosen_TK, 0, self.group)
        weights_all = funcol.all_gather_tensor_autograd(weights_TK, 0, self.group)
        return x_all, chosen_all, weights_all

    def combine(self, out_ND: Tensor) -> Tensor:
        """Sum the ranks' partial outputs and hand each rank the rows of its own tokens."""
        return funcol.reduce_scatter_tensor_autograd(out_ND, "sum", 0, self.group)
