"""The Transformers backend: train any Hugging Face causal LM through the project's model contract.

``--model.name hf --model.hf_config DIR_OR_TYPE`` builds the model that transformers' own modeling
code defines (`AutoModelForCausalLM.from_config`, so composite configs reduce to their text model as
transformers does) and wraps it in `HFCausalLM`, which speaks the contract the trainer, SimpleFSDP,
the graph trainer and checkpoints use for native models::

    model(tokens_BS)                          -> logits [B, S, V]
    model(tokens_BS, labels_BS, positions_BS) -> LossOutput(ce_sum, aux_loss, expert_load)
    init_plan() / init_weights() / init_buffers(device)     (meta build, sharded init)

What the wrapper adds to the HF model:

* Attention through our kernel registry: an attention function registered with transformers'
  `AttentionInterface` under the name "titan_tpu" (with a mask function in `AttentionMaskInterface`
  that leaves causal and document masks to us, sdpa's masks otherwise). It runs our `attention`
  kernel for causal (and document-masked)
  attention and hands everything it does not cover (sliding windows, soft-capping, attention sinks,
  dropout, non-causal modules, other masks) to transformers' own sdpa function. Models that do not
  route attention through the interface keep their own.
* Loss through our chunked loss kernel when the model's logits are exactly its output embedding
  applied to its base model's last hidden state (checked numerically once, after initialisation:
  models that scale, soft-cap or bias their logits fail the check and use their own logits).
* Document masks: with packed documents the per-token positions go to the model as `position_ids`
  (RoPE restarts per document) and the document ids to our attention kernel.
* Activation checkpointing per decoder layer (the classes in `_no_split_modules`).
* Experts through our `grouped_mm` kernel: transformers' `ExpertsInterface` where the model uses it,
  else a static-shape form of the model's own experts class (`GRAPH_SAFE_FORWARDS`: DBRX,
  LongCat-Flash, whose loops over `nonzero()` graph capture cannot trace). Under
  `--parallelism.ep` transformers' stacked experts are spread over ranks as a native model's
  (marked for SimpleFSDP; the model's dispatch reaches the experts function through the call
  context).
* Meta-device build: parameters are created on the meta device while buffers are computed for real
  (non-persistent buffers such as RoPE `inv_freq` are neither initialised nor loaded after
  `to_empty`, a known trap); their values are kept and restored by `init_buffers`. Small
  parameters keep their construction values too (a learned activation's scalars set in
  `__init__` that the model's `_init_weights` does not touch); the model's own init runs after.

Parameter names are the HF model's own, under the prefix ``hf_model.``.

The package, one module per job (import from the module that does the job):

* `config`: a directory's config.json or a model type, with overrides; `HFArgs`.
* `hooks`: our attention, mask and experts implementations registered with transformers, and
  the graph-safe expert forms.
* `model`: `HFCausalLM` and `build_hf_model` (the meta-device build).
* `flops`: FLOPs per trained token.
* `weights`: weights in and out of Hugging Face directories.
* `spec`: `HFSpec`, the backend's model spec (what the rest asks about a model; it sits a layer above
  the rest of the package, with models/spec.py).
* `vision`: vision-language models (Qwen2.5-VL, Gemma 3, LLaVA): the record of each architecture,
  the frozen vision encoder and the static-shape merge of image features into the text.
"""
