"""Text generation from a built model: `generate` (loop.py) with a decoder per kind of model
(decoders.py) and the choice of the next token (sampling.py); `titan-tpu generate` is command.py."""

from titan_tpu.generate.loop import Generation, generate
from titan_tpu.generate.sampling import Sampling

__all__ = ["Generation", "Sampling", "generate"]
