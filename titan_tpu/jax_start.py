"""JAX's runtime for a process of the JAX path (compile.backend jax, graph/jax_step.py): one JAX
device per process, the distributed client found through the torch process group, and libtpu's
settings for one TPU chip per process."""

from __future__ import annotations

import os
import sys

# A host's chips as libtpu's process bounds when each process takes one chip (TPU_PROCESS_BOUNDS):
# a 4-chip host (v4, v5p) is 2x2x1, an 8-chip host (v5e, v6e) 2x4x1.
_HOST_PROCESS_BOUNDS = {1: "1,1,1", 4: "2,2,1", 8: "2,4,1"}
_TPU_PROCESS_PORT = 8476  # libtpu's first per-process port; process i of a host listens on 8476 + i


def start_jax(platform: str, *, rank: int, world_size: int) -> None:
    """JAX's runtime for this process, on `platform` alone; with several processes its distributed
    client too, as JAX process `rank` of `world_size` (the coordinator on rank 0's host, found through
    the torch process group), so that jax.devices() lists every process's device. Each process
    must hold exactly one JAX device: device r of the run is rank r's (a one-line error otherwise,
    with what to change)."""
    if platform == "tpu" and "torch_tpu" in sys.modules:
        raise ValueError("compile.backend jax runs the step on the TPU chips through JAX, but torch-tpu is loaded in "
                         "this process and may hold them: start it with TORCH_DEVICE_BACKEND_AUTOLOAD=0 (titan-tpu "
                         "train sets it when the recipe names compile.backend jax)")
    os.environ["JAX_PLATFORMS"] = platform
    if platform == "tpu" and world_size > 1:
        _tpu_one_chip_per_process(rank, world_size)
    import jax

    if world_size > 1:
        if platform == "cpu":  # XLA:CPU's collectives across processes
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=_jax_coordinator(rank), num_processes=world_size,
                                   process_id=rank)
    try:
        local, total = len(jax.local_devices()), jax.device_count()
    except RuntimeError as e:  # JAX's backend did not start: "Unable to initialize backend 'tpu': ..."
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ValueError(f"compile.backend jax on training.device {platform}: JAX cannot start its {platform} backend "
                         f"here ({reason[:200]}); run on a TPU VM, or use --training.device cpu (XLA on this CPU)"
                         ) from None
    check_jax_devices(platform, local=local, total=total, world_size=world_size)


def check_jax_devices(platform: str, *, local: int, total: int, world_size: int) -> None:
    """The launch the JAX path takes: one process per JAX device, every device of the run a process's."""
    if local != 1:
        raise ValueError(f"compile.backend jax runs one process per device; this process sees {local} {platform} "
                         f"devices: start {local} processes for it (torchrun --nproc_per_node = devices per host)")
    if total != world_size:
        raise ValueError(f"compile.backend jax: the run has {world_size} processes, JAX sees {total} {platform} "
                         "devices; start one process per device")


def _jax_coordinator(rank: int) -> str:
    """host:port of JAX's coordinator: a free port on rank 0's host (MASTER_ADDR, where torchrun's
    ranks reach rank 0), chosen by rank 0 and shared through the torch process group."""
    import socket

    import torch.distributed as dist

    address = [None]
    if rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            address[0] = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{probe.getsockname()[1]}"
    dist.broadcast_object_list(address, src=0)
    return address[0]


def _tpu_one_chip_per_process(rank: int, world_size: int) -> None:
    """libtpu's settings for one chip per process (set unless the environment has them): this
    process's chip (LOCAL_RANK), its port, every process's address (gathered through the torch
    process group) and the processes' grid. On one host the grid is the host's chips; across hosts
    it is the slice's and must be given (TPU_PROCESS_BOUNDS). Written against libtpu's documented
    variables; not yet run on a TPU."""
    import socket

    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if "TPU_PROCESS_BOUNDS" not in os.environ:
        if per_host != world_size or per_host not in _HOST_PROCESS_BOUNDS:
            raise ValueError(f"compile.backend jax on {world_size // per_host} TPU hosts of {per_host} chips: set "
                             "TPU_PROCESS_BOUNDS to the slice's chips as x,y,z (e.g. 2,2,2 for a v5p-16), or start "
                             "every host with titan-tpu launch, which derives it")
        os.environ["TPU_PROCESS_BOUNDS"] = _HOST_PROCESS_BOUNDS[per_host]
    port = _TPU_PROCESS_PORT + local_rank
    addresses = [None] * world_size
    dist.all_gather_object(addresses, f"{socket.gethostbyname(socket.gethostname())}:{port}")
    os.environ.setdefault("TPU_CHIPS_PER_PROCESS_BOUNDS", "1,1,1")
    os.environ.setdefault("TPU_VISIBLE_CHIPS", str(local_rank))
    os.environ.setdefault("TPU_PROCESS_PORT", str(port))
    os.environ.setdefault("TPU_PROCESS_ADDRESSES", ",".join(addresses))
    os.environ.setdefault("CLOUD_TPU_TASK_ID", str(rank))
