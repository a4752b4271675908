"""What `titan-tpu verify` checks: a model spec resolved to one working Hugging Face directory with
weights, and the backend that runs it.

Every spec becomes a directory that transformers' own from_pretrained reads, so the reference side
of every check is unmodified transformers:

* a native name/flavor (``llama3/debug``, ``qwen3_moe/30b_a3b``): the flavor's seeded init, written
  with our HF export; the native backend runs it;
* an HF directory with weights: that directory; the native backend where the native adapter reads
  its config (Llama, Qwen3, Qwen3-MoE without unsupported features), the Transformers backend
  otherwise;
* an HF directory without weights (config.json only), or an HF model type with overrides: the
  config, built by transformers with seed 0 and saved with save_pretrained.

A vision-language directory (Qwen2.5-VL, Gemma 3, LLaVA: models/hf/vision.py) runs on the
Transformers backend with its images; it must hold its image processor's files, which the checks'
image rows are laid out by (`Subject.image_view`).

``tiny`` shrinks the config first (one layer of each kind, hidden 64, vocabulary 512, as hf-sweep
does), so a 70B config verifies on a CPU; weights that do not fit the shrunk config are replaced by
a seeded init, and the subject says so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import torch

from titan_tpu.models.common.transformer import TransformerArgs
from titan_tpu.models.spec import spec_for_hf_dir
from titan_tpu.models.spec_base import ModelSpec


@dataclasses.dataclass
class Subject:
    spec: str  # as the user gave it
    model: ModelSpec  # what runs it: native where the adapter reads hf_dir, else the Transformers backend
    hf_dir: Path  # the working directory: config.json + safetensors, read by transformers
    weights: str  # where the weights came from (the user's, or a seeded init)
    native_name: str | None = None  # llama3 | qwen3 | qwen3_moe for the native backend
    real_args: TransformerArgs | None = None  # the real-size native args (the planner's input)
    real_config: dict | None = None  # the real-size HF config (before --tiny)
    notes: list[str] = dataclasses.field(default_factory=list)
    real_hf_config: str | None = None  # what --model.hf_config names for the real size (the planner's input)
    overrides: dict = dataclasses.field(default_factory=dict)  # the user's config changes (--overrides)

    @property
    def config(self) -> dict:
        return json.loads((self.hf_dir / "config.json").read_text())

    @property
    def backend(self) -> str:
        """How the report names what runs it: native | hf."""
        return self.model.kind

    def native_args(self) -> TransformerArgs:
        assert self.model.kind == "native", self.model.label
        return self.model.args

    def hf_args(self):
        assert self.model.kind == "hf", self.model.label
        return self.model.args

    @property
    def vision(self) -> bool:
        """A vision-language model: its checks run on rows with an image in their slot."""
        return self.model.image_model_dir() is not None

    def image_view(self):
        """The image side of a vision-language subject (data/images.py `ImageProcessorView`, one
        image slot a row), or None for a text-only one."""
        return _image_view(str(self.hf_dir)) if self.vision else None


def image_sides(directory: str | Path) -> tuple[int, int]:
    """(smallest, largest) side of the images a vision-language directory's processor takes; (0, 0)
    for a processor with a fixed resolution (model.image_size 0: its own)."""
    from transformers import AutoImageProcessor

    from titan_tpu.data.images import processor_sides

    return processor_sides(AutoImageProcessor.from_pretrained(str(directory)))


# The smallest images the processor takes: a few image tokens a row, so a check's rows stay short.
@functools.cache
def _image_view(hf_dir: str):
    from titan_tpu.data.images import ImageProcessorView

    return ImageProcessorView(hf_dir, max_images=1, image_size=image_sides(hf_dir)[0])


def check_image_processor(directory: Path, config) -> None:
    """A vision-language directory holds its image processor's settings, or a one-line error naming
    the file."""
    from titan_tpu.data.images import has_processor
    from titan_tpu.models.hf.vision import is_vision_language

    if is_vision_language(config) and not has_processor(directory):
        raise FileNotFoundError(f"{directory} is a {config.model_type} vision-language model without its image "
                                "processor (preprocessor_config.json, or processor_config.json with an image_processor)"
                                "; copy the processor's files from the model's repository")


def tiny_native_args(args: TransformerArgs) -> TransformerArgs:
    """A native config shrunk as hf-sweep shrinks HF ones: its features (RoPE scaling, QK norm, tied
    embeddings, MoE routing) kept, sizes cut."""
    tiny = dataclasses.replace(args, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               head_dim=16 if args.head_dim else None, vocab_size=512, ffn_hidden_dim=128,
                               max_seq_len=min(args.max_seq_len, 16384))  # RoPE scaling's original length fits
    if args.moe is not None:
        tiny.moe = dataclasses.replace(args.moe, num_experts=4, top_k=2, hidden_dim=64,
                                       mlp_only_layers=[], decoder_sparse_step=1)
    return tiny


# A seeded init (std ~0.02) gives a tiny model near-uniform attention, under which a conversion bug
# such as one permuted key projection moves the logits by ~1e-3 (KL ~4e-8: under the PASS band).
# Seeded weights are scaled by this factor so attention and logits are as peaked as a trained
# model's; both sides of every comparison read the same scaled weights.
SHARPEN = 4.0


def _seeded_hf_dir(config, out: Path) -> None:
    from titan_tpu.models.hf.config import auto_model_class
    from titan_tpu.models.hf.vision import is_vision_language

    torch.manual_seed(0)
    model = auto_model_class(config).from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.mul_(SHARPEN)
        if is_vision_language(config):  # a projector that starts at zero (Gemma 3's) would hide the images
            for param in model.parameters():
                if param.ndim >= 2 and not param.any():
                    param.normal_(0, 0.02 * SHARPEN)
    model.save_pretrained(str(out))


# --tiny of a vision-language model: hf-sweep shrinks its text config; its vision tower is shrunk
# here (two layers, hidden 32 or less, 28-pixel images in 7-pixel patches where the processor has a
# fixed resolution; Qwen2.5-VL keeps its 14-pixel patches, merged 2 x 2, and takes 56-pixel images),
# and its image processor is fitted to the shrunk tower (`_write_image_processor`).
TINY_VISION = {
    "qwen2_5_vl": {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "window_size": 56,
                   "fullatt_block_indexes": [1]},
    "gemma3": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
               "image_size": 28, "patch_size": 7},
    "llava": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 7, "projection_dim": 16},
}
TINY_IMAGE_TOKENS = {"gemma3": {"mm_tokens_per_image": 4}}  # Gemma 3 pools the 4 x 4 patches to 2 x 2
# The image processor of a model type given without a directory (its defaults, fitted to the config).
IMAGE_PROCESSORS = {"qwen2_5_vl": "Qwen2VLImageProcessor", "gemma3": "Gemma3ImageProcessor",
                    "llava": "CLIPImageProcessor"}


def _tiny_vision_overrides(config) -> dict:
    """What makes a vision-language config's vision side tiny (`TINY_VISION`), its image token ids
    distinct inside the tiny vocabulary (hf-sweep moves every id past it to 1), and Qwen2.5-VL's
    3-D rotary sections as wide as the tiny heads."""
    from titan_tpu.models.hf.config import text_config
    from titan_tpu.tools.hf_sweep import TINY_SIZES, VOCAB

    model_type = config.model_type
    out = {"vision_config": {**config.vision_config.to_dict(), **TINY_VISION[model_type]},
           **TINY_IMAGE_TOKENS.get(model_type, {})}
    ids = [k for k, v in config.to_dict().items()
           if isinstance(v, int) and (k.endswith("_token_id") or k.endswith("_token_index")) and v >= VOCAB]
    out.update({key: VOCAB - 1 - i for i, key in enumerate(ids)})
    if model_type == "qwen2_5_vl":
        out["vision_config"]["out_hidden_size"] = TINY_SIZES["hidden_size"]  # the merger's output: the text width
        rope = dict(text_config(config).rope_parameters or {})
        section = rope.get("mrope_section", [16, 24, 24])  # the model's own default where the config has none
        half = TINY_SIZES["head_dim"] // 2  # the sections split half of a tiny head's dimensions
        cut = [max(1, s * half // sum(section)) for s in section]
        cut[-1] += half - sum(cut)
        out["rope_parameters"] = {**rope, "mrope_section": cut}
    return out


def _write_image_processor(source: Path | None, config, out: Path) -> None:
    """The image processor of `source` (or the model type's defaults) fitted to `config`'s vision
    tower (a fixed resolution of its image_size; its patch and merge sizes), saved into `out`."""
    import tempfile

    from transformers import AutoImageProcessor

    if source is None:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "preprocessor_config.json").write_text(json.dumps(
                {"image_processor_type": IMAGE_PROCESSORS[config.model_type]}))
            processor = AutoImageProcessor.from_pretrained(tmp)
    else:
        processor = AutoImageProcessor.from_pretrained(str(source))
    vision = config.vision_config
    side = getattr(vision, "image_size", None)
    if side and (getattr(processor, "size", None) or {}).get("height"):
        processor.size = {"height": side, "width": side}
    if side and getattr(processor, "crop_size", None):
        processor.size, processor.crop_size = {"shortest_edge": side}, {"height": side, "width": side}
    for ours, theirs in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                         ("temporal_patch_size", "temporal_patch_size")):
        if hasattr(processor, ours) and hasattr(vision, theirs):
            setattr(processor, ours, getattr(vision, theirs))
    processor.save_pretrained(str(out))


def _seeded_native(args: TransformerArgs) -> dict[str, torch.Tensor]:
    from titan_tpu.models.registry import build_model

    return {k: v * SHARPEN if v.ndim >= 2 else v for k, v in build_model(args, seed=0).state_dict().items()}


# transformers' default configs of these types do not run as they are: Qwen2.5-VL's merger writes
# 3584-wide features into an 8192-wide text model; Gemma 3's 224-pixel, 16-pixel-patch tower has 14 x
# 14 patches to pool into 16 x 16 tokens. Fixed as the published models have them.
DEFAULT_CONFIG_FIXES = {
    "qwen2_5_vl": {"out_hidden_size": lambda config: config.text_config.hidden_size},
    "gemma3": {"image_size": 896, "patch_size": 14},  # Gemma 3 4B's tower: 64 x 64 patches pooled to 16 x 16
}


def _vision_type_dir(model_type: str, out: Path) -> Path:
    """A directory of `model_type`'s default config and image processor (`IMAGE_PROCESSORS`)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    for key, value in DEFAULT_CONFIG_FIXES.get(model_type, {}).items():
        setattr(config.vision_config, key, value(config) if callable(value) else value)
    config.save_pretrained(str(out))
    _write_image_processor(None, config, out)
    return out


def _tiny_hf_config(spec: str, overrides: dict, base_config=None):
    """`spec` (a directory or a type) with hf-sweep's tiny sizes, then the user's overrides."""
    from titan_tpu.models.hf.config import load_hf_config
    from titan_tpu.models.hf.vision import is_vision_language
    from titan_tpu.tools.hf_sweep import tiny_overrides

    config = base_config or load_hf_config(spec, overrides)
    tiny = tiny_overrides(config.model_type, config)
    if is_vision_language(config):
        tiny.update(_tiny_vision_overrides(config))
    return load_hf_config(spec, {**tiny, **overrides})


def resolve(spec: str, *, work_dir: Path, tiny: bool, overrides: dict | None = None) -> Subject:
    """`spec` -> a Subject whose hf_dir lies under `work_dir` (or is the user's directory)."""
    from titan_tpu.evaluation.loss import native_hf_dir
    from titan_tpu.models.hf.config import causal_lm_types, load_hf_config
    from titan_tpu.models.hf.vision import is_vision_language
    from titan_tpu.models.hf.weights import has_weights
    from titan_tpu.models.hub.adapter import model_args_from_hf_config
    from titan_tpu.models.hub.checkpoint import save_hf_checkpoint
    from titan_tpu.models.registry import MODEL_FLAVORS, get_model_args

    overrides = dict(overrides or {})
    path = Path(spec).expanduser()
    work_dir.mkdir(parents=True, exist_ok=True)
    name, _, flavor = spec.partition("/")
    if not path.exists() and spec.removeprefix("hf:") in TINY_VISION:
        # a vision-language type: its default config and image processor, verified as a directory of them
        real_dir = _vision_type_dir(spec.removeprefix("hf:"), work_dir / "real")
        subject = resolve(str(real_dir), work_dir=work_dir, tiny=tiny, overrides=overrides)
        return dataclasses.replace(subject, spec=spec, weights=f"seeded init (seed 0) x {SHARPEN:g}")
    if not path.exists() and flavor and name in MODEL_FLAVORS:
        real = get_model_args(name, flavor)
        args = tiny_native_args(real) if tiny else real
        out = work_dir / "model"
        save_hf_checkpoint(out, name=name, args=args, state_dict=_seeded_native(args), overwrite=True)
        return Subject(spec, spec_for_hf_dir(out), out, f"seeded init (seed 0) x {SHARPEN:g}", name, real)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; verify takes a Hugging Face model directory, a native "
                                    "name/flavor (llama3/8B) or a transformers model type (llama)")
        real_config = json.loads((path / "config.json").read_text())
        check_image_processor(path, load_hf_config(str(path)))  # one-line errors: not a causal LM, an invalid config
        native = native_hf_dir(path)
        real = model_args_from_hf_config(real_config)[1] if native else None
        real_source = {"real_hf_config": str(path), "overrides": overrides}
        if has_weights(path) and not tiny and not overrides:
            return Subject(spec, spec_for_hf_dir(path), path, f"the directory's own ({path})",
                           model_args_from_hf_config(real_config)[0] if native else None, real, real_config,
                           **real_source)
        config = _tiny_hf_config(str(path), overrides) if tiny else load_hf_config(str(path), overrides)
        weights = f"seeded init (seed 0) x {SHARPEN:g}: " + ("the directory has no weights" if not has_weights(path)
                                              else "its weights do not fit the shrunk config")
    elif spec in causal_lm_types() or spec.startswith("hf:"):
        spec_type = spec.removeprefix("hf:")
        config = _tiny_hf_config(spec_type, overrides) if tiny else load_hf_config(spec_type, overrides)
        real_config, real, weights = None, None, f"seeded init (seed 0) x {SHARPEN:g}"
        real_source = {"real_hf_config": spec_type, "overrides": overrides}
    else:
        load_hf_config(spec)  # raises with close names
        raise AssertionError("unreachable")
    out = work_dir / "model"
    _seeded_hf_dir(config, out)
    if is_vision_language(config):
        _write_image_processor(path, config, out)
    model = spec_for_hf_dir(out)
    name = model.name if model.kind == "native" else None
    return Subject(spec, model, out, weights, name, real, real_config, **real_source)
