"""The report's clients x classes heat map of a partitioned run: partition.npz holds each
client's examples per class, counted here again with NumPy from the source file's labels at the
client's indices; the report draws each client's class shares from them (one panel per split,
clients along x, classes along y) and names the partitioner's settings; a run that partitioned nothing has no
such figure."""

import os

import numpy as np
import pytest

from deltafl_jax import DataConfig, load_dataset, report
from deltafl_jax.datasets import partition as P
from deltafl_jax.outputs.directory import RunWriter
from tests.test_figures import fake_run
from tests.test_partition import centralised_npz


def counts(labels, rows):
    """[K, C]: for each client's index list, its examples per class (C = 10 here)."""
    return np.stack([np.bincount(labels[r], minlength=10) for r in rows])


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory):
    """A fabricated run folder with the partition.npz of a Dir(0.3) split of a small file over
    12 clients (8 training clients kept by --max_train_clients, each cut to 60 examples)."""
    root = tmp_path_factory.mktemp("partitioned")
    path = str(root / "c.npz")
    _, y, _, yt = centralised_npz(path, n=1200, n_test=600)
    data = load_dataset(DataConfig("npz", data_path=path, partition="dirichlet",
                                   dirichlet_alpha=0.3, num_clients=12, partition_seed=3,
                                   max_train_clients=8, max_examples_per_client=60))
    run = fake_run(root / "runs" / "delta", "deltafl", None, (1.0, 0.5))
    RunWriter(run).write_partition(data)
    return run, y, yt


def test_partition_npz_counts_each_clients_classes(partitioned):
    run, y, yt = partitioned
    with np.load(os.path.join(run, "partition.npz")) as z:
        arrays = {k: z[k] for k in z.files}
    train, test = P.client_lists(arrays, "train"), P.client_lists(arrays, "test")
    assert len(train) == 8 and len(test) == 12 and max(r.size for r in train) <= 60
    np.testing.assert_array_equal(arrays["train_label_histogram"], counts(y, train))
    np.testing.assert_array_equal(arrays["test_label_histogram"], counts(yt, test))
    assert arrays["train_label_histogram"].sum() == sum(r.size for r in train)


def test_the_report_draws_the_clients_by_classes_counts(partitioned, tmp_path):
    run, y, yt = partitioned
    runs, skipped = report.load([os.path.dirname(run)])
    assert skipped == []
    got = report.write_report(runs, str(tmp_path / "out"), dpi=40)
    name = "partition_clients_classes_synthetic_linear.png"
    assert name in got["drawn"] and (tmp_path / "out" / name).stat().st_size > 1000
    assert f"]({name})" in (tmp_path / "out" / "report.md").read_text()
    fig = got["drawn"][name]
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in panels] == ["training clients (8)", "test devices (12)"]
    with np.load(os.path.join(run, "partition.npz")) as z:
        rows = {s: P.client_lists(z, s) for s in ("train", "test")}
    for ax, labels, split in zip(panels, (y, yt), ("train", "test")):
        shown = np.asarray(ax.images[0].get_array())
        want = counts(labels, rows[split])
        want = want / want.sum(axis=1, keepdims=True)       # each client's class shares
        np.testing.assert_allclose(shown, want.T, rtol=1e-12)   # classes x clients
        assert ax.get_xlabel() == "client" and ax.get_ylabel() == "class"
    assert fig._suptitle.get_text() == "delta: dirichlet, α = 0.3, seed 3"


def test_no_heat_map_without_a_partition(tmp_path):
    fake_run(tmp_path / "runs" / "plain", "deltafl", None, (1.0,))
    runs, _ = report.load([str(tmp_path / "runs")])
    got = report.write_report(runs, str(tmp_path / "out"), dpi=40)
    assert not any(k.startswith("partition_") for k in got["drawn"])
