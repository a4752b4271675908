"""Image-text chat rows for vision-language models, in static shapes.

A row is a chat row (``messages``) whose user turns hold images as content parts, as Hugging Face
chat templates expect them::

    {"messages": [{"role": "user", "content": [{"type": "image", "path": "cat.png"},
                                               {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}

(``"path"``, or ``"image"`` holding a path or the bytes of an encoded image, as a parquet column
of images does). It is rendered with the model directory's own chat template (data/chat.py: loss on
the assistant's text only), each image placeholder the template writes is expanded as the
directory's processor expands it (`ImageFormat`), and tokenized. Images are read when their row
is batched: converted to RGB, resized to the one fixed resolution of the model (`image_side`), and
laid out by the directory's own image processor.

Static shapes, as XLA needs and as MaxText does it: every row has `max_images` image slots
(model.max_images), filled in order, the rest zeros and marked empty; a row is one conversation
padded to seq_len, so every batch has the same shapes whatever its images. A conversation with
more images than slots is an error naming the row and the key; a conversation longer than seq_len
is dropped and counted. Rows without images are fine (all slots empty).

With data.pack_images a row holds several conversations instead, as text chat rows do (greedily,
in order): a conversation starts a new row when the row's tokens or its image slots would not hold
it, so every image stays in the row of its conversation, the row's slots hold its images in the
order their tokens appear (the k-th image token run reads slot k), and positions restart at each
conversation (the batch's `positions_BS`), which keeps attention within it. The per-token extras
are computed per conversation (Qwen2.5-VL's 3-D positions restart with it).

What differs per architecture (the placeholder and its expansion, the tokens per image, the
extra per-token inputs: Qwen2.5-VL's 3-D rotary positions, Gemma 3's image token types) is one
`ImageFormat` per model_type in `IMAGE_FORMATS`.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from titan_tpu.data.batch import IGNORE_INDEX, ImageInputs, TokenBatch
from titan_tpu.data.mixture import MixtureLoader, pack_bounds

DEFAULT_DYNAMIC_SIDE = 448  # model.image_size 0 on a processor without a fixed resolution (Qwen2.5-VL's)


@dataclass(frozen=True)
class ImageFormat:
    """How one architecture's processor puts an image into the text, and what its rows carry
    besides the tokens and pixels."""

    placeholder: str  # what the chat template writes per image part
    expansion: Callable[[str, int], str]  # (placeholder, tokens per image) -> the text that replaces it
    image_token: str  # the token the model replaces by image features (config.image_token_id's)
    tokens_per_image: Callable[[ImageProcessorView], int]
    # (view, the row's tokens, the image token's id) -> the row's per-architecture entries (`stack_rows` keys)
    row_extras: Callable[[ImageProcessorView, np.ndarray, int], dict[str, Any]] = lambda view, inputs_S, image_id: {}


def _repeat(placeholder: str, tokens: int) -> str:
    return placeholder * tokens


def _qwen_tokens(view: ImageProcessorView) -> int:
    return int(view.grid.prod()) // view.processor.merge_size ** 2


def _qwen_extras(view: ImageProcessorView, inputs_S: np.ndarray, image_token_id: int) -> dict[str, Any]:
    merge = view.processor.merge_size
    grid_hw = (int(view.grid[1]) // merge, int(view.grid[2]) // merge)
    return {"grid_thw": view.grid.expand(view.max_images, 3),
            "positions_3S": qwen_rope_positions(inputs_S, image_token_id=image_token_id, grid_hw=grid_hw)}


def _llava_tokens(view: ImageProcessorView) -> int:
    """One token per patch, and the class token with the "full" feature strategy."""
    vision = view.config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 + (view.config.vision_feature_select_strategy == "full")


IMAGE_FORMATS: dict[str, ImageFormat] = {
    "qwen2_5_vl": ImageFormat("<|image_pad|>", _repeat, "<|image_pad|>", _qwen_tokens, _qwen_extras),
    "llava": ImageFormat("<image>", _repeat, "<image>", _llava_tokens),
    "gemma3": ImageFormat(
        "<start_of_image>", lambda boi, n: f"\n\n{boi}{'<image_soft_token>' * n}<end_of_image>\n\n",
        "<image_soft_token>", lambda view: int(view.config.mm_tokens_per_image),
        lambda view, inputs_S, image_id: {"token_types_S": (inputs_S == image_id).astype(np.int64)}),
}


def has_processor(directory: str | Path) -> bool:
    """Whether the directory holds an image processor's settings: preprocessor_config.json, or
    processor_config.json with an image_processor entry (as newer processors save it)."""
    directory = Path(directory)
    if (directory / "preprocessor_config.json").is_file():
        return True
    processor = directory / "processor_config.json"
    return processor.is_file() and "image_processor" in json.loads(processor.read_text())



def processor_sides(processor) -> tuple[int, int]:
    """(smallest, largest) side of the square images an image processor takes at their own
    resolution, multiples of its patch x merge size within its min_pixels and max_pixels; (0, 0)
    for a processor with a fixed resolution (model.image_size 0: its own)."""
    size = getattr(processor, "size", None) or {}
    if size.get("height") or (getattr(processor, "crop_size", None) or {}).get("height"):
        return 0, 0
    factor = processor.patch_size * processor.merge_size
    least = getattr(processor, "min_pixels", None) or size.get("shortest_edge") or factor * factor
    most = getattr(processor, "max_pixels", None) or size.get("longest_edge") or least
    return max(1, math.ceil(math.sqrt(least) / factor)) * factor, max(1, math.isqrt(most) // factor) * factor


class ImageProcessorView:
    """A vision-language directory's image side: its config's image facts, its image processor,
    the fixed resolution and the tokens each image becomes."""

    def __init__(self, directory: str | Path, *, max_images: int, image_size: int = 0):
        from transformers import AutoConfig, AutoImageProcessor

        directory = Path(directory)
        if not has_processor(directory):
            raise FileNotFoundError(f"model.hf_config {directory} has no image processor (preprocessor_config.json or "
                                    "processor_config.json): a vision-language model needs its processor's files; copy "
                                    "them from the model's repository")
        if max_images < 1:
            raise ValueError(f"model.max_images = {max_images} must be >= 1 (rows without images leave their slots "
                             "empty; plain text trains with data.format text)")
        self.config = AutoConfig.from_pretrained(str(directory))
        self.model_type = self.config.model_type
        if self.model_type not in IMAGE_FORMATS:
            raise ValueError(f"{directory} is a {self.model_type} model; image-text rows are read for "
                             f"{', '.join(sorted(IMAGE_FORMATS))}")
        self.format = IMAGE_FORMATS[self.model_type]
        self.processor = AutoImageProcessor.from_pretrained(str(directory))
        self.max_images = max_images
        self.side = self._side(image_size)
        example = self.pixels(_blank(self.side))
        self.pixel_shape = tuple(example["pixel_values"].shape)
        self.grid = example.get("grid_thw")
        self.tokens_per_image = self.format.tokens_per_image(self)
        if self.grid is not None and int(self.grid[1]) * self.processor.patch_size != self.side:
            least, most = processor_sides(self.processor)
            raise ValueError(f"model.image_size = {self.side} is outside what the processor of {directory} allows "
                             f"(its min_pixels and max_pixels): choose a side from {least} to {most}")

    def _side(self, image_size: int) -> int:
        size = getattr(self.processor, "size", None) or {}
        fixed = size.get("height") or (getattr(self.processor, "crop_size", None) or {}).get("height")
        factor = getattr(self.processor, "patch_size", 1) * getattr(self.processor, "merge_size", 1)
        self.fixed = bool(fixed)
        if fixed and not image_size:
            return int(fixed)
        if fixed and image_size != fixed:
            raise ValueError(f"model.image_size = {image_size}: this processor resizes every image to {fixed}; "
                             "set model.image_size to 0")
        side = image_size or DEFAULT_DYNAMIC_SIDE
        if side % factor:
            raise ValueError(f"model.image_size = {side} must be a multiple of {factor} (patch size x merge size) for "
                             f"{self.model_type}")
        return side

    def pixels(self, image) -> dict[str, torch.Tensor]:
        """One image (PIL, RGB, any size) at the model's resolution, as the image processor lays it
        out: pixel_values of one slot (and Qwen2.5-VL's patch grid)."""
        from PIL import Image

        if not self.fixed:  # the processor would pick a size per image: ours, with the processor's own filter
            image = image.resize((self.side, self.side), getattr(self.processor, "resample", Image.Resampling.BICUBIC))
        out = self.processor(images=[image], return_tensors="pt")
        pixels = out["pixel_values"].float()
        found = {"pixel_values": pixels if "image_grid_thw" in out else pixels[0]}
        if "image_grid_thw" in out:
            found["grid_thw"] = out["image_grid_thw"][0]
        return found


def _blank(side: int):
    from PIL import Image

    return Image.new("RGB", (side, side))


def image_parts(messages: list[dict]) -> list[dict]:
    return [part for m in messages if isinstance(m.get("content"), list) for part in m["content"]
            if isinstance(part, dict) and part.get("type") == "image"]


def _image_value(part: dict):
    """What an image part holds: a path string, bytes, or neither."""
    value = part.get("path", part.get("image"))
    if isinstance(value, dict):  # a parquet image column: {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path")
    return value


def _image_path(value: str, base: Path | None) -> Path:
    """A path string as read: relative ones against the data file's folder."""
    path = Path(value).expanduser()
    return base / path if base is not None and not path.is_absolute() else path


def read_image(part: dict, *, where: str, base: Path | None = None):
    """The PIL image (RGB) of an image content part; one line naming the row and the file if it
    cannot be read."""
    from PIL import Image, UnidentifiedImageError

    value = _image_value(part)
    try:
        if isinstance(value, (bytes, bytearray)):
            return Image.open(io.BytesIO(value)).convert("RGB")
        if not isinstance(value, str) or not value:
            raise ValueError("no path or image bytes")
        return Image.open(_image_path(value, base)).convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as e:
        what = f"file {value}" if isinstance(value, str) else "its bytes"
        raise ValueError(f"image of chat {where} cannot be read ({what}: {e}); fix or drop the row") from None


def check_image_exists(part: dict, *, where: str, base: Path | None = None) -> None:
    """An image part that names a file: the file exists (one line naming the row and the file if not),
    checked when the rows are read, not when the row is batched hours into a run. Its decoding is
    `read_image`'s, at the batch."""
    value = _image_value(part)
    if not isinstance(value, str) or not value:
        return  # bytes, or nothing: read_image says which at the batch
    path = _image_path(value, base)
    if not path.is_file():
        raise ValueError(f"image of chat {where} cannot be read (file {value}: no such file {str(path)!r}); fix or "
                         "drop the row")


def expand_placeholders(text: str, spans: list[tuple[int, int]], *, placeholder: str,
                        expansion: str) -> tuple[str, list[tuple[int, int]]]:
    """`text` with every `placeholder` replaced by `expansion`, as a processor does before it
    tokenizes, and the character spans moved with it."""
    pieces = text.split(placeholder)
    if len(pieces) == 1:
        return text, spans
    starts = np.cumsum([0] + [len(p) + len(placeholder) for p in pieces[:-1]])  # old start of each piece
    grown = len(expansion) - len(placeholder)

    def moved(position: int) -> int:
        return position + grown * int(np.searchsorted(starts[1:], position, side="right"))

    return expansion.join(pieces), [(moved(a), moved(b - 1) + 1) for a, b in spans]


def qwen_rope_positions(tokens_S: np.ndarray, *, image_token_id: int, grid_hw: tuple[int, int]) -> np.ndarray:
    """Qwen2.5-VL's 3-D rotary positions [3, S] (transformers' get_rope_index for still images):
    text tokens count up on all three axes; an image's tokens (grid_hw after merging) take
    (start, start + row, start + column), and the text after it starts at start + max(h, w)."""
    h, w = grid_hw
    is_image = tokens_S == image_token_id
    positions = np.zeros((3, len(tokens_S)), dtype=np.int64)
    at, i = 0, 0
    while i < len(tokens_S):
        if is_image[i]:
            rows, cols = np.divmod(np.arange(h * w), w)
            positions[:, i:i + h * w] = np.stack([np.full(h * w, at), at + rows, at + cols])
            at += max(h, w)
            i += h * w
        else:
            positions[:, i] = at
            at += 1
            i += 1
    return positions


def image_token_id(renderer, view: ImageProcessorView) -> int:
    """The id of the token the model replaces by image features; one line if the tokenizer lacks it."""
    token = view.format.image_token
    found = renderer.tokenizer.token_id(token)
    if found is None or found != view.config.image_token_id:
        raise ValueError(f"the tokenizer beside model.hf_config has no {token} token with the id of the "
                         f"config's image_token_id {view.config.image_token_id}; use the model's own tokenizer")
    return found


def slotted_image_parts(messages: list[dict], *, view: ImageProcessorView, where: str) -> list[dict]:
    """The conversation's image parts, which must fit the row's image slots."""
    parts = image_parts(messages)
    if len(parts) > view.max_images:
        raise ValueError(f"chat {where} holds {len(parts)} images, more than the {view.max_images} image slots "
                         f"of a row; raise model.max_images to {len(parts)} or split the row")
    return parts


def expand_images(text: str, spans: list[tuple[int, int]], *, images: int, view: ImageProcessorView,
                  where: str) -> tuple[str, list[tuple[int, int]]]:
    """A rendered conversation with each image placeholder its template wrote expanded as the
    processor expands it (`expand_placeholders`), after checking there is one per image."""
    fmt = view.format
    if text.count(fmt.placeholder) != images:
        raise ValueError(f"chat {where}: the chat template wrote {text.count(fmt.placeholder)} image "
                         f"placeholders ({fmt.placeholder}) for {images} images; check the template")
    expansion = fmt.expansion(fmt.placeholder, view.tokens_per_image)
    return expand_placeholders(text, spans, placeholder=fmt.placeholder, expansion=expansion)


def image_slots(parts: list[dict], *, view: ImageProcessorView, where: str,
                base: Path | None = None) -> dict[str, torch.Tensor]:
    """A row's image slots: every part's image read and laid out by the processor, in order, the
    rest zeros and marked empty."""
    pixels = torch.zeros((view.max_images, *view.pixel_shape))
    slots = torch.zeros(view.max_images, dtype=torch.bool)
    for k, part in enumerate(parts):
        pixels[k] = view.pixels(read_image(part, where=where, base=base))["pixel_values"]
        slots[k] = True
    return {"pixel_values": pixels, "slots": slots}


# The architectures whose conversations may share a row (data.pack_images): their per-token
# extras restart per conversation and their attention keeps within it (tests/test_vlm_packing.py).
PACKABLE = ("gemma3", "llava", "qwen2_5_vl")


def check_packable(model_type: str) -> None:
    if model_type not in PACKABLE:
        raise ValueError(f"packing is not supported for {model_type} yet; set data.pack_images = false "
                         f"(packed: {', '.join(PACKABLE)})")


class ImageChatRows:
    """Image-text chat rows, one conversation per row or several packed (a `RowSource` of
    data/mixture.py whose rows are dicts): rendered and tokenized once, their images read when the
    row is batched."""

    def __init__(self, rows: list[dict], *, renderer, view: ImageProcessorView, seq_len: int, val_fraction: float,
                 name: str, wheres: list[str] | None = None, bases: list[Path | None] | None = None,
                 all_val: bool = False, pack: bool = False):
        """`rows` named in errors as `wheres` (default "row i of `name`"); relative image paths are
        read from `bases` (each row's file's folder; default the working directory). `pack`: several
        conversations a row (data.pack_images), their positions restarting at each."""
        from titan_tpu.data.chat import check_messages
        from titan_tpu.data.loader import _num_val_windows

        self.view, self.seq_len = view, seq_len
        self.image_token_id = image_token_id(renderer, view)
        self.encoded, self.num_dropped = [], 0
        for i, row in enumerate(rows):
            where = wheres[i] if wheres else f"row {i + 1} of {name}"  # rows count from 1, as a file's lines
            base = bases[i] if bases else None
            messages = row.get("messages") if isinstance(row, dict) else None
            check_messages(messages, where=where)
            parts = slotted_image_parts(messages, view=view, where=where)
            for part in parts:
                check_image_exists(part, where=where, base=base)
            text, spans = expand_images(*renderer.render(messages), images=len(parts), view=view, where=where)
            ids, trained = renderer.tokens_and_flags(text, spans, where=where)
            if len(ids) > seq_len:
                self.num_dropped += 1
                continue
            self.encoded.append((ids, trained, parts, where, base))
        self.pack = pack
        if pack:
            check_packable(view.model_type)
            self.bounds = pack_bounds([len(e[0]) for e in self.encoded], [len(e[2]) for e in self.encoded],
                                      seq_len=seq_len, max_images=view.max_images)
        else:
            self.bounds = list(range(len(self.encoded) + 1))
        count = len(self.bounds) - 1
        self.num_val = count if all_val else _num_val_windows(count, val_fraction)
        self.num_train = count - self.num_val

    def row(self, index: int) -> dict[str, Any]:
        if self.pack:
            return self._packed_row(index)
        ids, trained, parts, where, base = self.encoded[index]
        S, n = self.seq_len, len(ids)
        inputs = np.zeros(S, dtype=np.int64)  # padding: after the conversation, never trained or attended from it
        labels = np.full(S, IGNORE_INDEX, dtype=np.int64)
        inputs[:n] = ids
        labels[:n - 1] = np.where(trained[1:].astype(bool), ids[1:], IGNORE_INDEX)
        out = {"inputs": inputs, "labels": labels, **image_slots(parts, view=self.view, where=where, base=base)}
        out.update(self.view.format.row_extras(self.view, inputs, self.image_token_id))
        return out

    def _packed_row(self, index: int) -> dict[str, Any]:
        """Conversations [bounds[index], bounds[index+1]) one after another, then padding (a
        document of its own, never trained); each one's positions and per-token extras computed
        on its own tokens, its images in the next slots."""
        S, view = self.seq_len, self.view
        inputs = np.zeros(S, dtype=np.int64)
        labels = np.full(S, IGNORE_INDEX, dtype=np.int64)
        pixels = torch.zeros((view.max_images, *view.pixel_shape))
        slots = torch.zeros(view.max_images, dtype=torch.bool)
        segments, at, k = [], 0, 0
        for ids, trained, parts, where, base in self.encoded[self.bounds[index]:self.bounds[index + 1]]:
            n = len(ids)
            inputs[at:at + n] = ids
            labels[at:at + n - 1] = np.where(trained[1:].astype(bool), ids[1:], IGNORE_INDEX)
            for part in parts:
                pixels[k] = view.pixels(read_image(part, where=where, base=base))["pixel_values"]
                slots[k] = True
                k += 1
            segments.append((at, at + n))
            at += n
        if at < S:
            segments.append((at, S))
        positions = np.zeros(S, dtype=np.int64)
        for a, b in segments:
            positions[a:b] = np.arange(b - a)
        out = {"inputs": inputs, "labels": labels, "positions": positions, "pixel_values": pixels, "slots": slots}
        segment_extras = [view.format.row_extras(view, inputs[a:b], self.image_token_id) for a, b in segments]
        for key, value in segment_extras[0].items():
            # Per-token extras joined segment by segment; the others (Qwen2.5-VL's grids of the row's
            # slots) are the same for every segment.
            per_token = key in PER_TOKEN_EXTRAS
            out[key] = np.concatenate([e[key] for e in segment_extras], axis=-1) if per_token else value
        return out


def qwen_tower_inputs(grid_N3: torch.Tensor, vision_config) -> dict[str, torch.Tensor]:
    """Qwen2.5-VL's vision tower inputs for images of grids `grid_N3`, computed here with
    transformers' own functions, which the tower then takes instead of computing them itself
    (with .tolist() and loops, which graph capture cannot trace)."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

    merge = vision_config.spatial_merge_size
    window_index, cu_window_seqlens = get_vision_window_index(grid_N3, spatial_merge_size=merge,
                                                              window_size=vision_config.window_size,
                                                              patch_size=vision_config.patch_size)
    return {"position_ids": get_vision_position_ids(grid_N3, merge), "cu_seqlens": get_vision_cu_seqlens(grid_N3),
            "window_index": window_index, "cu_window_seqlens": cu_window_seqlens}


def stack_rows(rows: list[dict[str, Any]], view: ImageProcessorView | None = None) -> TokenBatch:
    """Rows of `ImageChatRows` as one batch (`view`: the processor view that made them, for the
    inputs a vision tower takes precomputed)."""
    def stacked(key: str) -> torch.Tensor | None:
        if key not in rows[0]:
            return None
        return torch.stack([torch.as_tensor(r[key]) for r in rows])

    positions, grid = stacked("positions_3S"), stacked("grid_thw")
    tower = None
    if grid is not None and view is not None:
        tower = qwen_tower_inputs(grid.reshape(-1, 3), view.config.vision_config)
    images = ImageInputs(pixel_values=stacked("pixel_values"), slots_BM=stacked("slots"), grid_thw=grid,
                         positions_3BS=None if positions is None else positions.transpose(0, 1).contiguous(),
                         token_types_BS=stacked("token_types_S"), tower_inputs=tower)
    # Packed rows (data.pack_images) carry each token's position in its conversation: the documents.
    return TokenBatch(stacked("inputs"), stacked("labels"), positions_BS=stacked("positions"), images=images)


# The entries of `ImageFormat.row_extras` with one value per token (along their last axis): what a
# left-padded batch of prompts pads.
PER_TOKEN_EXTRAS = ("positions_3S", "token_types_S")


def directory_renderer(directory: str | Path, *, tokenizer, max_images: int, image_size: int,
                       chat_template: str = "") -> tuple[Any, ImageProcessorView]:
    """(chat renderer, image view) of the vision-language model in `directory`: its chat template
    (or `chat_template` as data.chat_template names one) over `tokenizer`, its image processor with
    `max_images` slots at `image_size`. Training rows, prompts and eval rows all render with these."""
    from titan_tpu.data.chat import ChatRenderer, load_chat_template

    view = ImageProcessorView(directory, max_images=max_images, image_size=image_size)
    template, special = load_chat_template(directory, chat_template)
    return ChatRenderer(template, tokenizer, special_tokens=special), view


class ImagePrompts:
    """Prompts with images for generation (titan-tpu generate), rendered as a training row is: the
    directory's chat template, here with its generation prompt (the assistant's turn opened), each
    image placeholder expanded as the processor expands it, and the images in the row's slots. A
    batch of prompts sits left-padded, as transformers' generate pads it; a row's per-token extras
    (Qwen2.5-VL's 3-D positions, Gemma 3's token types) are computed on its own tokens, then padded."""

    def __init__(self, renderer, view: ImageProcessorView):
        self.renderer, self.view = renderer, view
        self.image_token_id = image_token_id(renderer, view)

    @classmethod
    def of_dir(cls, directory: str | Path, *, tokenizer, max_images: int, image_size: int,
               chat_template: str = "") -> ImagePrompts:
        """The prompts of the vision-language model in `directory` (its processor and chat template,
        or `chat_template` as data.chat_template names one)."""
        return cls(*directory_renderer(directory, tokenizer=tokenizer, max_images=max_images, image_size=image_size,
                                       chat_template=chat_template))

    def encode(self, messages: Any, *, where: str, base: Path | None = None) -> tuple[list[int], dict[str, Any]]:
        """(token ids, image slots as `image_slots` gives them) of a conversation to continue; its
        images read now (relative paths from `base`), one-line errors naming `where`."""
        from jinja2.exceptions import TemplateError

        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in messages):
            raise ValueError(f"chat {where} is not a list of {{role, content}} messages")
        parts = slotted_image_parts(messages, view=self.view, where=where)
        try:
            text = self.renderer.text(messages, add_generation_prompt=True)
        except TemplateError as e:
            raise ValueError(f"chat {where}: the chat template failed ({e}); check the row or the template") from None
        text, _ = expand_images(text, [], images=len(parts), view=self.view, where=where)
        images = image_slots(parts, view=self.view, where=where, base=base)
        return self.renderer.tokenizer.encode_with_offsets(text)[0], images

    def batch(self, prompts: list[list[int]], images: list[dict[str, Any] | None]) -> ImageInputs:
        """The `ImageInputs` of prompts left-padded to the longest; a row's `images` as `encode`
        gives them, or None for a prompt without images (its slots empty)."""
        P = max(len(ids) for ids in prompts)
        empty = image_slots([], view=self.view, where="")
        rows = []
        for ids, row_images in zip(prompts, images):
            pad = P - len(ids)
            extras = self.view.format.row_extras(self.view, np.asarray(ids, dtype=np.int64), self.image_token_id)
            for key in PER_TOKEN_EXTRAS:
                if key in extras:
                    extras[key] = np.pad(extras[key], [(0, 0)] * (extras[key].ndim - 1) + [(pad, 0)])
            rows.append({"inputs": np.pad(np.asarray(ids, dtype=np.int64), (pad, 0)),
                         **(empty if row_images is None else row_images), **extras})
        return stack_rows(rows, self.view).images


class ImageChatLoader(MixtureLoader):
    """The mixture loader over `ImageChatRows`: the same choice of rows, the same resumable
    position, its rows stacked into a `TokenBatch` with `ImageInputs`."""

    def _stack(self, rows) -> TokenBatch:
        return stack_rows(rows, self.sources[0].view)

    def example_batch(self) -> TokenBatch:
        """A micro-batch of this loader's shapes (its first row, repeated): what graph mode captures."""
        source = next(s for s in self.sources if s.num_train)
        return self._stack([source.row(0)] * self.batch_size)


def _source_rows(spec, *, renderer, view: ImageProcessorView, seq_len: int, val_fraction: float,
                 all_val: bool = False, pack: bool = False) -> ImageChatRows:
    """One source's rows (every file of it, in order); images relative to their file's folder."""
    return read_image_chat_rows(spec.path, field=spec.field, renderer=renderer, view=view, seq_len=seq_len,
                                val_fraction=val_fraction, all_val=all_val, pack=pack)


def read_image_chat_rows(path: str | Path, *, field: str, renderer, view: ImageProcessorView, seq_len: int,
                         val_fraction: float = 0.0, all_val: bool = False, pack: bool = False) -> ImageChatRows:
    """The chat rows of `path` (a file, a glob or a folder of .jsonl / .parquet files, as
    data.source reads them; `field` the messages' column), in order; images relative to their
    file's folder."""
    from titan_tpu.data.sources import iter_records, resolve_files

    rows, wheres, bases = [], [], []
    for file in resolve_files(path):
        for line, messages in enumerate(iter_records([file], field=field), start=1):
            rows.append({"messages": messages})
            wheres.append(f"{file} row {line}")
            bases.append(file.parent)
    return ImageChatRows(rows, renderer=renderer, view=view, seq_len=seq_len, val_fraction=val_fraction,
                         name=str(path), wheres=wheres, bases=bases, all_val=all_val, pack=pack)


def image_chat_loaders(data_cfg: Any, sources: list, *, model_dir: str | Path, tokenizer, max_images: int,
                       image_size: int, seq_len: int, batch_size: int, seed: int, dp_rank: int, dp_size: int,
                       validation: bool, log: Callable[[str], None] = print):
    """(training loader, validation loader or None) over chat sources for the vision-language model
    of `model_dir`, rendered with its chat template (or data.chat_template) and its image processor;
    several conversations a row with data.pack_images."""
    from dataclasses import replace

    renderer, view = directory_renderer(model_dir, tokenizer=tokenizer, max_images=max_images, image_size=image_size,
                                        chat_template=data_cfg.chat_template)
    pack = data_cfg.pack_images
    if pack:
        check_packable(view.model_type)  # before reading any row
    val_fraction = 0.0 if data_cfg.val_source else data_cfg.val_fraction
    rows = [_source_rows(s, renderer=renderer, view=view, seq_len=seq_len, val_fraction=val_fraction, pack=pack)
            for s in sources]
    for spec, r in zip(sources, rows):
        if r.num_dropped:
            log(f"data: {spec.label}: dropped {r.num_dropped} conversation(s) longer than seq_len {seq_len}")
    log(f"data: image-text rows of {view.model_type}: {max_images} image slot(s) a row (model.max_images), images at "
        f"{view.side} x {view.side}, {view.tokens_per_image} tokens each, "
        + ("conversations packed (data.pack_images)" if pack else "one conversation a row"))
    common = dict(seq_len=seq_len, batch_size=batch_size, seed=seed, dp_rank=dp_rank, dp_world_size=dp_size,
                  document_mask=False)
    train = ImageChatLoader(rows, names=[s.label for s in sources], weights=[s.weight for s in sources],
                            repeat=[s.repeat for s in sources], **common)
    val = train if validation and not data_cfg.val_source else None
    if validation and data_cfg.val_source:
        spec = replace(sources[0], path=data_cfg.val_source, weight=1.0, name="val")
        val_rows = _source_rows(spec, renderer=renderer, view=view, seq_len=seq_len, val_fraction=0.0, all_val=True,
                                pack=pack)
        if val_rows.num_val == 0:
            raise ValueError(f"data.val_source {data_cfg.val_source!r} holds no row of {seq_len} tokens; use more "
                             "validation data or a larger training.seq_len")
        val = ImageChatLoader([val_rows], names=["val"], weights=[1.0], repeat=[True], split="val", **common)
    return train, val
