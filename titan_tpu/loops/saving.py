"""A loop's checkpoints: resuming from the newest tier, the persistent and local saves at their
intervals, a failed save's policy (checkpoint.on_save_error), and the emergency save a SIGTERM gets
under checkpoint.grace_seconds (the local tier first, then the persistent one if the budget holds it).

Every rank runs these together (the saves are collective); the time they take is counted in the
loop's goodput ledger (train/goodput.py).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from titan_tpu.train.checkpoint import CheckpointSaveError, checkpoint_step
from titan_tpu.train.local_tier import LocalTierError

__all__ = ["Saving"]


class Saving:
    """The checkpoint side of `loop` (a loops/base.py `Loop`, which owns it: this module names no
    loop, so the two import in one direction): it reads the loop's step and state and times into
    its goodput."""

    def __init__(self, loop):
        self.loop = loop
        self.cfg, self.log = loop.cfg, loop.log
        self.checkpointer, self.local_tier = loop.components.checkpointer, loop.components.local_tier
        self.failures = 0  # saves that failed under checkpoint.on_save_error = warn
        self.last_save_seconds: float | None = None  # the last persistent save's time in this process
        self.local_tier_seconds: float | None = None  # the grace budget's check at the start: one local-tier write

    # ------------------------------------------------------------------------------------------
    # resuming

    def maybe_resume(self) -> bool:
        """Load the newest complete tier (local or persistent); True when it was the local one, which
        the caller then writes to the persistent tier."""
        loop = self.loop
        if not self.cfg.checkpoint.resume:
            return False
        latest = self.checkpointer.agreed_latest()  # collective: rank 0's view of the checkpoint directory
        local = self.local_tier.newest() if self.local_tier is not None else None  # collective
        persistent_step = checkpoint_step(latest) if latest is not None else 0
        if local is not None and local[0] > persistent_step:
            loop.load_checkpoint(local[1], local=True)
            self.log(f"resumed from the local tier {local[1]} at step {loop.step}, newer than the persistent "
                     f"checkpoint ({latest.name if latest else 'none'}); writing it to the persistent tier now")
            return True
        if latest is not None:
            loop.load_checkpoint(latest)
            self.log(f"resumed from {latest} at step {loop.step}")
        elif self.cfg.checkpoint.initial_load_path:
            loop.components.load_initial_weights(self.cfg.checkpoint.initial_load_path)
        return False

    # ------------------------------------------------------------------------------------------
    # saving

    def save_checkpoint(self) -> Path | None:
        """Save this step's checkpoint; None if it failed under checkpoint.on_save_error = warn."""
        return self.checkpoint_io(lambda: self.checkpointer.save(self.loop.step, self.loop.state_dict()))

    def save_local_tier(self, *, or_warn: bool = True) -> float | None:
        """Write this step's local tier (every rank); returns its seconds (the slowest rank's), or
        None when it failed, which is a warning (the persistent tier still works) unless not or_warn."""
        start = time.perf_counter()
        try:
            return self.local_tier.save(self.loop.step, self.loop.state_dict())
        except LocalTierError as e:
            if not or_warn:
                raise
            self.log(f"warning: {e}; training goes on")
            return None
        finally:
            self.loop.count_time("checkpoint_save", time.perf_counter() - start)

    def after_step(self, *, done: bool, stop: bool, since_signal: float) -> None:
        """The saves due after a step: the emergency save on a signal under a grace budget, else the
        persistent checkpoint at its interval (or at the end, or on a signal), else the local tier at
        its own interval."""
        c, step = self.cfg.checkpoint, self.loop.step
        if stop and self.local_tier is not None and c.grace_seconds > 0:
            self.emergency_save(since_signal)
        elif c.enabled and (step % c.interval == 0 or done or stop):
            if c.async_save:  # the previous async save's failure, if any, first
                self.loop.timed("checkpoint_save", lambda: self.checkpoint_io(self.checkpointer.wait))
            save_start = time.perf_counter()
            self.loop.timed("checkpoint_save", self.save_checkpoint)
            self.last_save_seconds = None if c.async_save else time.perf_counter() - save_start
        elif c.local_interval and step % c.local_interval == 0:
            self.save_local_tier()

    def close(self, *, finished: bool) -> None:
        """An async save lands before the process ends; a finished run's local tier is cleared (the
        persistent tier holds the end)."""
        self.loop.timed("checkpoint_save", lambda: self.checkpoint_io(self.checkpointer.close))
        if self.local_tier is not None and finished:
            self.local_tier.clear()

    def checkpoint_io(self, fn):
        """Run a checkpointer call; a failed save stops the run (raises) or, under on_save_error =
        warn, is logged and training goes on (the next interval tries again)."""
        try:
            return fn()
        except CheckpointSaveError as e:
            if self.cfg.checkpoint.on_save_error == "stop":
                raise
            self.failures += 1
            self.log(f"warning: {e}; training goes on (checkpoint.on_save_error = warn) and the next save is "
                     f"tried at step {self._next_save_step()}")
            return None

    def _next_save_step(self) -> int:
        interval, steps, step = self.cfg.checkpoint.interval, self.cfg.training.steps, self.loop.step
        return min((step // interval + 1) * interval, steps) if step < steps else steps

    # ------------------------------------------------------------------------------------------
    # the grace budget (checkpoint.grace_seconds)

    def check_grace_budget(self) -> None:
        """Write the local tier once at the start, timed: a budget shorter than that is refused."""
        grace = self.cfg.checkpoint.grace_seconds
        seconds = self.save_local_tier(or_warn=False)
        if seconds > grace:
            raise ValueError(f"checkpoint.grace_seconds = {grace:g} is too short for even the local tier: writing it "
                             f"takes {seconds:.2f} s here ({self.local_tier.dir}), before the step in flight ends; "
                             f"set it to at least {math.ceil(2 * seconds + 1)} or point checkpoint.local_dir at faster "
                             "storage")
        self.log(f"grace budget {grace:g} s: the local tier takes {seconds:.2f} s ({self.local_tier.dir})")
        self.local_tier_seconds = seconds

    def check_step_in_flight(self, step_seconds: float) -> None:
        """After this process's second step (the first one's warm-up aside): a SIGTERM waits for the
        step in flight before the local tier, so the budget must hold both; a warning, not a refusal
        (a step's time varies)."""
        if self.local_tier_seconds is None:
            return
        grace, need = self.cfg.checkpoint.grace_seconds, step_seconds + self.local_tier_seconds
        if need > grace:
            self.log(f"warning: checkpoint.grace_seconds = {grace:g} may not hold an emergency save: a SIGTERM waits "
                     f"for the step in flight ({step_seconds:.2f} s here), then writes the local tier "
                     f"({self.local_tier_seconds:.2f} s); set it to at least {math.ceil(2 * need + 1)}")

    def emergency_save(self, since_signal: float) -> None:
        """SIGTERM under checkpoint.grace_seconds: the local tier, then the persistent checkpoint if
        what is left of the budget holds the last one's time (or none was timed yet), else it is
        written at the next start. One line says where the budget went."""
        grace = self.cfg.checkpoint.grace_seconds
        waited = _agreed_max(since_signal)  # the step in flight, on the slowest rank
        local = self.save_local_tier()  # None: it failed (a warning); the persistent save is then tried
        left = grace - waited - (local or 0.0)
        previous = self.last_save_seconds
        if local is not None and previous is not None and previous > left:
            persistent = (f"persistent checkpoint deferred to the next start (the last one took {previous:.1f} s, "
                          f"{max(left, 0):.1f} s were left)")
            total = waited + local
        else:
            local = local or 0.0
            start = time.perf_counter()
            self.loop.timed("checkpoint_save", self.save_persistent_now)
            seconds = time.perf_counter() - start
            persistent = f"persistent checkpoint in {seconds:.1f} s"
            total = waited + local + seconds
        verdict = "within" if total <= grace else "OVER"
        self.log(f"emergency save at step {self.loop.step}: {total:.1f} s of the {grace:g} s grace budget "
                 f"({verdict}): the step in flight {waited:.1f} s, local tier {local:.2f} s, {persistent}")

    def save_persistent_now(self) -> None:
        """A persistent checkpoint of this step, written through (an async one included)."""
        self.checkpoint_io(self.checkpointer.wait)
        self.save_checkpoint()
        self.checkpoint_io(self.checkpointer.wait)


def _agreed_max(value: float) -> float:
    """The largest `value` of all ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
