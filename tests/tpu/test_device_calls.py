"""The calls device.py makes to find and drive a TPU, made for real (not bound to a signature) in the
TPU environment: torch-tpu 0.2.0 loaded, libtpu present, no chip. Which of them answer here, which
raise, and what our backends make of each: a device chosen with its reason, or a one-line error.

torch-tpu 0.2.0 keeps `torch.tpu.is_available`, `device_count`, `current_device`, `set_device` and
`synchronize` to torch and itself (they raise for any other caller, chip or not), so device.py finds
the TPU through `torch.accelerator`, where torch-tpu registers the "tpu" device type.
"""

from __future__ import annotations

import pytest
import torch

from titan_tpu import device
from titan_tpu.device import get_backend, import_torch_tpu_with_a_device, tpu_device_count

# (the torch.tpu function device.py used to call, its arguments): internal in 0.2.0.
INTERNAL = {"is_available": (), "device_count": (), "current_device": (), "set_device": (0,), "synchronize": ()}

# Every torch.accelerator function device.py calls, with its arguments, and what it does off a chip.
ACCELERATOR = {"is_available": ((), False), "current_accelerator": ((), None), "device_count": ((), 0),
               # called only where device_count > 0, or inside a try (memory statistics)
               "current_device_index": ((), RuntimeError), "set_device_index": ((0,), RuntimeError),
               "synchronize": ((), RuntimeError), "memory_allocated": ((), RuntimeError),
               "max_memory_allocated": ((), RuntimeError), "reset_peak_memory_stats": ((), RuntimeError)}


def test_device_py_calls_no_function_torch_tpu_keeps_to_itself():
    """Each one raises for us ("internal to TorchTPU"), and device.py's source names none of them."""
    import inspect

    source = inspect.getsource(device)
    for name, args in INTERNAL.items():
        with pytest.raises(RuntimeError, match="internal to TorchTPU"):
            getattr(torch.tpu, name)(*args)
        assert f"torch.tpu.{name}(" not in source, name


@pytest.mark.parametrize("name", list(ACCELERATOR))
def test_torch_accelerator_off_a_chip(name):
    """What each torch.accelerator call device.py makes does here, and that device.py makes it."""
    import inspect

    args, outcome = ACCELERATOR[name]
    assert f"torch.accelerator.{name}(" in inspect.getsource(device), name
    call = getattr(torch.accelerator, name)
    if outcome is RuntimeError:
        with pytest.raises(RuntimeError, match="none is available"):
            call(*args)
    else:
        assert call(*args) == outcome


def test_our_backends_off_a_chip():
    """No TPU here: `auto` takes the CPU and says why in one phrase; `tpu` and the TorchTPU compile
    backend refuse in one line; the device's name (torch.tpu.get_device_name, which answers) names no
    generation, so a TPU's peak would come from the VM's environment."""
    assert tpu_device_count() == 0
    backend = get_backend("auto")
    assert backend.name == "cpu" and backend.chosen_because == "auto: torch-tpu sees no TPU device; no CUDA device"
    for call in (lambda: get_backend("tpu"), import_torch_tpu_with_a_device):
        with pytest.raises(ValueError, match="sees no TPU device") as error:
            call()
        assert "\n" not in str(error.value)
    with pytest.warns(UserWarning, match="experimental"):
        assert torch.tpu.get_device_name() == "TPU"


@pytest.mark.multiprocess
def test_the_jax_path_on_a_machine_without_a_tpu_is_one_line():
    """A TPU recipe's JAX path where JAX finds no TPU: the run's last line is our one-line error (what
    to change), not JAX's backend traceback."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-m", "titan_tpu", "train", "--config", "configs/llama3_debug.toml",
                           "--training.mode", "graph", "--compile.backend", "jax", "--training.device", "tpu",
                           "--training.steps", "1", "--output_dir", "/nonexistent/never-written"],
                          capture_output=True, text=True, timeout=300, env=env)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert last.startswith("error: compile.backend jax on training.device tpu: JAX cannot start its tpu backend"), last
    assert last.endswith("run on a TPU VM, or use --training.device cpu (XLA on this CPU)"), last


def test_launch_calls_torch_tpus_launch_helper_for_several_hosts():
    """`titan-tpu launch` hands the hosts it derived to torch-tpu's own helper
    (torch.tpu.distributed.set_tpu_launch_env), called for real: it answers off a chip and sets
    torch-tpu's slice-builder addresses (one per process of every host) and keeps ours; the launcher's
    own environment is left as it was."""
    import os

    from titan_tpu.tools.launch import Layout, _torch_tpu_launch_env, launch_environment

    layout = Layout(nnodes=2, node_rank=1, master_addr="10.0.0.5", master_port=29500, nproc_per_node=4,
                    process_bounds="2,2,2", hostnames=("10.0.0.5", "10.0.0.6"))
    before = dict(os.environ)
    env = launch_environment(layout, {k: v for k, v in os.environ.items() if not k.startswith("TORCH_TPU_")})
    _torch_tpu_launch_env(layout, env)
    assert dict(os.environ) == before
    addresses = env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    assert len(addresses) == 8 and addresses[0].startswith("10.0.0.5:") and addresses[-1].startswith("10.0.0.6:")
    assert (env["NODE_RANK"], env["MASTER_ADDR"], env["TPU_PROCESS_BOUNDS"]) == ("1", "10.0.0.5", "2,2,2")
