"""The persistent compile cache (graph/compile_cache.py): where each compiler is pointed, which
setting wins, and that a second process finds what the first compiled (Inductor's FX-graph cache,
counted by the same numbers a run logs). bench/compile_cache.py measures what it saves on the
debug model's step."""

import subprocess
import sys
import textwrap

import pytest

from titan_tpu.config import build_config
from titan_tpu.graph.compile_cache import default_compile_cache_dir, use_compile_cache

VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR", "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT",
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch, tmp_path):
    """Each test starts without the compilers' variables and puts them back after; the default root
    goes under tmp_path."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_each_backend_gets_its_directory_and_the_variable_its_compiler_reads(tmp_path, monkeypatch):
    import os

    for backend, variable, sub in (("inductor", "TORCHINDUCTOR_CACHE_DIR", "inductor"),
                                   ("tpu", "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", "torchtpu")):
        cache = use_compile_cache(str(tmp_path / "cc"), backend=backend)
        assert cache.directory == tmp_path / "cc" / sub and cache.directory.is_dir()
        assert os.environ[variable] == str(tmp_path / "cc" / sub) and cache.source == "compile.cache_dir"
    assert use_compile_cache(str(tmp_path / "cc"), backend="tpu").hits() is None  # TorchTPU does not say
    if "jax" not in sys.modules:  # JAX reads its settings from the environment when it is imported
        cache = use_compile_cache(str(tmp_path / "cc"), backend="jax")
        assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "cc" / "jax")
        assert float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) == 0.0
        assert "jax" not in sys.modules  # not imported here: jax_start.start_jax picks its platform first
    # Nothing to cache, or switched off: the compilers' own defaults stay.
    assert use_compile_cache(str(tmp_path / "cc"), backend="eager") is None
    assert use_compile_cache(str(tmp_path / "cc"), backend="aot_eager") is None
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert use_compile_cache(str(tmp_path / "cc"), backend="inductor", enabled=False) is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_the_config_beats_the_environment_which_beats_the_default(tmp_path, monkeypatch):
    default = use_compile_cache("", backend="inductor")
    assert default.directory == default_compile_cache_dir() / "inductor" == tmp_path / "xdg/titan_tpu/compile/inductor"
    assert default.source == "default"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    mine = use_compile_cache("", backend="inductor")
    assert mine.directory == tmp_path / "mine" and mine.source == "the environment (TORCHINDUCTOR_CACHE_DIR)"
    assert use_compile_cache(str(tmp_path / "cfg"), backend="inductor").directory == tmp_path / "cfg" / "inductor"
    cfg = build_config(None, ["--compile.cache_dir", str(tmp_path / "cfg"), "--compile.cache", "false"])
    assert cfg.compile.cache_dir == str(tmp_path / "cfg") and cfg.compile.cache is False


def test_an_unwritable_directory_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"^compile.cache_dir: cannot create .*file/inductor \(.*\); point "
                                         r"compile.cache_dir at a writable directory, or set compile.cache false$"):
        use_compile_cache(str(blocker), backend="inductor")


COMPILE_ONCE = textwrap.dedent("""
    import sys, torch
    from titan_tpu.graph.compile_cache import use_compile_cache
    cache = use_compile_cache(sys.argv[1], backend="inductor")
    cache.watch()
    from torch._dynamo import lookup_backend
    from titan_tpu.graph.compile import _fake_inputs_with_shape_env
    def f(x, y):
        return ((x * 2 + y).relu().sum(dim=0),)
    gm = torch.fx.symbolic_trace(f)
    inputs = [torch.randn(8, 4), torch.randn(8, 4)]
    with torch.no_grad():  # as graph/compile.py hands a captured step to Inductor
        compiled = lookup_backend("inductor")(gm, _fake_inputs_with_shape_env(inputs))
        assert torch.equal(compiled(*inputs)[0], f(*inputs)[0])
    print(cache.hits(), cache.misses(), cache.entries())
    print(cache.describe())
""")


@pytest.mark.multiprocess(ranks=False)  # fresh processes, as a restart
def test_a_second_process_finds_what_the_first_compiled(tmp_path):
    def run() -> tuple[list[int], str]:
        done = subprocess.run([sys.executable, "-c", COMPILE_ONCE, str(tmp_path / "cc")], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        counts, line = done.stdout.strip().splitlines()[-2:]
        return [int(n) for n in counts.split()], line

    (hits, misses, entries), _ = run()
    assert (hits, misses) == (0, 1) and entries > 0
    (hits, misses, _), line = run()
    assert (hits, misses) == (1, 0)
    assert line == f"cache: 1 hit, 0 misses in {tmp_path / 'cc' / 'inductor'}"
