"""Building blocks shared by the model families (attention, RoPE, norms, feed-forward)."""

from titan_tpu.models.common.transformer import RopeScaling, Transformer, TransformerArgs

__all__ = ["RopeScaling", "Transformer", "TransformerArgs"]
