"""`titan-tpu launch COMMAND [ARGS]`: start this host's processes of a run over several hosts (a
TPU slice of more than one host, several GPU nodes), with torchrun's rendezvous and libtpu's
process grid derived instead of typed. The same line runs on every host; on Cloud TPU:

    gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all \\
        --command "cd titan-tpu && .venv-tpu/bin/titan-tpu launch train --config RECIPE"

Where each value comes from (the first source that has it wins; the launch line says which):

- the hosts, this host's index and host 0's address:
  1. --nnodes, --node-rank, --master-addr;
  2. TPU_WORKER_HOSTNAMES (host 0 first) with TPU_WORKER_ID, or JOB_COMPLETION_INDEX: what GKE
     gives each pod of a TPU slice, and a Kubernetes indexed Job;
  3. the Cloud TPU VM's metadata server (`worker-network-endpoints`, `agent-worker-number`), asked
     only on a host that has TPU chips, once, with a 2 s timeout;
  4. otherwise one host.
- processes on this host (one per device): --nproc-per-node; the host's TPU chips (the
  metadata's CHIPS_PER_HOST_BOUNDS, else the chips in /dev); its CUDA GPUs; else 1.
- the slice's chip grid, TPU_PROCESS_BOUNDS for the JAX path on several hosts (one process per
  chip): --topology; TPU_TOPOLOGY (GKE); the metadata's TOPOLOGY. A value already in the
  environment is kept.

On a TPU host with torch-tpu installed it also calls torch-tpu's own launch helper
(`torch.tpu.distributed.set_tpu_launch_env`), which sets torch-tpu's variables from the hosts
found here. Then it replaces itself with `python -m torch.distributed.run ... -m titan_tpu COMMAND
ARGS`, so signals and the exit status are torchrun's.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Layout", "derive_layout", "torchrun_argv", "main"]

METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Layout:
    """One host's share of a run: what torchrun and libtpu are told."""
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    nproc_per_node: int
    process_bounds: str | None = None  # "x,y,z": the slice's chips, when known and several hosts
    hostnames: tuple[str, ...] = ()  # every host, host 0 first, when a source listed them
    sources: dict[str, str] = field(default_factory=dict)  # value -> where it came from

    def describe(self) -> str:
        s = self.sources
        rendezvous = f"{self.master_addr}:{self.master_port}"
        where = f"host {self.node_rank} of {self.nnodes} ({s['hosts']}); rendezvous {rendezvous}"
        if self.nnodes == 1:
            where = f"{s['hosts']}; torchrun --standalone"
        line = f"launch: {where}; {self.nproc_per_node} process(es) here ({s['nproc']})"
        if self.process_bounds:
            line += f"; TPU_PROCESS_BOUNDS {self.process_bounds} ({s['bounds']})"
        return line


def derive_layout(args: argparse.Namespace, environ: Mapping[str, str], *,
                  metadata: Callable[[str], str | None], tpu_chips: int, gpus: Callable[[], int]) -> Layout:
    """This host's layout from the flags, the environment and (on a TPU host) the metadata server.
    `metadata(key)` returns an attribute of the TPU VM's metadata or None; `tpu_chips` is the
    count found in /dev; `gpus()` counts CUDA devices (called only when nothing else decides)."""
    ask = tpu_chips > 0 and not environ.get("TPU_SKIP_MDS_QUERY")  # a TPU VM has a metadata server
    tpu_env = _tpu_env(metadata("tpu-env") if ask else None)
    hostnames, index, hosts_from = _host_list(environ, metadata if ask else lambda key: None)

    nnodes = len(hostnames) or 1
    if args.nnodes is not None:
        if hostnames and args.nnodes != len(hostnames):
            raise ValueError(f"launch --nnodes {args.nnodes}, but {hosts_from} lists {len(hostnames)} hosts "
                             f"({','.join(hostnames)}): drop --nnodes or correct the host list")
        nnodes = args.nnodes
    if args.node_rank is not None:
        index = args.node_rank
    if nnodes > 1 and index is None:
        raise ValueError(f"launch: {nnodes} hosts but this host's index is unknown: pass --node-rank (0..{nnodes - 1}) "
                         "or set TPU_WORKER_ID")
    index = index or 0
    if not 0 <= index < nnodes:
        raise ValueError(f"launch: this host's index {index} is outside 0..{nnodes - 1} for {nnodes} hosts")
    master = args.master_addr or (hostnames[0] if hostnames else None)
    if nnodes > 1 and master is None:
        raise ValueError("launch --nnodes > 1 needs host 0's address: pass --master-addr (or set TPU_WORKER_HOSTNAMES)")
    if args.nnodes is not None or args.node_rank is not None or args.master_addr:
        hosts_from = "--nnodes/--node-rank/--master-addr" + (f" with {hosts_from}" if hosts_from else "")
    hosts_from = hosts_from or "one host: no host list in the flags, the environment or a TPU VM's metadata"
    if nnodes == 1 and "one host" not in hosts_from:
        hosts_from = f"one host ({hosts_from})"

    nproc, nproc_from = _processes_here(args, tpu_env, tpu_chips, gpus)
    sources = {"hosts": hosts_from, "nproc": nproc_from}
    bounds = None
    if nnodes > 1 and (tpu_chips or args.topology):
        bounds, sources["bounds"] = _process_bounds(args, environ, tpu_env, nnodes)
        chips = math.prod(_bounds(bounds, "TPU_PROCESS_BOUNDS"))
        if chips != nnodes * nproc:
            raise ValueError(f"launch: TPU_PROCESS_BOUNDS {bounds} is {chips} chips, but {nnodes} hosts x {nproc} "
                             f"processes is {nnodes * nproc}: correct --topology or --nproc-per-node")
    return Layout(nnodes=nnodes, node_rank=index, master_addr=master or "127.0.0.1",
                  master_port=args.master_port, nproc_per_node=nproc, process_bounds=bounds,
                  hostnames=tuple(hostnames), sources=sources)


def _host_list(environ: Mapping[str, str], metadata: Callable[[str], str | None]
               ) -> tuple[list[str], int | None, str]:
    """(every host, host 0 first; this host's index or None; where they came from, "" if nowhere):
    GKE's variables (or an indexed Job's), else the TPU VM's metadata."""
    if environ.get("TPU_WORKER_HOSTNAMES"):
        hostnames = [h for h in environ["TPU_WORKER_HOSTNAMES"].split(",") if h]
        for name in ("TPU_WORKER_ID", "JOB_COMPLETION_INDEX"):
            if environ.get(name, "") != "":
                return hostnames, _integer(environ[name], name), f"TPU_WORKER_HOSTNAMES, {name}"
        return hostnames, None, "TPU_WORKER_HOSTNAMES"
    if endpoints := metadata("worker-network-endpoints"):
        worker = metadata("agent-worker-number")
        index = _integer(worker, "the metadata's agent-worker-number") if worker is not None else None
        return [_endpoint_address(e) for e in endpoints.split(",") if e], index, "the TPU VM's metadata"
    return [], None, ""


def _processes_here(args: argparse.Namespace, tpu_env: dict[str, str], tpu_chips: int,
                    gpus: Callable[[], int]) -> tuple[int, str]:
    """(processes on this host, one per device; why that many)."""
    if args.nproc_per_node is not None:
        if args.nproc_per_node < 1:
            raise ValueError(f"launch --nproc-per-node {args.nproc_per_node}: give at least 1")
        return args.nproc_per_node, "--nproc-per-node"
    if tpu_env.get("CHIPS_PER_HOST_BOUNDS"):
        return (math.prod(_bounds(tpu_env["CHIPS_PER_HOST_BOUNDS"], "CHIPS_PER_HOST_BOUNDS")),
                "the host's TPU chips, from the metadata's CHIPS_PER_HOST_BOUNDS")
    if tpu_chips:
        return tpu_chips, "the host's TPU chips"
    if (count := gpus()) > 0:
        return count, "the host's CUDA GPUs"
    return 1, "no accelerator found: one process"


def _process_bounds(args: argparse.Namespace, environ: Mapping[str, str], tpu_env: dict[str, str],
                    nnodes: int) -> tuple[str, str]:
    """(the slice's chip grid as x,y,z, where it came from): a value already set is kept (the one
    derived is still read, so that a malformed --topology is named)."""
    derived = next(((",".join(str(n) for n in _bounds(value, where)), where) for value, where in (
        (args.topology, "--topology"), (environ.get("TPU_TOPOLOGY"), "TPU_TOPOLOGY"),
        (tpu_env.get("TOPOLOGY"), "the metadata's TOPOLOGY")) if value), None)
    if environ.get("TPU_PROCESS_BOUNDS"):
        return environ["TPU_PROCESS_BOUNDS"], "TPU_PROCESS_BOUNDS, kept"
    if derived is not None:
        return derived
    raise ValueError(f"launch: {nnodes} TPU hosts, but the slice's chip grid is unknown: pass --topology "
                     "(e.g. 2x2x2 for a v5p-16)")


def torchrun_argv(layout: Layout, command: list[str]) -> list[str]:
    """The torchrun command line that starts this host's processes of `titan-tpu COMMAND ARGS`."""
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(layout.nproc_per_node)]
    if layout.nnodes == 1:
        run += ["--standalone"]
    else:
        run += ["--nnodes", str(layout.nnodes), "--node_rank", str(layout.node_rank),
                "--master_addr", layout.master_addr, "--master_port", str(layout.master_port)]
    return run + ["-m", "titan_tpu", *command]


def launch_environment(layout: Layout, environ: Mapping[str, str]) -> dict[str, str]:
    """The processes' environment: the caller's, with the process grid and the host list added."""
    env = dict(environ)
    if layout.process_bounds:
        env.setdefault("TPU_PROCESS_BOUNDS", layout.process_bounds)
    if layout.nnodes > 1:
        if layout.hostnames:  # torch-tpu's helper reads the host list; host 0 alone is not one
            env.setdefault("TPU_WORKER_HOSTNAMES", ",".join(layout.hostnames))
        env.update(NNODES=str(layout.nnodes), NODE_RANK=str(layout.node_rank), MASTER_ADDR=layout.master_addr,
                   MASTER_PORT=str(layout.master_port))
    return env


# ---------------------------------------------------------------------------------------------
# what the host says about itself


def local_tpu_chips(dev: Path = Path("/dev")) -> int:
    """TPU chips attached to this host: /dev/accelN (v2-v4, v5e) or /dev/vfio/N (v5p, v6e, v7)."""
    accel = [p for p in dev.glob("accel*") if re.fullmatch(r"accel\d+", p.name)]
    if accel:
        return len(accel)
    return len([p for p in (dev / "vfio").glob("*") if p.name.isdigit()])


def gce_metadata(key: str) -> str | None:
    """An attribute of this TPU VM's metadata, or None (no server, no such key): one try, 2 s."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(METADATA_URL + key, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return None


def cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _tpu_env(text: str | None) -> dict[str, str]:
    """The metadata's tpu-env, lines like `CHIPS_PER_HOST_BOUNDS: '2,2,1'`, as a dict."""
    values = {}
    for line in (text or "").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            values[key.strip()] = value.strip().strip("'\"")
    return values


def _endpoint_address(endpoint: str) -> str:
    """worker-network-endpoints lists `name:id:address` (older VMs) or the address alone."""
    parts = endpoint.split(":")
    return parts[2] if len(parts) == 3 else parts[0]


def _bounds(text: str, where: str) -> list[int]:
    """'2x2x2', '2,2,1' or '4x4' as three integers."""
    try:
        dims = [int(p) for p in re.split(r"[x,]", text.strip()) if p]
    except ValueError:
        dims = []
    if not 1 <= len(dims) <= 3 or min(dims) < 1:
        raise ValueError(f"launch: {where} {text!r} is not a chip grid: write it as 2x2x2 or 4x4")
    return dims + [1] * (3 - len(dims))


def _integer(text: str, where: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"launch: {where} is {text!r}, not a host index") from None


# ---------------------------------------------------------------------------------------------
# the command


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="titan-tpu launch",
        description="Start this host's processes of a run over several hosts: run the same line on every host "
                    "(gcloud compute tpus tpu-vm ssh NAME --worker=all --command '...'). Everything after the "
                    "options is a titan-tpu command, e.g. train --config RECIPE.",
    )
    p.add_argument("--nnodes", type=int, default=None, help="hosts in the run (default: from the host list)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=None, help="this host's index, 0 is host 0")
    p.add_argument("--master-addr", "--master_addr", default=None, help="host 0's address (default: the list's first)")
    p.add_argument("--master-port", "--master_port", type=int, default=DEFAULT_PORT,
                   help=f"torchrun's rendezvous port on host 0 (default {DEFAULT_PORT})")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None,
                   help="processes on this host (default: its TPU chips or GPUs, else 1)")
    p.add_argument("--topology", default=None, help="the slice's chips, e.g. 2x2x2 (default: TPU_TOPOLOGY or the "
                                                    "TPU VM's metadata); sets TPU_PROCESS_BOUNDS")
    p.add_argument("--dry-run", action="store_true", help="print the derived layout and the torchrun command; "
                                                          "start nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the titan-tpu command and its arguments")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("launch needs a titan-tpu command to start, e.g. titan-tpu launch train --config RECIPE")
    if command[0] == "launch":
        raise ValueError("launch starts a titan-tpu command other than launch: e.g. titan-tpu launch train ...")
    chips = local_tpu_chips()
    layout = derive_layout(args, os.environ, metadata=gce_metadata, tpu_chips=chips, gpus=cuda_devices)
    env = launch_environment(layout, os.environ)
    argv_run = torchrun_argv(layout, command)
    print(layout.describe(), flush=True)
    if args.dry_run:
        for name in ("TPU_PROCESS_BOUNDS", "TPU_WORKER_HOSTNAMES"):
            if env.get(name) and env.get(name) != os.environ.get(name):
                print(f"{name}={env[name]}")
        print(" ".join(argv_run))
        return 0
    if chips and layout.nnodes > 1:
        _torch_tpu_launch_env(layout, env)
    sys.stdout.flush()
    os.execve(sys.executable, argv_run, env)
    return 0  # not reached


def _torch_tpu_launch_env(layout: Layout, env: dict[str, str]) -> None:
    """torch-tpu's own variables, from the hosts found above, added to `env` (device.py
    `torch_tpu_launch_env`, which calls torch-tpu's helper on os.environ: this process's environment
    is put back afterwards)."""
    from titan_tpu.device import torch_tpu_launch_env

    saved = dict(os.environ)
    os.environ.update(env)
    try:
        torch_tpu_launch_env(nnodes=layout.nnodes, nproc_per_node=layout.nproc_per_node)
        env.update(os.environ)
    finally:
        os.environ.clear()
        os.environ.update(saved)
