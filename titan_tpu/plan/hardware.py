"""The hardware table of the planner: peak FLOP/s, memory, memory and interconnect bandwidth per
device, each number with its source.

Peak FLOP/s are dense bf16 per device, read from the one table titan_tpu/device_peaks.py keeps for the
MFU denominator (so a plan's MFU and a run's MFU share their denominator; tests/test_device.py ties
them); the memory, bandwidth and interconnect numbers are the planner's own; this CPU's peak is its
measured matmul rate in the compute dtype (device_cpu.cpu_peak_flops; bf16 only on CPUs with bf16
instructions). `efficiency` is the fraction of peak the
planner assumes matmul-dominated work reaches; it is an assumption for accelerators (stated in
docs/planner.md) and a calibrated number for this CPU (`titan-tpu plan --calibrate`).

Interconnect: bytes per second one device can send into a ring collective (one direction). For
TPUs the vendor pages give the bidirectional ICI bandwidth per chip; a ring on one axis of the
torus uses one link pair, but SimpleFSDP's dp_shard ring spans the whole slice, so the planner
takes half the bidirectional per-chip number (the send direction) as the ring bandwidth, an
optimistic bound that ignores topology. GPUs: NVLink per GPU, half of the bidirectional figure.

Beyond a node or a slice: `network_bandwidth`, bytes per second one device sends into a ring that
leaves its NVLink node (its InfiniBand/RoCE NIC: DGX H100/H200/B200 nodes have eight GPUs and eight
400 Gb/s ConnectX-7 ports) or its TPU slice (its share of the host's data-center network, DCN),
and `devices_per_node` (GPUs: 8; TPUs: None, the slice is the domain, as many chips as the run
has over `parallelism.slices`). Which axis crosses what: parallel/fabric_terms.py.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

from titan_tpu import device_cpu, device_peaks

__all__ = ["Hardware", "HARDWARE", "resolve_hardware", "cpu_hardware", "measure_cpu_memory_bandwidth"]

_GOOGLE = "https://cloud.google.com/tpu/docs/"


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # per device
    memory_bytes: float  # per device (HBM, or this machine's RAM)
    memory_bandwidth: float  # bytes/s per device
    interconnect_bandwidth: float  # bytes/s a device sends into a ring collective
    devices_per_chip: int = 1
    efficiency: float = 0.7  # ACCELERATOR_EFFICIENCY: fraction of peak matmul-dominated work reaches (docstring)
    graph_efficiency: float | None = None  # the same for graph mode (captured, compiled); None: `efficiency`
    # Fraction of memory_bandwidth the eager step's elementwise work reaches (1.0: the copy rate;
    # graph mode, whose compiler fuses that work, always uses 1.0).
    elementwise_efficiency: float = 1.0
    runtime_bytes: float = 0.0  # memory the planner's terms do not model (CPU: the process itself)
    graph_runtime_bytes: float | None = None  # the same in graph mode (CPU: plus the compiled step); None: as eager
    # What each rank of a multi-process run holds beside runtime_bytes (CPU: the process group's
    # state, gloo's threads and buffers); 0 on accelerators (not measured there).
    distributed_runtime_bytes: float = 0.0
    source: str = ""
    # Seconds each collective call costs beside its bytes (launch, synchronisation). Accelerators: 0,
    # not modelled (no measurement here); the CPU: CPU_COLLECTIVE_LATENCY.
    collective_latency: float = 0.0
    # Dense fp8 matmul FLOP/s per device where the chip has an fp8 rate above its bf16 one (tpu7x,
    # H100/H200, B200); None where it has none (v4, v5e, v5p, v6e: Google's tpu7x comparison table
    # gives their fp8 peak as their bf16 one, and XLA runs an f8 dot there at the bf16 rate) and on
    # this CPU. The planner's fp8 terms (fp8.py `fp8_terms`) read it.
    fp8_peak_flops: float | None = None
    # Bytes/s a device sends into a ring that leaves its node (GPUs: its NIC) or its slice (TPUs: its
    # share of the host's DCN); None where no vendor figure is published (v4) and on this CPU (one
    # machine). The planner times an axis that crosses nodes or slices at it (parallel/fabric_terms.py).
    network_bandwidth: float | None = None
    network_source: str = ""  # where network_bandwidth is stated (the inside fabric's figure is in `source`)
    # Devices that share the fast interconnect (NVLink) in one node; None: TPUs, whose ICI spans the
    # whole slice (the slice is the domain: the run's devices over parallelism.slices), and this CPU.
    devices_per_node: int | None = None

    def mode_constants(self, *, graph: bool) -> tuple[float, float, float]:
        """(matmul efficiency, elementwise efficiency, runtime bytes) of an eager or a graph-mode
        step. Graph fields left unset fall back to the eager ones; graph mode's elementwise work
        runs at the copy rate (its compiler fuses it)."""
        if not graph:
            return self.efficiency, self.elementwise_efficiency, self.runtime_bytes
        return self.graph_efficiency or self.efficiency, 1.0, self.graph_runtime_bytes or self.runtime_bytes

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


GiB = 1024**3

# Accelerator efficiency: an assumption, not a measurement (docs/planner.md discusses it).
ACCELERATOR_EFFICIENCY = 0.7

# Checked against the vendor pages on 2026-11-30 (Google's TPU pages: the per-generation pages and
# the comparison table of the tpu7x page). Google states ICI as bidirectional GB/s per chip; for v4,
# whose page gives no per-chip figure, the send bandwidth is the page's "all-reduce bandwidth per
# Pod" (1.1 PB/s) over its 4,096 chips, which for v5e and v6e gives exactly half their stated
# bidirectional figure, the same rule as the others.
# fp8 peaks checked 2026-12-05: the tpu7x page's comparison table ("Peak compute per chip (FP8)": v5p
# 459, v6e 918, TPU7x 4,614 TFLOP/s, so only tpu7x gains) and its performance guide
# (cloud.google.com/tpu/docs/ironwood-performance: "peak theoretical performance of 4614 TFLOPS per
# chip"); NVIDIA's H100 and H200 pages (FP8 Tensor Core 3,958 TFLOP/s with sparsity, 1,979 dense)
# and the HGX page (B200 FP8/FP6 Tensor Core 9 PFLOP/s per GPU with sparsity, 4.5 dense).
# The network beyond a node or a slice (`network_bandwidth`, one direction, per device), checked
# 2026-12-06. TPUs: Google's tpu7x page's comparison table, "Data center network (DCN) bandwidth per
# chip (Gb/s)": v5p 50, v6e 100, TPU7x 100 (the v5p page gives the same 50); v5e: the v6e page's
# comparison table, "Per-host NIC configuration 2 x 100 Gbps NIC" with 8 chips per host (25 Gb/s a
# chip; the v5e page's "Data center network bandwidth per Pod 6.4 Tbps" over its 256 chips gives the
# same); v4: no figure on Google's pages, so None (a multi-slice v4 plan is refused). A TPU7x chip is
# two devices: half each. Google states neither direction; a NIC's rate is per direction, so the
# figure is taken as what a chip sends. GPUs: NVIDIA's DGX BasePOD reference architecture
# (docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/
# core-components.html): DGX H100 and H200, "eight single-port NVIDIA ConnectX-7 VPI, up to 400 Gb/s
# InfiniBand/Ethernet" for eight GPUs; DGX B200, "8x single-port NVIDIA ConnectX-7 VPI, Up to 400Gb/s":
# one 400 Gb/s NIC (50 GB/s each way) per GPU, eight GPUs on one NVLink domain per node.
_DCN = "Data center network (DCN) bandwidth per chip"
NIC_SOURCE = ("https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/"
              "latest/core-components.html: eight single-port 400 Gb/s ConnectX-7 (InfiniBand) per 8-GPU DGX node, "
              "one per GPU")
GPU_NIC = 400e9 / 8  # bytes/s: one 400 Gb/s ConnectX-7 port per GPU
GPUS_PER_NODE = 8

HARDWARE: dict[str, Hardware] = {
    "v4": Hardware("v4", device_peaks.tpu_peak_flops("v4"), 32 * GiB, 1200e9, 1.1e15 / 4096,
                   source=f"{_GOOGLE}v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s; all-reduce bandwidth "
                          "1.1 PB/s per 4,096-chip pod (no per-chip ICI figure on the page)"),
    "v5e": Hardware("v5e", device_peaks.tpu_peak_flops("v5e"), 16e9, 819e9, 400e9 / 2, network_bandwidth=25e9 / 8,
                    network_source=f"{_GOOGLE}v6e (comparison table): per-host NIC 2 x 100 Gb/s, 8 v5e chips per "
                                   "host: 25 Gb/s per chip",
                    source=f"{_GOOGLE}v5e: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, bidirectional ICI "
                           "400 GB/s per chip"),
    "v5p": Hardware("v5p", device_peaks.tpu_peak_flops("v5p"), 95 * GiB, 2765e9, 1200e9 / 2, network_bandwidth=50e9 / 8,
                    network_source=f"{_GOOGLE}v5p: {_DCN} 50 Gb/s",
                    source=f"{_GOOGLE}v5p-training: 459 TFLOP/s bf16, 95 GiB HBM2e at 2,765 GB/s, "
                           "bidirectional ICI 1,200 GB/s per chip"),
    "v6e": Hardware("v6e", device_peaks.tpu_peak_flops("v6e"), 32 * GiB, 1638e9, 800e9 / 2, network_bandwidth=100e9 / 8,
                    network_source=f"{_GOOGLE}tpu7x (comparison table): {_DCN}, v6e 100 Gb/s",
                    source=f"{_GOOGLE}v6e and {_GOOGLE}tpu7x (comparison table): 918 TFLOP/s bf16, 32 GiB HBM "
                           "at 1,638 GB/s, bidirectional ICI 800 GB/s per chip"),
    # v7 (Ironwood, TPU7x): two devices per chip; per-device numbers are half the chip's.
    "v7": Hardware("v7", device_peaks.tpu_peak_flops("v7"), 192 * GiB / 2, 7380e9 / 2, 1200e9 / 2 / 2,
                   devices_per_chip=device_peaks.tpu_devices_per_chip("v7"), fp8_peak_flops=4614e12 / 2,
                   network_bandwidth=100e9 / 8 / 2,
                   network_source=f"{_GOOGLE}tpu7x (comparison table): {_DCN}, TPU7x 100 Gb/s (halved: two devices)",
                   source=f"{_GOOGLE}tpu7x: 2,307 TFLOP/s bf16 (4,614 fp8), 192 GiB HBM at 7,380 GB/s, bidirectional "
                          "ICI 1,200 GB/s per chip; two devices per chip (halved here)"),
    "h100": Hardware("h100", device_peaks.cuda_peak_flops("H100 SXM"), 80e9, 3.35e12, 900e9 / 2, fp8_peak_flops=1979e12,
                     network_bandwidth=GPU_NIC, network_source=NIC_SOURCE, devices_per_node=GPUS_PER_NODE,
                     source="https://www.nvidia.com/en-us/data-center/h100/ (SXM): 989 TFLOP/s bf16 dense "
                            "(1,979 with sparsity), fp8 1,979 dense (3,958 with sparsity), 80 GB HBM3 at 3.35 TB/s, "
                            "NVLink 900 GB/s bidirectional"),
    "h200": Hardware("h200", device_peaks.cuda_peak_flops("H200"), 141e9, 4.8e12, 900e9 / 2, fp8_peak_flops=1979e12,
                     network_bandwidth=GPU_NIC, network_source=NIC_SOURCE, devices_per_node=GPUS_PER_NODE,
                     source="https://www.nvidia.com/en-us/data-center/h200/ (SXM): 989 TFLOP/s bf16 dense "
                            "(1,979 with sparsity), fp8 1,979 dense (3,958 with sparsity), 141 GB HBM3e at 4.8 TB/s, "
                            "NVLink 900 GB/s bidirectional"),
    "b200": Hardware("b200", device_peaks.cuda_peak_flops("B200"), 180e9, 8e12, 1800e9 / 2, fp8_peak_flops=4500e12,
                     network_bandwidth=GPU_NIC, network_source=NIC_SOURCE, devices_per_node=GPUS_PER_NODE,
                     source="https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, per GPU): 2.25 PFLOP/s "
                            "bf16 dense (4.5 with sparsity), fp8 4.5 dense (9 with sparsity), 180 GB HBM3e at 8 TB/s, "
                            "NVLink 5 1.8 TB/s bidirectional"),
}

# This CPU: constants measured by `titan-tpu plan --calibrate` (docs/planner.md has the runs).
# CPU_RUNTIME_BYTES: the resident memory of a trainer process before it builds a model (Python,
# torch, the tokenizer and data loader), measured the same way the trainer measures memory (RSS).
# Eager steps: matmul time at CPU_EFFICIENCY of the measured peak plus elementwise time at
# CPU_ELEMENTWISE_EFFICIENCY of the measured copy bandwidth, both fitted together (least squares
# on the relative error) to the eager debug runs of the 2026-11-30 23:31-23:51 calibration (Intel
# Xeon, 2 threads).
CPU_EFFICIENCY = 0.70
CPU_ELEMENTWISE_EFFICIENCY = 0.28
CPU_RUNTIME_BYTES = 0.348e9  # measured by the same calibration
# Graph mode (the step captured and compiled): one efficiency, the median the graph-mode runs of the
# same calibration imply (elementwise at the copy rate: Inductor fuses it; the runs cannot tell a
# second constant apart).
CPU_GRAPH_EFFICIENCY = 0.50
# CPU_GRAPH_RUNTIME_BYTES: the resident memory of a graph-mode trainer beside its tensors: the
# runtime above plus the captured and compiled step (graph, generated code, compiler state),
# measured like CPU_RUNTIME_BYTES with the tiny run in graph mode (Inductor).
CPU_GRAPH_RUNTIME_BYTES = 0.484e9
# CPU_DISTRIBUTED_RUNTIME_BYTES: what a rank of a 2-process run holds beyond CPU_RUNTIME_BYTES (the
# process group: gloo's threads and buffers, torch.distributed's state): the tiny run on 2 ranks
# (dp_shard 2) minus its planner terms and the one-process runtime, measured by the calibration
# (`measure_runtime_bytes(ranks=2)`); 2026-12-02, AMD EPYC: 0.03-0.05 GB in three sittings.
CPU_DISTRIBUTED_RUNTIME_BYTES = 0.04e9
# CPU_COLLECTIVE_BANDWIDTH: bytes/s a rank sends into a gloo all-gather or reduce-scatter between two
# processes of this machine (loopback TCP), medians at 1 and 4 MB a rank (plan/collective_rate.py,
# 2026-12-01: 0.36-0.71 GB/s by kind and size). It was taken as a quarter of the copy rate (6.5
# GB/s) before; the calibration measures it in each sitting.
CPU_COLLECTIVE_BANDWIDTH = 0.53e9
# CPU_COLLECTIVE_LATENCY: seconds a collective call costs beside its bytes on this CPU: the median
# time of a 4 KB gloo all-gather and reduce-scatter between two processes (plan/collective_rate.py,
# 2026-12-01, AMD EPYC: 2.0 and 0.5 ms in two sittings minutes apart; their mean. The README's
# profile of a 2-rank eager step with per-parameter collectives, 2026-11-30, saw ~2.6 ms per call
# with DTensor's dispatch). It is what
# makes per-parameter collectives (bucket_mb 0: 57 calls each way for llama3 debug) slower than
# buckets (9) in the planner, as measured (retention 0.48 vs 0.68 on 2026-11-30).
CPU_COLLECTIVE_LATENCY = 1.25e-3


def measure_cpu_memory_bandwidth(nbytes: int = 1 << 27, reps: int = 5) -> float:
    """Best-of-`reps` copy rate of a `nbytes` fp32 tensor, counting read + write (bytes/s)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _total_ram() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 16e9


def cpu_hardware(*, measure: bool = True, dtype: str = "float32") -> Hardware:
    """This machine: measured matmul peak in the compute dtype (model.dtype; auto is float32 on
    the CPU) and copy bandwidth (about 2 s), or, with measure=False, nominal numbers (for tests and
    for plans that only need memory)."""
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    short = "bf16" if torch_dtype == torch.bfloat16 else "fp32"
    peak = device_cpu.cpu_peak_flops(torch_dtype) if measure else 100e9
    bandwidth = measure_cpu_memory_bandwidth() if measure else 10e9
    return Hardware("cpu", peak, _total_ram(), bandwidth, CPU_COLLECTIVE_BANDWIDTH, efficiency=CPU_EFFICIENCY,
                    graph_efficiency=CPU_GRAPH_EFFICIENCY, graph_runtime_bytes=CPU_GRAPH_RUNTIME_BYTES,
                    elementwise_efficiency=CPU_ELEMENTWISE_EFFICIENCY,
                    runtime_bytes=CPU_RUNTIME_BYTES, distributed_runtime_bytes=CPU_DISTRIBUTED_RUNTIME_BYTES,
                    collective_latency=CPU_COLLECTIVE_LATENCY,
                    source=f"this machine: {short} matmul peak {peak / 1e9:.0f} GFLOP/s and copy bandwidth "
                           f"{bandwidth / 1e9:.1f} GB/s {'measured now' if measure else '(nominal, not measured)'}; "
                           "RAM from /proc/meminfo; ranks of one run share it; collectives at gloo's measured "
                           f"{CPU_COLLECTIVE_BANDWIDTH / 1e9:.2f} GB/s per rank (plan/collective_rate.py) and "
                           f"{CPU_COLLECTIVE_LATENCY * 1e3:.1f} ms per call")


def known_names() -> list[str]:
    return [*HARDWARE, "cpu"]


def resolve_hardware(spec: str, *, measure: bool = True, dtype: str = "float32") -> tuple[Hardware, int | None]:
    """("v5p-1024" | "v5p" | "h100" | "cpu" ...) -> (hardware, chips or None). TPU slice names count
    TensorCores for v4 and v5p (2 per chip: v5p-1024 is 512 chips) and chips for v5e, v6e and v7,
    as Google names them; GPU and cpu names may carry a device count (h100-8). dtype: model.dtype,
    the dtype the CPU's peak is measured in (accelerators: their bf16 table)."""
    text = spec.strip().lower()
    match = re.fullmatch(r"([a-z0-9]+?)(?:-(\d+))?", text)
    if match is None:
        raise ValueError(f"unknown hardware {spec!r}; known: {', '.join(known_names())} (a TPU slice as e.g. v5p-1024)")
    name, count = match.group(1), match.group(2)
    generation = device_peaks.tpu_generation(name) if name not in HARDWARE and name != "cpu" else None
    name = generation or name
    if name == "cpu":
        hw = cpu_hardware(measure=measure, dtype=dtype)
    elif name in HARDWARE:
        hw = HARDWARE[name]
    else:
        raise ValueError(f"unknown hardware {spec!r}; known: {', '.join(known_names())} (a TPU slice as e.g. v5p-1024)")
    chips = None
    if count is not None:
        chips = int(count)
        if name in ("v4", "v5p"):
            if chips % 2:
                raise ValueError(f"{spec}: {name} slices count TensorCores, two per chip; use an even number")
            chips //= 2
    return hw, chips
