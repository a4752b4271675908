"""Backend selection: which device we train on and the facts the trainer needs about it.

A `Backend` bundles the torch device, the process-group backend, the compile backend, the peak
FLOP/s used as the MFU denominator, memory statistics and a synchronize hook, so nothing else in
the framework has to branch on "cpu" / "cuda" / "tpu"; what differs per device is one class each
(`_CPU`, `_CUDA`, `_TPU`, `_JAX`), so `Backend` does not branch on its own name either.

Its neighbours: device_peaks.py (the accelerators' datasheet peaks), device_cpu.py (the CPU's
measured peak, bf16 support and memory) and jax_start.py (JAX's runtime for the JAX path).

Every TorchTPU call of the framework outside the kernels is in this module (the kernels' are in
kernels/tpu.py; tests/test_tpu_sites.py keeps it so). TorchTPU (`torch_tpu`) is never imported at
module import time: in an environment that has torch_tpu but no libtpu, importing it aborts the
whole process, so we only import it when the TPU backend is actually chosen (or, for "auto", after
checking with `importlib.util.find_spec` that both torch_tpu and libtpu are installed).

Peak FLOP/s, for the compute dtype (model.dtype; docs/mixed_precision.md):
  * CPU: a measured matmul rate in the compute dtype (device_cpu.py), measured once per process
    and dtype on the current thread count, and again when a run beats it (`Backend.mfu`). bf16 is
    measured, and allowed, only where the CPU has bf16 matmul instructions (`cpu_bf16_support`).
  * CUDA: dense bf16 datasheet numbers by device name (device_peaks.py); an fp32 run is
    measured against them too, and the printed peak says so.
  * TPU: dense bf16 datasheet numbers by generation, per device (device_peaks.py).
  * $TITAN_TPU_PEAK_FLOPS, if set, overrides all of the above (for hardware not in the tables).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from titan_tpu.device_cpu import _cpu_memory_stats, cpu_peak_flops
from titan_tpu.device_peaks import (
    CUDA_FALLBACK_PEAK,
    TPU_FALLBACK_GENERATION,
    _env_peak_override,
    cuda_peak_flops,
    tpu_devices_per_chip,
    tpu_generation,
    tpu_peak_flops,
)
from titan_tpu.jax_start import start_jax

BACKEND_CHOICES = ("auto", "cpu", "cuda", "tpu")

# ---------------------------------------------------------------------------------------------
# Backend
# ---------------------------------------------------------------------------------------------


class _CPU:
    """The CPU: a measured peak, the process's RSS, nothing to synchronise."""

    datasheet_peak = False  # the peak is measured in the compute dtype itself
    compute_device_type = kernel_device_type = "cpu"  # where the math runs; whose kernels model code takes
    collective_per_tensor = False  # SimpleFSDP's flat buckets (MixedPrecision.per_tensor)
    jax_platform = None  # JAX's platform, for compile.backend jax only (`_JAX`)

    def start(self, rank: int, world_size: int) -> None:
        """Start the device's runtime once the process group is up (nothing to do here)."""

    def look_up_peak(self, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
        flops = cpu_peak_flops(dtype)
        return flops, (f"cpu {_dtype_name(dtype)} matmul, measured {flops / 1e9:.0f} GFLOP/s on "
                       f"{torch.get_num_threads()} threads")

    def measure_peak_again(self, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
        cpu_peak_flops(dtype, again=True)
        return self.look_up_peak(device, dtype)

    def memory_stats(self, device: torch.device) -> dict[str, float]:
        return _cpu_memory_stats()

    def reset_peak_memory(self, device: torch.device) -> None:
        # Linux resets VmHWM to the current RSS when "5" is written to clear_refs.
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def synchronize(self, device: torch.device) -> None:
        pass


class _CUDA:
    """A CUDA GPU: the datasheet's dense bf16 peak by device name, the caching allocator's stats."""

    datasheet_peak = True
    compute_device_type = kernel_device_type = "cuda"
    collective_per_tensor = False
    jax_platform = None  # the torch backends run no JAX

    def start(self, rank: int, world_size: int) -> None:
        pass

    def look_up_peak(self, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
        dev_name = torch.cuda.get_device_name(device)
        flops = cuda_peak_flops(dev_name)
        if flops is None:
            warnings.warn(
                f"no peak FLOP/s known for GPU {dev_name!r}; MFU uses {CUDA_FALLBACK_PEAK / 1e12:.0f} "
                "TFLOP/s (set TITAN_TPU_PEAK_FLOPS to the card's dense bf16 peak)",
                stacklevel=3,
            )
            assumed = f"assumed {CUDA_FALLBACK_PEAK / 1e12:.0f} TFLOP/s bf16 dense"
            return CUDA_FALLBACK_PEAK, f"cuda {dev_name}: unknown card, {assumed}"
        return flops, f"cuda {dev_name}: bf16 dense datasheet peak {flops / 1e12:.0f} TFLOP/s"

    def memory_stats(self, device: torch.device) -> dict[str, float]:
        return {
            "memory_gb": torch.cuda.memory_allocated(device) / 1e9,
            "max_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9,
        }

    def reset_peak_memory(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


class _TPU:
    """A TPU through TorchTPU: the datasheet's dense bf16 peak by generation, per device."""

    datasheet_peak = True
    compute_device_type = kernel_device_type = "tpu"
    collective_per_tensor = True  # one collective per tensor: XLA combines them
    jax_platform = None  # the torch backends run no JAX

    def start(self, rank: int, world_size: int) -> None:
        pass

    def look_up_peak(self, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
        kind = _detect_tpu_kind(device)
        gen = tpu_generation(kind) if kind else None
        if gen is None:
            gen = TPU_FALLBACK_GENERATION
            warnings.warn(
                f"could not tell the TPU generation from {kind!r}; MFU assumes {gen} "
                "(set TITAN_TPU_PEAK_FLOPS to override)",
                stacklevel=3,
            )
        flops = tpu_peak_flops(gen)
        per = " per device (2 devices per chip)" if tpu_devices_per_chip(gen) > 1 else ""
        return flops, f"tpu {gen} ({kind}): bf16 dense datasheet peak {flops / 1e12:.0f} TFLOP/s{per}"

    def memory_stats(self, device: torch.device) -> dict[str, float]:
        # torch_tpu 0.2.0 lists no memory API of its own; try torch.accelerator's generic
        # allocator stats, which work when the backend registers an allocator.
        try:
            return {
                "memory_gb": torch.accelerator.memory_allocated(device) / 1e9,
                "max_memory_gb": torch.accelerator.max_memory_allocated(device) / 1e9,
            }
        except Exception:  # noqa: BLE001 - any failure just means "no stats"
            return {}

    def reset_peak_memory(self, device: torch.device) -> None:
        try:
            torch.accelerator.reset_peak_memory_stats(device)
        except Exception:  # noqa: BLE001
            pass

    def synchronize(self, device: torch.device) -> None:
        torch.accelerator.synchronize(device)  # torch.tpu.synchronize is internal to torch-tpu 0.2.0


class _JAX:
    """XLA through JAX's runtime (compile.backend jax, graph/jax_step.py): the step runs on this
    process's JAX device (a TPU chip, or one XLA host device on a CPU); the torch side of the run (the
    master copy of the model, data, checkpoints) lives on the host CPU. One process per device, as
    torchrun starts them: rank r of the torch process group is JAX process r, holding device r of
    the mesh (docs/architecture.md, "The JAX path").

    platform: "tpu" or "cpu", JAX's platform. Peak: a TPU's datasheet number by generation (JAX's
    device kind), or on a CPU the measured matmul rate of `_CPU`."""

    def __init__(self, platform: str):
        self.jax_platform = platform
        # A TPU's XLA combines one collective per tensor (as TorchTPU's); XLA:CPU runs each through
        # gloo, so there SimpleFSDP's flat buckets make fewer of them, as on the torch CPU path.
        self.collective_per_tensor = platform == "tpu"
        self.datasheet_peak = platform == "tpu"
        self.compute_device_type = platform
        # On a TPU model code is captured with the TPU's JAX kernels (kernels/jax_traced.py).
        self.kernel_device_type = "jax" if platform == "tpu" else "cpu"

    def start(self, rank: int, world_size: int) -> None:
        start_jax(self.jax_platform, rank=rank, world_size=world_size)

    def look_up_peak(self, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
        if self.jax_platform == "cpu":
            with _torch_threads(_xla_cpu_threads()):  # measured on the cores XLA:CPU's thread pool takes
                flops, description = _CPU().look_up_peak(device, dtype)
            return flops, f"{description} (XLA:CPU's threads; XLA:CPU runs the step)"
        import jax

        kind = jax.local_devices()[0].device_kind
        gen = tpu_generation(kind) or TPU_FALLBACK_GENERATION
        flops = tpu_peak_flops(gen)
        return flops, f"tpu {gen} ({kind}, through JAX): bf16 dense datasheet peak {flops / 1e12:.0f} TFLOP/s"

    def measure_peak_again(self, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
        with _torch_threads(_xla_cpu_threads()):
            cpu_peak_flops(dtype, again=True)
        return self.look_up_peak(device, dtype)

    def memory_stats(self, device: torch.device) -> dict[str, float]:
        import jax

        stats = jax.local_devices()[0].memory_stats()  # None on XLA:CPU
        if not stats:
            return _cpu_memory_stats()
        return {"memory_gb": stats.get("bytes_in_use", 0) / 1e9,
                "max_memory_gb": stats.get("peak_bytes_in_use", 0) / 1e9}

    def reset_peak_memory(self, device: torch.device) -> None:
        if self.jax_platform == "cpu":
            _CPU().reset_peak_memory(device)

    def synchronize(self, device: torch.device) -> None:
        pass  # each step reads its loss, which waits for the program


def _xla_cpu_threads() -> int:
    """The threads XLA:CPU computes with: one per core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextlib.contextmanager
def _torch_threads(count: int):
    """torch's intra-op thread count set to `count` inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# How often a run that beats the measured CPU peak has it measured again (each ~1.5 s), per process.
PEAK_RETRIES = 3

# One class per device kind: what differs between them, so `Backend` never asks its own name.
_DEVICE_KINDS = {"cpu": _CPU(), "cuda": _CUDA(), "tpu": _TPU()}


@dataclass
class Backend:
    """One training device and how to drive it. Build with `get_backend`.

    Memory numbers are in GB of 1e9 bytes: process RSS on CPU, allocated tensor memory on
    accelerators. What differs per device lives in its class (`_CPU`, `_CUDA`, `_TPU`).
    """

    name: str  # "cpu" | "cuda" | "tpu" | "jax"
    device: torch.device  # where the run's torch tensors live (the host CPU for "jax")
    process_group_backend: str  # "gloo" | "nccl" | "tpu_dist"
    compile_backend: str  # "inductor" (cpu, cuda) | "tpu" (TorchTPU's Dynamo backend) | "jax"
    kind: object = None  # what differs per device (`_CPU`, `_CUDA`, `_TPU`, `_JAX`); default by name
    chosen_because: str = ""  # why this device (`get_backend`, `jax_backend`): one phrase for the log
    _peaks: dict = field(default_factory=dict, repr=False, compare=False)  # by compute dtype
    _peak_retries: dict = field(default_factory=dict, repr=False, compare=False)  # re-measurements, by dtype
    _unreliable: set = field(default_factory=set, repr=False, compare=False)  # dtypes already said so

    @property
    def _kind(self):
        return self.kind if self.kind is not None else _DEVICE_KINDS[self.name]

    @property
    def compute_device_type(self) -> str:
        """Where the step's math runs: "cpu", "cuda" or "tpu" (a TPU through JAX too)."""
        return self._kind.compute_device_type

    @property
    def kernel_device_type(self) -> str:
        """The device type whose kernels the model is built with (kernels/): the torch device's, or
        "jax" for a TPU through JAX (the TPU's JAX kernels, kernels/jax_traced.py)."""
        return self._kind.kernel_device_type

    @property
    def collective_per_tensor(self) -> bool:
        """SimpleFSDP's collectives one per tensor (XLA combines them) rather than in flat buckets."""
        return self._kind.collective_per_tensor

    @property
    def jax_platform(self) -> str | None:
        """JAX's platform ("tpu", "cpu") for compile.backend jax; None for the torch backends."""
        return self._kind.jax_platform

    def start(self, rank: int, world_size: int) -> None:
        """Start the device's runtime, once the process group is up (JAX's distributed client for
        compile.backend jax; nothing for the torch backends)."""
        self._kind.start(rank, world_size)

    # -- peak FLOP/s ---------------------------------------------------------------------------

    def _peak_and_description(self, dtype: torch.dtype) -> tuple[float, str]:
        if dtype not in self._peaks:
            flops, description = self._measure_or_look_up_peak(dtype)
            if self._kind.datasheet_peak and dtype != torch.bfloat16 and _env_peak_override() is None:
                description += f" (the run computes in {_dtype_name(dtype)}: MFU against the bf16 peak)"
            self._peaks[dtype] = (flops, description)
        return self._peaks[dtype]

    def _measure_or_look_up_peak(self, dtype: torch.dtype) -> tuple[float, str]:
        override = _env_peak_override()
        if override is not None:
            return override, f"{self.name} peak from TITAN_TPU_PEAK_FLOPS: {override / 1e12:.3g} TFLOP/s"
        return self._kind.look_up_peak(self.device, dtype)

    def peak_flops(self, dtype: torch.dtype = torch.float32) -> float:
        """Per-device dense peak FLOP/s for compute in `dtype`, the MFU denominator."""
        return self._peak_and_description(dtype)[0]

    def peak_description(self, dtype: torch.dtype = torch.float32) -> str:
        """One line saying which peak MFU is measured against, naming its dtype (printed at the
        start of training)."""
        return self._peak_and_description(dtype)[1]

    def mfu(self, flops_per_s: float, dtype: torch.dtype = torch.float32) -> tuple[float | None, str]:
        """(model FLOPs utilisation in percent of the peak for compute in `dtype`, never above 100;
        a line to log, or ""). A measured peak (the CPU's) that the run's rate beats was measured
        while other processes held the cores: it is measured again, at most `PEAK_RETRIES` times
        per process, and the best measurement kept. A rate still above the peak, or above a
        datasheet peak (a FLOP count or a clock that is off), gives None: the peak is unreliable,
        and no MFU is claimed."""
        peak, _ = self._peak_and_description(dtype)
        note = ""
        retries = self._peak_retries.get(dtype, 0)
        if (flops_per_s > peak and not self._kind.datasheet_peak and _env_peak_override() is None
                and retries < PEAK_RETRIES):
            self._peak_retries[dtype] = retries + 1
            before = peak
            peak, description = self._kind.measure_peak_again(self.device, dtype)
            self._peaks[dtype] = (peak, description)
            note = (f"MFU peak measured again: the run computes {flops_per_s / 1e9:.0f} GFLOP/s per device, above the "
                    f"{before / 1e9:.0f} measured before (other processes held the cores); now {description}")
        if flops_per_s <= peak:
            return 100.0 * flops_per_s / peak, note
        if dtype not in self._unreliable:
            self._unreliable.add(dtype)
            note = (f"{note + '; ' if note else ''}MFU not reported (MFU n/a): the run's {flops_per_s / 1e12:.3g} "
                    f"TFLOP/s per device exceed the peak ({self.peak_description(dtype)}), so that peak is unreliable")
        return None, note

    # -- memory and synchronisation -------------------------------------------------------------

    def memory_stats(self) -> dict[str, float]:
        """{"memory_gb": now, "max_memory_gb": peak since the last reset}; {} if unavailable."""
        return self._kind.memory_stats(self.device)

    def reset_peak_memory(self) -> None:
        self._kind.reset_peak_memory(self.device)

    def synchronize(self) -> None:
        """Wait for queued device work, so wall-clock timings measure the work itself."""
        self._kind.synchronize(self.device)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))


def _detect_tpu_kind(device: torch.device) -> str | None:
    """A string naming the TPU generation: torch_tpu's device name, else the TPU VM's env."""
    try:
        name = torch.tpu.get_device_name(device)
        if name and tpu_generation(name):
            return name
    except Exception:  # noqa: BLE001 - fall through to the environment
        pass
    for var in ("TPU_ACCELERATOR_TYPE", "ACCELERATOR_TYPE", "TPU_TYPE"):
        if os.environ.get(var):
            return os.environ[var]
    return None


def _tpu_installed() -> bool:
    """True if torch_tpu and libtpu are both findable, without importing either."""
    if "torch_tpu" in sys.modules:
        return True
    if importlib.util.find_spec("torch_tpu") is None:
        return False
    return importlib.util.find_spec("libtpu") is not None or bool(os.environ.get("TPU_LIBRARY_PATH"))


def tpu_compile_error(reason: str) -> ValueError:
    """The one-line error for every way the graph trainer's tpu compile backend is unavailable."""
    return ValueError(f"compile.backend tpu needs TorchTPU on a TPU VM (pip install torch-tpu, with libtpu): "
                      f"{reason}; use --compile.backend inductor or aot_eager elsewhere")


def check_tpu_compile_backend(training_device: str) -> None:
    """Config-time check for compile.backend = tpu, without importing torch_tpu (its import can
    abort the process where libtpu is missing): the device must be tpu, or auto with TorchTPU
    installed. Whether a TPU is really there is checked when the step is compiled."""
    if training_device not in ("tpu", "auto"):
        raise tpu_compile_error(f"training.device is {training_device} (use tpu or auto)")
    if not _tpu_installed():
        raise tpu_compile_error("torch_tpu is not installed here")


def import_torch_tpu_with_a_device() -> None:
    """For compile.backend tpu: import torch_tpu (it registers torch.tpu and the Dynamo backend
    "tpu") and check that it sees a TPU; the one-line `tpu_compile_error` otherwise."""
    if not _tpu_installed():
        raise tpu_compile_error("torch_tpu is not installed here")
    try:
        importlib.import_module("torch_tpu")
    except Exception as e:  # noqa: BLE001 - any failure to load means "not usable here"
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__  # keep the error one line
        raise tpu_compile_error(f"importing torch_tpu failed ({first_line})") from e
    if tpu_device_count() == 0:
        raise tpu_compile_error("torch_tpu sees no TPU device")


def torch_tpu_launch_env(*, nnodes: int, nproc_per_node: int) -> None:
    """torch-tpu's own variables for a launch over several hosts (its slice builder's addresses, the
    topology), set in os.environ by its helper from TPU_WORKER_HOSTNAMES, NODE_RANK and MASTER_ADDR
    (tools/launch.py sets them first); it keeps every value already set. Nothing where torch-tpu is
    not installed."""
    if not _tpu_installed():
        return
    importlib.import_module("torch_tpu")
    torch.tpu.distributed.set_tpu_launch_env(nnodes=nnodes, nproc_per_node=nproc_per_node)


def _import_torch_tpu() -> None:
    hint = (
        "backend 'tpu' needs torch_tpu: pip install torch-tpu and libtpu in a separate environment "
        "(there, torch without libtpu aborts at import unless TORCH_DEVICE_BACKEND_AUTOLOAD=0), "
        "or choose backend cpu or cuda"
    )
    if not _tpu_installed():
        raise ValueError(hint)
    try:
        importlib.import_module("torch_tpu")
    except ImportError as e:
        raise ValueError(f"{hint} (import failed: {e})") from None


def _local_index(count: int) -> int:
    """Device index for this process: LOCAL_RANK under torchrun, else the current device."""
    local_rank = os.environ.get("LOCAL_RANK")
    return int(local_rank) % max(count, 1) if local_rank is not None else -1


def _cpu_backend() -> Backend:
    return Backend(name="cpu", device=torch.device("cpu"), process_group_backend="gloo", compile_backend="inductor")


def _cuda_backend() -> Backend:
    if not torch.cuda.is_available():
        raise ValueError("backend 'cuda' requested but torch.cuda.is_available() is False; use 'cpu' or 'auto'")
    index = _local_index(torch.cuda.device_count())
    if index >= 0:
        torch.cuda.set_device(index)  # NCCL and default-device allocations follow this
    else:
        index = torch.cuda.current_device()
    return Backend(
        name="cuda", device=torch.device("cuda", index), process_group_backend="nccl", compile_backend="inductor"
    )


def tpu_device_count() -> int:
    """The TPU devices torch sees, through `torch.accelerator` (torch-tpu registers the "tpu" device
    type there): torch-tpu 0.2.0 keeps `torch.tpu.is_available`, `device_count`, `set_device`,
    `current_device` and `synchronize` to torch and itself and raises for any other caller, with or
    without a chip. 0 without a TPU (torch.accelerator then answers for no device, or another one)."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != "tpu":
        return 0
    return torch.accelerator.device_count()


def _tpu_backend() -> Backend:
    _import_torch_tpu()
    count = tpu_device_count()
    if count == 0:
        raise ValueError("backend 'tpu' requested but torch_tpu sees no TPU device; use 'cpu' or 'auto'")
    index = _local_index(count)
    if index >= 0:
        torch.accelerator.set_device_index(index)
    else:
        index = torch.accelerator.current_device_index()
    return Backend(
        name="tpu", device=torch.device("tpu", index), process_group_backend="tpu_dist", compile_backend="tpu"
    )


def jax_backend(training_device: str, *, require_jax: bool = True) -> Backend:
    """The backend of compile.backend jax: JAX's platform from training.device (tpu, cpu, or auto:
    tpu where JAX would find one, else cpu); the torch side on the host CPU, its process group
    gloo. JAX itself starts with `Backend.start`, once the process group is up. require_jax False:
    its facts only (run/resolved.py Target), for a step captured without running it."""
    if training_device not in ("tpu", "cpu", "auto"):
        raise ValueError(f"compile.backend jax runs the step on a TPU or this CPU; training.device is "
                         f"{training_device}: set it to tpu or cpu, or use --compile.backend inductor on a GPU")
    if require_jax and importlib.util.find_spec("jax") is None:
        raise ValueError("compile.backend jax needs JAX: pip install -e '.[jax]' (on a TPU VM the .[tpu] install of "
                         "docs/tpu.md has it)")
    platform, why = training_device, f"compile.backend jax, training.device = {training_device}"
    if platform == "auto":
        platform = "tpu" if importlib.util.find_spec("libtpu") is not None and _tpu_vm() else "cpu"
        why = ("compile.backend jax, auto: libtpu installed on a TPU VM" if platform == "tpu" else
               "compile.backend jax, auto: no libtpu or no TPU VM here, JAX's CPU")
    return Backend(name="jax", device=torch.device("cpu"), process_group_backend="gloo", compile_backend="jax",
                   kind=_JAX(platform), chosen_because=why)


def _tpu_vm() -> bool:
    """A TPU VM: its accelerator devices (/dev/accel*, /dev/vfio) are present."""
    return bool(list(Path("/dev").glob("accel*"))) or Path("/dev/vfio").is_dir() and any(Path("/dev/vfio").iterdir())



def _tpu_absent() -> str | None:
    """For "auto": None where torch_tpu is installed and sees a TPU, else why not (one phrase).
    Never crashes without it: a broken install is a reason, not an error."""
    if not _tpu_installed():
        return "torch-tpu is not installed"
    try:
        importlib.import_module("torch_tpu")
        count = tpu_device_count()
    except Exception as e:  # noqa: BLE001 - a broken install means "no TPU" for auto
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"torch-tpu did not load ({first_line[:120]})"
    return None if count else "torch-tpu sees no TPU device"


def get_backend(name: str = "auto") -> Backend:
    """Backend for "cpu" | "cuda" | "tpu", or "auto": tpu if present, else cuda if available, else cpu;
    `Backend.chosen_because` says why, one phrase (the run logs it).

    For cuda and tpu under torchrun, the device index is LOCAL_RANK and it is made current.
    """
    if name not in BACKEND_CHOICES:
        raise ValueError(f"unknown device backend {name!r}; choose one of {', '.join(BACKEND_CHOICES)}")
    if name != "auto":
        backend = {"cpu": _cpu_backend, "cuda": _cuda_backend, "tpu": _tpu_backend}[name]()
        backend.chosen_because = f"training.device = {name}"
        return backend
    no_tpu = _tpu_absent()
    if no_tpu is None:
        backend = _tpu_backend()
        backend.chosen_because = f"auto: torch-tpu sees {tpu_device_count()} TPU device(s)"
    elif torch.cuda.is_available():
        backend = _cuda_backend()
        backend.chosen_because = f"auto: {no_tpu}; CUDA sees {torch.cuda.device_count()} GPU(s)"
    else:
        backend = _cpu_backend()
        backend.chosen_because = f"auto: {no_tpu}; no CUDA device"
    return backend
