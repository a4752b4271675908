"""The vision-language learning check (docs/vision_language.md, "Learning check"): a tiny random
LLaVA learns to name the colour and shape of a synthetic picture (data/shapes.py).

    python -m titan_tpu.tools.shapes_demo write               # rows, images, model dir: outputs/shapes_demo
    titan-tpu train --config configs/vlm_shapes_demo.toml     # reads them, writes outputs/vlm_shapes_demo
    python -m titan_tpu.tools.shapes_demo score outputs/vlm_shapes_demo

`write` lays out a demo directory (default outputs/shapes_demo):

    data/train.jsonl, heldout.jsonl   chat rows (data/shapes.py), their images under data/images/
    model/                            config.json (LLaVA: a CLIP vision tower and a Llama, both tiny),
                                      tokenizer.json, chat template, image processor; no weights:
                                      training starts from training.seed's init

`score` scores the run's checkpoints on the held-out rows as multiple choice: the model's summed
log-likelihood of each of the nine answers (the assistant's tokens and its end of turn, as
training counts them), the answer with the highest one taken. Chance is 1/9. It prints a line per
checkpoint and writes eval/shapes/accuracy rows into the run's metrics.jsonl, so that
`titan-tpu report` plots them with the benchmark scores.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from titan_tpu.data.batch import IGNORE_INDEX
from titan_tpu.data.shapes import ANSWERS, QUESTION, row_answer, shape_row, write_split

# LLaVA-1.5's turn format: an image part is the <image> token, which its processor repeats.
LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '</s>' }}{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT: ' }}{% endif %}"
)
SPECIALS = ("<unk>", "<s>", "</s>", "<image>", "<pad>")
IMAGE_SIDE, PATCH = 32, 8  # 4 x 4 patches: 16 image tokens
SEQ_LEN = 40  # a row: 16 image tokens, the question and an answer (35 tokens)
VOCAB = 384  # the 256 bytes, the specials and whole words of the demo
METRIC = "eval/shapes/accuracy"
DEFAULT_DIR = Path("outputs/shapes_demo")  # what configs/vlm_shapes_demo.toml reads


def _train_tokenizer(directory: Path) -> dict[str, int]:
    """A byte-level BPE over the demo's words, `SPECIALS` first, saved as tokenizer.json."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([QUESTION, "USER: ", "ASSISTANT: ", *ANSWERS] * 8, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    return {s: tok.token_to_id(s) for s in SPECIALS}


def write_model_dir(directory: Path) -> Path:
    """A tiny LLaVA directory without weights: a 2-layer CLIP tower on 32-pixel images in 8-pixel
    patches (16 tokens an image, its last layer's features), a 2-layer Llama, the processor."""
    from transformers import LlavaConfig, LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    directory.mkdir(parents=True, exist_ok=True)
    ids = _train_tokenizer(directory)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>", unk_token="<unk>", model_max_length=256,
                                        extra_special_tokens={"image_token": "<image>"})
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIDE},
                                            crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=LLAVA_TEMPLATE,
                               patch_size=PATCH, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1)
    processor.save_pretrained(str(directory))
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=128, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                         pad_token_id=ids["<pad>"]),
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIDE, patch_size=PATCH,
                           projection_dim=64),
        image_token_index=ids["<image>"], vision_feature_layer=-1, vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    config.save_pretrained(str(directory))
    return directory


def write_demo(directory: Path, *, train_rows: int, heldout_rows: int, seed: int) -> None:
    directory = Path(directory)
    trained = write_split(directory / "data", "train", rows=train_rows, side=IMAGE_SIDE, seed=seed)
    write_split(directory / "data", "heldout", rows=heldout_rows, side=IMAGE_SIDE, seed=seed, avoid=trained)
    write_model_dir(directory / "model")


@dataclass(frozen=True)
class Score:
    """Held-out accuracy of one set of weights: the answer right, its colour right, its shape right."""

    accuracy: float
    colour: float
    shape: float

    def metrics(self) -> dict[str, float]:
        return {METRIC: self.accuracy, "eval/shapes/colour_accuracy": self.colour,
                "eval/shapes/shape_accuracy": self.shape}


def answer_rows(rows: list[dict]) -> list[dict]:
    """Each row once per answer of `ANSWERS`, in their order: the candidates multiple choice scores."""
    return [shape_row(row["messages"][0]["content"][0]["path"], answer) for row in rows for answer in ANSWERS]


@torch.no_grad()
def score(model: torch.nn.Module, rows: list[dict], *, model_dir: Path, base: Path, seq_len: int = SEQ_LEN,
          batch_size: int = 90) -> Score:
    """`model`'s multiple-choice accuracy on shapes `rows` (image paths relative to `base`): for each
    row the answer of `ANSWERS` whose tokens (rendered with the model directory's chat template, as
    training renders them, in rows of `seq_len`) have the highest summed log-likelihood."""
    from titan_tpu.data.chat import ChatRenderer, load_chat_template
    from titan_tpu.data.images import ImageChatRows, ImageProcessorView, stack_rows
    from titan_tpu.data.tokenizer import load_tokenizer

    template, special = load_chat_template(model_dir)
    renderer = ChatRenderer(template, load_tokenizer(model_dir / "tokenizer.json"), special_tokens=special)
    candidates = answer_rows(rows)
    source = ImageChatRows(candidates, renderer=renderer, view=ImageProcessorView(model_dir, max_images=1),
                           seq_len=seq_len, val_fraction=0.0, name="held-out answers",
                           bases=[base] * len(candidates))
    if source.num_dropped:
        raise ValueError(f"{source.num_dropped} held-out answers are longer than training.seq_len {seq_len} tokens; "
                         "score rows that shapes_demo write made")
    model.eval()
    losses = []
    for start in range(0, len(candidates), batch_size):
        batch = stack_rows([source.row(i) for i in range(start, min(start + batch_size, len(candidates)))])
        logits_BSV = model(batch.inputs_BS, images=batch.images)
        losses.append(F.cross_entropy(logits_BSV.transpose(1, 2).float(), batch.labels_BS, ignore_index=IGNORE_INDEX,
                                      reduction="none").sum(dim=1))
    chosen = torch.cat(losses).view(len(rows), len(ANSWERS)).argmin(dim=1).tolist()
    picked = [ANSWERS[i].split() for i in chosen]
    truth = [row_answer(row).split() for row in rows]
    n = len(rows)
    return Score(accuracy=sum(p == t for p, t in zip(picked, truth)) / n,
                 colour=sum(p[0] == t[0] for p, t in zip(picked, truth)) / n,
                 shape=sum(p[1] == t[1] for p, t in zip(picked, truth)) / n)


def _read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def score_run(run_dir: Path, *, rows_file: Path | None = None, log=print) -> dict[int, Score]:
    """Every complete checkpoint of the run (and step 0: its initial weights, training.seed's init)
    scored on the held-out rows (default: the run's data.val_source); the scores replace earlier
    ones in the run's metrics.jsonl."""
    from titan_tpu.config import Config
    from titan_tpu.evaluation.loss import load_eval_model
    from titan_tpu.train.checkpoint import Checkpointer

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} has no config.json; pass the output_dir of a titan-tpu train run")
    run_config = json.loads((run_dir / "config.json").read_text())
    rows_file = Path(rows_file or run_config["data"]["val_source"])
    if not rows_file.is_file():
        raise FileNotFoundError(f"held-out rows {rows_file} not found; pass --rows HELDOUT_JSONL")
    rows = _read_rows(rows_file)
    model_dir = Path(run_config["model"]["hf_config"])
    cfg = Config()
    cfg.model.name, cfg.model.hf_config, cfg.training.seed = "hf", str(model_dir), run_config["training"]["seed"]
    weights = {0: None, **{int(p.name.split("-")[1]): p for p in Checkpointer(run_dir / "checkpoints")
                           .complete_checkpoints()}}
    scores = {}
    for step, checkpoint in sorted(weights.items()):
        loaded = load_eval_model(cfg, checkpoint=checkpoint, device=torch.device("cpu"))
        scores[step] = score(loaded.model, rows, model_dir=model_dir, base=rows_file.parent,
                             seq_len=run_config["training"]["seq_len"])
        s = scores[step]
        log(f"step {step:>5}: held-out accuracy {s.accuracy:.3f} (colour {s.colour:.3f}, shape {s.shape:.3f}; "
            f"chance {1 / len(ANSWERS):.3f}) on {len(rows)} rows")
    _write_scores(run_dir / "metrics.jsonl", scores)
    return scores


def _write_scores(metrics_file: Path, scores: dict[int, Score]) -> None:
    """The scores as eval/shapes/* rows of metrics.jsonl, in place of any written before."""
    lines = metrics_file.read_text().splitlines() if metrics_file.is_file() else []
    kept = [line for line in lines if METRIC not in _row(line)]
    kept += [json.dumps({"step": step, **s.metrics()}) for step, s in sorted(scores.items())]
    metrics_file.write_text("".join(line + "\n" for line in kept))


def _row(line: str) -> dict:
    try:
        row = json.loads(line)
    except ValueError:  # a torn last line of a killed run: kept as it is
        return {}
    return row if isinstance(row, dict) else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_tpu.tools.shapes_demo", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="the demo's rows, images and model directory")
    write.add_argument("directory", type=Path, nargs="?", default=DEFAULT_DIR,
                       help=f"where (default {DEFAULT_DIR}, where the recipe reads it)")
    write.add_argument("--train-rows", type=int, default=1800)
    write.add_argument("--heldout-rows", type=int, default=180)
    write.add_argument("--seed", type=int, default=0)
    scoring = commands.add_parser("score", help="held-out accuracy of a run's checkpoints, into its metrics.jsonl")
    scoring.add_argument("run_dir", type=Path)
    scoring.add_argument("--rows", type=Path, help="held-out rows (default: the run's data.val_source)")
    args = parser.parse_args(argv)
    try:
        if args.command == "write":
            write_demo(args.directory, train_rows=args.train_rows, heldout_rows=args.heldout_rows, seed=args.seed)
            print(f"wrote {args.directory}/data ({args.train_rows} training rows, {args.heldout_rows} held out) and "
                  f"{args.directory}/model")
        else:
            score_run(args.run_dir, rows_file=args.rows)
    except (ValueError, FileNotFoundError) as e:  # a user's mistake: one line, as titan-tpu's commands say it
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
