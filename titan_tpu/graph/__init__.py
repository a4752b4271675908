"""Graph mode: the whole training step captured as one FX graph (capture.py) and compiled
(compile.py), behind the same step contract as the eager trainer."""

from titan_tpu.graph.capture import CapturedStep, capture_train_step
from titan_tpu.graph.compile import BACKENDS, GraphStep, compile_step

__all__ = ["BACKENDS", "CapturedStep", "GraphStep", "capture_train_step", "compile_step"]
