"""Shared fixtures: a small slice of the embedded corpus, tokenized once per test session; and the
`multiprocess` marker, which tests/stress.py uses to find the tests it must run many times."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import dist_utils
import pytest
import torch

# tests/tpu/ needs torch-tpu and jax (their own environment, `make tpu-check`): never collected here.
collect_ignore = [] if os.environ.get("TITAN_TPU_CHECK") == "1" else ["tpu"]

# Two threads, as on the CI machine: keeps timings and float reduction order the same everywhere.
torch.set_num_threads(2)

SMALL_CORPUS_BYTES = 1_500_000


def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: spawns ranks or training processes; "
                                       "tests/stress.py runs these many times in a row")


# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`). Every multiprocess
# test goes to one worker, one after another in suite order, as the stress command runs them: two rank
# spawns at once would double the fork server's start and halve each rank's cores under a timeout.
# The other tests are handed out a file at a time, so a module-scoped fixture or a cached reference
# run is computed once. A plain `pytest` (no -n, or -n 0) runs everything in one process as before.
#
# The scheduler runs in the controlling process, which sees test ids only, never markers; and xdist's
# own loadgroup cannot carry the group in the id under this pytest (it sets `item._nodeid`, which
# pytest 9 no longer reads). So each worker writes the ids of the marked tests it collected into a
# directory the controller made, and the scheduler reads them before it hands out the first test.
MULTIPROCESS_GROUP = "multiprocess"

try:
    from xdist.scheduler import LoadGroupScheduling
except ImportError:  # pytest-xdist is a dev dependency; without it the suite runs in one process
    LoadGroupScheduling = None

if LoadGroupScheduling is not None:
    _groups_dir: list[str] = []  # the controller's directory for the workers' lists, made once

    class _FileOrGroupScheduling(LoadGroupScheduling):
        """`--dist loadgroup` where a unit of work is the multiprocess group or a file, and the
        multiprocess group, the longest unit, is handed out first so that it does not start last."""

        def __init__(self, config, log):
            super().__init__(config, log)
            self.multiprocess: set[str] = set()

        def _split_scope(self, nodeid: str) -> str:
            if nodeid in self.multiprocess:
                return MULTIPROCESS_GROUP
            if "@" in nodeid:  # an xdist that does put the group into the id
                return nodeid.rsplit("@", 1)[-1]
            return nodeid.split("::", 1)[0]

        def schedule(self) -> None:
            if self.collection is None and _groups_dir:  # before the first hand-out
                for path in Path(_groups_dir[0]).glob("*.txt"):
                    self.multiprocess.update(path.read_text().splitlines())
            super().schedule()

        def _assign_work_unit(self, node) -> None:
            if MULTIPROCESS_GROUP in self.workqueue:
                self.workqueue.move_to_end(MULTIPROCESS_GROUP, last=False)
            super()._assign_work_unit(node)

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") == "loadgroup":
            return _FileOrGroupScheduling(config, log)
        return None

    def pytest_configure_node(node):
        if not _groups_dir:
            _groups_dir.append(tempfile.mkdtemp(prefix="titan-tpu-test-groups-"))
        node.workerinput["titan_tpu_groups_dir"] = _groups_dir[0]

    def pytest_unconfigure(config):
        if _groups_dir and not hasattr(config, "workerinput"):
            shutil.rmtree(_groups_dir.pop(), ignore_errors=True)

    @pytest.hookimpl(tryfirst=True)  # before the worker sends its collection to the controller
    def pytest_collection_finish(session):
        groups_dir = getattr(session.config, "workerinput", {}).get("titan_tpu_groups_dir")
        if groups_dir:
            marked = [item.nodeid for item in session.items if item.get_closest_marker("multiprocess")]
            worker = session.config.workerinput["workerid"]
            (Path(groups_dir) / f"{worker}.txt").write_text("".join(f"{nodeid}\n" for nodeid in marked))


@pytest.fixture(autouse=True)
def _note_multiprocess_marker(request):
    """Tell dist_utils whether the running test is marked, so that spawning ranks from an unmarked
    test fails with a message instead of escaping the stress command."""
    dist_utils.current_test_is_marked = request.node.get_closest_marker("multiprocess") is not None
    yield
    dist_utils.current_test_is_marked = None


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """Cache directory shared by every test that trains on the embedded corpus."""
    return tmp_path_factory.mktemp("titan_tpu_cache")


@pytest.fixture
def train_overrides(tmp_path, data_cache):
    """Command-line overrides for a fast debug-model run writing into tmp_path/run."""

    def make(**extra) -> list[str]:
        values = {
            "output_dir": str(tmp_path / "run"),
            "data.cache_dir": str(data_cache),
            "data.max_bytes": SMALL_CORPUS_BYTES,
            "training.device": "cpu",
            "training.batch_size": 4,
            "training.seq_len": 128,
            "training.steps": 20,
            "lr_scheduler.warmup_steps": 1,
            "metrics.log_freq": 1,
            "metrics.tensorboard": "false",
            "validation.freq": 10,
            "validation.steps": 2,
            "checkpoint.interval": 10,
        }
        values.update({k.replace("__", "."): v for k, v in extra.items()})
        args = []
        for key, value in values.items():
            args += [f"--{key}", str(value)]
        return args

    return make
