"""`titan-tpu plan`: per-device memory, FLOPs, communication, step time, tokens/s and MFU of a
run, from its config alone (planner.py), on a hardware table with sources (hardware.py), checked
against real CPU runs (calibrate.py, docs/planner.md)."""

from titan_tpu.plan.hardware import HARDWARE, Hardware, resolve_hardware
from titan_tpu.plan.planner import Plan, format_plan, plan_config

__all__ = ["HARDWARE", "Hardware", "Plan", "format_plan", "plan_config", "resolve_hardware"]
