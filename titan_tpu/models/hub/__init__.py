"""Our native models' weights in the Hugging Face Hub checkpoint layout (config.json and safetensors,
as `save_pretrained` writes them), without transformers: what `titan-tpu convert`, eval and the
native model spec read and write. Not the Transformers backend (`model.name = hf`: models/hf/).

The package, one module per job:

* `adapter`: the mapping, pure: config.json fields <-> `TransformerArgs`, Hub names and layouts <->
  native ones (the RoPE row permutation of wq and wk, fused and per-expert MoE weights).
* `sources`: a checkpoint read lazily, block by block (`TensorSource`): each process reads the
  slices of the weights it holds.
* `checkpoint`: the files: reading a directory (its config.json, shards and index) into native
  weights or sources, and writing native weights as Hub shards.
"""
