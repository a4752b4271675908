"""Shared fixtures: a small slice of the embedded corpus, tokenized once per test session; and the
`multiprocess` marker, which tests/stress.py uses to find the tests it must run many times."""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning (libgomp's default spins
# for a while after each parallel region), so that a test's idle threads do not take the core the
# other pytest-xdist worker, or a rank, is computing on. Inherited by the ranks and subprocesses.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import dist_utils  # noqa: E402 (imports torch)
import pytest  # noqa: E402
import torch  # noqa: E402

# tests/tpu/ needs torch-tpu and jax (their own environment, `make tpu-check`): never collected here.
collect_ignore = [] if os.environ.get("TITAN_TPU_CHECK") == "1" else ["tpu"]

# Two threads, as on the CI machine: keeps timings and float reduction order the same everywhere.
torch.set_num_threads(2)

SMALL_CORPUS_BYTES = 1_500_000


def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess(ranks=True): spawns ranks or training processes; "
                                       "tests/stress.py runs these many times in a row; ranks=False: one "
                                       "process at a time and no ranks, scheduled with its file "
                                       "(tests/xdist_groups.py)")
    if config.pluginmanager.hasplugin("xdist"):  # `make test`: how two workers share the suite
        import xdist_groups

        config.pluginmanager.register(xdist_groups, "xdist_groups")
    # The weightless model directories TPU recipes name, relative to the repository root the suite runs
    # in (gitignored: a clean clone has none), written once; every worker may ask at once, and the
    # writer renames a finished copy into place.
    from titan_tpu.tools.hf_shape_dir import STAND_INS, ensure

    for path in STAND_INS:
        ensure(path, log=lambda message: None)


@pytest.fixture(autouse=True)
def _note_multiprocess_marker(request):
    """Tell dist_utils whether the running test is marked, so that spawning ranks from an unmarked
    test fails with a message instead of escaping the stress command."""
    dist_utils.current_test_is_marked = request.node.get_closest_marker("multiprocess") is not None
    yield
    dist_utils.current_test_is_marked = None


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """Cache directory shared by every test that trains on the embedded corpus. Under pytest-xdist both
    workers share one, beside their own temporary directories: a build is locked per cache entry and
    renamed into place whole (titan_tpu/data/prepare.py), so the corpus is tokenized once per run."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "titan_tpu_cache"
        shared.mkdir(exist_ok=True)
        return shared
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


@pytest.fixture
def one_thread():
    """Run the test on one intra-op thread. Inductor's CPU kernels accumulate scatter-adds (the
    embedding's gradient: one row per token, repeated tokens added together) with atomic adds
    across threads, in no fixed order, so two compiled runs of the same step can differ in the
    last bit of a repeated token's row; a test that compares two such runs bit for bit needs one
    order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
