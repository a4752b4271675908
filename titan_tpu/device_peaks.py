"""The accelerators' peak FLOP/s: the one table of datasheet numbers the MFU denominator
(device.py `Backend`) and the planner's hardware table (plan/hardware.py) both read, and the
$TITAN_TPU_PEAK_FLOPS override for hardware not in them.

  * CUDA: dense bf16 datasheet numbers by device name (`cuda_peak_flops`).
  * TPU: dense bf16 datasheet numbers by generation, per device (`tpu_peak_flops`); v7 exposes two
    devices per chip, so each device gets half the chip's number.
"""

from __future__ import annotations

import os
import re

# The one table of accelerator peaks: the MFU denominator here and the planner's hardware table
# (plan/hardware.py) both read these.
# Dense bf16 peak FLOP/s per device, matched as substrings of torch.cuda.get_device_name().
# Order matters: more specific names come first ("H100 PCIe" before "H100").
_CUDA_PEAK_BF16 = (
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("B100", 1750e12),
    ("H200", 989e12),
    ("H100 PCIE", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)
# Used (with a warning) for a GPU not in the table. The H100 number: for most unknown cards it
# understates MFU rather than overstating it.
CUDA_FALLBACK_PEAK = 989e12

# Dense bf16 peak FLOP/s per *chip*, and how many torch devices one chip exposes.
_TPU_PEAK_BF16_PER_CHIP = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12, "v7": 2307e12}
_TPU_DEVICES_PER_CHIP = {"v7": 2}
# Used (with a warning) when the TPU generation cannot be detected.
TPU_FALLBACK_GENERATION = "v6e"


def cuda_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a CUDA device name, or None if the name is not in the table."""
    upper = device_name.upper()
    for key, flops in _CUDA_PEAK_BF16:
        if key in upper:
            return flops
    return None


def tpu_generation(name: str) -> str | None:
    """Normalise a TPU device kind / accelerator type to "v4" | "v5e" | "v5p" | "v6e" | "v7".

    Accepts the spellings seen in the wild: device kinds ("TPU v5 lite", "TPU v6 lite", "TPU7x"),
    accelerator types ("v5litepod-16", "v6e-8", "v5p-128", "tpu7x-8") and code names
    ("trillium", "ironwood"). Returns None when nothing matches.
    """
    s = name.lower().replace("_", " ").strip()
    if "ironwood" in s or re.search(r"(tpu\s*|\bv)7", s):
        return "v7"
    if "trillium" in s or re.search(r"\bv6\s*(e|lite)", s) or re.search(r"tpu\s*v6\b", s):
        return "v6e"
    if re.search(r"\bv5\s*(e|lite)", s):
        return "v5e"
    if re.search(r"\bv5\s*p", s) or re.search(r"\bv5\b", s):  # plain "TPU v5" is the v5p kind
        return "v5p"
    if re.search(r"\bv4", s):
        return "v4"
    return None


def tpu_peak_flops(generation: str) -> float:
    """Dense bf16 peak FLOP/s per torch device for a TPU generation ("v5e", "TPU v6 lite", ...)."""
    gen = tpu_generation(generation)
    if gen is None:
        raise ValueError(
            f"unknown TPU generation {generation!r}; known: {sorted(_TPU_PEAK_BF16_PER_CHIP)}"
        )
    return _TPU_PEAK_BF16_PER_CHIP[gen] / tpu_devices_per_chip(gen)


def tpu_devices_per_chip(generation: str) -> int:
    """How many torch devices one chip of a TPU generation exposes (2 on v7, else 1)."""
    return _TPU_DEVICES_PER_CHIP.get(tpu_generation(generation) or generation, 1)


def _env_peak_override() -> float | None:
    value = os.environ.get("TITAN_TPU_PEAK_FLOPS")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"TITAN_TPU_PEAK_FLOPS must be a number like 989e12, got {value!r}") from None
