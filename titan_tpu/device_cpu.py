"""The CPU as the trainer measures it: its matmul peak in the compute dtype (there is no meaningful
datasheet number for a shared VM; measured once per process and dtype, the best of 12 matmuls in
three rounds, about 1.5 s in fp32), whether it has bf16 matmul instructions, and the process's
memory from /proc."""

from __future__ import annotations

import platform
import resource
import sys
import time
from pathlib import Path

import torch

# Matrix size and repetitions for the CPU matmul benchmark: 2048^3 * 2 = 17 GFLOP per matmul,
# ~0.12 s each at ~140 GFLOP/s, so warmup + 3 rounds of 4 timed reps take about 1.5 s; the best rep
# is taken, which is robust to a neighbour stealing the cores for part of that time.
_CPU_BENCH_N = 2048
_CPU_BENCH_REPS = 4  # matmuls per round
_CPU_BENCH_ROUNDS = 3  # rounds a few tens of milliseconds apart: a neighbour's burst spoils fewer of them


# measurement taken in a busy moment (seen here: 87 instead of 145 GFLOP/s; 139 instead of 332 with
# another process busy on one of two cores) would otherwise inflate every later run's MFU past
# 100%. A second of measuring per process is the price. Within a process, a run that beats the
# peak is the proof that it was measured in such a moment: `Backend.mfu` measures it again.
_cpu_peak_memo: dict[str, float] = {}  # keyed by CPU model, thread count, torch version and dtype


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def _cpu_cache_key(dtype: torch.dtype) -> str:
    return f"{_cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}|{dtype}"


# /proc/cpuinfo flags that give a CPU native bf16 matmuls (AVX512_BF16 dot products, AMX tiles).
# Without them torch emulates bf16 and its matmuls run ~100x slower than fp32 (AMD EPYC with AVX2:
# measured in docs/mixed_precision.md).
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, or None where it cannot be read (not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cpu_bf16_support() -> tuple[bool, str]:
    """(does this CPU run bf16 matmuls natively, why): the /proc/cpuinfo flags `CPU_BF16_FLAGS`,
    or torch's own CPU capability query where /proc/cpuinfo cannot be read."""
    flags = _cpu_flags()
    if flags is not None:
        found = [f for f in CPU_BF16_FLAGS if f in flags]
        if found:
            return True, f"{_cpu_model()} lists {' and '.join(found)} in /proc/cpuinfo"
        return False, f"{_cpu_model()} lists neither {' nor '.join(CPU_BF16_FLAGS)} in /proc/cpuinfo"
    queries = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    found = [q for q in queries if getattr(torch.cpu, q, lambda: False)()]
    if found:
        return True, f"torch.cpu.{found[0]}() is True on {_cpu_model()}"
    return False, f"torch reports neither AVX512_BF16 nor AMX on {_cpu_model()}"


def check_cpu_compute_dtype(dtype: str) -> None:
    """The one-line error for model.dtype bfloat16 on a CPU without bf16 matmul instructions."""
    if dtype != "bfloat16":
        return
    supported, why = cpu_bf16_support()
    if not supported:
        raise ValueError(f"model.dtype = bfloat16 on the CPU needs bf16 matmul instructions ({why}), without "
                         "which bf16 matmuls run ~100x slower than float32: use model.dtype = float32")


def measure_cpu_matmul_flops(n: int = _CPU_BENCH_N, reps: int = _CPU_BENCH_REPS,
                             dtype: torch.dtype = torch.float32, rounds: int = _CPU_BENCH_ROUNDS) -> float:
    """The best n x n matmul rate (FLOP/s) in `dtype` on the current torch thread count, of `rounds`
    rounds of `reps` matmuls with a short pause between rounds."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm up: thread pool start, page faults on `out`
    best = float("inf")
    for round_index in range(rounds):
        if round_index:
            time.sleep(0.03)
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def cpu_peak_flops(dtype: torch.dtype = torch.float32, *, again: bool = False) -> float:
    """Measured CPU matmul peak in `dtype`, memoised for the life of the process; `again` measures
    once more and keeps the best of every measurement (the memo only grows: a low one is a busy
    machine, not a slower CPU). bf16 only where the CPU has bf16 instructions (elsewhere the
    measurement alone would take minutes)."""
    if dtype == torch.bfloat16:
        check_cpu_compute_dtype("bfloat16")
    key = _cpu_cache_key(dtype)
    if again or key not in _cpu_peak_memo:
        _cpu_peak_memo[key] = max(_cpu_peak_memo.get(key, 0.0), measure_cpu_matmul_flops(dtype=dtype))
    return _cpu_peak_memo[key]


# ---------------------------------------------------------------------------------------------
# CPU memory from /proc (Linux) with a getrusage fallback
# ---------------------------------------------------------------------------------------------


def _proc_status_kb(field_name: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return float(line.split()[1])  # "VmRSS:   123456 kB"
    except OSError:
        pass
    return None


def _cpu_memory_stats() -> dict[str, float]:
    rss_kb = _proc_status_kb("VmRSS")
    hwm_kb = _proc_status_kb("VmHWM")
    if hwm_kb is None:
        # ru_maxrss is in KiB on Linux and bytes on macOS.
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        hwm_kb = maxrss / 1024 if sys.platform == "darwin" else float(maxrss)
    if rss_kb is None:
        rss_kb = hwm_kb
    return {"memory_gb": rss_kb * 1024 / 1e9, "max_memory_gb": hwm_kb * 1024 / 1e9}
