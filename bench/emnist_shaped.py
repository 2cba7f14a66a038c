"""An EMNIST-shaped federated image set with a learnable signal, generated offline, for runs
that need FEMNIST's shape and a non-trivial error where FEMNIST itself is not prepared
(docs/results/precision.md's EMNIST-shaped row). It is not FEMNIST and its errors say
nothing about FEMNIST's.

Each of 10 classes is a fixed template: a few smooth strokes (line segments inked with a
Gaussian profile) drawn from the seed. A client is a writer with a style: a shift, a stroke
width, a contrast, a background level and a pixel-noise level; a fraction of the writers
(``--strong``, 20% by default) have a strong style (larger shift, thicker or thinner strokes,
more noise, lower contrast), so that clients far from the population exist, as the papers'
tail metrics need. An example is its class template in its writer's style, jittered by up to
one pixel, with pixel noise. Client sizes are FEMNIST-like (bench/common.py's
``femnist_like_sizes``, median 179, 101 to 447) times ``--size_scale``.

Output: one .npz in ``--dataset=npz``'s format (deltafl_jax/datasets/npz.py): train_x / test_x
[N, 28, 28] uint8 (ink bright on a dark background), train_y / test_y [N] int32 labels 0..9,
train_client / test_client [N] int32 writer ids (test writers are others than the training
ones), and x_scale = 1/255. Deterministic from ``--seed``::

    python -m bench.emnist_shaped --out=/tmp/emnist_shaped.npz
    python -m experiments.run --flagfile=experiments/emnist_cpu.flags --dataset=npz \\
        --data_path=/tmp/emnist_shaped.npz
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from bench.common import femnist_like_sizes

SIDE, NUM_CLASSES, STROKES = 28, 10, 3


def templates(rng: np.random.Generator) -> np.ndarray:
    """[C, S, 2, 2] stroke end points (row, col) of each class, inside the 28x28 square's
    central 6..22 box."""
    return rng.uniform(6.0, 22.0, size=(NUM_CLASSES, STROKES, 2, 2))


def render(strokes: np.ndarray, width: float) -> np.ndarray:
    """[28, 28] ink in [0, 1] of one template's strokes [S, 2, 2], a Gaussian profile of
    standard deviation `width` pixels around each segment (the strokes' maximum)."""
    grid = np.stack(np.meshgrid(np.arange(SIDE), np.arange(SIDE), indexing="ij"), -1)  # [28,28,2]
    ink = np.zeros((SIDE, SIDE))
    for a, b in strokes:
        ab = b - a
        t = np.clip(((grid - a) @ ab) / max(float(ab @ ab), 1e-9), 0.0, 1.0)  # [28, 28]
        d2 = np.sum((grid - (a + t[..., None] * ab)) ** 2, -1)  # [28, 28]
        ink = np.maximum(ink, np.exp(-d2 / (2.0 * width ** 2)))
    return ink


def writer_style(rng: np.random.Generator, strong: bool) -> dict:
    """One writer's style; a strong one is far from the population."""
    if strong:
        return dict(shift=rng.integers(-4, 5, size=2), width=rng.choice([0.6, 2.2]),
                    contrast=rng.uniform(0.35, 0.6), background=rng.uniform(0.1, 0.25),
                    noise=rng.uniform(0.3, 0.45))
    return dict(shift=rng.integers(-1, 2, size=2), width=rng.uniform(1.0, 1.4),
                contrast=rng.uniform(0.8, 1.0), background=rng.uniform(0.0, 0.05),
                noise=rng.uniform(0.15, 0.25))


def writer_examples(rng: np.random.Generator, strokes: np.ndarray, size: int,
                    strong: bool) -> tuple[np.ndarray, np.ndarray]:
    """`size` examples of one writer: ([size, 28, 28] uint8, [size] int32 labels)."""
    style = writer_style(rng, strong)
    inks = np.stack([render(s, style["width"]) for s in strokes])  # [C, 28, 28]
    y = rng.integers(0, NUM_CLASSES, size=size).astype(np.int32)
    x = np.empty((size, SIDE, SIDE))
    for i, label in enumerate(y):
        dr, dc = style["shift"] + rng.integers(-1, 2, size=2)
        x[i] = np.roll(inks[label], (int(dr), int(dc)), axis=(0, 1))
    x = style["background"] + style["contrast"] * x + rng.normal(0.0, style["noise"], x.shape)
    return np.round(255.0 * np.clip(x, 0.0, 1.0)).astype(np.uint8), y


def split(rng: np.random.Generator, strokes: np.ndarray, num_clients: int, size_seed: int,
          size_scale: float, strong_frac: float) -> dict:
    """One split's arrays (x, y, client) and which writers are strong."""
    sizes = np.maximum(1, np.round(femnist_like_sizes(num_clients, size_seed) * size_scale))
    strong = np.zeros(num_clients, bool)
    strong[rng.permutation(num_clients)[:int(round(strong_frac * num_clients))]] = True
    xs, ys = zip(*(writer_examples(rng, strokes, int(n), bool(s))
                   for n, s in zip(sizes, strong)))
    client = np.repeat(np.arange(num_clients, dtype=np.int32), sizes.astype(int))
    return dict(x=np.concatenate(xs), y=np.concatenate(ys), client=client, strong=strong)


def generate(seed: int = 0, train_clients: int = 40, test_clients: int = 40,
             size_scale: float = 0.5, strong_frac: float = 0.2) -> dict:
    """The .npz's arrays (and `train_strong` / `test_strong`, [K] bool, the strong writers)."""
    rng = np.random.default_rng(seed)
    strokes = templates(rng)
    out = {}
    for name, k, size_seed in (("train", train_clients, seed), ("test", test_clients, seed + 1)):
        part = split(rng, strokes, k, size_seed, size_scale, strong_frac)
        out.update({f"{name}_{key}": value for key, value in part.items()})
    out["x_scale"] = np.float32(1.0 / 255.0)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the .npz to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train_clients", type=int, default=40)
    p.add_argument("--test_clients", type=int, default=40)
    p.add_argument("--size_scale", type=float, default=0.5,
                   help="client sizes are FEMNIST-like sizes times this")
    p.add_argument("--strong", type=float, default=0.2,
                   help="fraction of writers with a strong style")
    a = p.parse_args(argv)
    if a.train_clients < 1 or a.test_clients < 1 or a.size_scale <= 0 or not 0 <= a.strong <= 1:
        p.error("--train_clients/--test_clients must be >= 1, --size_scale > 0, "
                "--strong in [0, 1]")
    arrays = generate(a.seed, a.train_clients, a.test_clients, a.size_scale, a.strong)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    np.savez_compressed(a.out, **arrays)
    info = {"out": a.out, "train_examples": int(len(arrays["train_y"])),
            "test_examples": int(len(arrays["test_y"])),
            "strong_train": int(arrays["train_strong"].sum()),
            "strong_test": int(arrays["test_strong"].sum())}
    print(json.dumps(info))
    return info


if __name__ == "__main__":
    main()
