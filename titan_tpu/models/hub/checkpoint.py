"""Read and write Hugging Face checkpoints (config.json + safetensors) without transformers.

Layout written and read (the one `save_pretrained` produces):
  config.json
  model.safetensors                                  (one shard), or
  model-00001-of-0000N.safetensors ... + model.safetensors.index.json   (N > 1 shards)
"""

import dataclasses
import json
import math
import os
import shutil
import struct
import uuid
from pathlib import Path

import torch
from torch import Tensor

from titan_tpu.files import read_json_file, usual_permissions
from titan_tpu.models.common.transformer import Transformer, TransformerArgs
from titan_tpu.models.hub.adapter import (
    hf_config_from_model_args,
    hf_fused_expert_shapes,
    hf_param_shapes,
    hf_sources_from_native,
    model_args_from_hf_config,
    native_param_shapes,
    native_sources_from_hf,
)
from titan_tpu.models.hub.sources import (
    BlockDequantized,
    FileTensor,
    InMemory,
    ShardFiles,
    TensorSource,
    full_index,
    row_blocks,
)

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
REDOWNLOAD = "re-download or re-export the model directory"


def check_safetensors_file(path: str | Path) -> None:
    """One ValueError naming ``path`` if it is not a whole safetensors file: a truncated file (an
    interrupted download or copy) or a damaged header. Reads only the header: the format stores an
    8-byte header length, a JSON header giving every tensor's byte range, then the data, so a whole
    file is exactly as long as its header says. (The format has no checksum: a flipped bit inside the
    tensor data cannot be told from a real value.)"""
    path = Path(path)
    size = path.stat().st_size

    def damaged(why: str) -> ValueError:
        return ValueError(f"{path} is damaged ({why}); {REDOWNLOAD}")

    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise damaged(f"{size} bytes, shorter than a safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise damaged(f"its header claims {header_len:,} bytes, the file has {size:,}: truncated")
        try:
            header = json.loads(f.read(header_len).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise damaged(f"the header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise damaged("the header is not a JSON object")
    try:
        data_end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise damaged("a tensor entry of the header has no valid data_offsets") from None
    if 8 + header_len + data_end != size:
        raise damaged(f"{size:,} bytes where its header describes {8 + header_len + data_end:,}"
                      f"{': truncated' if size < 8 + header_len + data_end else ''}")


def read_hf_config_json(path: str | Path) -> dict:
    """A model directory's config.json, with a one-line error when it is damaged."""
    config = read_json_file(path, what="config", fix=REDOWNLOAD)
    if not isinstance(config, dict):
        raise ValueError(f"config {path} is damaged (not a JSON object); {REDOWNLOAD}")
    return config


def load_hf_checkpoint(hf_dir: str | Path, *, mtp_num_layers: int = 0) -> tuple[str, TransformerArgs,
                                                                              dict[str, Tensor]]:
    """Read an HF checkpoint directory -> (model name, args, NATIVE state dict), every tensor whole
    (one process that needs all of them: eval, conversion). A run that shards the model reads only
    its blocks: `hf_native_sources` with models/hub/sources.py `read_block_`.

    Names and shapes are checked against config.json from the safetensors headers before any
    tensor is read, so a wrong checkpoint fails fast with a message naming the tensor. Tensors
    keep their stored dtype (fp8 block-scaled weights come dequantised, float32); load_model_from_hf casts.
    """
    name, args, sources = hf_native_sources(hf_dir, mtp_num_layers=mtp_num_layers)
    return name, args, {key: source.read(full_index(source.shape)) for key, source in sources.items()}


def hf_native_sources(hf_dir: str | Path, *, mtp_num_layers: int = 0) -> tuple[str, TransformerArgs,
                                                                                dict[str, TensorSource]]:
    """(model name, args, native name -> its lazy source) of an HF checkpoint directory: every
    name and shape checked from the safetensors headers and config.json, nothing read yet
    (models/hub/sources.py). Experts may be stored one tensor each (the hub layout) or fused
    (transformers 5.x's); fp8 weights with per-block `weight_scale_inv` (DeepSeek-V3's release, its
    config's `quantization_config`) are dequantised as they are read."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"HF checkpoint directory {hf_dir} does not exist; check the path")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing; an HF checkpoint needs its config.json")
    config = read_hf_config_json(config_path)
    name, args = model_args_from_hf_config(config)
    if mtp_num_layers:  # DeepSeek-V3's multi-token-prediction layers, model.layers.{num_hidden_layers + k}
        args = dataclasses.replace(args, mtp_num_layers=mtp_num_layers)
    stored = _stored_tensors(hf_dir)
    files = ShardFiles()
    sources = _dequantized_sources(stored, files, config, hf_dir)
    expected = hf_param_shapes(args)
    fused = hf_fused_expert_shapes(args)
    known = {**expected, **fused}
    for key in list(sources):
        path, shape = stored[key][:2] if key in stored else (None, sources[key].shape)
        if key.endswith("rotary_emb.inv_freq"):
            del sources[key]  # derived buffer saved by old transformers versions
            continue
        if args.mla is not None and _layer_index(key) >= args.n_layers + args.mtp_num_layers:
            del sources[key]  # DeepSeek-V3's multi-token-prediction layers not asked for (or all of them)
            continue
        where = path.name if path is not None else hf_dir.name
        if key not in known:
            raise ValueError(f"unexpected tensor {key!r} in {where}; it does not belong to the {name} model described "
                             "by config.json")
        if tuple(shape) != known[key]:
            raise ValueError(f"tensor {key!r} in {where} has shape {list(shape)}, expected {list(known[key])} from "
                             "config.json")
    fused_layers = {k.rpartition(".mlp.")[0] for k in sources if k in fused}
    needed = [k for k in expected if not (".mlp.experts." in k and k.rpartition(".mlp.")[0] in fused_layers)]
    needed += [k for k in fused if k.rpartition(".mlp.")[0] in fused_layers]  # both fused tensors of a layer
    for key in needed:
        # HF drops lm_head.weight from tied checkpoints; untied ones must have it.
        if key not in sources and not (key == "lm_head.weight" and args.tie_embeddings):
            if _layer_index(key) >= args.n_layers:
                raise ValueError(f"{hf_dir} has no multi-token-prediction weights ({key} is missing): set "
                                 "model.mtp_num_layers to 0, or load a checkpoint that has them")
            raise ValueError(f"tensor {key!r} is missing from the checkpoint in {hf_dir}")
    return name, args, native_sources_from_hf(sources, args)


def _stored_tensors(hf_dir: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """Every tensor of the checkpoint's files: (file, shape, safetensors dtype), from the headers."""
    from safetensors import safe_open

    stored = {}
    for shard in _shard_files(hf_dir):
        check_safetensors_file(shard)
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                view = f.get_slice(key)
                stored[key] = (shard, tuple(view.get_shape()), view.get_dtype())
    return stored


_SCALE = "_scale_inv"  # DeepSeek-V3's fp8 release: `<weight name>_scale_inv`, one float per block


def _dequantized_sources(stored: dict, files: ShardFiles, config: dict, hf_dir: Path) -> dict[str, TensorSource]:
    """HF name -> source: each stored tensor as it is, but an fp8 weight and its `weight_scale_inv`
    as one dequantised weight (the block size from config.json's quantization_config)."""
    sources: dict[str, TensorSource] = {key: FileTensor(files, path, key, shape) for key, (path, shape, _) in
                                        stored.items() if not key.endswith(_SCALE)}
    scaled = [key[: -len(_SCALE)] for key in stored if key.endswith(_SCALE)]
    float8 = [key for key, (_, _, dtype) in stored.items() if dtype.startswith("F8")]
    if not scaled and not float8:
        return sources
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") != "fp8" or len(quantization.get("weight_block_size") or ()) != 2:
        raise ValueError(f"{hf_dir} holds fp8 weights with per-block scales, but its config.json has no fp8 "
                         "quantization_config with a weight_block_size; re-download the model directory")
    block = tuple(int(b) for b in quantization["weight_block_size"])
    for key in float8:
        if key not in scaled:
            raise ValueError(f"fp8 tensor {key!r} in {stored[key][0].name} has no {key + _SCALE}: it cannot be "
                             f"dequantised; {REDOWNLOAD}")
    for key in scaled:
        if key not in sources:
            raise ValueError(f"{key + _SCALE} in {stored[key + _SCALE][0].name} scales no tensor; {REDOWNLOAD}")
        weight, scale = sources[key], FileTensor(files, *stored[key + _SCALE][:1], key + _SCALE,
                                                 stored[key + _SCALE][1])
        blocks = tuple(math.ceil(n / b) for n, b in zip(weight.shape, block))
        if len(weight.shape) != 2 or tuple(scale.shape) != blocks:
            raise ValueError(f"{key + _SCALE} has shape {list(scale.shape)}, expected {list(blocks)} for a weight of "
                             f"{list(weight.shape)} in blocks of {list(block)}; {REDOWNLOAD}")
        sources[key] = BlockDequantized(weight, scale, block)
    return sources


def _layer_index(key: str) -> int:
    """i of an HF name model.layers.{i}.*; -1 for the others."""
    if not key.startswith("model.layers."):
        return -1
    index = key[len("model.layers."):].split(".", 1)[0]
    return int(index) if index.isdigit() else -1


def _shard_files(hf_dir: Path) -> list[Path]:
    index_path = hf_dir / _INDEX
    if index_path.is_file():
        index = read_json_file(index_path, what="index", fix=REDOWNLOAD)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"index {index_path} is damaged (no weight_map object); {REDOWNLOAD}")
        weight_map = index["weight_map"]
        files = [hf_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(
                    f"shard {f.name} named in {_INDEX} is missing from {hf_dir}; "
                    "re-download or re-save the checkpoint"
                )
        return files
    single = hf_dir / _SINGLE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{hf_dir} has neither {_SINGLE} nor {_INDEX}")


def save_hf_checkpoint(
    hf_dir: str | Path,
    *,
    name: str,
    args: TransformerArgs,
    state_dict: dict[str, Tensor],
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a native state dict (in memory) as an HF checkpoint directory, in `dtype` (default its
    own); returns its path. `save_hf_sources` says how."""
    if dtype is None:
        dtype = next(iter(state_dict.values())).dtype if state_dict else torch.float32
    return save_hf_sources(hf_dir, name=name, args=args, sources={k: InMemory(v) for k, v in state_dict.items()},
                           dtype=dtype, max_shard_bytes=max_shard_bytes, overwrite=overwrite)


def save_hf_sources(hf_dir: str | Path, *, name: str, args: TransformerArgs, sources: dict[str, TensorSource],
                    dtype: torch.dtype, max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> Path:
    """Write native weights, each a source read when its turn comes (models/hub/sources.py), as an HF
    checkpoint directory in `dtype`: safetensors shards of at most `max_shard_bytes` (one per
    tensor larger than that) with an index, as the Hub shards them; returns its path. One tensor is
    in memory at a time: each shard's header is written first from the shapes, then the tensors'
    bytes one after another.

    Everything is written to a hidden temporary sibling directory which is renamed into place
    at the end, so a crash never leaves a half-written `hf_dir` and never destroys an existing
    one (with overwrite=True the old directory is moved aside first and deleted only after
    the new one is in place).
    """
    hf_dir = Path(hf_dir)
    if hf_dir.exists() and not hf_dir.is_dir():
        raise FileExistsError(f"{hf_dir} exists and is not a directory; choose another path")
    if hf_dir.is_dir() and any(hf_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{hf_dir} already exists and is not empty; pass --overwrite or choose another "
            "directory"
        )
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    config = hf_config_from_model_args(name, args, torch_dtype=str(dtype).removeprefix("torch."))
    # Check shapes by native name (the names the caller knows); hf_sources_from_native then checks
    # for missing and unexpected tensors.
    expected = native_param_shapes(args)
    for key, source in sources.items():
        if key in expected and tuple(source.shape) != expected[key]:
            raise ValueError(
                f"tensor {key!r} has shape {list(source.shape)}, expected {list(expected[key])} "
                "from the model args"
            )
    hf = hf_sources_from_native(sources, args)
    shards = _split_shards([(key, tuple(source.shape)) for key, source in hf.items()], dtype, max_shard_bytes)

    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = hf_dir.parent / f".{hf_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if len(shards) == 1:
            _write_safetensors(tmp / _SINGLE, [(key, hf[key]) for key in shards[0]], dtype)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _write_safetensors(tmp / fname, [(key, hf[key]) for key in shard], dtype)
                weight_map.update({k: fname for k in shard})
            total = sum(math.prod(source.shape) * dtype.itemsize for source in hf.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        usual_permissions(tmp)  # an export is for others to read too
        _swap_into_place(tmp, hf_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return hf_dir


# safetensors' names of the dtypes an export writes
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def _write_safetensors(path: Path, tensors: list[tuple[str, TensorSource]], dtype: torch.dtype) -> None:
    """A safetensors file of `tensors` in `dtype`, written in one pass with one tensor in memory at a
    time: the header (every tensor's dtype, shape and byte range, laid end to end in this order)
    from the shapes, then each tensor's bytes (little-endian, as this machine stores them)."""
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"an export in {dtype} is not supported; use float32, bfloat16 or float16")
    header, start = {}, 0
    for key, source in tensors:
        size = math.prod(source.shape) * dtype.itemsize
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(source.shape),
                       "data_offsets": [start, start + size]}
        start += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, source in tensors:
            for index in row_blocks(source.shape):
                block = source.read(index).to(dtype).contiguous()
                f.write(block.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def _swap_into_place(tmp: Path, hf_dir: Path) -> None:
    if not hf_dir.exists():
        os.rename(tmp, hf_dir)
        return
    # Existing directory (empty, or overwrite=True): move it aside, rename, then delete it.
    old = hf_dir.parent / f".{hf_dir.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(hf_dir, old)
    try:
        os.rename(tmp, hf_dir)
    except BaseException:
        os.rename(old, hf_dir)  # put the original back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _split_shards(tensors: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                  max_shard_bytes: int) -> list[list[str]]:
    """Greedy in-order packing of tensor names; a tensor bigger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def load_model_from_hf(
    hf_dir: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[str, TransformerArgs, Transformer]:
    """Build the native model for an HF checkpoint and load its weights (no random init)."""
    name, args, sd = load_hf_checkpoint(hf_dir)
    with torch.device("meta"):
        model = Transformer(args)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    model.load_state_dict(sd, strict=True, assign=True)
    model.init_buffers(device)  # the RoPE table is not in the checkpoint
    return name, args, model
