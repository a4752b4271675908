"""A loop's replica groups (fault_tolerance; train/replica_ft.py): joining the lighthouse, the quorum
before each step (a group behind the live ones takes a peer's state), and a step whose gradient
average failed because a peer died during it, taken again in the next quorum."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_tpu.train.replica_ft import ReplicaFT

__all__ = ["ReplicaGroups"]


class ReplicaGroups:
    """This process's replica group in the run's quorum, driven by `loop` (a loops/base.py `Loop`,
    which owns it: this module names no loop, so the two import in one direction)."""

    def __init__(self, loop, ft: ReplicaFT | None):
        self.loop, self.ft = loop, ft
        self._data_before_step: dict | None = None

    @classmethod
    def join(cls, loop) -> ReplicaGroups | None:
        """Join the replica groups' lighthouse (None without fault_tolerance): from here on this
        group heartbeats, so it is called right before the loop, once the model is resumed and built."""
        f = loop.cfg.fault_tolerance
        if not f.enabled:
            return None
        from titan_tpu.train.replica_ft import ReplicaFT, check_lighthouse

        host, port = f.lighthouse_address()
        check_lighthouse(host, port, f.timeout_seconds, replicas=f.replicas)
        groups = cls(loop, None)
        groups.ft = ReplicaFT(host, port, f.replica_id, state_fn=loop.state_dict, load_fn=groups._take_peer_state,
                              timeout=f.timeout_seconds, connect_timeout=f.timeout_seconds)
        loop.components.step_fn.grad_sync = groups.ft.average
        loop.log(f"replica group {f.replica_id} of {f.replicas} (lighthouse {f.lighthouse}): gradients averaged over "
                 f"the live groups each step; this group reads its 1/{f.replicas} share of each global batch")
        return groups

    @property
    def members(self):
        """The replica groups in the gradient average of this step (a metrics row's `replica_groups`)."""
        return self.ft.members

    def _take_peer_state(self, state: dict) -> None:
        """Recovery: a healthy peer's state (this group was behind it) replaces this group's."""
        self.loop.components.install_state(state)
        self.loop.step = state["step"]

    def quorum(self) -> None:
        """Before a step: agree on the quorum with the live groups; a group behind them takes their
        state. Time spent on a quorum change counts as restart in goodput (start-up for the first
        process's first quorum)."""
        ft, loop = self.ft, self.loop
        ft.step = loop.step
        changes, start = ft.stats.quorum_changes, time.perf_counter()
        ft.start_step()
        if ft.stats.quorum_changes != changes and loop.goodput is not None:
            first = changes == 0 and not loop.goodput.earlier
            loop.goodput.add("startup" if first else "restart", time.perf_counter() - start)
        self._data_before_step = loop.components.train_loader.state_dict()

    def drop_step(self, seconds: float) -> None:
        """A step whose gradient average failed (a peer died mid-step): nothing was applied, so the
        step and its batch are taken again in the next quorum."""
        loop = self.loop
        loop.components.train_loader.load_state_dict(self._data_before_step)
        loop.step -= 1
        if loop.goodput is not None:
            loop.goodput.lost_step(seconds)
        loop.log(f"step {loop.step + 1} not applied: a replica group left during it; taken again in the next quorum")

    def close(self) -> None:
        self.ft.close()
