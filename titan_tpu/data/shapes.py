"""Synthetic image-text rows for the vision-language learning check: pictures of one coloured
shape, and the question of its colour and shape.

Each image is `side` x `side` pixels: one filled shape (`SHAPES`) in one colour (`COLOURS`) at a
random size and place on a plain light background. Its row is a chat row in the training format
(data/images.py)::

    {"messages": [{"role": "user", "content": [{"type": "image", "path": "images/train_00000.png"},
                                               {"type": "text", "text": "What colour and shape is this?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "red circle"}]}]}

so there are len(COLOURS) x len(SHAPES) answers (`ANSWERS`), and a model that ignores the image
is right one time in nine. Both splits cycle through the nine answers (every answer as often as
another in each split) and draw their places and sizes from their own seed, so the held-out images
are never training images. Everything is drawn from `random.Random(seed)`: the same seed writes
the same files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {"red": (215, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 215)}
SHAPES = ("circle", "square", "triangle")
ANSWERS = tuple(f"{colour} {shape}" for colour in COLOURS for shape in SHAPES)
QUESTION = "What colour and shape is this?"
BACKGROUND = (235, 235, 235)


def draw_shape(shape: str, colour: str, *, side: int, rng: random.Random):
    """A PIL image (RGB, side x side) of one filled `shape` in `colour`, between half and 90 % of
    the side across (smaller ones leave a circle and a square a few pixels apart at 32 pixels, and
    take a tiny model several times the steps to tell), wholly inside the image at a random place."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (side, side), BACKGROUND)
    size = rng.randint(round(0.5 * side), round(0.9 * side))
    x, y = rng.randint(0, side - size), rng.randint(0, side - size)
    box = (x, y, x + size - 1, y + size - 1)
    draw, fill = ImageDraw.Draw(image), COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(x + (size - 1) / 2, y), (x, y + size - 1), (x + size - 1, y + size - 1)], fill=fill)
    else:
        raise ValueError(f"shape {shape!r} is not one of {', '.join(SHAPES)}")
    return image


def shape_row(image_path: str, answer: str) -> dict:
    """The chat row of one image (its path as the row names it) and its answer."""
    return {"messages": [{"role": "user", "content": [{"type": "image", "path": image_path},
                                                      {"type": "text", "text": QUESTION}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}


def write_split(directory: Path, name: str, *, rows: int, side: int, seed: int) -> Path:
    """`rows` images under directory/images/ and their chat rows in directory/{name}.jsonl (image
    paths relative to it); the rows' file."""
    rng = random.Random(f"{name}-{seed}")
    (directory / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        answer = ANSWERS[i % len(ANSWERS)]
        colour, shape = answer.split()
        relative = f"images/{name}_{i:05d}.png"
        draw_shape(shape, colour, side=side, rng=rng).save(directory / relative)
        lines.append(json.dumps(shape_row(relative, answer)) + "\n")
    rows_file = directory / f"{name}.jsonl"
    rows_file.write_text("".join(lines))
    return rows_file


def row_answer(row: dict) -> str:
    """The assistant's answer of a shapes row."""
    return row["messages"][-1]["content"][0]["text"]
