"""The run's assembly: what a run is made of, built once from its `RunSetup` (run/setup.py), before
any loop runs: the device and process group, the mesh, the data loaders, the model (and a
reference model where the objective needs one), the optimizer, the objective, the step function
(eager or captured), the checkpointer. The loops (titan_tpu/loops) drive these parts and never
build them; a new loop (DPO, GRPO) reuses them and adds only what it needs.
"""
