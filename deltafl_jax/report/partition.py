"""The report's clients x classes heat map of a partitioned run (``--partition``: the run's
``partition.npz``, :mod:`deltafl_jax.datasets.partition`), the figure federated papers show of
a label-skewed split.

The numbers are the run's own: ``train_label_histogram`` and ``test_label_histogram`` [K, C]
of partition.npz, client k's examples of class c, counted from the source labels at the
client's indices when the run partitioned its data (after the client limits). One panel per
split (the training clients, then the test devices), a column per client in the order the
partitioner made them, a row per class, the colour the class's share of the client's examples
(each column sums to 1, so the skew reads the same whatever the clients' sizes; the counts are
in partition.npz).
The runs of a setting that share one partition are drawn once: the figure is the first run's
of the setting that holds one, and its title names that run and the partitioner's settings.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.report.figures import figure_title, new_figure
from deltafl_jax.report.tables import Column

SPLIT_TITLES = {"train": "training clients", "test": "test devices"}


def _histograms(path: str) -> Optional[Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]]:
    from deltafl_jax.outputs.directory import RunFormatError, RunReader
    try:
        arrays = RunReader(path).partition()
    except RunFormatError:
        return None
    if arrays is None:
        return None
    hists = {split: np.asarray(arrays[f"{split}_label_histogram"], np.int64)
             for split in SPLIT_TITLES if f"{split}_label_histogram" in arrays}
    return (hists, arrays) if hists else None


def partition_data(cols: Sequence[Column]):
    """(run name, {split: [K, C] label histogram}, partition.npz's arrays) of the first run of
    the columns whose partition.npz holds label histograms, or None."""
    seen = set()
    for col in cols:
        for run, _ in col.parts:
            if run.path in seen:
                continue
            seen.add(run.path)
            got = _histograms(run.path)
            if got is not None:
                return (run.name, *got)
    return None


def partition_title(name: str, arrays: Dict[str, np.ndarray]) -> str:
    """'RUN: dirichlet, alpha = 0.1, 100 clients, seed 0' from partition.npz's settings."""
    def setting(key):
        value = arrays.get(f"setting_{key}")
        return None if value is None else value.item()

    method = setting("method")
    parts = [str(method)] if method is not None else []
    if method in ("dirichlet", "inner_dirichlet") and setting("alpha") is not None:
        parts.append(f"α = {float(setting('alpha')):g}")
    if method == "shards" and setting("shards_per_client") is not None:
        parts.append(f"{int(setting('shards_per_client'))} shards per client")
    if method == "pathological" and setting("classes_per_client") is not None:
        parts.append(f"{int(setting('classes_per_client'))} classes per client")
    if setting("seed") is not None:
        parts.append(f"seed {int(setting('seed'))}")
    return f"{name}: " + ", ".join(parts)


def class_shares(hist: np.ndarray) -> np.ndarray:
    """[K, C] each client's examples per class over its examples (0 for a client without any)."""
    hist = np.asarray(hist, np.float64)
    return hist / np.maximum(hist.sum(axis=1, keepdims=True), 1.0)


def partition_figure(cols: Sequence[Column]):
    """The clients x classes heat map of the setting's partition (module docstring), or None
    when none of its runs partitioned labelled data."""
    got = partition_data(cols)
    if got is None:
        return None
    name, hists, arrays = got
    classes = max(h.shape[1] for h in hists.values())
    height = min(2.0 + 0.18 * classes, 9.0)
    fig, axes = new_figure(1, len(hists), 5.5 * len(hists), height)
    for ax, (split, hist) in zip(axes[0], hists.items()):
        image = ax.imshow(class_shares(hist).T, aspect="auto", vmin=0.0, vmax=1.0, origin="lower", interpolation="nearest",
                          cmap="viridis", extent=(-0.5, hist.shape[0] - 0.5,
                                                  -0.5, hist.shape[1] - 0.5))
        ax.set_title(f"{SPLIT_TITLES[split]} ({hist.shape[0]})", fontsize=9)
        ax.set_xlabel("client")
        ax.set_ylabel("class")
        fig.colorbar(image, ax=ax, label="share of the client's examples")
    figure_title(fig, partition_title(name, arrays), fontsize=10)
    return fig


__all__ = ["class_shares", "partition_data", "partition_figure", "partition_title"]
