"""`titan-tpu plan`: per-device memory, FLOPs, communication, step time, tokens/s and MFU of a
run, from its config alone (planner.py and the rooms of its terms), on a hardware table with
sources (hardware.py), checked against real CPU runs (calibrate.py, docs/planner.md)."""

from titan_tpu.plan.hardware import HARDWARE, Hardware, resolve_hardware
from titan_tpu.plan.planner import plan_config
from titan_tpu.plan.result import Plan
from titan_tpu.plan.text import format_plan

__all__ = ["HARDWARE", "Hardware", "Plan", "format_plan", "plan_config", "resolve_hardware"]
