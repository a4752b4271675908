"""How `make test` (`pytest -n 2 --dist loadgroup`) shares the suite between two pytest-xdist workers.

Every test marked `multiprocess` goes to one worker, one after another in suite order, as a round of
tests/stress.py runs them: two rank spawns at once would halve each rank's cores under a timeout and
start the fork server twice. Every other test goes with the rest of its file, so a module-scoped
fixture or a cached reference run is computed once. So does a test marked
`multiprocess(ranks=False)`: it starts processes one at a time and no ranks (a training process it
kills, signals or restarts, on one thread), so it takes no more of the cores than a one-process
test, starts no fork server and binds no port; stress.py still runs it. The multiprocess group, the longest piece, is
handed out first so that it does not start last. A plain `pytest` (no -n, or -n 0) uses none of this.

The scheduler runs in the controlling process, which sees test ids only, never markers; and xdist's
own loadgroup cannot carry the group in the id under pytest 9 (it sets `item._nodeid`, which pytest
no longer reads). So each worker writes the ids of the marked tests it collected into a directory
the controller made, and the scheduler reads them before it hands out the first test.

tests/conftest.py imports these hooks; tests/test_xdist_groups.py runs them on a small suite.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadGroupScheduling

MARKER = "multiprocess"
GROUP = "multiprocess"
_groups_dir: list[str] = []  # the controller's directory for the workers' lists, made once


class FileOrGroupScheduling(LoadGroupScheduling):
    """A unit of work is the multiprocess group or one file; the group is handed out first."""

    def __init__(self, config, log):
        super().__init__(config, log)
        self.multiprocess: set[str] = set()

    def _split_scope(self, nodeid: str) -> str:
        if nodeid in self.multiprocess:
            return GROUP
        return nodeid.split("::", 1)[0]

    def schedule(self) -> None:
        if self.collection is None and _groups_dir:  # before the first hand-out
            for path in Path(_groups_dir[0]).glob("*.txt"):
                self.multiprocess.update(path.read_text().splitlines())
        super().schedule()

    def _assign_work_unit(self, node) -> None:
        if GROUP in self.workqueue:
            self.workqueue.move_to_end(GROUP, last=False)
        super()._assign_work_unit(node)


def in_group(item) -> bool:
    """Marked `multiprocess`, and not `multiprocess(ranks=False)` (the closest mark decides: a test's
    own mark over its module's `pytestmark`)."""
    marker = item.get_closest_marker(MARKER)
    return marker is not None and marker.kwargs.get("ranks", True)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return FileOrGroupScheduling(config, log)
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
        marked = [item.nodeid for item in session.items if in_group(item)]
        worker = session.config.workerinput["workerid"]
        (Path(groups_dir) / f"{worker}.txt").write_text("".join(f"{nodeid}\n" for nodeid in marked))
