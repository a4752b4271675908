"""Run a function on N local gloo ranks (spawned processes) and collect what each returns.

    results = run_distributed(fn, world_size=2, args=(...), kwargs={...})

`fn(*args, **kwargs)` runs on every rank with the default process group already initialised
(gloo over TCP on 127.0.0.1); `torch.distributed.get_rank()` tells it which rank it is. It must be
a module-level function (spawned processes import it by name) and return something
`torch.save`-able; results come back as a list indexed by rank. An exception on any rank is
re-raised here with that rank's traceback; a hang is killed after `timeout_s`.

The harness itself is `titan_tpu.parallel.spawn.run_ranks` (how ranks start, rendezvous and exit,
and why: docs/known-issues.md, 1b); this module adds the rule that a test starting ranks carries
the `multiprocess` marker, so that tests/stress.py runs it many times in a row.

`train_on_ranks(config, overrides, world_size=2)` runs the trainer itself on such ranks (what
torchrun would run, without starting Python and torch again in every process) and returns what
each rank printed.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from pathlib import Path

from titan_tpu.parallel.spawn import run_ranks

__all__ = ["require_multiprocess_marker", "run_distributed", "train_on_ranks"]

# Set by conftest.py for the running test: True when it is marked `multiprocess`, None outside tests.
current_test_is_marked: bool | None = None


def require_multiprocess_marker() -> None:
    """Fail a test that starts ranks or training processes without `@pytest.mark.multiprocess`:
    such a test must be run by tests/stress.py before it is trusted."""
    if current_test_is_marked is False:
        raise AssertionError("this test starts several processes: mark it @pytest.mark.multiprocess so that "
                             "tests/stress.py runs it many times in a row")


def run_distributed(fn: Callable, *, world_size: int, args: tuple = (), kwargs: dict | None = None,
                    timeout_s: float = 120.0, num_threads: int = 1, pg_timeout_s: float | None = None) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results.
    `pg_timeout_s`: the process group's collective timeout (default: torch's)."""
    require_multiprocess_marker()
    return run_ranks(fn, world_size=world_size, args=args, kwargs=kwargs, timeout_s=timeout_s,
                     num_threads=num_threads, pg_timeout_s=pg_timeout_s)


def _train_rank(config: str | None, overrides: list[str]) -> str:
    from titan_tpu.config import build_config
    from titan_tpu.loops import assemble

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assemble(build_config(config, overrides)).train()
    return printed.getvalue()


def train_on_ranks(config: str | Path | None, overrides: list[str], *, world_size: int = 2,
                   timeout_s: float = 300.0) -> list[str]:
    """`titan-tpu train --config CONFIG OVERRIDES...` on `world_size` gloo ranks forked from the fork
    server, one thread each (as the tests' torchrun runs with OMP_NUM_THREADS=1); returns what each
    rank printed. For tests about what a run computes; a test about the launcher itself (torchrun's
    environment, signals, kill -9) starts real processes."""
    config = str(config) if config is not None else None  # None: the overrides say everything
    return run_distributed(_train_rank, world_size=world_size, args=(config, [str(a) for a in overrides]),
                           timeout_s=timeout_s)
