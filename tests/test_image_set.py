"""The image benchmarks a user copies: experiments/cifar10_dirichlet*.flags and
fmnist_shards.flags, their datasets' known shapes for ``--estimate`` offline, and the
leaderboard's ``--set=image``, on small CIFAR-pickle and IDX files the tests write (no network):
refused in one line and exit 2 without its data and --download; with --download the published
files are fetched (here: written by a stand-in of the fetch) and prepared; the slow test runs
the set at toy size."""

import json
import os

import numpy as np
import pytest

from deltafl_jax import DataConfig, DataError
from deltafl_jax.datasets import centralised
from deltafl_jax.datasets import partition as P
from deltafl_jax.datasets.known_shapes import (KNOWN_CENTRALISED, centralised_stand_in,
                                               load_or_stand_in)
from tests.test_image_datasets import write_cifar, write_mnist
from tests.test_leaderboard import run_board

RNG = np.random.default_rng(7)


def mnist_files(folder, n_train=200, n_test=100):
    """Fashion-MNIST-format IDX files of balanced labels (0..9 in turn)."""
    arrays = {"train": (RNG.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
                        (np.arange(n_train) % 10).astype(np.uint8)),
              "test": (RNG.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
                       (np.arange(n_test) % 10).astype(np.uint8))}
    return write_mnist(folder, arrays)


def test_the_stand_in_has_the_published_split_sizes_and_balanced_classes():
    # Published counts: CIFAR-10 5,000 / 1,000 images a class, CIFAR-100 500 / 100,
    # Fashion-MNIST 6,000 / 1,000 (Krizhevsky 2009; Xiao et al. 2017).
    for name, per_class, shape in (("cifar10", (5000, 1000), (32, 32, 3)),
                                   ("cifar100", (500, 100), (32, 32, 3)),
                                   ("fashion_mnist", (6000, 1000), (28, 28, 1))):
        known = KNOWN_CENTRALISED[name]
        assert known.image_shape == shape
        assert (known.train, known.test) == (per_class[0] * known.num_classes,
                                             per_class[1] * known.num_classes)
    c = centralised_stand_in("fashion_mnist")
    assert c.train_x.shape == (60000, 28, 28, 1) and c.train_x.dtype == np.uint8
    assert list(np.bincount(c.train_y)) == [6000] * 10
    assert list(np.bincount(c.test_y)) == [1000] * 10


def test_a_dirichlet_partition_has_the_same_sizes_on_any_labels_of_the_same_counts():
    """The stand-in's client sizes are the real data's: Dir's cuts depend on the per-class counts
    and the seed only, not on where the labels sit (here: the stand-in's labels shuffled)."""
    y = centralised_stand_in("cifar10").test_y
    spec = P.PartitionSpec("dirichlet", 100, alpha=0.1, min_partition_size=2, seed=0)
    a = P.partition(y, spec)
    b = P.partition(np.random.default_rng(3).permutation(y), spec)
    assert [p.size for p in a] == [p.size for p in b]


def test_estimate_offline_uses_the_known_shape_and_the_runs_partition(tmp_path):
    config = DataConfig("fashion_mnist", partition="shards", num_clients=100,
                        data_dir=str(tmp_path / "empty"))
    data, note = load_or_stand_in(config)
    assert "known shape" in note and "--partition=shards" in note
    assert data.train.num_clients == data.test.num_clients == 100
    assert list(data.train.sizes) == [600] * 100 and list(data.test.sizes) == [100] * 100
    assert data.partition is not None and data.x_scale == pytest.approx(1 / 255)
    assert not (tmp_path / "empty").exists()


def test_prepared_data_are_loaded_and_their_partition_errors_raised(tmp_path):
    cache = tmp_path / "cache"
    mnist_files(str(cache / "raw" / "fashion_mnist"))
    config = DataConfig("fashion_mnist", partition="iid", num_clients=10, data_dir=str(cache))
    data, note = load_or_stand_in(config)
    assert note is None and data.train.num_clients == 10 and int(data.train.sizes.sum()) == 200
    too_many = DataConfig("fashion_mnist", partition="dirichlet", num_clients=10,
                          min_partition_size=500, data_dir=str(cache))
    with pytest.raises(DataError, match="min_partition_size=500"):
        load_or_stand_in(too_many)   # a real partition error, not the stand-in


def test_the_image_flagfiles_plan_their_settings():
    from tests.test_flagfiles import plan
    for name, alpha in (("cifar10_dirichlet.flags", 0.1), ("cifar10_dirichlet_05.flags", 0.5)):
        (c,) = plan(name)
        part = c.data.partitioner
        assert (c.data.dataset, part.method, part.dirichlet_alpha) == ("cifar10", "dirichlet",
                                                                       alpha)
        assert part.num_clients == 100 and c.thetas == (1.0, 0.8, 0.5)
    (c,) = plan("fmnist_shards.flags")
    part = c.data.partitioner
    assert (c.data.dataset, part.method, part.shards_per_client) == ("fashion_mnist", "shards",
                                                                     2)
    assert part.num_clients == 100 and c.thetas == (1.0, 0.8, 0.5)


def test_the_image_set_without_its_data_is_one_line_exit_2(tmp_path, capsys):
    cache, out = tmp_path / "cache", tmp_path / "board"
    code, err, _ = run_board(["--set=image", f"--data_dir={cache}", f"--out={out}"], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cifar10_dirichlet: cifar10: no "
                                                   "prepared data"), err
    assert "--download" in lines[0]
    assert not out.exists() and not cache.exists()


def _fake_fetch(monkeypatch, fetched):
    """centralised.download_files writing the published files the tests make, offline."""
    def fetch(name, data_dir, timeout=60.0):
        folder = centralised.raw_dir(data_dir, name)
        fetched.append(name)
        if name == "cifar10":
            write_cifar(folder, "cifar10", per_batch=40, n_test=40)
        else:
            mnist_files(folder)
        return folder
    monkeypatch.setattr(centralised, "download_files", fetch)


def test_download_fetches_and_prepares_what_is_missing(tmp_path, capsys, monkeypatch):
    from experiments import leaderboard as board
    fetched = []
    _fake_fetch(monkeypatch, fetched)
    cache = tmp_path / "cache"
    board.FLAGS.unparse_flags()
    argv = ["leaderboard", "--set=image", "--download", f"--data_dir={cache}",
            f"--out={tmp_path / 'board'}", "--num_clients=4", "--clients_per_round=2",
            "--methods=deltafl,fedavg"]
    board.parse_flags_or_fail(argv)
    board.ARGS[:] = argv
    settings = board.plan(argv)
    assert fetched == ["cifar10", "fashion_mnist"]
    assert [s.name for s in settings] == ["cifar10_dirichlet", "fmnist_shards"]
    cifar, fmnist = (s.data for s in settings)
    assert cifar.train.num_clients == 4 and int(cifar.train.sizes.sum()) == 200
    assert fmnist.train.num_clients == 4 and list(fmnist.train.sizes) == [50] * 4
    assert "fetching and preparing cifar10 (--download)" in capsys.readouterr().out
    settings = board.plan(argv)          # prepared now: nothing fetched again
    assert fetched == ["cifar10", "fashion_mnist"]


@pytest.mark.slow   # two settings trained end to end: CI's second step
def test_the_image_set_at_toy_size(tmp_path, capsys, monkeypatch):
    fetched = []
    _fake_fetch(monkeypatch, fetched)
    out = tmp_path / "board"
    code, err, stdout = run_board(
        ["--set=image", "--download", f"--data_dir={tmp_path / 'cache'}", f"--out={out}",
         "--num_clients=4", "--clients_per_round=2", "--num_rounds=2", "--eval_every=1",
         "--methods=deltafl,fedavg", "--lr_multipliers=1", "--seeds=1", "--model=linear",
         "--augment=none", "--thetas=0.5"], capsys)
    assert code in (0, None), err
    for name in ("cifar10_dirichlet", "fmnist_shards"):
        record = json.loads((out / name / "leaderboard.json").read_text())
        assert record["train_clients"] == record["test_clients"] == 4
        assert {m["name"] for m in record["methods"]} == {"deltafl", "fedavg"}
        assert (out / name / "deltafl" / "final" / "partition.npz").exists()
    assert os.path.exists(out / "leaderboard.md") and fetched == ["cifar10", "fashion_mnist"]


@pytest.mark.slow   # builds and compiles four programs: CI's second step
def test_the_image_set_estimate_runs_offline_on_the_known_shapes(tmp_path, capsys):
    cache, out = tmp_path / "cache", tmp_path / "board"
    code, err, stdout = run_board(
        ["--set=image", "--estimate", "--estimate_rounds=1", "--methods=fedavg",
         "--num_rounds=2", "--max_examples_per_client=20", "--model=linear", "--augment=none",
         f"--data_dir={cache}", f"--out={out}"], capsys)
    assert code in (0, None), err
    for name, dataset in (("cifar10_dirichlet", "cifar10"), ("fmnist_shards", "fashion_mnist")):
        assert f"{name}: measured on {dataset}'s known shape" in stdout
        assert f"estimate of {name} fedavg lr (measured)" in stdout
    assert "estimate of all 6 programs" in stdout
    assert not out.exists() and not cache.exists()
