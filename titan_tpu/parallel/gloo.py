"""gloo process groups with one worker thread each (docs/known-issues.md, 1d).

A gloo process group runs its collectives on a pool of worker threads (two by default), and
every worker of a group drives the same gloo context. When two collectives of one group run at
once, gloo's TCP transport can free a small bookkeeping block (the shared-pointer control block
of an `UnboundBuffer`) from both threads: glibc then reports `malloc(): unaligned tcache chunk
detected`, or a later allocation crashes. Our eager SimpleFSDP and expert-parallel steps keep
several collectives of one group in flight, so this hit about one multi-process test in a few
hundred. With one worker per group the group's collectives run one after another, as they would
over its single set of TCP connections anyway; different groups still run side by side.

torch offers no way to ask for this through `init_process_group` or `new_group` (they ignore
options for gloo), so `use_single_thread_gloo()` replaces the class `torch.distributed` builds
gloo groups from with a subclass that passes one thread in its options. The subclass keeps every
`isinstance(..., ProcessGroupGloo)` check true. `tests/test_parallel.py` checks the effect (one
`pt_gloo_runloop` thread per group), so a torch upgrade that bypasses the hook fails a test
instead of silently bringing the fault back.
"""

from __future__ import annotations

import os

import torch.distributed.distributed_c10d as c10d

__all__ = ["use_single_thread_gloo", "GLOO_THREADS"]

GLOO_THREADS = 1


def use_single_thread_gloo() -> None:
    """Every gloo process group created after this call (the default group, DeviceMesh's
    subgroups, `new_group`) runs its collectives on one worker thread. Idempotent."""
    if not c10d.is_gloo_available() or getattr(c10d.ProcessGroupGloo, "_titan_single_thread", False):
        return
    base = c10d.ProcessGroupGloo

    class SingleThreadProcessGroupGloo(base):
        _titan_single_thread = True

        def __init__(self, store, rank, size, timeout=c10d.default_pg_timeout):
            options = base._Options()
            options._timeout = timeout
            options._devices = _devices(base)
            options._threads = GLOO_THREADS
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SingleThreadProcessGroupGloo


def _devices(gloo_class) -> list:
    """The devices torch's own constructor would pick: one per interface named in
    GLOO_SOCKET_IFNAME, else the default one."""
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if interfaces:
        return [gloo_class.create_device(interface=name) for name in interfaces]
    return [gloo_class.create_default_device()]
