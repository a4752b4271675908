"""A compile cache that survives restarts: each compiler of a graph-mode step keeps what it compiled
under one directory (compile.cache_dir), so a run restarted after a preemption or a crash loads
its step's program instead of compiling it again.

- Inductor (compile.backend inductor, CPU and CUDA): its FX-graph cache and AOTAutograd cache, both
  keyed by the graph, the input shapes, the compiler's config and torch's version, live under
  ``TORCHINDUCTOR_CACHE_DIR`` (by default a directory in /tmp, which a reboot or a new container
  empties). We point it at ``<cache>/inductor``; Triton's kernels (CUDA) go beneath it.
  torch.compiler's "mega-cache" (``save_cache_artifacts``/``load_cache_artifacts``) packs the same
  entries into one blob to carry to other machines; a directory that persists needs none of it.
- JAX (compile.backend jax): its persistent compilation cache (``jax_compilation_cache_dir``), keyed
  by the HLO, the compile options and the jax/jaxlib versions, at ``<cache>/jax``, with no minimum
  compile time (JAX's default writes only programs that took over a second).
- TorchTPU (compile.backend tpu): torch-tpu 0.2.0's binary reads a "tier-3" compilation cache root
  from ``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT`` (found in its strings, not in its documented
  API; not yet run on a TPU); we set it to ``<cache>/torchtpu`` before the device starts.

The default root, ~/.cache/titan_tpu/compile, sits beside the data cache rather than under a run's
output directory: every cache above is keyed by content, so runs that compile the same step (a
restart into a new output_dir, a sweep over learning rates) share entries safely, and a run's
directory on object storage would make each read slow. An environment variable the user set
(``TORCHINDUCTOR_CACHE_DIR``, ``JAX_COMPILATION_CACHE_DIR``, ``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT``)
wins over the default but not over an explicit compile.cache_dir.

Everything here runs before the device starts and before anything compiles, since the compilers
read these settings when they start (JAX's cache is chosen at its first compile, TorchTPU's with its
client).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CompileCache", "default_compile_cache_dir", "use_compile_cache"]

# Per backend: (the environment variable the compiler reads, the subdirectory of the root).
_ENV = {"inductor": ("TORCHINDUCTOR_CACHE_DIR", "inductor"), "jax": ("JAX_COMPILATION_CACHE_DIR", "jax"),
        "tpu": ("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", "torchtpu")}


def default_compile_cache_dir() -> Path:
    """~/.cache/titan_tpu/compile (XDG_CACHE_HOME respected), beside the data cache."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "titan_tpu" / "compile"


@dataclass
class CompileCache:
    """Where `backend`'s compiler keeps its programs, and what it found there: `hits()` / `misses()`
    count this process's lookups since `watch()` (Inductor's FX-graph cache, JAX's persistent
    cache; None where the compiler does not say: TorchTPU)."""

    backend: str
    directory: Path
    source: str  # "compile.cache_dir", "the environment (NAME)" or "default"
    _start: Counter = field(default_factory=Counter)
    _jax_events: Counter = field(default_factory=Counter)

    def watch(self) -> None:
        """Start counting this process's lookups: call just before the step compiles (for JAX, once
        the device has started: jax is imported by then)."""
        if self.backend == "jax":
            from jax import monitoring

            def listen(event: str, **_: Any) -> None:
                if event.startswith("/jax/compilation_cache/"):
                    self._jax_events[event] += 1

            monitoring.register_event_listener(listen)
        self._start = self._counts() or Counter()

    def entries(self) -> int:
        """Files under the directory (0 when it does not exist yet)."""
        return sum(len(files) for _, _, files in os.walk(self.directory)) if self.directory.is_dir() else 0

    def _counts(self) -> Counter | None:
        if self.backend == "inductor":
            from torch._dynamo.utils import counters

            return Counter(hit=counters["inductor"]["fxgraph_cache_hit"],
                           miss=counters["inductor"]["fxgraph_cache_miss"],
                           bypass=counters["inductor"]["fxgraph_cache_bypass"])
        if self.backend == "jax":
            return Counter(hit=self._jax_events["/jax/compilation_cache/cache_hits"],
                           miss=self._jax_events["/jax/compilation_cache/compile_requests_use_cache"]
                           - self._jax_events["/jax/compilation_cache/cache_hits"])
        return None

    def hits(self) -> int | None:
        counts = self._counts()
        return None if counts is None else counts["hit"] - self._start["hit"]

    def misses(self) -> int | None:
        counts = self._counts()
        return None if counts is None else counts["miss"] - self._start["miss"]

    def where(self) -> str:
        """The line a run logs before it compiles."""
        return f"compile cache: {self.directory} ({self.source}; {self.entries()} files there)"

    def describe(self) -> str:
        """One phrase for the compile line: 'cache: 1 hit, 0 misses in DIR'."""
        hits, misses = self.hits(), self.misses()
        if hits is None:
            return f"cache {self.directory} ({self.entries()} files)"
        bypassed = (self._counts() or Counter())["bypass"] - self._start["bypass"]
        uncacheable = f", {bypassed} not cacheable" if bypassed else ""  # Inductor says why at TORCH_LOGS=+inductor
        return (f"cache: {hits} hit{'s' * (hits != 1)}, {misses} miss{'es' * (misses != 1)}{uncacheable} in "
                f"{self.directory}")


def use_compile_cache(cache_dir: str, *, backend: str, enabled: bool = True) -> CompileCache | None:
    """Point `backend`'s compiler (compile.backend: inductor, jax or tpu) at its persistent cache
    under `cache_dir` ("" = the default root, module docstring), before anything compiles. Returns
    None for backends with nothing to cache (eager, aot_eager) or when `enabled` is false."""
    if not enabled or backend not in _ENV:
        return None
    variable, subdirectory = _ENV[backend]
    if cache_dir:
        directory, source = Path(cache_dir).expanduser().absolute() / subdirectory, "compile.cache_dir"
    elif os.environ.get(variable):
        directory, source = Path(os.environ[variable]).expanduser().absolute(), f"the environment ({variable})"
    else:
        directory, source = default_compile_cache_dir() / subdirectory, "default"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile.cache_dir: cannot create {directory} ({e.strerror}); point compile.cache_dir at "
                         "a writable directory, or set compile.cache false") from None
    os.environ[variable] = str(directory)
    cache = CompileCache(backend=backend, directory=directory, source=source)
    if backend == "jax":
        _configure_jax(directory)
    return cache


def _configure_jax(directory: Path) -> None:
    """JAX reads its settings from the environment when imported (importing it here would fix its
    platform before jax_start.start_jax chooses one), through jax.config once imported."""
    settings: dict[str, Any] = {"jax_compilation_cache_dir": str(directory),
                                "jax_persistent_cache_min_compile_time_secs": 0.0}
    if "jax" in sys.modules:
        import jax

        for name, value in settings.items():
            jax.config.update(name, value)
    else:
        for name, value in settings.items():
            os.environ[name.upper()] = str(value)
