"""Hugging Face weights read block by block: each rank reads only the slices of the tensors it
holds (models/hub/sources.py), and gets exactly what a whole-tensor load would have given it;
DeepSeek-V3's fp8 block-scaled checkpoints are dequantised on the way in as transformers does;
the streaming export writes what the in-memory one did."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_tpu.components.program import build_model as build_run_model
from titan_tpu.components.resolve import resolve
from titan_tpu.components.world import Place, fake_world
from titan_tpu.config import build_config
from titan_tpu.models.hub.checkpoint import hf_native_sources, load_hf_checkpoint, save_hf_checkpoint
from titan_tpu.models.hub.sources import full_index
from titan_tpu.models.registry import build_model
from titan_tpu.models.spec import model_spec
from titan_tpu.run.resolved import Target
from titan_tpu.run.setup import RunSetup

CONFIGS = "configs"


def _spec(config: str, overrides: list[str] = ()):
    cfg = build_config(f"{CONFIGS}/{config}", ["--training.device", "cpu", *overrides])
    return cfg, model_spec(cfg.model)


def _hf_dir(tmp_path, config: str, *, max_shard_bytes: int = 200_000):
    """An HF directory of the config's model with seeded random weights, in several shard files."""
    _, spec = _spec(config)
    model = build_model(spec.args, seed=3)
    out = save_hf_checkpoint(tmp_path / config.removesuffix(".toml"), name=spec.name, args=spec.args,
                             state_dict=model.state_dict(), max_shard_bytes=max_shard_bytes)
    return out, model.state_dict()


def _random_block(shape: tuple[int, ...], rng: random.Random) -> tuple[slice, ...]:
    index = []
    for n in shape:
        start = rng.randrange(n)
        index.append(slice(start, rng.randrange(start + 1, n + 1)))
    return tuple(index)


@pytest.mark.parametrize("config", ["llama3_debug.toml", "qwen3_debug.toml", "qwen3_moe_debug.toml"])
def test_every_block_read_equals_that_block_of_the_whole_tensor(tmp_path, config):
    hf_dir, state = _hf_dir(tmp_path, config)
    _, _, sources = hf_native_sources(hf_dir)
    assert sources.keys() == state.keys()
    rng = random.Random(0)
    for key, source in sources.items():
        whole = source.read(full_index(source.shape))
        assert torch.equal(whole, state[key]), key  # the native layout: RoPE rows, stacked experts
        for _ in range(4):  # blocks straddling heads, experts and shard files
            index = _random_block(source.shape, rng)
            assert torch.equal(source.read(index), whole[index]), (key, index)


def test_fused_experts_of_transformers_5_read_by_block(tmp_path):
    """transformers 5.x holds a MoE layer's experts fused (gate_up_proj, down_proj), and some
    checkpoints store them so: blocks of the native per-projection stacks come out of those."""
    transformers = pytest.importorskip("transformers")
    from tests.test_moe import random_hf_model, tiny_args

    args = tiny_args()
    hf = random_hf_model(args)
    hf.save_pretrained(tmp_path / "fused")  # its config.json; the weights as the module holds them:
    stored = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in stored), "transformers no longer fuses experts"
    for file in (tmp_path / "fused").glob("*.safetensors"):
        file.unlink()
    save_file(stored, tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"})
    _, _, sources = hf_native_sources(tmp_path / "fused")
    _, _, whole = load_hf_checkpoint(tmp_path / "fused")
    rng = random.Random(1)
    for key, source in sources.items():
        for _ in range(4):
            index = _random_block(source.shape, rng)
            assert torch.equal(source.read(index), whole[key][index]), (key, index)
    assert transformers is not None and len(list((tmp_path / "fused").glob("*.safetensors"))) == 1


def _rank_loads(cfg, hf_dir, world: int) -> list[dict[str, torch.Tensor]]:
    """Each rank of a fake `world`-rank run builds the sharded model and loads the HF directory:
    its local blocks, per parameter."""
    run = resolve(RunSetup.resolved(cfg), Target(world_size=world))  # fp32 on the CPU, as the run's assembly
    out = []
    for rank in range(world):
        with fake_world(world, rank):
            model = build_run_model(run, Place.of(run, rank=rank, device=torch.device("cpu")))
            run.spec.load_hf_weights(model, hf_dir)
            out.append({k: _local_with_placements(v) for k, v in model.state_dict().items()})
    return out


def _local_with_placements(t):
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to_local().clone(), t.device_mesh, t.placements
    return t.clone(), None, None


@pytest.mark.parametrize("config,overrides", [
    ("llama3_debug.toml", ["--parallelism.dp_shard", "4"]),
    ("llama3_debug.toml", ["--parallelism.dp_shard", "2", "--parallelism.tp", "2"]),
    ("llama3_debug.toml", ["--parallelism.dp_shard", "2", "--parallelism.tp", "2", "--model.scan_layers", "true"]),
    ("qwen3_moe_debug.toml", ["--parallelism.dp_shard", "4", "--parallelism.ep", "2"]),
], ids=["dp_shard4", "dp2_tp2", "dp2_tp2_scanned", "moe_dp4_ep2"])
def test_each_rank_loads_exactly_its_block_of_a_whole_tensor_load(tmp_path, config, overrides):
    """Rank r's block of every weight equals torch's own sharding (distribute_tensor) of the tensor
    loaded whole by one process: bitwise, whatever the placements (FSDP, tp, both on one dim, ep)."""
    from torch.distributed.tensor import distribute_tensor

    cfg, _ = _spec(config, overrides)
    hf_dir, _ = _hf_dir(tmp_path, config)
    _, _, whole = load_hf_checkpoint(hf_dir)  # one process, every tensor read whole
    world = 4
    per_rank = _rank_loads(cfg, hf_dir, world)
    for rank, loaded in enumerate(per_rank):
        with fake_world(world, rank):
            for key, (local, mesh, placements) in loaded.items():
                if mesh is None:
                    assert torch.equal(local, whole[key]), key
                    continue
                expected = distribute_tensor(whole[key], mesh, placements, src_data_rank=None).to_local()
                assert torch.equal(local, expected), (rank, key, placements)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3's fp8 release layout: e4m3 weights, one float32 `weight_scale_inv` per block
# ---------------------------------------------------------------------------------------------

# The release's blocks are 128 x 128; tiny dimensions need a smaller one. Every dimension of the
# tiny model is a multiple of 8, as transformers' dequantisation requires (it reads the block size
# off the scale grid); the release's 576-row wkv_a is not a multiple of 128: its last block is
# partial, which the next test covers.
FP8_BLOCK = (8, 8)


def _quantize_blockwise(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> (e4m3 weight, float32 scale per block) as DeepSeek's release stores them: each block
    scaled so its largest magnitude is e4m3's largest finite value, 448."""
    rows, cols = w.shape
    b0, b1 = block
    grid = (math.ceil(rows / b0), math.ceil(cols / b1))
    padded = torch.zeros(grid[0] * b0, grid[1] * b1)
    padded[:rows, :cols] = w.float()
    blocks = padded.reshape(grid[0], b0, grid[1], b1)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    quantized = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return quantized.to(torch.float8_e4m3fn), scale


def _fp8_checkpoint(src, dst) -> int:
    """The HF directory `src` with every 2-D weight of the layers' linear layers (not the router,
    the norms, the embedding or the output projection, as in the release) stored block-scaled in
    e4m3, and config.json's quantization_config the release's. Returns how many were quantized."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK)}
    (dst / "config.json").write_text(json.dumps(config))
    tensors = {}
    for file in src.glob("*.safetensors"):
        tensors.update(load_file(file))
    quantized = 0
    out = {}
    for key, t in tensors.items():
        router = key.endswith("mlp.gate.weight")
        if key.startswith("model.layers.") and t.ndim == 2 and "norm" not in key and not router:
            out[key], out[key + "_scale_inv"] = _quantize_blockwise(t, FP8_BLOCK)
            quantized += 1
        else:
            out[key] = t.to(torch.bfloat16)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return quantized


def test_deepseek_v3_fp8_checkpoint_loads_with_transformers_dequantised_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.test_deepseek_v3 import random_hf_model, tiny_args
    from titan_tpu.models.hub.checkpoint import load_model_from_hf

    args = tiny_args()
    random_hf_model(args).save_pretrained(tmp_path / "bf16")
    assert _fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8") > 10

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", dtype=torch.float32, attn_implementation="sdpa",
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=FP8_BLOCK)).eval()
    assert not any(p.dtype == torch.float8_e4m3fn for p in reference.parameters())  # it dequantised
    name, _, model = load_model_from_hf(tmp_path / "fp8")
    assert name == "deepseek_v3"
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(input_ids=tokens).logits
        got = model(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # And not merely close to the bf16 original: the fp8 rounding is in both.
    original = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32,
                                                                 attn_implementation="sdpa").eval()
    with torch.no_grad():
        assert (original(input_ids=tokens).logits - want).abs().max() > 1e-3


def test_partial_last_blocks_dequantise_as_deepseeks_reference_does():
    """A weight whose dimensions are not multiples of the block (the release's wkv_a: 576 rows in
    128-row blocks): every value times the scale of the block it lies in, and any block read alone."""
    from titan_tpu.models.hub.sources import BlockDequantized, InMemory

    w = torch.randn(20, 13, generator=torch.Generator().manual_seed(0))
    quantized, scale = _quantize_blockwise(w, (8, 8))
    assert scale.shape == (3, 2)
    expected = torch.empty(20, 13)
    for i in range(20):
        for j in range(13):
            expected[i, j] = quantized[i, j].float() * scale[i // 8, j // 8]
    source = BlockDequantized(InMemory(quantized), InMemory(scale), (8, 8))
    assert torch.equal(source.read(full_index((20, 13))), expected)
    assert torch.equal(source.read((slice(7, 17), slice(5, 13))), expected[7:17, 5:13])
    torch.testing.assert_close(expected, w, rtol=0.07, atol=0)  # e4m3 keeps 3 mantissa bits


def test_fp8_without_its_scales_or_quantization_config_is_one_line(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_deepseek_v3 import random_hf_model, tiny_args

    random_hf_model(tiny_args()).save_pretrained(tmp_path / "bf16")
    _fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no fp8 quantization_config with a weight_block_size"):
        hf_native_sources(tmp_path / "fp8")

    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    scale = next(k for k in tensors if k.endswith("_scale_inv"))
    del tensors[scale]
    save_file(tensors, tmp_path / "fp8" / "model.safetensors")
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(FP8_BLOCK)}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"has no .*_scale_inv: it cannot be dequantised"):
        hf_native_sources(tmp_path / "fp8")


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_export_writes_the_dtype_asked_in_indexed_shards_safetensors_reads(tmp_path, dtype):
    """The header-first writer (one tensor in memory at a time): files safetensors reads, in the
    dtype asked, an index naming every tensor's shard, the weights back exactly (rounded once)."""
    _, spec = _spec("qwen3_moe_debug.toml")
    model = build_model(spec.args, seed=1)
    out = save_hf_checkpoint(tmp_path / "out", name=spec.name, args=spec.args, state_dict=model.state_dict(),
                             dtype=dtype, max_shard_bytes=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    written = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(out / file)
        assert all(index["weight_map"][k] == file for k in tensors)
        written.update(tensors)
    assert written.keys() == index["weight_map"].keys() and len(set(index["weight_map"].values())) > 2
    assert {t.dtype for t in written.values()} == {dtype}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix("torch.")
    _, _, back = load_hf_checkpoint(out)
    for key, value in model.state_dict().items():
        assert torch.equal(back[key], value.to(dtype)), key


def test_checkpoint_blocks_read_through_dcp_equal_the_whole_tensors(tmp_path):
    """The export's reads of a training checkpoint (train/checkpoint_sources.py): any block, read
    alone or through the cache of whole tensors, equals that block of the tensor loaded whole."""
    from titan_tpu.models.hub.sources import InMemory, MergedLoRA
    from titan_tpu.train.checkpoint import Checkpointer, load_full_state_dict
    from titan_tpu.train.checkpoint_sources import CheckpointTensors

    _, spec = _spec("qwen3_moe_debug.toml")
    state = build_model(spec.args, seed=2).state_dict()
    step_dir = Checkpointer(tmp_path / "ckpt").save(1, {"step": 1, "model": state})
    whole = load_full_state_dict(step_dir)
    rng = random.Random(2)
    for cache_bytes in (0, 2**30):  # every read from the files; whole tensors cached for partial reads
        checkpoint = CheckpointTensors(step_dir, cache_bytes=cache_bytes)
        sources = checkpoint.sources()
        assert sources.keys() == whole.keys()
        for key, source in sources.items():
            assert source.shape == tuple(whole[key].shape) and source.dtype == whole[key].dtype
            assert torch.equal(source.read(full_index(source.shape)), whole[key]), key
            for _ in range(3):
                index = _random_block(source.shape, rng)
                assert torch.equal(source.read(index), whole[key][index]), (key, index)

    # A LoRA pair folded in block by block: W + B @ A * scaling, as merge_lora_state_dict does it.
    w, a, b = torch.randn(12, 10), torch.randn(3, 10), torch.randn(12, 3)
    merged = MergedLoRA(InMemory(w), InMemory(a), InMemory(b), scaling=0.5)
    torch.testing.assert_close(merged.read((slice(2, 9), slice(4, 10))), (w + b @ a * 0.5)[2:9, 4:10],
                               rtol=1e-6, atol=1e-6)


def test_import_streams_each_tensor_into_the_checkpoint_and_the_export_gives_the_files_back(tmp_path):
    """convert --hf-dir --to-checkpoint writes what a whole-dict save wrote (DCP plans from meta
    placeholders, each tensor read when written), fp8 dequantised; --to-hf gives it back."""
    pytest.importorskip("transformers")
    from tests.test_deepseek_v3 import random_hf_model, tiny_args
    from titan_tpu.convert import checkpoint_to_hf, hf_to_checkpoint
    from titan_tpu.train.checkpoint import load_full_state_dict, read_checkpoint_meta

    random_hf_model(tiny_args()).save_pretrained(tmp_path / "bf16")
    _fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8")
    _, _, dequantised = load_hf_checkpoint(tmp_path / "fp8")
    step_dir = hf_to_checkpoint(tmp_path / "fp8", tmp_path / "ckpt")
    assert read_checkpoint_meta(step_dir)["model_name"] == "deepseek_v3"
    saved = load_full_state_dict(step_dir)
    assert saved.keys() == dequantised.keys()
    for key, value in dequantised.items():
        assert saved[key].dtype == value.dtype and torch.equal(saved[key], value), key
    assert {saved[k].dtype for k in saved} == {torch.float32, torch.bfloat16}  # dequantised ones, stored ones

    out = checkpoint_to_hf(step_dir, tmp_path / "export", dtype=torch.float32)
    _, _, exported = load_hf_checkpoint(out)
    for key, value in dequantised.items():
        assert torch.equal(exported[key], value.float()), key
