"""Benchmarks of our models by lm-evaluation-harness (the eval extra): `harness.py`, our model as an
lm-eval model class; `tasks.py`, the tasks and how they are scored. Used by `titan-tpu eval --tasks`
and by the in-training evaluation."""
