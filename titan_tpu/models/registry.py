"""Model registry: the native families (models/family.py records), (family name, flavor) ->
TransformerArgs; building; parameter and FLOP counts."""

import copy

import torch

from titan_tpu.kernels import KernelConfig
from titan_tpu.models import deepseek_v3, llama3, qwen3, qwen3_moe
from titan_tpu.models.common.transformer import Transformer, TransformerArgs
from titan_tpu.models.family import Family

# Every native family, by model.name: a new family is its module and one entry here.
FAMILIES: dict[str, Family] = {family.name: family for family in (llama3.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY,
                                                                   deepseek_v3.FAMILY)}
MODEL_NAMES: tuple[str, ...] = tuple(FAMILIES)  # config.py's model.name choices, with "hf"
MODEL_FLAVORS: dict[str, dict[str, TransformerArgs]] = {name: family.flavors for name, family in FAMILIES.items()}


def get_model_args(name: str, flavor: str) -> TransformerArgs:
    """A copy of the flavor's args (callers may edit it, e.g. max_seq_len, without side effects)."""
    if name not in MODEL_FLAVORS:
        raise ValueError(
            f"unknown model name {name!r}; choose one of {', '.join(sorted(MODEL_FLAVORS))}"
        )
    flavors = MODEL_FLAVORS[name]
    if flavor not in flavors:
        raise ValueError(
            f"unknown flavor {flavor!r} for model {name!r}; choose one of {', '.join(flavors)}"
        )
    return copy.deepcopy(flavors[flavor])


def build_model(
    args: TransformerArgs,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
    scan_layers: bool = False,
    ac_mode: str = "none",
    kernels: KernelConfig | None = None,
) -> Transformer:
    """Construct on the meta device (no memory, no init cost), materialise on `device` in `dtype`,
    then initialise. With `seed`, the init is reproducible (torch's global RNG is seeded).
    scan_layers / ac_mode / kernels: execution options of `Transformer` (same weights for the same seed)."""
    with torch.device("meta"):
        model = Transformer(args, scan_layers=scan_layers, ac_mode=ac_mode, kernels=kernels)
    model.to_empty(device=device)
    model.to(dtype=dtype)
    if seed is not None:
        torch.manual_seed(seed)
    model.init_weights()
    return model


def _attention_params(args: TransformerArgs) -> int:
    if args.mla is not None:
        from titan_tpu.models.common.mla import mla_params

        return mla_params(dim=args.dim, n_heads=args.n_heads, args=args.mla)
    attention = args.dim * args.hd * (2 * args.n_heads + 2 * args.n_kv_heads)  # wq, wo + wk, wv
    return attention + (2 * args.hd if args.qk_norm else 0)


def num_params(args: TransformerArgs, *, exclude_embedding: bool = False) -> int:
    """Parameter count from the args alone (all experts counted). `exclude_embedding` drops
    tok_embeddings only (with tied embeddings that matrix is also the output projection, so it
    disappears too)."""
    d = args.dim
    total = d  # final norm
    for layer_id in range(args.n_layers):
        total += _block_params(args, layer_id)
    for layer_id in range(args.n_layers, args.n_layers + args.mtp_num_layers):
        # Multi-token prediction: enorm, hnorm, eh_proj, its block (the kind of layer n_layers + k), its norm.
        total += 3 * d + 2 * d * d + _block_params(args, layer_id)
    if not args.tie_embeddings:
        total += d * args.vocab_size  # output
    if not exclude_embedding:
        total += d * args.vocab_size  # tok_embeddings
    return total


def _block_params(args: TransformerArgs, layer_id: int) -> int:
    d = args.dim
    if args.is_moe_layer(layer_id):
        moe = args.moe
        # router + experts + shared experts
        feed_forward = d * moe.num_experts + (moe.num_experts + moe.num_shared_experts) * 3 * d * moe.hidden_dim
    else:
        feed_forward = 3 * d * args.ffn_hidden_dim
    return _attention_params(args) + feed_forward + 2 * d  # + attention_norm, ffn_norm


def num_moe_blocks(args: TransformerArgs) -> int:
    """MoE blocks, the multi-token-prediction ones included."""
    return sum(args.is_moe_layer(i) for i in range(args.n_layers + args.mtp_num_layers))


def num_active_params(args: TransformerArgs, *, exclude_embedding: bool = False) -> int:
    """Parameters one token's forward uses: for MoE layers the router and its top-k experts
    (equal to num_params for a dense model)."""
    total = num_params(args, exclude_embedding=exclude_embedding)
    moe = args.moe
    if moe is not None:
        unused = (moe.num_experts - moe.top_k) * 3 * args.dim * moe.hidden_dim
        total -= num_moe_blocks(args) * unused
    return total


def flops_per_token(args: TransformerArgs, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), the MFU numerator.

    ``6 * N + 6 * n_layers * n_heads * head_dim * seq_len``

    With multi-head latent attention (DeepSeek-V3) N counts its projections, and the scores use
    the query-key width while the weighted sum uses the value width: head_dim is their mean
    (`attention_head_dim`). Shared experts count as active parameters of every token.

    * ``6 * N``: every weight matrix costs 2 FLOPs per token per parameter in the forward
      (a multiply and an add) and 4 in the backward (gradient w.r.t. input and w.r.t. weight).
      N is the non-embedding parameter count: the embedding lookup is a gather, not a matmul.
      With tied embeddings the same matrix still serves as the output projection
      (2 * dim * vocab FLOPs per token forward), so dim * vocab is added back to N. Norm weights
      are included in N as TorchTitan does; they are ~0.1% of it for real models. For a
      mixture of experts N counts the *active* parameters: attention, norms, the router (all E
      logits are computed) and the top-k experts a token is routed to, not all E.
    * ``6 * L * H * hd * S``: attention scores (Q K^T) and the weighted sum (P V) are each
      2 * S * hd FLOPs per query per head forward, 4 * L * H * hd * S per token, and backward
      doubles that, 12 * L * H * hd * S, for full attention. With a causal mask only about half
      of the score matrix is needed, so it is counted once: 6 * L * H * hd * S, the convention
      of TorchTitan, MaxText and Megatron today. (torch's FlopCounterMode reports the full,
      non-causal 12 * L * H * hd * S; see tests/test_flops.py.)

    Multi-token prediction (mtp_num_layers D) adds its layers' parameters to N, its blocks to L,
    and the shared output projection once more per depth (D * dim * vocab in N).

    Norms, RoPE, softmax, routing bookkeeping and other elementwise work are not counted.
    """
    n = num_active_params(args, exclude_embedding=True)
    if args.tie_embeddings:
        n += args.dim * args.vocab_size
    n += args.mtp_num_layers * args.dim * args.vocab_size  # the output projection, run again per depth
    blocks = args.n_layers + args.mtp_num_layers
    return 6.0 * n + 6.0 * blocks * args.n_heads * attention_head_dim(args) * seq_len


def frozen_weight_gradient_flops_per_token(args: TransformerArgs) -> float:
    """The weight-gradient share of `flops_per_token`'s 6 * N (2 of its 6 FLOPs per weight and
    token): what a frozen base (LoRA) does not compute. The attention's scores and weighted sum
    have no weights and keep theirs."""
    return flops_per_token(args, 0) / 3  # at seq_len 0 the count is the weights' 6 * N alone


def head_flops_per_token(args: TransformerArgs) -> float:
    """The output projection's share of `flops_per_token` (6 * dim * vocab, once more per
    multi-token-prediction depth): the part outside the blocks that checkpointing never reruns."""
    return 6.0 * args.dim * args.vocab_size * (1 + args.mtp_num_layers)


def recomputed_flops_per_token(args: TransformerArgs, seq_len: int) -> float:
    """What full activation checkpointing runs again in the backward, per token: the blocks'
    forward (a third of `flops_per_token` without the output projection: checkpointing wraps the
    blocks, never the output projection and loss) less each block's last matmul, the feed-forward
    down projection (of the dense MLP, or of the routed top-k and shared experts), whose output
    only joins the residual sum, which no gradient needs: torch's checkpoint stops its rerun
    before it (early stop) and XLA drops it as dead code."""
    down = 0.0
    for layer_id in range(args.n_layers + args.mtp_num_layers):
        if args.is_moe_layer(layer_id):
            down += 2.0 * args.dim * args.moe.hidden_dim * (args.moe.top_k + args.moe.num_shared_experts)
        else:
            down += 2.0 * args.dim * args.ffn_hidden_dim
    return (flops_per_token(args, seq_len) - head_flops_per_token(args)) / 3 - down


def flops_per_token_as_xla_counts(args: TransformerArgs, seq_len: int, *, layers_counted: int, recompute: bool,
                                  attention: str, experts_in_kernel: bool, frozen_base: bool = False,
                                  reference_forwards: float = 0.0, logits_recomputed: bool = False,
                                  blocks_repeated: float = 1.0) -> float:
    """The executed FLOPs per token that XLA's cost analysis reports for a compiled step, from
    the same terms as `flops_per_token`: XLA counts a scanned stack's loop body once (layers_counted
    1: one body per kind of layer, a model whose first layers are dense scanning them apart from
    its MoE layers, as DeepSeek-V3 does; else n_layers + mtp_num_layers, every block) and no work
    inside a custom call.
    attention: "kernel" (splash, a Mosaic custom call: not counted), "full" (plain softmax
    attention compiled by XLA: the whole S x S score matrix, masked half included) or "causal"
    (the formula's half). experts_in_kernel: the routed experts' matmuls run in megablox's gmm and
    tgmm (custom calls: not counted); the router and shared experts are XLA's. recompute: full
    checkpointing's rerun of each block's forward. frozen_base: LoRA, whose frozen weights get no
    gradient (4 of the 6 FLOPs per weight and token; the small adapters are left out).
    reference_forwards: the forwards a frozen reference runs per trained forward and backward (DPO:
    one over the same rows, a third of a trained token's work each).
    logits_recomputed: the compiled program computes the output projection's
    logits twice (XLA's tpu7x compile rematerializes them for the backward of the plain-XLA loss:
    two [tokens, vocab] products in its HLO where v5p and v6e have one). A scanned stack of one
    layer (the 16B DeepSeek's single dense layer) is a loop of one trip: XLA inlines it and merges
    checkpointing's rerun with the forward it repeats, so its optimized HLO has no rerun to count.
    blocks_repeated: the blocks' work done this many times over (pipeline stages in one program:
    every stage computes in every iteration, the bubble's too, iterations / passes).
    Norms,
    softmax, SiLU, the optimizer are not counted (as in flops_per_token)."""
    blocks = args.n_layers + args.mtp_num_layers
    head = head_flops_per_token(args)
    block_matmuls = (6.0 * num_active_params(args, exclude_embedding=True)
                     + 6.0 * args.dim * args.vocab_size * (args.tie_embeddings + args.mtp_num_layers)
                     - head - 6.0 * args.dim) / blocks  # per block: no final norm, no output projection
    causal = 6.0 * args.n_heads * attention_head_dim(args) * seq_len
    block_attention = {"kernel": 0.0, "full": 2 * causal, "causal": causal}[attention]

    def feed_forward(moe_layer: bool) -> tuple[float, float, float]:
        """(the layer kind's feed-forward FLOPs per token, the part of them XLA counts (not the
        routed experts' inside gmm and tgmm), its down projection's as XLA counts them)."""
        if not moe_layer:
            dense = 6.0 * 3 * args.dim * args.ffn_hidden_dim
            return dense, dense, 2.0 * args.dim * args.ffn_hidden_dim
        moe = args.moe
        experts = moe.num_shared_experts + (0 if experts_in_kernel else moe.top_k)
        active = 6.0 * (args.dim * moe.num_experts
                        + (moe.num_shared_experts + moe.top_k) * 3 * args.dim * moe.hidden_dim)
        in_kernel = 6.0 * moe.top_k * 3 * args.dim * moe.hidden_dim if experts_in_kernel else 0.0
        return active, active - in_kernel, 2.0 * args.dim * moe.hidden_dim * experts

    kinds = [args.is_moe_layer(i) for i in range(blocks)]
    shared = block_matmuls - sum(feed_forward(k)[0] for k in kinds) / blocks  # attention and the rest
    counted = kinds if layers_counted >= blocks else sorted(set(kinds[:args.n_layers]))  # a loop body per kind

    weights = 4.0 / 6.0 if frozen_base else 1.0  # no weight gradients for a frozen base

    def block(moe_layer: bool) -> float:
        _, ffn, down = feed_forward(moe_layer)
        per_block = shared + ffn + block_attention
        one_trip_loop = layers_counted < blocks and kinds[:args.n_layers].count(moe_layer) == 1
        rerun = recompute and not one_trip_loop
        # full checkpointing reruns the block's forward, without its down projection (recomputed_flops_per_token)
        return (shared + ffn) * weights + block_attention + (per_block / 3 - down if rerun else 0.0)

    reference = (head + sum(shared + feed_forward(k)[1] + block_attention for k in counted)) / 3
    return head * weights + blocks_repeated * sum(block(k) for k in counted) + reference * reference_forwards + \
        (head / 3 if logits_recomputed else 0.0)


def attention_head_dim(args: TransformerArgs) -> float:
    """The head width of the attention FLOP term: head_dim, or for multi-head latent attention
    the mean of the query-key width (scores) and the value width (weighted sum)."""
    if args.mla is not None:
        return (args.mla.qk_head_dim + args.mla.v_head_dim) / 2
    return args.hd


def num_expert_params(args: TransformerArgs) -> int:
    """Parameters of the MoE experts (all of them): what expert parallelism spreads over ep ranks."""
    if args.moe is None:
        return 0
    return num_moe_blocks(args) * args.moe.num_experts * 3 * args.dim * args.moe.hidden_dim


def largest_param(args: TransformerArgs) -> int:
    """Elements of the largest single parameter of the unrolled model (the embedding or output
    projection for every model here; an MoE layer's stacked experts can be larger)."""
    sizes = [args.vocab_size * args.dim, args.dim * args.ffn_hidden_dim]
    if args.moe is not None:
        sizes.append(args.moe.num_experts * args.dim * args.moe.hidden_dim)
    return max(sizes)
