"""The run configuration: a dataclass schema, TOML recipes and command-line overrides.

A recipe is a TOML file whose tables mirror the sections below (``[training]``, ``[optimizer]``,
...). Any field can be overridden on the command line as ``--section.key value`` (or
``--section.key=value``); ``--output_dir`` is the one top-level key. Every mistake (an unknown
section or key, a value of the wrong type, a choice outside the allowed set, an impossible
combination) is one ``ValueError`` whose message names the key and says what is allowed: each
section's own keys here (`check`), combinations across sections and the components' own limits in
the run setup (titan_tpu/run/setup.py `prepare_run`), which this module never imports.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from titan_tpu.data.sources import SourceConfig, normalized_weights, source_from_table
from titan_tpu.kernels import KernelConfig
from titan_tpu.models.registry import MODEL_NAMES


@dataclass
class JobConfig:
    name: str = "run"  # run name: the default output directory is outputs/<name>
    description: str = ""  # free text; TPU and GPU recipes name their hardware here ("TPU v5p-128: 64 chips")


@dataclass
class ModelConfig:
    # A native family (models/registry.py FAMILIES: llama3, qwen3, qwen3_moe) or hf.
    name: Literal[MODEL_NAMES + ("hf",)] = "llama3"
    flavor: str = "debug"  # a row of the family's flavor table, e.g. debug, 1B, 8B
    # name = hf (the Transformers backend, models/hf/): a Hugging Face model directory
    # (config.json; its safetensors weights and tokenizer.json are used when present) or a causal-LM
    # model_type of transformers (e.g. llama, qwen3, gemma3_text) for a fresh model; hf_overrides
    # changes config values: '{"hidden_size": 64}' or hidden_size=64,num_hidden_layers=2.
    hf_config: str = ""
    hf_overrides: str = ""  # name = hf: changes to the directory's config values (the comment above)
    # name = hf on a vision-language directory (Qwen2.5-VL, Gemma 3, LLaVA; docs/vision_language.md):
    # train the vision encoder too (frozen by default; the projector into the language model always trains).
    train_vision: bool = False
    # Image slots of every row, a static shape: empty slots are padded and masked, a row with more images is an error.
    max_images: int = 1
    # The side every image is resized to, for processors without a fixed one (Qwen2.5-VL's); 0 = 448. A multiple
    # of the patch size x merge size (28 for Qwen2.5-VL).
    image_size: int = 0
    # Compute dtype. Parameters and AdamW's moments stay fp32 (master weights) and are cast for
    # compute, on one device as on many, eager and graph (docs/mixed_precision.md). auto: float32 on
    # CPU, bfloat16 on CUDA and TPU; bfloat16 on a CPU needs its bf16 instructions (avx512_bf16/amx_bf16).
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Store the repeated blocks stacked ([layers, ...]) and run them with torch's scan op: the
    # compiler sees one block whatever the depth. Checkpoints keep the per-layer layout.
    scan_layers: bool = False
    # Mixture-of-experts balancing (qwen3_moe only): aux_loss adds transformers' load-balancing
    # loss times moe_aux_loss_coef; expert_bias is DeepSeek-V3's auxiliary-loss-free bias, moved
    # by moe_bias_update_rate each step; none does neither.
    moe_load_balance: Literal["aux_loss", "expert_bias", "none"] = "aux_loss"
    moe_aux_loss_coef: float = 0.001  # moe_load_balance = aux_loss: the balancing loss's weight
    moe_bias_update_rate: float = 0.001  # moe_load_balance = expert_bias: how far the biases move per step
    # Multi-token prediction (deepseek_v3 only; docs/deepseek_v3.md): depths after the main model,
    # each one block that predicts one token further ahead through the shared embedding and output
    # projection (DeepSeek-V3 publishes 1). 0: off. Megatron's and MaxText's names.
    mtp_num_layers: int = 0
    # mtp_num_layers > 0: the loss adds this weight x the mean over depths of their cross-entropies
    # (DeepSeek-V3 trained with 0.3, then 0.1).
    mtp_loss_scaling_factor: float = 0.1


@dataclass
class TrainingConfig:
    steps: int = 100  # optimizer steps
    batch_size: int = 8  # sequences per micro-batch (per data-parallel rank)
    seq_len: int = 256  # tokens per sequence (a packed window of documents)
    grad_accum_steps: int = 1  # micro-batches summed into one optimizer step
    # Tokens per optimizer step on all ranks; when set (> 0) it sets grad_accum_steps from the mesh:
    # global_batch_tokens / (batch_size x seq_len x data-parallel ranks), which must divide.
    global_batch_tokens: int = 0
    max_norm: float = 1.0  # global gradient-norm clipping; <= 0 disables clipping
    seed: int = 0  # initialisation and data order
    deterministic: bool = False  # torch.use_deterministic_algorithms for bitwise-repeatable runs
    device: Literal["auto", "cpu", "cuda", "tpu"] = "auto"  # auto: tpu, else cuda, else cpu
    # eager: plain autograd. graph: forward, backward, clipping and AdamW captured with make_fx and
    # compiled by compile.backend (one program; with grad_accum_steps > 1 a micro-batch program and
    # an update program: docs/graph_mode.md).
    mode: Literal["eager", "graph"] = "eager"
    # next_token: pre-training and SFT (cross-entropy on the labels). dpo: preference pairs, the
    # [dpo] section (docs/dpo.md); training.batch_size then counts pairs. grpo: online RL from
    # prompts and a reward, the [grpo] section (docs/grpo.md); training.batch_size then counts
    # prompts per rank and a step is one round of sampling and grpo.passes optimizer updates.
    # orpo: preference pairs without a reference model, the [orpo] section; batch_size counts pairs.
    objective: Literal["next_token", "dpo", "grpo", "orpo"] = "next_token"


@dataclass
class DPOConfig:
    # Direct preference optimisation (docs/dpo.md), with training.objective = "dpo".
    beta: float = 0.1  # how far the policy may move from the reference: the rewards are beta x log-ratios
    loss_type: Literal["sigmoid", "hinge"] = "sigmoid"  # sigmoid: -log sigmoid(beta x margin); hinge: relu(1 - ...)
    # The frozen reference policy: "initial" is the run's starting weights (a frozen copy, or under
    # LoRA the base model with the adapters off: no copy); or a checkpoint / HF directory to load.
    reference: str = "initial"


@dataclass
class ORPOConfig:
    # Odds ratio preference optimisation (train/orpo.py), with training.objective = "orpo": the
    # chosen rows' NLL minus beta x log sigmoid of the log odds ratio, no reference model.
    beta: float = 0.1  # weight of the odds-ratio term (TRL's ORPOConfig.beta, the paper's lambda)
    # The NLL over the chosen row's prompt and completion tokens, as TRL (a second forward of the
    # chosen rows); false: over the completion only, as the paper writes it.
    nll_includes_prompt: bool = True


@dataclass
class GRPOConfig:
    # Group relative policy optimisation (docs/grpo.md), with training.objective = "grpo": each
    # prompt is sampled num_generations times from the current policy, a reward scores every sample,
    # and the policy learns from the reward's advantage within its prompt's group.
    num_generations: int = 8  # G: samples per prompt (>= 2: the advantage compares samples of one prompt)
    max_completion_length: int = 32  # new tokens per sample at most
    temperature: float = 1.0  # sampling temperature (> 0); the log-probabilities are taken at it, as TRL does
    top_k: int = 0  # sample among the k most likely tokens; 0: all
    top_p: float = 1.0  # nucleus sampling; 1: off
    passes: int = 1  # optimizer updates per batch of samples (TRL's num_iterations, the paper's mu)
    epsilon: float = 0.2  # the policy ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float = 0.0  # 0: epsilon (symmetric clipping); DAPO's clip-higher uses 0.28
    beta: float = 0.0  # weight of the KL penalty to a frozen reference (k3 estimator); 0: no reference
    kl_correction: bool = True  # k3 times the policy ratio (TRL's use_bias_correction_kl); false: plain k3
    # How token losses add up: dapo (TRL's default): over all completion tokens of the step; grpo
    # (DeepSeekMath): a mean per sample, then over samples; dr_grpo: the sum over samples x max_completion_length.
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = "dapo"
    # Advantages divided by the std of the group's rewards (TRL's default), of the step's, or not at all (Dr. GRPO).
    scale_rewards: Literal["group", "batch", "none"] = "group"
    # The reward: a built-in (exact_match, regex, length) or your function as "module:function" or
    # "path/to/file.py:function", called as f(prompts, completions, **columns) -> list of floats
    # (TRL's signature); several are summed with reward_weights.
    reward: list[str] = field(default_factory=lambda: ["exact_match"])
    reward_weights: list[float] = field(default_factory=list)  # one number per reward; empty: all 1
    answer_column: str = "answer"  # exact_match: the column holding each prompt's expected answer
    reward_pattern: str = ""  # regex: reward 1 when the completion matches this pattern (re.search)
    # The frozen reference of the KL penalty: "initial" (the starting weights; under LoRA the base
    # model with the adapters off) or a checkpoint / HF directory.
    reference: str = "initial"


@dataclass
class ParallelismConfig:
    # Data parallelism with SimpleFSDP under torchrun: dp_replicate x dp_shard must equal the
    # number of ranks. dp_shard shards parameters, gradients and optimizer state; dp_replicate
    # keeps whole copies (both > 1: hybrid sharding). fp32 master parameters, computed in
    # model.dtype, as on one device.
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: all ranks that dp_replicate leaves
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"  # dtype gradients are reduced in
    # Bucketed collectives: each model piece (embedding, block, norm, output) is all-gathered, and
    # its gradients reduce-scattered, as one flat buffer of at most bucket_mb MB (compute dtype)
    # instead of one collective per parameter. 0: one collective per parameter. The default keeps
    # a whole block in one bucket up to 8B-class blocks while bounding the flat buffer.
    bucket_mb: float = 256.0
    # Re-shard after the forward (FSDP2's name): a block's gathered weights are freed after its
    # forward and all-gathered again in the backward (one more all-gather per block bucket), and a
    # scanned stack is gathered one layer at a time inside the loop, so about one layer's gathered
    # weights are alive at a time instead of the whole model. false: keep them from the forward to
    # the backward (one gather fewer per block; for small models where memory is not the limit).
    # auto: false where the planner's plan with false fits the device, else true (titan-tpu plan;
    # the trainer logs its choice): re-sharding's extra gathers are paid only where the memory is
    # needed. Acts on bucketed collectives (bucket_mb > 0).
    reshard_after_forward: Literal["auto", "true", "false"] = "auto"
    # Expert parallelism (MoE models): experts spread over groups of ep ranks; ep divides dp_shard
    # and the number of experts. Tokens reach their experts by all-gather + reduce-scatter.
    ep: int = 1
    # How tokens reach their experts under ep > 1 (docs/moe.md): all_gather (every token to every
    # rank of the group, outputs reduce-scattered back) or all_to_all (each token only to the
    # ranks holding its experts, outputs returned the same way).
    ep_dispatch: Literal["all_gather", "all_to_all"] = "all_gather"
    # Tensor parallelism with sequence parallelism (docs/tensor_parallel.md): the innermost mesh
    # axis; dp_replicate x dp_shard x cp x tp must equal the number of ranks. tp divides the heads,
    # kv heads, ffn_hidden_dim, vocab_size and training.seq_len. Dense models only (MoE: use ep).
    tp: int = 1
    # Context parallelism (docs/context_parallel.md): each rank holds 1 / cp of every sequence;
    # dense models, composes with tp (cp x tp) and the data-parallel axes. seq_len divisible by
    # 2 x cp, and seq_len / cp by tp.
    cp: int = 1
    # Pipeline parallelism (docs/pipeline_parallel.md): the scanned layer stack split into pp stages,
    # each micro-batch passed from stage to stage inside the one step (parallel/pipeline.py). The
    # step's batch splits into pp_microbatches micro-batches (0: pp of them); pp_repeats > 1 is
    # the circular schedule (each rank holds pp_repeats chunks of layers, a smaller bubble).
    pp: int = 1
    pp_microbatches: int = 0  # micro-batches each step's batch splits into through the stages; 0: pp
    pp_repeats: int = 1  # layer chunks per stage: 1 is GPipe, more the circular schedule
    # TPU slices the run spans (MaxText's num_slices; docs/multi_host.md): the slices talk over the
    # data-center network (DCN), so dp_replicate is laid across them, the outermost mesh axis
    # (MaxText's dcn_data_parallelism = slices) and everything else stays inside each slice over ICI
    # (ici_data_parallelism = dp_replicate / slices, ici_fsdp = dp_shard, ici_sequence = cp,
    # ici_tensor = tp). dp_replicate must be a multiple of it. `titan-tpu plan` times dp_replicate's
    # all-reduce at the DCN's rate; `titan-tpu compile` compiles for that many slices.
    slices: int = 1


@dataclass
class CompileConfig:
    # Backend for --training.mode graph: eager runs the captured FX graph as is (debugging),
    # aot_eager adds AOTAutograd without code generation, inductor generates C++/Triton code,
    # tpu hands the graph to TorchTPU (XLA; needs torch_tpu and training.device tpu or auto); jax
    # lowers it to one SPMD program that JAX's runtime runs on the TPU chips or this CPU's XLA
    # (graph/jax_step.py: the program `titan-tpu compile` certifies; one process per device).
    backend: Literal["eager", "aot_eager", "inductor", "tpu", "jax"] = "inductor"
    # Compile the step as several programs: fwd_bwd (forward + loss, then backward + update) or
    # collectives (every collective wait in a program of its own), for backends slow to compile one
    # large program.
    split: Literal["none", "fwd_bwd", "collectives"] = "none"
    # Collective schedule of the captured step (graph/passes.py, schedule_collectives): each
    # all-gather is issued `prefetch` buckets ahead of its use (the next block's weights travel
    # while the current block computes) and gradient reduce-scatters are waited for only where
    # clipping reads them. 0: reduce-scatters moved, all-gathers not; -1: trace order.
    prefetch: int = 1
    # Keep compiled programs across restarts (graph/compile_cache.py): Inductor's FX-graph and
    # AOTAutograd caches, JAX's persistent compilation cache, TorchTPU's tier-3 cache, each in a
    # subdirectory of cache_dir; a restart then loads its step instead of compiling it (docs/graph_mode.md).
    cache: bool = True
    # "" = ~/.cache/titan_tpu/compile (beside the data cache, shared by runs: entries are keyed by the
    # graph, shapes, compiler settings and versions), unless TORCHINDUCTOR_CACHE_DIR / JAX_COMPILATION_CACHE_DIR
    # is set. On hosts that are recreated, point it at a disk that outlives them.
    cache_dir: str = ""


@dataclass
class ActivationCheckpointConfig:
    # Recompute activations in the backward instead of keeping them: none; full (keep only each
    # block's input); selective (keep matmul and attention outputs, recompute the rest).
    mode: Literal["none", "full", "selective"] = "none"


@dataclass
class LoRAConfig:
    # LoRA fine-tuning (docs/lora.md): the base weights are frozen (no gradients, no optimizer
    # state) and each targeted linear layer learns a low-rank update B @ A * alpha / rank.
    enabled: bool = False
    rank: int = 16  # the adapters' inner dimension
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input, in training only
    # Linear layers by name: a name's last part (wq, q_proj) or an fnmatch glob of the full name.
    # Empty: the attention and MLP projections (wq wk wv wo w1 w2 w3; q_proj ... down_proj).
    target_modules: list[str] = field(default_factory=list)


@dataclass
class Fp8Config:
    # fp8 training (docs/fp8.md): the targeted linear layers' forward and backward matmuls in
    # float8 with dynamic scales; master weights and every other op unchanged.
    enabled: bool = False
    scaling: Literal["tensorwise", "rowwise"] = "tensorwise"  # amax per tensor, or per row
    # Linear layers by name, as lora.target_modules. Empty: the attention and MLP projections
    # (not the output projection nor an MoE router).
    target_modules: list[str] = field(default_factory=list)
    emulate: bool = False  # dequantise and multiply in fp32 on any device (always so on the CPU)
    # MoE experts' grouped matmuls in float8 too (per-expert scales). Opt-in, as TorchTitan's float8
    # MoE conversion: docs/fp8.md "MoE experts" says why.
    experts: bool = False


@dataclass
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"  # AdamW with decoupled weight decay, fp32 moments (train/optim.py)
    lr: float = 8e-4  # peak learning rate, reached after lr_scheduler.warmup_steps
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # added to the second moment's root
    weight_decay: float = 0.1  # decoupled; on tensors of 2+ dims (linear weights, embeddings), not norms or biases


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 10  # linear warm-up from 0 to optimizer.lr (clamped to training.steps)
    decay_ratio: float = 0.8  # fraction of training spent decaying (warmup-stable-decay)
    decay_type: Literal["linear", "cosine", "none"] = "cosine"  # the shape of the decay to min_lr_ratio
    min_lr_ratio: float = 0.1  # floor, as a fraction of optimizer.lr


@dataclass
class DataConfig:
    # "stdlib" (embedded default corpus), a directory of .txt/.md/.py, or parquet / jsonl(.gz/.zst) / arrow
    # files, a glob of them, a datasets.save_to_disk directory or a local HF dataset directory (docs/data.md)
    source: str = "stdlib"
    text_field: str = "text"  # field/column that holds the document (format chat: the messages; "" = "messages")
    # chat: {role, content} lists, loss on assistant tokens only; preference: prompt/chosen/rejected
    # rows for training.objective = dpo (docs/dpo.md); prompts: prompt rows (and the reward's
    # columns) for training.objective = grpo (docs/grpo.md)
    format: Literal["text", "chat", "preference", "prompts"] = "text"
    # Several sources mixed by weight, in TOML only: [[data.sources]] path, weight, text_field, format, repeat, name.
    sources: list[SourceConfig] = field(default_factory=list)
    val_source: str = ""  # validate on this source (same format) instead of the held-out fraction
    overlong: Literal["drop", "truncate"] = "drop"  # chat conversations longer than seq_len: drop (counted) or cut
    # format chat: the template conversations are rendered with. "" = the one beside the tokenizer
    # (tokenizer_config.json's chat_template or chat_template.jinja); "chatml" = the built-in ChatML with
    # {% generation %} blocks (Qwen's turn format, without thinking), for templates that rewrite earlier
    # turns (Qwen3's); or a path to a .jinja file.
    chat_template: str = ""
    max_bytes: int = 0  # stop reading the corpus after this many bytes; 0 = all of it
    tokenizer_path: str = ""  # a tokenizer.json; empty = train a byte-level BPE of the model's vocab size
    cache_dir: str = ""  # where tokenizers and token shards are cached; empty = ~/.cache/titan_tpu
    # The most a run tokenizes itself, in MB of source on disk (data.max_bytes caps it): a source not
    # yet in the cache above it (or a BPE to train on one) is refused in one line naming `titan-tpu
    # prepare-data`, which tokenizes ahead in parallel processes; 0 = no limit (docs/data.md).
    tokenize_limit_mb: float = 1000.0
    val_fraction: float = 0.01  # share of the token stream held out for validation
    # Packed windows hold several documents: true keeps attention within each document and restarts
    # RoPE positions at each one (the loader emits per-token positions); false attends across them.
    document_mask: bool = False
    # Vision-language chat rows (docs/vision_language.md): pack several conversations into each row of
    # training.seq_len (at most model.max_images images a row, each with its conversation; attention kept
    # within each conversation); false: one conversation a row, padded.
    pack_images: bool = False


@dataclass
class ValidationConfig:
    enabled: bool = True  # evaluate the loss on held-out data during training
    freq: int = 50  # validate every freq steps (and after the last step)
    steps: int = 4  # validation batches per evaluation


@dataclass
class EvaluationConfig:
    # lm-evaluation-harness benchmarks (the eval extra) scored during training on the training mesh:
    # every data-parallel rank scores its share of the requests, rank 0 logs eval/<task>/<metric>
    # (metrics.jsonl, the trackers, the report) and writes lm-eval's JSON to lm_eval/step-N.json.
    # Task names as `titan-tpu eval --tasks` takes them (evaluation/during_training.py). Empty: none.
    tasks: list[str] = field(default_factory=list)
    freq: int = 500  # every freq steps (and after the last step)
    limit: float = 0.0  # documents per task at most (below 1: that fraction of each task); 0: all
    num_fewshot: int = -1  # examples in each prompt; -1: each task's own
    batch_size: int = 8  # rows per forward
    include_path: str = ""  # a folder of task YAMLs of one's own (local data_files)
    apply_chat_template: bool = False  # render prompts with the tokenizer's (or data.chat_template's) template


@dataclass
class MetricsConfig:
    log_freq: int = 10  # a metrics row (loss, tokens/s, MFU, memory) every log_freq steps
    # Where each row goes besides metrics.jsonl and the console: tensorboard, wandb (an optional
    # extra; offline without WANDB_API_KEY). train/trackers.py; on the command line "tensorboard,wandb".
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    tensorboard: bool = True  # false leaves tensorboard out even when trackers lists it (the older switch)
    wandb_project: str = "titan-tpu"  # the Weights & Biases project when trackers has wandb
    console: bool = True  # print each metrics row to the console (rank 0)
    # MoE models: a warning line when a layer's busiest expert gets more than this many times the layer's
    # mean load (moe/layer<i>/load_max, loops/routing.py), once until that layer falls back to it. A fresh
    # router reads 1.2-1.5 (qwen3_moe debug, 512 tokens a step); 4 with 128 experts, top-8, is a quarter of
    # the tokens on one expert. A layer reaches at most E / top_k (every token on that expert): 4 in the
    # 8-expert top-2 debug model, so set 3 there. 0: off.
    expert_load_warning: float = 4.0


@dataclass
class ProfilingConfig:
    # torch.profiler over active_steps steps from start_step: one Chrome trace per rank
    # (trace_dir/rank<r>.json.gz, opens in Perfetto) and a table of where the step went by category
    # on rank 0's console (train/profiling.py). memory_snapshot (CUDA): the allocator's history as
    # trace_dir/memory_rank<r>.pickle (drag into pytorch.org/memory_viz).
    enabled: bool = False
    start_step: int = 3  # the first profiled step (after warm-up and compilation)
    active_steps: int = 2  # how many steps are profiled
    trace_dir: str = ""  # empty = <output_dir>/profile
    memory_snapshot: bool = False  # CUDA: also record the allocator's history


@dataclass
class CheckpointConfig:
    enabled: bool = True  # save checkpoints under output_dir/checkpoints
    interval: int = 100  # save every interval steps (and after the last step)
    keep_latest_k: int = 2  # 0 keeps every checkpoint
    resume: bool = True  # continue from the newest checkpoint in output_dir/checkpoints if there is one
    async_save: bool = False  # write checkpoints in the background while training goes on
    # A save that fails (no space, no permission, an I/O error): stop ends the run with one line and
    # a non-zero exit; warn logs the line, trains on and tries again at the next interval.
    on_save_error: Literal["stop", "warn"] = "stop"
    # Weights to start from when there is nothing to resume: a checkpoint (step, checkpoints/ or run
    # directory) or a Hugging Face model directory. Only the model weights are taken.
    initial_load_path: str = ""
    # Seconds between SIGTERM and the kill (a preemption notice, e.g. 30). > 0: SIGTERM writes the
    # local tier first (each rank's shards to checkpoint.local_dir, in seconds), then the persistent
    # checkpoint if the budget still holds it, else at the next start (docs/fault_tolerance.md).
    # 0: SIGTERM writes the persistent checkpoint only.
    grace_seconds: float = 0.0
    # The local tier's directory: fast storage of this host. "" = /dev/shm (host memory) where there
    # is one, else <output_dir>/checkpoints-local.
    local_dir: str = ""
    # Also write the local tier every this many steps (0: only on SIGTERM, with grace_seconds > 0):
    # a kill -9 then loses at most this many steps.
    local_interval: int = 0
    # Where the persistent checkpoints go: "" = <output_dir>/checkpoints; a relative path is under
    # output_dir; e.g. a gcsfuse mount of a bucket (docs/fault_tolerance.md, checkpoints on object storage).
    folder: str = ""
    # How a checkpoint is committed (train/checkpoint.py): rename (written into a hidden directory,
    # renamed into place: atomic on local disks and NFS), marker (written in place; complete once its
    # checkpoint.json, written last, exists: object-store mounts, where renaming a directory copies it
    # object by object), auto (marker on a gcsfuse / s3fs / mountpoint-s3 mount, else rename).
    commit: Literal["auto", "rename", "marker"] = "auto"


@dataclass
class FaultToleranceConfig:
    # Replica fault tolerance (docs/fault_tolerance.md): this process is replica group `replica_id` of
    # `replicas`, each a `titan-tpu train` of its own; every step they average gradients through the
    # lighthouse (`titan-tpu lighthouse`). A group that dies is left out of the average until it
    # restarts and takes the current weights from a peer; the others keep stepping.
    enabled: bool = False
    replica_id: int = 0  # this group, in [0, replicas): it reads its 1/replicas share of each global batch
    replicas: int = 2  # the replica groups the global batch is split over
    lighthouse: str = "127.0.0.1:29510"  # host:port of `titan-tpu lighthouse`
    # A collective whose peer is alive but silent (not dead: a dead peer fails it at once) fails after
    # this long, and the group's step is taken again in a new quorum.
    timeout_seconds: float = 30.0

    def lighthouse_address(self) -> tuple[str, int | None]:
        """(host, port) of `lighthouse`; port None when it is not a number (checked by `check`)."""
        host, _, port = self.lighthouse.rpartition(":")
        return host, int(port) if port.isdigit() else None


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)  # attention and loss implementations
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    orpo: ORPOConfig = field(default_factory=ORPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    output_dir: str = ""  # empty = outputs/<job.name>; replica groups: <output_dir>/replica_<id>

    @property
    def run_dir(self) -> Path:
        base = Path(self.output_dir or Path("outputs") / self.job.name)
        # Each replica group keeps its own checkpoints, metrics and lock (they hold the same weights).
        return base / f"replica_{self.fault_tolerance.replica_id}" if self.fault_tolerance.enabled else base

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name != "output_dir")


# ----------------------------------------------------------------------------------------------
# Typed assignment


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _convert(key: str, value: Any, annotation: Any) -> Any:
    """Convert a TOML or command-line value to the annotated type, or raise a one-line error."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if isinstance(value, bool) and str(value).lower() in choices:
            return str(value).lower()  # a TOML true/false for a choice spelled "true"/"false"
        if value not in choices:
            raise ValueError(f"{key} = {value!r} is not a valid choice; use one of {', '.join(map(str, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        raise AssertionError(f"unions are not supported in the config schema ({key})")
    from_cli = isinstance(value, str)
    if origin is list and typing.get_args(annotation) == (float,):  # a TOML array of numbers, or "1,0.5"
        items = [v.strip() for v in value.split(",") if v.strip()] if from_cli else value
        try:
            if isinstance(items, list) and not any(isinstance(v, bool) for v in items):
                return [float(v) for v in items]
        except (TypeError, ValueError):
            pass
        raise ValueError(f"{key} = {value!r} has the wrong type; expected a list of numbers, e.g. [1.0, 0.5] "
                         "(1,0.5 on the command line)")
    if origin is list:  # list[str]: a TOML array, or "a,b" on the command line
        items = [v.strip() for v in value.split(",") if v.strip()] if from_cli else value
        if isinstance(items, list) and all(isinstance(v, str) for v in items):
            return items
        raise ValueError(f"{key} = {value!r} has the wrong type; expected a list of strings, e.g. [\"a\", \"b\"] "
                         "(a,b on the command line)")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if from_cli and value.lower() in ("true", "1", "yes", "on"):
            return True
        if from_cli and value.lower() in ("false", "0", "no", "off"):
            return False
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli:
            try:
                return int(value)
            except ValueError:
                pass
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli:
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
    else:
        raise AssertionError(f"unsupported annotation {annotation} for {key}")
    raise ValueError(f"{key} = {value!r} has the wrong type; expected {annotation.__name__}")


def set_value(cfg: Config, dotted_key: str, value: Any) -> None:
    """Assign ``section.key`` (or the top-level ``output_dir``) with type checking."""
    if dotted_key == "output_dir":
        cfg.output_dir = _convert(dotted_key, value, str)
        return
    section, _, key = dotted_key.partition(".")
    if section not in SECTIONS or not key:
        raise ValueError(f"unknown config key {dotted_key!r}; keys look like section.key with section one of "
                         f"{', '.join(SECTIONS)} (or output_dir)")
    section_obj = getattr(cfg, section)
    types_by_key = _field_types(type(section_obj))
    if key not in types_by_key:
        raise ValueError(f"unknown config key {dotted_key!r}; valid keys in [{section}]: {', '.join(types_by_key)}")
    if dotted_key == "data.sources":
        if not isinstance(value, list):
            raise ValueError("data.sources is a list of [[data.sources]] tables in the TOML recipe; on the command "
                             "line use --data.source PATH")
        cfg.data.sources = [source_from_table(t, key=f"data.sources[{i}]") for i, t in enumerate(value)]
        return
    setattr(section_obj, key, _convert(dotted_key, value, types_by_key[key]))


# ----------------------------------------------------------------------------------------------
# Loading


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist; pass --config with a TOML recipe, "
                                "e.g. configs/llama3_debug.toml")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``["--a.b", "1", "--c.d=2"]`` -> ``[("a.b", "1"), ("c.d", "2")]``."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; overrides look like --section.key VALUE")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ValueError(f"--{key} needs a value")
            value = args[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def build_config(toml_path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML recipe, then command-line overrides; then each section's own checks
    (`check`). The checks across sections run in `titan_tpu.run.setup.prepare_run`."""
    cfg = Config()
    if toml_path is not None:
        for section, table in load_toml(toml_path).items():
            if section == "output_dir":
                set_value(cfg, section, table)
                continue
            if not isinstance(table, dict):
                raise ValueError(f"config key {section!r} in {toml_path} must be a table [{section}]; "
                                 f"sections: {', '.join(SECTIONS)}")
            for key, value in table.items():
                set_value(cfg, f"{section}.{key}", value)
    for key, value in parse_overrides(overrides or []):
        set_value(cfg, key, value)
    check(cfg)
    return cfg


def data_sources(cfg: Config) -> list[SourceConfig]:
    """The run's sources: [[data.sources]], or the one data.source with its text_field and format."""
    if cfg.data.sources:
        return cfg.data.sources
    d = cfg.data
    field = "" if d.format == "chat" and d.text_field == "text" else d.text_field
    return [SourceConfig(path=d.source, text_field=field, format=d.format)]


def grad_accum_from_tokens(t: TrainingConfig, dp_ranks: int, *, ranks_per_dp: int = 1) -> int:
    """The micro-batches per step that give training.global_batch_tokens on `dp_ranks` data-parallel
    ranks (tensor- and context-parallel ranks share their rank's batch: `ranks_per_dp` of them), as
    TorchTitan derives its accumulation from the global batch; training.grad_accum_steps when
    global_batch_tokens is 0. A mesh that cannot keep the global batch (a restart on other ranks)
    is refused naming the nearest data-parallel sizes that can."""
    if not t.global_batch_tokens:
        return t.grad_accum_steps
    per_micro_batch = t.batch_size * t.seq_len * dp_ranks
    if t.global_batch_tokens % per_micro_batch:
        fits = [d for d in range(1, 2 * dp_ranks + 2) if t.global_batch_tokens % (t.batch_size * t.seq_len * d) == 0]
        below, above = [d for d in fits if d < dp_ranks][-1:], [d for d in fits if d > dp_ranks][:1]
        nearest = " or ".join(f"{d * ranks_per_dp} ranks" for d in below + above)
        keep = f"the nearest world sizes that keep it: {nearest}" if nearest else "no number of ranks keeps it"
        raise ValueError(f"training.global_batch_tokens = {t.global_batch_tokens} is not a multiple of batch_size x "
                         f"seq_len x data-parallel ranks = {t.batch_size} x {t.seq_len} x {dp_ranks} = "
                         f"{per_micro_batch} ({keep}); pick a multiple or change training.batch_size")
    return t.global_batch_tokens // per_micro_batch


def check(cfg: Config) -> None:
    """Each section's own keys: ranges and the combinations within one section. Checks that span
    sections or need a component (the model spec, the lr schedule, the trackers, the device) run
    once per run in `titan_tpu.run.setup.prepare_run`; types and choices are checked on assignment."""
    t = cfg.training
    for key, value in (("training.steps", t.steps), ("training.batch_size", t.batch_size),
                       ("training.seq_len", t.seq_len), ("training.grad_accum_steps", t.grad_accum_steps),
                       ("metrics.log_freq", cfg.metrics.log_freq), ("validation.freq", cfg.validation.freq),
                       ("validation.steps", cfg.validation.steps), ("checkpoint.interval", cfg.checkpoint.interval),
                       ("evaluation.freq", cfg.evaluation.freq), ("evaluation.batch_size", cfg.evaluation.batch_size)):
        if value < 1:
            raise ValueError(f"{key} = {value} must be >= 1")
    if cfg.parallelism.dp_replicate < 1 or (cfg.parallelism.dp_shard < 1 and cfg.parallelism.dp_shard != -1):
        raise ValueError(f"parallelism.dp_replicate = {cfg.parallelism.dp_replicate} and parallelism.dp_shard = "
                         f"{cfg.parallelism.dp_shard} must be >= 1 (dp_shard may be -1: the remaining ranks)")
    if cfg.parallelism.slices < 1 or cfg.parallelism.dp_replicate % cfg.parallelism.slices:
        raise ValueError(f"parallelism.slices = {cfg.parallelism.slices} lays dp_replicate across the slices "
                         f"(MaxText's dcn_data_parallelism): set parallelism.dp_replicate to a multiple of it (now "
                         f"{cfg.parallelism.dp_replicate}), or slices to 1")
    if cfg.compile.prefetch < -1:
        raise ValueError(f"compile.prefetch = {cfg.compile.prefetch} must be >= -1 (-1: keep the trace order)")
    if cfg.parallelism.bucket_mb < 0:
        raise ValueError(f"parallelism.bucket_mb = {cfg.parallelism.bucket_mb} must be >= 0 (0: one collective per "
                         "parameter)")
    if cfg.parallelism.ep < 1:
        raise ValueError(f"parallelism.ep = {cfg.parallelism.ep} must be >= 1")
    if t.global_batch_tokens < 0:
        raise ValueError(f"training.global_batch_tokens = {t.global_batch_tokens} must be >= 0 (0: use "
                         "training.grad_accum_steps)")
    if t.global_batch_tokens and t.grad_accum_steps != 1:
        raise ValueError(f"training.global_batch_tokens = {t.global_batch_tokens} sets training.grad_accum_steps; "
                         f"remove one of them (grad_accum_steps = {t.grad_accum_steps})")
    cfg.kernels.validate()
    lora = cfg.lora
    if lora.enabled:
        if lora.rank < 1:
            raise ValueError(f"lora.rank = {lora.rank} must be >= 1")
        if lora.alpha <= 0:
            raise ValueError(f"lora.alpha = {lora.alpha} must be > 0")
        if not 0.0 <= lora.dropout < 1.0:
            raise ValueError(f"lora.dropout = {lora.dropout} must be in [0, 1)")
    prof = cfg.profiling
    if prof.start_step < 1 or prof.active_steps < 1:
        raise ValueError(f"profiling.start_step = {prof.start_step} and profiling.active_steps = {prof.active_steps} "
                         "must be >= 1")
    if cfg.checkpoint.grace_seconds < 0 or cfg.checkpoint.local_interval < 0:
        raise ValueError(f"checkpoint.grace_seconds = {cfg.checkpoint.grace_seconds} and checkpoint.local_interval = "
                         f"{cfg.checkpoint.local_interval} must be >= 0 (0: off)")
    if cfg.metrics.expert_load_warning < 0:
        raise ValueError(f"metrics.expert_load_warning = {cfg.metrics.expert_load_warning} must be >= 0 (a load "
                         "max/mean such as 4; 0: no warning)")
    if cfg.checkpoint.keep_latest_k < 0:
        raise ValueError(f"checkpoint.keep_latest_k = {cfg.checkpoint.keep_latest_k} must be >= 0 (0 keeps all)")
    if cfg.optimizer.lr <= 0:
        raise ValueError(f"optimizer.lr = {cfg.optimizer.lr} must be > 0")
    if cfg.data.sources:
        if cfg.data.source != "stdlib":
            raise ValueError("data.source and [[data.sources]] are both set; keep one (a single source can be either)")
        normalized_weights(cfg.data.sources)
    if cfg.dpo.beta <= 0:
        raise ValueError(f"dpo.beta = {cfg.dpo.beta} must be > 0")
    if cfg.orpo.beta <= 0:
        raise ValueError(f"orpo.beta = {cfg.orpo.beta} must be > 0")
    _check_grpo(cfg.grpo)
    if cfg.data.max_bytes < 0:
        raise ValueError(f"data.max_bytes = {cfg.data.max_bytes} must be >= 0 (0 reads the whole corpus)")
    if cfg.data.tokenize_limit_mb < 0:
        raise ValueError(f"data.tokenize_limit_mb = {cfg.data.tokenize_limit_mb:g} must be >= 0 (0: no limit)")
    _check_fault_tolerance(cfg.fault_tolerance)
    if cfg.evaluation.limit < 0 or cfg.evaluation.num_fewshot < -1:
        raise ValueError(f"evaluation.limit = {cfg.evaluation.limit:g} must be >= 0 (0: all documents) and "
                         f"evaluation.num_fewshot = {cfg.evaluation.num_fewshot} >= -1 (-1: each task's own)")


def _check_fault_tolerance(ft: FaultToleranceConfig) -> None:
    """The [fault_tolerance] keys' own ranges (what they need of other sections: run/setup.py)."""
    if not ft.enabled:
        return
    if ft.replicas < 1 or not 0 <= ft.replica_id < ft.replicas:
        raise ValueError(f"fault_tolerance.replica_id = {ft.replica_id} must be in [0, fault_tolerance.replicas = "
                         f"{ft.replicas})")
    host, port = ft.lighthouse_address()
    if not host or port is None:
        raise ValueError(f"fault_tolerance.lighthouse = {ft.lighthouse!r} must be host:port, e.g. 127.0.0.1:29510 "
                         "(where `titan-tpu lighthouse --port 29510` runs)")
    if ft.timeout_seconds <= 0:
        raise ValueError(f"fault_tolerance.timeout_seconds = {ft.timeout_seconds} must be > 0")


def _check_grpo(g: GRPOConfig) -> None:
    """The [grpo] keys' own ranges (what they need of other sections: run/setup.py)."""
    if g.num_generations < 2:
        raise ValueError(f"grpo.num_generations = {g.num_generations} must be >= 2: the advantage compares the "
                         "samples of one prompt with each other")
    if g.max_completion_length < 1:
        raise ValueError(f"grpo.max_completion_length = {g.max_completion_length} must be >= 1")
    if not g.temperature > 0:
        raise ValueError(f"grpo.temperature = {g.temperature} must be > 0 (GRPO samples; 1.0 is TRL's default)")
    if g.passes < 1:
        raise ValueError(f"grpo.passes = {g.passes} must be >= 1")
    if g.epsilon <= 0 or g.epsilon_high < 0:
        raise ValueError(f"grpo.epsilon = {g.epsilon} must be > 0 and grpo.epsilon_high = {g.epsilon_high} >= 0")
    if g.beta < 0:
        raise ValueError(f"grpo.beta = {g.beta} must be >= 0 (0: no KL penalty)")
    if not g.reward:
        raise ValueError("grpo.reward is empty; name a built-in (exact_match, regex, length) or module:function")
    if g.reward_weights and len(g.reward_weights) != len(g.reward):
        raise ValueError(f"grpo.reward_weights has {len(g.reward_weights)} numbers for {len(g.reward)} rewards; "
                         "give one per reward")
