"""Prefill and decode steps over a built model, one class per kind of model (`decoder_for` picks).

A decoder turns a batch of prompts into the logits of each row's next token (`prefill`), then,
fed one token per row, into the logits of the token after it (`step`), keeping the model's cache
in between. The generation loop (loop.py) only sees that contract.

* `NativeDecoder`: our Transformer with its static-shape cache (models/common/kv_cache.py).
  Prompts sit right-padded and every row keeps its own position, so RoPE sees each token's true
  position and no padding is ever visible to a real token. The decode step has the same shapes at
  every position: with a compile backend it is compiled once (`torch.compile(fullgraph=True,
  dynamic=False)`; Inductor on CPU and CUDA, TorchTPU's backend on a TPU, as the trainer's
  device backend names it); the prefill, whose shape follows the prompts, runs eagerly.
* `FullForwardDecoder`: our Transformer as training builds it with scanned layers or
  checkpointed blocks, which have no cached path (a trained model scored during training,
  evaluation/during_training.py): every step runs the whole forward over each row's tokens so far. The
  same logits as the cache gives, at a cost that grows with the square of the length.
* `HFDecoder`: a transformers model (the HF backend) with transformers' own cache, the layout
  its `generate` uses: prompts left-padded under an attention mask, positions counted from each
  row's first real token; a dynamic cache eagerly, a static one under a compile backend. A
  vision-language model's prompts may carry images (`ImageInputs`, left-padded as the prompts):
  the prefill runs the vision tower on every slot and merges its features into the token
  embeddings as the training forward does (models/hf/vision.py), with the architecture's inputs
  beside them (Qwen2.5-VL's 3-D positions, Gemma 3's image token types); the decode steps feed
  text tokens only, so they keep one shape, each row's positions continuing one past the
  furthest its prompt reached (behind the token count after a Qwen2.5-VL image, as transformers'
  rope deltas put them).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor

from titan_tpu.models.common.transformer import Transformer
from titan_tpu.models.hf.model import HFCausalLM

if TYPE_CHECKING:
    from titan_tpu.data.batch import ImageInputs


def _no_images(images: ImageInputs | None) -> None:
    if images is not None:
        raise ValueError("a native model reads no images; generate from a vision-language model of the hf backend "
                         "(Qwen2.5-VL, Gemma 3, LLaVA) or drop the images")


class NativeDecoder:
    def __init__(self, model: Transformer, *, compile_backend: str | None = None):
        self.model = model
        self._decode = self._last_logits if compile_backend is None else torch.compile(
            self._last_logits, backend=compile_backend, fullgraph=True, dynamic=False)
        self.cache = None
        self.positions_B1: Tensor | None = None  # where each row's next token goes

    @property
    def device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    @property
    def vocab_size(self) -> int:
        return self.model.tok_embeddings.num_embeddings

    @property
    def max_length(self) -> int:
        """Positions the RoPE table covers."""
        return self.model.rope_cache.shape[0]

    def prefill(self, prompts: list[list[int]], *, length: int, images: ImageInputs | None = None) -> Tensor:
        _no_images(images)
        B, lengths = len(prompts), [len(p) for p in prompts]
        tokens_BP = torch.zeros(B, max(lengths), dtype=torch.long, device=self.device)  # right-padded
        for b, prompt in enumerate(prompts):
            tokens_BP[b, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        positions_BP = torch.arange(tokens_BP.shape[1], device=self.device).expand(B, -1)
        self.cache = self.model.kv_cache(batch=B, length=length)
        h_BPD = self.model.cached_hidden_states(tokens_BP, positions_BS=positions_BP, cache=self.cache)
        last_B = torch.tensor(lengths, device=self.device) - 1
        self.positions_B1 = (last_B + 1).unsqueeze(1)
        return F.linear(h_BPD[torch.arange(B, device=self.device), last_B], self.model.output_weight())

    def step(self, tokens_B: Tensor) -> Tensor:
        logits_BV = self._decode(tokens_B.unsqueeze(1), self.positions_B1, self.cache)
        self.positions_B1 = self.positions_B1 + 1
        return logits_BV

    def _last_logits(self, tokens_B1: Tensor, positions_B1: Tensor, cache) -> Tensor:
        h_B1D = self.model.cached_hidden_states(tokens_B1, positions_BS=positions_B1, cache=cache)
        return F.linear(h_B1D[:, -1], self.model.output_weight())


class FullForwardDecoder(NativeDecoder):
    def __init__(self, model: Transformer):
        super().__init__(model)
        self.rows: list[list[int]] = []  # each row's tokens so far

    def prefill(self, prompts: list[list[int]], *, length: int, images: ImageInputs | None = None) -> Tensor:
        _no_images(images)
        self.rows = [list(prompt) for prompt in prompts]
        return self._last_logits_of_rows()

    def step(self, tokens_B: Tensor) -> Tensor:
        for row, token in zip(self.rows, tokens_B.tolist()):
            row.append(token)
        return self._last_logits_of_rows()

    def _last_logits_of_rows(self) -> Tensor:
        # Right-padded: causal attention keeps a row's padding from its real tokens.
        lengths = torch.tensor([len(row) for row in self.rows], device=self.device)
        tokens_BS = torch.zeros(len(self.rows), int(lengths.max()), dtype=torch.long, device=self.device)
        for b, row in enumerate(self.rows):
            tokens_BS[b, :len(row)] = torch.tensor(row, dtype=torch.long)
        logits_BSV = self.model(tokens_BS)
        return logits_BSV[torch.arange(len(self.rows), device=self.device), lengths - 1]


class HFDecoder:
    def __init__(self, model: HFCausalLM, *, compile_backend: str | None = None):
        self.model = model
        self.hf_model = model.hf_model
        self.static = compile_backend is not None
        self._forward = self.hf_model if compile_backend is None else torch.compile(
            self.hf_model, backend=compile_backend, dynamic=False)
        parameters = inspect.signature(self.hf_model.forward).parameters
        self._cache_key = "cache" if "cache" in parameters else "past_key_values"  # transformers 5.x / 4.x
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        self.cache = None
        self.mask_BL: Tensor | None = None  # [B, cache length]
        self.filled = 0  # cache columns written
        self.positions_B1: Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.hf_model.get_input_embeddings().weight.device

    @property
    def vocab_size(self) -> int:
        return self.hf_model.get_input_embeddings().num_embeddings

    @property
    def max_length(self) -> int | None:
        return getattr(self.hf_model.config.get_text_config(), "max_position_embeddings", None)

    def prefill(self, prompts: list[list[int]], *, length: int, images: ImageInputs | None = None) -> Tensor:
        from transformers import DynamicCache, StaticCache

        B, P = len(prompts), max(len(p) for p in prompts)
        tokens_BP = torch.zeros(B, P, dtype=torch.long, device=self.device)  # left-padded
        # Which cache columns hold real tokens: the prompts' (after their padding) and every one
        # after them (causality hides those not yet written). One shape for the whole run.
        self.mask_BL = torch.ones(B, length, dtype=torch.long, device=self.device)
        for b, prompt in enumerate(prompts):
            tokens_BP[b, P - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            self.mask_BL[b, :P - len(prompt)] = 0
        positions_BP = (self.mask_BL[:, :P].cumsum(-1) - 1).clamp(min=0)
        inputs = {"input_ids": tokens_BP, "position_ids": positions_BP}
        if images is not None:
            inputs = self._with_images(tokens_BP, positions_BP, images)
        kind = StaticCache if self.static else DynamicCache
        settings = {"config": self.hf_model.config, "max_cache_len": length, "max_batch_size": B}
        accepted = inspect.signature(kind.__init__).parameters  # these differ between transformers releases
        self.cache = kind(**{key: value for key, value in settings.items() if key in accepted})
        self.filled = P
        logits_BV = self._call(self.hf_model, inputs)
        positions = inputs["position_ids"]  # [B, P], or Qwen2.5-VL's [3, B, P]
        self.positions_B1 = (positions.amax(dim=0) if positions.dim() == 3 else positions).amax(-1, keepdim=True) + 1
        return logits_BV

    def _with_images(self, tokens_BP: Tensor, positions_BP: Tensor, images: ImageInputs) -> dict[str, Tensor]:
        """The prefill's inputs with the images merged in, as the training forward merges them."""
        images = pytree.tree_map(lambda t: t.to(self.device), images)
        if images.slots_BM.shape[0] != tokens_BP.shape[0]:
            raise ValueError(f"{images.slots_BM.shape[0]} rows of images for {tokens_BP.shape[0]} prompts; give "
                             "one row of image slots per prompt")
        embeds_BPD = self.model.embeddings_with_images(tokens_BP, images)
        return {"inputs_embeds": embeds_BPD, "position_ids": positions_BP, **self.model.vision.language_inputs(images)}

    def step(self, tokens_B: Tensor) -> Tensor:
        self.filled += 1
        logits_BV = self._call(self._forward, {"input_ids": tokens_B.unsqueeze(1), "position_ids": self.positions_B1})
        self.positions_B1 = self.positions_B1 + 1
        return logits_BV

    def _call(self, forward, inputs: dict[str, Tensor]) -> Tensor:
        # A static cache takes the mask of all its columns; a dynamic one of those it holds.
        mask_BS = self.mask_BL if self.static else self.mask_BL[:, :self.filled]
        out = forward(**inputs, attention_mask=mask_BS, use_cache=True, **{self._cache_key: self.cache},
                      **self._last_only)
        return out.logits[:, -1]


def decoder_for(model: torch.nn.Module, *, compile_backend: str | None = None) -> NativeDecoder | HFDecoder:
    """The decoder of a built model: the one place that asks which kind of model it is."""
    if isinstance(model, Transformer):
        if not model.decodes_with_cache:
            return FullForwardDecoder(model)
        return NativeDecoder(model, compile_backend=compile_backend)
    if isinstance(model, HFCausalLM):
        return HFDecoder(model, compile_backend=compile_backend)
    raise ValueError(f"generate takes a native Transformer or an HF-backend model, got {type(model).__name__}")
