"""The run's assembly: what a run is made of, built once before any loop runs. The run resolved for
its world with the re-shard choice made (resolve.py), one rank's program (program.py: model, frozen
reference, objective, optimizer, example batch, and the JAX path's captured programs; the code
`titan-tpu compile` builds its step with too, on a fake world: world.py), and the run's parts in
order (build.py `Components`: device and process group, data, program, step, checkpointer). The
loops (titan_tpu/loops) drive these parts and never build them.
"""
