"""Graceful shutdown on SIGTERM/SIGINT: finish the step, write a checkpoint, exit 0.

Schedulers (SLURM, Kubernetes, preemptible TPU VMs) send SIGTERM some time before killing a job.
Raising from inside a signal handler could interrupt a step or a checkpoint write halfway, so the
handlers only set a flag; the training loop checks it between steps::

    with GracefulShutdown() as shutdown:
        while step < total:
            train_step()
            if shutdown.should_stop():
                checkpointer.save(step, state); break

A second SIGINT (Ctrl-C pressed again) is not caught: the process dies at once, so a user can
always force-quit. The checkpoint protocol is atomic, so that is safe too.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulShutdown:
    def __init__(self) -> None:
        self._requested = False
        self._signal: int | None = None
        self._signal_time: float | None = None  # time.monotonic() when the first signal arrived
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """True once SIGTERM or SIGINT arrived in this process."""
        return self._requested

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self._signal).name if self._signal is not None else None

    def seconds_since_signal(self) -> float:
        """Seconds since this process got the signal (0 if it got none: another rank did)."""
        return time.monotonic() - self._signal_time if self._signal_time is not None else 0.0

    def should_stop(self) -> bool:
        """``requested`` agreed across ranks: True on every rank if any rank got a signal.

        A signal may reach one rank a step before the others; without agreement that rank would
        enter the (collective) checkpoint save alone and hang. Collective: call it on every rank at
        the same point (one scalar all-reduce, on CPU since the flag is host state; gloo groups and
        groups with a CPU backend qualify).
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self._requested
        flag = torch.tensor([int(self._requested)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._requested = True
        self._signal = signum
        if self._signal_time is None:
            self._signal_time = time.monotonic()
        if signum == signal.SIGINT:
            # The next Ctrl-C kills the process the ordinary way (no KeyboardInterrupt to catch).
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    def __enter__(self) -> GracefulShutdown:
        # Python only lets the main thread install handlers; elsewhere (e.g. a notebook worker
        # thread) we stay inert and ``requested`` simply never becomes True.
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            # None means a handler installed outside Python; the default is the closest we can restore.
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
