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
another in each split) and draw their places and sizes from their own seed; a held-out picture is
never one the training rows hold (the same answer, size and place would be the same pixels).
Everything is drawn from `random.Random` seeded by the split's name and `seed`: the same seed
writes the same files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Collection
from pathlib import Path

COLOURS = {"red": (215, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 215)}
SHAPES = ("circle", "square", "triangle")
ANSWERS = tuple(f"{colour} {shape}" for colour in COLOURS for shape in SHAPES)
QUESTION = "What colour and shape is this?"
BACKGROUND = (235, 235, 235)
Picture = tuple[str, int, int, int]  # (answer, size, x, y): what an image shows, pixel for pixel


def place_shape(rng: random.Random, *, side: int) -> tuple[int, int, int]:
    """(size, x, y) of a shape between half and 90 % of the side across (smaller ones leave a circle
    and a square a few pixels apart at 32 pixels, and take a tiny model several times the steps to
    tell), wholly inside the image at a random place."""
    size = rng.randint(round(0.5 * side), round(0.9 * side))
    return size, rng.randint(0, side - size), rng.randint(0, side - size)


def draw_shape(shape: str, colour: str, *, side: int, place: tuple[int, int, int]):
    """A PIL image (RGB, side x side) of one filled `shape` in `colour` at `place` (size, x, y)."""
    from PIL import Image, ImageDraw

    size, x, y = place
    image = Image.new("RGB", (side, side), BACKGROUND)
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


def write_split(directory: Path, name: str, *, rows: int, side: int, seed: int,
                avoid: Collection[Picture] = ()) -> set[Picture]:
    """`rows` images under directory/images/ and their chat rows in directory/{name}.jsonl (image
    paths relative to it), none of them one of the pictures in `avoid` (a held-out split avoids the
    training split's); the pictures drawn."""
    rng = random.Random(f"{name}-{seed}")
    (directory / "images").mkdir(parents=True, exist_ok=True)
    lines, drawn = [], set()
    for i in range(rows):
        answer = ANSWERS[i % len(ANSWERS)]
        picture = _new_picture(answer, rng=rng, side=side, avoid=avoid)
        colour, shape = answer.split()
        relative = f"images/{name}_{i:05d}.png"
        draw_shape(shape, colour, side=side, place=picture[1:]).save(directory / relative)
        lines.append(json.dumps(shape_row(relative, answer)) + "\n")
        drawn.add(picture)
    (directory / f"{name}.jsonl").write_text("".join(lines))
    return drawn


def _new_picture(answer: str, *, rng: random.Random, side: int, avoid: Collection[Picture]) -> Picture:
    for _ in range(1000):
        picture = (answer, *place_shape(rng, side=side))
        if picture not in avoid:
            return picture
    raise ValueError(f"the training rows hold nearly every {side}-pixel picture of a {answer}: no held-out one is "
                     "left; write fewer --train-rows")


def row_answer(row: dict) -> str:
    """The assistant's answer of a shapes row."""
    return row["messages"][-1]["content"][0]["text"]
