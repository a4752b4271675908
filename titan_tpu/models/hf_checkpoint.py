"""Read and write Hugging Face checkpoints (config.json + safetensors) without transformers.

Layout written and read (the one `save_pretrained` produces):
  config.json
  model.safetensors                                  (one shard), or
  model-00001-of-0000N.safetensors ... + model.safetensors.index.json   (N > 1 shards)
"""

import dataclasses
import json
import os
import shutil
import struct
import uuid
from pathlib import Path

import torch
from torch import Tensor

from titan_tpu.files import read_json_file, usual_permissions
from titan_tpu.models.common.transformer import Transformer, TransformerArgs
from titan_tpu.models.hf_adapter import (
    from_hf_state_dict,
    hf_config_from_model_args,
    hf_fused_expert_shapes,
    hf_param_shapes,
    model_args_from_hf_config,
    native_param_shapes,
    to_hf_state_dict,
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
    """Read an HF checkpoint directory -> (model name, args, NATIVE state dict).

    Names and shapes are checked against config.json from the safetensors headers before any
    tensor is read, so a wrong checkpoint fails fast with a message naming the tensor.
    Tensors keep their stored dtype; load_model_from_hf casts.
    """
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"HF checkpoint directory {hf_dir} does not exist; check the path")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing; an HF checkpoint needs its config.json")
    name, args = model_args_from_hf_config(read_hf_config_json(config_path))
    if mtp_num_layers:  # DeepSeek-V3's multi-token-prediction layers, model.layers.{num_hidden_layers + k}
        args = dataclasses.replace(args, mtp_num_layers=mtp_num_layers)

    shard_files = _shard_files(hf_dir)
    for shard in shard_files:
        check_safetensors_file(shard)
    expected = hf_param_shapes(args)
    # Experts may be stored one tensor each (the hub layout) or fused (transformers 5.x's layout):
    # both are known names here; from_hf_state_dict unfuses, then checks that every expert is there.
    fused = hf_fused_expert_shapes(args)
    known = {**expected, **fused}
    hf_sd: dict[str, Tensor] = {}
    for shard in shard_files:
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq"):
                    continue  # derived buffer saved by old transformers versions
                if args.mla is not None and _layer_index(key) >= args.n_layers + args.mtp_num_layers:
                    continue  # DeepSeek-V3's multi-token-prediction layers not asked for (or all of them)
                if key not in known:
                    raise ValueError(
                        f"unexpected tensor {key!r} in {shard.name}; it does not belong to the "
                        f"{name} model described by config.json"
                    )
                got = tuple(f.get_slice(key).get_shape())
                if got != known[key]:
                    raise ValueError(
                        f"tensor {key!r} in {shard.name} has shape {list(got)}, expected "
                        f"{list(known[key])} from config.json"
                    )
        # Shapes are fine: now read this shard's tensors.
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                if key in known:
                    hf_sd[key] = f.get_tensor(key)
    fused_layers = {k.rpartition(".mlp.")[0] for k in hf_sd if k in fused}
    needed = [k for k in expected if not (".mlp.experts." in k and k.rpartition(".mlp.")[0] in fused_layers)]
    needed += [k for k in fused if k.rpartition(".mlp.")[0] in fused_layers]  # both fused tensors of a layer
    for key in needed:
        # HF drops lm_head.weight from tied checkpoints; untied ones must have it.
        if key not in hf_sd and not (key == "lm_head.weight" and args.tie_embeddings):
            if _layer_index(key) >= args.n_layers:
                raise ValueError(f"{hf_dir} has no multi-token-prediction weights ({key} is missing): set "
                                 "model.mtp_num_layers to 0, or load a checkpoint that has them")
            raise ValueError(f"tensor {key!r} is missing from the checkpoint in {hf_dir}")
    return name, args, from_hf_state_dict(hf_sd, args)


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
) -> Path:
    """Write a native state dict as an HF checkpoint directory; returns its path.

    Everything is written to a hidden temporary sibling directory which is renamed into place
    at the end, so a crash never leaves a half-written `hf_dir` and never destroys an existing
    one (with overwrite=True the old directory is moved aside first and deleted only after
    the new one is in place).
    """
    from safetensors.torch import save_file

    hf_dir = Path(hf_dir)
    if hf_dir.exists() and not hf_dir.is_dir():
        raise FileExistsError(f"{hf_dir} exists and is not a directory; choose another path")
    if hf_dir.is_dir() and any(hf_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{hf_dir} already exists and is not empty; pass --overwrite or choose another "
            "directory"
        )
    config = hf_config_from_model_args(name, args, torch_dtype=_dtype_name(state_dict))
    # Check shapes by native name (the names the caller knows); to_hf_state_dict then checks
    # for missing and unexpected tensors.
    expected = native_param_shapes(args)
    for key, t in state_dict.items():
        if key in expected and tuple(t.shape) != expected[key]:
            raise ValueError(
                f"tensor {key!r} has shape {list(t.shape)}, expected {list(expected[key])} "
                "from the model args"
            )
    hf_sd = {k: _plain_cpu(v) for k, v in to_hf_state_dict(state_dict, args).items()}
    shards = _split_shards(hf_sd, max_shard_bytes)

    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = hf_dir.parent / f".{hf_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if len(shards) == 1:
            save_file(shards[0], str(tmp / _SINGLE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
            total = sum(t.numel() * t.element_size() for t in hf_sd.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        usual_permissions(tmp)  # safetensors writes 0600 files; an export is for others to read too
        _swap_into_place(tmp, hf_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return hf_dir


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


def _plain_cpu(t: Tensor) -> Tensor:
    """A detached, contiguous CPU tensor that owns its storage exactly (safetensors refuses
    tensors sharing memory, and a view would otherwise drag its whole base along)."""
    t = t.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
        t = t.clone()
    return t


def _split_shards(hf_sd: dict[str, Tensor], max_shard_bytes: int) -> list[dict[str, Tensor]]:
    """Greedy in-order packing; a tensor bigger than the limit gets a shard of its own."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, t in hf_sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    return shards


def _dtype_name(state_dict: dict[str, Tensor]) -> str:
    dtype = next(iter(state_dict.values())).dtype if state_dict else torch.float32
    return str(dtype).removeprefix("torch.")


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
