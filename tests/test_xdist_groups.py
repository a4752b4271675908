"""tests/xdist_groups.py on a small suite run like `make test`: the multiprocess tests on one worker in
suite order before anything else there, every other file whole on one worker, and a test marked
`multiprocess(ranks=False)` with its file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

RECORD = '''
import os, pytest

def record(request):
    with open(os.environ["GROUPS_LOG"], "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {request.node.nodeid}\\n")
'''


def write_suite(root: Path) -> None:
    (root / "conftest.py").write_text(
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'multiprocess: spawns processes')\n")
    (root / "recorder.py").write_text(RECORD)
    # A file with marked and unmarked tests, a file marked whole (one test of it ranks=False), and
    # three plain files.
    (root / "test_mixed.py").write_text(
        "import pytest\nfrom recorder import record\n\n"
        + "".join(f"@pytest.mark.multiprocess\ndef test_ranks_{i}(request):\n    record(request)\n\n"
                  f"def test_plain_{i}(request):\n    record(request)\n\n" for i in range(3)))
    (root / "test_marked.py").write_text(
        "import pytest\nfrom recorder import record\n\npytestmark = pytest.mark.multiprocess\n\n"
        "@pytest.mark.parametrize('n', [1, 2])\ndef test_spawn(n, request):\n    record(request)\n\n"
        "@pytest.mark.multiprocess(ranks=False)\ndef test_one_process(request):\n    record(request)\n")
    for name in ("a", "b", "c"):
        (root / f"test_plain_{name}.py").write_text(
            "from recorder import record\n\n" + "".join(f"def test_{i}(request):\n    record(request)\n\n"
                                                       for i in range(4)))


def test_multiprocess_tests_share_one_worker_in_order_and_files_stay_whole(tmp_path):
    write_suite(tmp_path)
    log = tmp_path / "ran.txt"
    path = os.pathsep.join([str(TESTS), str(tmp_path), os.environ.get("PYTHONPATH", "")])
    # Run from a worker of `make test` itself: the inner run must not see the outer worker's variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(GROUPS_LOG=str(log), PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "xdist_groups",
                           "-n", "2", "--dist", "loadgroup", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [line.split(" ", 1) for line in log.read_text().splitlines()]
    assert len(runs) == 3 * 2 + 2 + 1 + 3 * 4, runs

    marked = ["test_mixed.py::test_ranks_0", "test_mixed.py::test_ranks_1", "test_mixed.py::test_ranks_2",
              "test_marked.py::test_spawn[1]", "test_marked.py::test_spawn[2]"]
    workers = {worker for worker, _ in runs}
    assert len(workers) == 2, runs  # the other worker had plain files to run meanwhile
    (mp_worker,) = {worker for worker, test in runs if test in marked}
    on_mp_worker = [test for worker, test in runs if worker == mp_worker]
    # Suite order (files as collected: test_marked.py before test_mixed.py), and first on that worker;
    # test_one_process, between them in suite order, is not in the group.
    assert on_mp_worker[:5] == sorted(marked, key=lambda t: (not t.startswith("test_marked"), t)), on_mp_worker
    assert "test_marked.py::test_one_process" in [test for _, test in runs]
    for name in ("test_mixed.py::test_plain", "test_plain_a.py", "test_plain_b.py", "test_plain_c.py"):
        assert len({worker for worker, test in runs if test.startswith(name)}) == 1, (name, runs)
