"""Backend selection, peak FLOP/s tables and the cached CPU measurement."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_tpu import device as dev, device_cpu, device_peaks, jax_start
from titan_tpu.device import Backend, get_backend
from titan_tpu.device_peaks import cuda_peak_flops, tpu_generation, tpu_peak_flops


@pytest.fixture
def fresh_cpu_memo(monkeypatch):
    """An empty in-process memo; counts real measurements."""
    monkeypatch.delenv("TITAN_TPU_PEAK_FLOPS", raising=False)
    monkeypatch.setattr(device_cpu, "_cpu_peak_memo", {})
    calls = []

    def fake_measure(dtype=torch.float32):
        calls.append(1)
        return 123e9

    monkeypatch.setattr(device_cpu, "measure_cpu_matmul_flops", fake_measure)
    return calls


def test_cpu_backend_fields():
    b = get_backend("cpu")
    assert isinstance(b, Backend)
    fields = (b.name, b.device, b.process_group_backend, b.compile_backend)
    assert fields == ("cpu", torch.device("cpu"), "gloo", "inductor")
    b.synchronize()  # no-op, must not fail


def test_auto_is_cpu_here():
    if torch.cuda.is_available() or importlib.util.find_spec("torch_tpu") is not None:
        pytest.skip("this machine has an accelerator stack")
    assert get_backend("auto").name == "cpu"
    assert get_backend().name == "cpu"


def test_unknown_backend_lists_choices():
    with pytest.raises(ValueError, match="cpu, cuda, tpu"):
        get_backend("gpu")


def test_cuda_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="cuda"):
        get_backend("cuda")
    assert get_backend("auto").name in ("cpu", "tpu")


def test_tpu_without_torch_tpu_is_a_clear_error(monkeypatch):
    real_find_spec = importlib.util.find_spec
    def find_spec(name, *args):
        return None if name in ("torch_tpu", "libtpu") else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.delitem(sys.modules, "torch_tpu", raising=False)
    with pytest.raises(ValueError, match="pip install torch-tpu") as e:
        get_backend("tpu")
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD" in str(e.value) and "\n" not in str(e.value)
    assert get_backend("auto").name != "tpu"  # auto must just skip the TPU


def test_tpu_import_failure_becomes_value_error(monkeypatch):
    # torch_tpu "installed" but broken: the ImportError must surface as a ValueError.
    monkeypatch.setattr(dev, "_tpu_installed", lambda: True)

    def broken_import(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(dev.importlib, "import_module", broken_import)
    with pytest.raises(ValueError, match="import failed"):
        get_backend("tpu")
    if not torch.cuda.is_available():
        assert get_backend("auto").name == "cpu"


def test_importing_device_does_not_import_torch_tpu():
    if importlib.util.find_spec("torch_tpu") is not None:
        pytest.skip("torch_tpu is installed here (torch auto-loads it)")
    # A fresh interpreter, so modules imported by other tests do not count.
    code = "import sys, titan_tpu.device as d; d.get_backend('cpu'); assert 'torch_tpu' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cpu_peak_measured_once_per_process(fresh_cpu_memo, monkeypatch, tmp_path):
    calls = fresh_cpu_memo
    monkeypatch.setenv("TITAN_TPU_CACHE", str(tmp_path))
    b = get_backend("cpu")
    assert b.peak_flops() == 123e9
    assert b.peak_flops() == 123e9 and get_backend("cpu").peak_flops() == 123e9
    assert len(calls) == 1  # the in-process memo answers repeated calls
    assert "measured 123 GFLOP/s" in b.peak_description()
    assert not list(tmp_path.iterdir())  # nothing persisted: a busy moment must not stick
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # another thread count: measured anew
    get_backend("cpu").peak_flops()
    assert len(calls) == 2


def test_peak_override_env(monkeypatch):
    monkeypatch.setenv("TITAN_TPU_PEAK_FLOPS", "5e11")
    b = get_backend("cpu")
    assert b.peak_flops() == 5e11 and "TITAN_TPU_PEAK_FLOPS" in b.peak_description()
    monkeypatch.setenv("TITAN_TPU_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match="TITAN_TPU_PEAK_FLOPS"):
        get_backend("cpu").peak_flops()


def test_real_cpu_matmul_measurement_is_plausible():
    flops = device_cpu.measure_cpu_matmul_flops(n=512, reps=2)  # small: just check the arithmetic
    assert 1e9 < flops < 1e14


def test_cpu_peak_description_and_real_peak(monkeypatch):
    monkeypatch.delenv("TITAN_TPU_PEAK_FLOPS", raising=False)
    monkeypatch.setattr(device_cpu, "_cpu_peak_memo", {})
    b = get_backend("cpu")
    assert b.peak_flops() > 1e9
    assert b.peak_description().startswith("cpu fp32 matmul, measured")
    assert f"on {torch.get_num_threads()} threads" in b.peak_description()


def test_cpu_memory_stats():
    b = get_backend("cpu")
    stats = b.memory_stats()
    assert set(stats) == {"memory_gb", "max_memory_gb"}
    assert 0 < stats["memory_gb"] <= stats["max_memory_gb"] + 1e-3
    b.reset_peak_memory()
    assert b.memory_stats()["max_memory_gb"] > 0


def test_cuda_peak_table():
    assert cuda_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert cuda_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert cuda_peak_flops("NVIDIA H200") == 989e12
    assert cuda_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert cuda_peak_flops("NVIDIA B200") == 2250e12
    assert cuda_peak_flops("Some Future GPU") is None


def test_tpu_peak_table():
    assert tpu_peak_flops("v4") == 275e12
    assert tpu_peak_flops("v5e") == tpu_peak_flops("TPU v5 lite") == 197e12
    assert tpu_peak_flops("v5p") == tpu_peak_flops("TPU v5") == 459e12
    assert tpu_peak_flops("v6e") == tpu_peak_flops("TPU v6 lite") == 918e12
    assert tpu_peak_flops("v7") == tpu_peak_flops("TPU7x") == 2307e12 / 2  # two devices per chip
    with pytest.raises(ValueError, match="unknown TPU generation"):
        tpu_peak_flops("v2")


def test_the_planner_plans_with_the_peaks_a_run_measures_its_mfu_against(monkeypatch):
    """One table: on every accelerator the planner knows, a plan's peak FLOP/s (and devices per
    chip) are what a training run on that device divides by for its MFU."""
    from titan_tpu.plan.hardware import HARDWARE

    monkeypatch.delenv("TITAN_TPU_PEAK_FLOPS", raising=False)
    for name, hardware in HARDWARE.items():
        if tpu_generation(name):
            monkeypatch.setattr(dev, "_detect_tpu_kind", lambda device, kind=name: kind)
            run = Backend(name="tpu", device=torch.device("cpu"), process_group_backend="gloo", compile_backend="tpu")
            assert hardware.devices_per_chip == device_peaks.tpu_devices_per_chip(name), name
        else:
            monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, kind=name: f"NVIDIA {kind.upper()}")
            run = Backend(name="cuda", device=torch.device("cpu"), process_group_backend="gloo",
                          compile_backend="inductor")
        assert run.peak_flops(torch.bfloat16) == hardware.peak_flops, name


@pytest.mark.parametrize(
    "name, gen",
    [
        ("v4-8", "v4"),
        ("v5litepod-16", "v5e"),
        ("v5e-4", "v5e"),
        ("v5p-128", "v5p"),
        ("v6e-8", "v6e"),
        ("Trillium", "v6e"),
        ("tpu7x-8", "v7"),
        ("TPU v7", "v7"),
        ("v3-8", None),
        ("cpu", None),
    ],
)
def test_tpu_generation_parsing(name, gen):
    assert tpu_generation(name) == gen


def test_cuda_backend_with_faked_cuda(monkeypatch):
    """The CUDA path without a GPU: device index from LOCAL_RANK, nccl, datasheet peak."""
    monkeypatch.delenv("TITAN_TPU_PEAK_FLOPS", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    b = get_backend("cuda")
    assert (b.name, b.device, b.process_group_backend, b.compile_backend) == (
        "cuda",
        torch.device("cuda", 3),
        "nccl",
        "inductor",
    )
    assert chosen == [3]
    assert b.peak_flops() == 989e12 and "H200" in b.peak_description()

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU")
    with pytest.warns(UserWarning, match="no peak FLOP/s known"):
        assert get_backend("cuda").peak_flops() == device_peaks.CUDA_FALLBACK_PEAK


def _internal(name):
    def call(*args, **kwargs):
        raise RuntimeError(f"{name} is internal to TorchTPU and can only be called by the PyTorch framework (torch "
                           f"and torch_tpu). Use torch.accelerator.{name} instead")
    return call


class _FakeTorchTpu:
    """Stands in for the torch.tpu module that torch_tpu installs, as torch-tpu 0.2.0 behaves: the
    device's name answers, the device functions it keeps to torch and itself raise for us."""

    def __init__(self, device_name):
        self.device_name = device_name
        for name in ("is_available", "device_count", "current_device", "set_device", "synchronize"):
            setattr(self, name, _internal(name))

    def get_device_name(self, device=None):
        return self.device_name


class _FakeAccelerator:
    """torch.accelerator on a TPU VM with torch-tpu loaded: 4 "tpu" devices."""

    def __init__(self):
        self.synced = []

    def is_available(self):
        return True

    def current_accelerator(self):
        return torch.device("tpu")

    def device_count(self):
        return 4

    def current_device_index(self):
        return 0

    def set_device_index(self, index):
        raise AssertionError("only called under torchrun")

    def synchronize(self, device=None):
        self.synced.append(device)


def test_tpu_backend_with_faked_torch_tpu():
    """Runs the check below in a fresh process: it must rename torch's privateuse1 device type to
    "tpu" (as torch_tpu does), which cannot be undone and would leak into other tests."""
    env = {**os.environ, "TITAN_TPU_FAKE_TPU": "1"}
    test_id = f"{__file__}::test_fake_tpu_backend_inner"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_id]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.skipif(not os.environ.get("TITAN_TPU_FAKE_TPU"), reason="run by test_tpu_backend_with_faked_torch_tpu")
def test_fake_tpu_backend_inner(monkeypatch):
    if torch._C._get_privateuse1_backend_name() != "tpu":
        torch.utils.rename_privateuse1_backend("tpu")
    monkeypatch.delenv("TITAN_TPU_PEAK_FLOPS", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    accelerator = _FakeAccelerator()
    monkeypatch.setitem(sys.modules, "torch_tpu", object())  # "already imported" (auto-loaded)
    monkeypatch.setattr(torch, "tpu", _FakeTorchTpu("TPU v6 lite"), raising=False)
    monkeypatch.setattr(torch, "accelerator", accelerator)
    b = get_backend("auto")
    assert (b.name, b.device, b.process_group_backend, b.compile_backend) == (
        "tpu",
        torch.device("tpu", 0),
        "tpu_dist",
        "tpu",
    )
    assert b.chosen_because == "auto: torch-tpu sees 4 TPU device(s)"
    assert b.peak_flops() == 918e12 and "v6e" in b.peak_description()
    b.synchronize()
    assert accelerator.synced == [torch.device("tpu", 0)]

    # v7: two devices per chip, so each device gets half the chip's peak.
    monkeypatch.setattr(torch, "tpu", _FakeTorchTpu("TPU7x"), raising=False)
    b = get_backend("tpu")
    assert b.peak_flops() == 2307e12 / 2 and "per device" in b.peak_description()

    # Unknown name: fall back to the TPU VM's accelerator type, then to a stated default.
    monkeypatch.setattr(torch, "tpu", _FakeTorchTpu("TPU"), raising=False)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    assert get_backend("tpu").peak_flops() == 197e12
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE")
    for var in ("ACCELERATOR_TYPE", "TPU_TYPE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.warns(UserWarning, match="could not tell the TPU generation"):
        assert get_backend("tpu").peak_flops() == tpu_peak_flops(device_peaks.TPU_FALLBACK_GENERATION)


# ---------------------------------------------------------------------------------------------
# MFU never above 100%: a run that beats the measured peak has it measured again, else no MFU
# ---------------------------------------------------------------------------------------------


def _measuring(monkeypatch, rates):
    """The CPU peak measurement returning `rates` in turn (the last one from then on); the calls."""
    monkeypatch.delenv("TITAN_TPU_PEAK_FLOPS", raising=False)
    monkeypatch.setattr(device_cpu, "_cpu_peak_memo", {})
    calls = []

    def fake_measure(dtype=torch.float32):
        calls.append(dtype)
        return rates[min(len(calls), len(rates)) - 1]

    monkeypatch.setattr(device_cpu, "measure_cpu_matmul_flops", fake_measure)
    return calls


def test_a_run_that_beats_the_peak_measured_in_a_busy_moment_has_it_measured_again(monkeypatch):
    calls = _measuring(monkeypatch, [139e9, 332e9])  # busy at the start, quiet later
    backend = get_backend("cpu")
    assert backend.peak_flops() == 139e9
    mfu, note = backend.mfu(166e9)
    assert mfu == pytest.approx(100 * 166 / 332) and len(calls) == 2
    assert note.startswith("MFU peak measured again: the run computes 166 GFLOP/s per device, above the 139 measured")
    assert "measured 332 GFLOP/s" in backend.peak_description() and "\n" not in note
    assert backend.mfu(100e9) == (pytest.approx(100 * 100 / 332), "") and len(calls) == 2  # below the peak: as is


def test_a_peak_the_run_keeps_beating_is_unreliable_and_no_mfu_is_claimed(monkeypatch):
    calls = _measuring(monkeypatch, [100e9, 90e9, 110e9, 105e9])
    backend = get_backend("cpu")
    mfu, note = backend.mfu(150e9)  # one more measurement per logged row, PEAK_RETRIES in all
    assert mfu is None and "MFU not reported (MFU n/a)" in note and "unreliable" in note and "\n" not in note
    assert len(calls) == 2
    for _ in range(dev.PEAK_RETRIES - 1):
        mfu, note = backend.mfu(150e9)
        assert mfu is None and note.startswith("MFU peak measured again") and "not reported" not in note  # said once
    assert backend.peak_flops() == 110e9 and len(calls) == 1 + dev.PEAK_RETRIES  # the best measurement is kept
    assert backend.mfu(150e9) == (None, "") and len(calls) == 1 + dev.PEAK_RETRIES  # measured no more
    assert backend.mfu(55e9) == (pytest.approx(50.0), "")


def test_a_datasheet_or_given_peak_is_never_measured_again_and_never_exceeded(monkeypatch):
    calls = _measuring(monkeypatch, [1e12])
    monkeypatch.setenv("TITAN_TPU_PEAK_FLOPS", "1e11")
    backend = get_backend("cpu")
    mfu, note = backend.mfu(2e11)
    assert mfu is None and "TITAN_TPU_PEAK_FLOPS" in note and calls == []


def test_the_console_says_the_peak_is_unreliable(tmp_path):
    from titan_tpu.train.metrics import MetricsLogger

    logger = MetricsLogger(output_dir=tmp_path, tensorboard=False, console=False)
    line = logger.format_line(3, {"loss": 2.0, "mfu": None})
    assert line.endswith("loss 2.0000 | MFU n/a (peak unreliable)")
    logger.log(3, {"loss": 2.0, "mfu": None})
    logger.close()
    assert '"mfu": null' in (tmp_path / "metrics.jsonl").read_text()


def test_training_prints_no_mfu_above_100_percent(monkeypatch, train_overrides, tmp_path, capsys):
    """A run on a CPU whose peak was measured far too low (every measurement 1 MFLOP/s): the log
    says the peak is unreliable instead of printing an MFU in the thousands of percent."""
    import json

    from titan_tpu.config import build_config
    from titan_tpu.loops import assemble

    calls = _measuring(monkeypatch, [1e6])
    cfg = build_config(str(Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml"),
                       train_overrides(training__steps=3, checkpoint__enabled="false", validation__enabled="false"))
    assemble(cfg).train()
    out = capsys.readouterr().out
    assert "MFU n/a (peak unreliable)" in out and "MFU not reported" in out
    assert not re.search(r"MFU \d", out), out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["mfu"] for row in rows] == [None] * 3 and len(calls) == 1 + dev.PEAK_RETRIES


# -- compile.backend jax: the refusals a machine without JAX, or a launch JAX does not take, gets --------------


def test_jax_path_without_jax_names_the_install(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jax" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"compile.backend jax needs JAX: pip install -e '\.\[jax\]'") as error:
        dev.jax_backend("cpu")
    assert "\n" not in str(error.value)


def test_jax_path_on_a_gpu_is_refused():
    with pytest.raises(ValueError, match="runs the step on a TPU or this CPU; training.device is cuda"):
        dev.jax_backend("cuda")


@pytest.mark.parametrize("local, total, world_size, match", [
    (4, 4, 1, r"one process per device; this process sees 4 cpu devices: start 4 processes for it"),
    (1, 8, 4, r"the run has 4 processes, JAX sees 8 cpu devices; start one process per device"),
])
def test_jax_path_launch_that_does_not_match_the_devices(local, total, world_size, match):
    with pytest.raises(ValueError, match=match) as error:
        jax_start.check_jax_devices("cpu", local=local, total=total, world_size=world_size)
    assert "\n" not in str(error.value)
    jax_start.check_jax_devices("cpu", local=1, total=world_size, world_size=world_size)  # what it takes


def test_jax_backend_keeps_the_torch_side_on_the_host(monkeypatch):
    """The step's math on the TPU (its kernels the TPU's JAX ones, one collective per tensor for XLA
    to combine), the run's torch tensors and process group on the host CPU."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "jax" else find_spec(name, *a))
    backend = dev.jax_backend("tpu")
    assert (backend.device.type, backend.process_group_backend, backend.jax_platform) == ("cpu", "gloo", "tpu")
    assert (backend.compute_device_type, backend.kernel_device_type, backend.collective_per_tensor) == \
        ("tpu", "jax", True)
    cpu = dev.jax_backend("cpu")
    assert (cpu.compute_device_type, cpu.kernel_device_type, cpu.collective_per_tensor) == ("cpu", "cpu", False)
    assert dev.get_backend("cpu").jax_platform is None


def test_auto_says_why_it_chose_the_cpu(monkeypatch):
    """Without torch-tpu and CUDA, `auto` is the CPU and says why in one phrase (the run's first line)."""
    if importlib.util.find_spec("torch_tpu") is not None:
        pytest.skip("torch_tpu is installed here: tests/tpu/test_device_calls.py covers auto there")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend = get_backend("auto")
    assert backend.name == "cpu" and backend.chosen_because == "auto: torch-tpu is not installed; no CUDA device"
    assert get_backend("cpu").chosen_because == "training.device = cpu"
