"""Partitioners (deltafl_jax.datasets.partition) against Flower Datasets and against NumPy
restatements of Flower Datasets' documented algorithms; --dataset=npz without client columns;
partition.npz; data_prep.stats.

The partition of labels y with seed s is, in Flower Datasets, ``FederatedDataset(shuffle=True,
seed=s)`` (Hugging Face ``Dataset.shuffle(seed=s)``: ``default_rng(s).permutation(n)``) followed
by the partitioner with ``seed=s``. The restatements below are written from the partitioners'
descriptions, in plain Python lists and loops. Flower Datasets itself is not a dependency (see
docs/guides/own-data.md): its partitions of the same labels, for every partitioner and three
seeds, are recorded in tests/fixtures/flower_partitions.npz (tests/fixtures/flower_partitions.py
says how), the partitioners are compared with that recording everywhere, and the recording with
``flwr_datasets`` where it is installed."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from deltafl_jax import DataConfig, DataError, load_dataset
from deltafl_jax.datasets import partition as P

from fixtures.flower_partitions import LABELS, SEEDS, SPECS, flower_partition, recorded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- NumPy restatements (the assignment of rows to clients; rows as in the shuffled split) ----

def ref_iid(n, k):
    base, extra = n // k, n % k
    out, start = [], 0
    for i in range(k):
        size = base + 1 if i < extra else base
        out.append(list(range(start, start + size)))
        start += size
    return out


def ref_dirichlet(y, k, alpha, min_size, balancing, rng):
    for _ in range(11):
        clients = [[] for _ in range(k)]
        for c in sorted(set(y.tolist())):
            rows = [i for i, v in enumerate(y.tolist()) if v == c]
            p = list(rng.dirichlet([alpha] * k))
            if balancing:
                p = [0.0 if len(clients[j]) > len(y) / k else p[j] for j in range(k)]
                total = sum(p)
                p = [v / total for v in p]
            bounds, acc = [0], 0.0
            for v in p[:-1]:
                acc += v
                bounds.append(int(acc * len(rows)))
            bounds.append(len(rows))
            for j in range(k):
                clients[j] += rows[bounds[j]:bounds[j + 1]]
        if min(len(c) for c in clients) >= min_size:
            return clients
    return None


def ref_shards(y, k, per_client, rng):
    order = sorted(range(len(y)), key=lambda i: (y[i], i))
    size = len(y) // (k * per_client)
    usable = len(y) // size
    chosen = list(rng.permutation(usable)[:k * per_client])
    return [sum((order[s * size:(s + 1) * size] for s in chosen[j * per_client:
                                                                (j + 1) * per_client]), [])
            for j in range(k)]


def ref_pathological(y, k, per_client, mode, rng):
    classes = sorted(set(y.tolist()))
    own = []
    for j in range(k):
        if mode == "random":
            own.append(list(rng.choice(classes, size=per_client, replace=False)))
        else:
            mine = [classes[j % len(classes)]]
            while len(mine) < per_client:
                c = rng.choice(classes, size=1)[0]
                if c not in mine:
                    mine.append(c)
            own.append(mine)
    clients = [[] for _ in range(k)]
    for c in classes:
        rows = [i for i, v in enumerate(y.tolist()) if v == c]
        holders = [j for j in range(k) if c in own[j]]
        q, r = divmod(len(rows), max(len(holders), 1))
        start = 0
        for h, j in enumerate(holders):
            end = start + q + (1 if h < r else 0)
            clients[j] += rows[start:end]
            start = end
    return clients


def ref_inner_dirichlet(y, sizes, alpha, rng):
    classes = sorted(set(y.tolist()))
    prior = rng.dirichlet([alpha] * len(classes), size=len(sizes))
    rows = [[i for i, v in enumerate(y.tolist()) if v == c] for c in classes]
    clients = [[None] * s for s in sizes]
    room, open_ids = list(sizes), list(range(len(sizes)))
    while sum(room):
        j = rng.choice(open_ids)
        if room[j] == 0:
            open_ids.remove(j)
            continue
        room[j] -= 1
        while True:
            c = rng.choice(len(classes), p=prior[j])
            if not rows[c]:
                prior[:, c] = 0
                prior = prior / prior.sum(axis=1, keepdims=True)
                continue
            clients[j][room[j]] = rows[c].pop()
            break
    return clients


def ref_size(n, k, law):
    f = {"linear": lambda i: i, "square": lambda i: i * i, "exponential": math.exp}[law]
    units = [f(float(i)) for i in range(1, k + 1)]
    sizes = [int(u / sum(units) * n) for u in units]
    sizes[-1] += n - sum(sizes)
    starts = np.cumsum([0] + sizes)
    return [list(range(starts[i], starts[i + 1])) for i in range(k)]


def restated(y, spec, seed):
    """The restatement's partition, as sets of source rows."""
    perm = np.random.default_rng(seed).permutation(len(y))
    ys, rng, m, k = y[perm], np.random.default_rng(seed), spec["method"], spec["num_clients"]
    if m == "iid":
        rows = ref_iid(len(y), k)
    elif m == "dirichlet":
        rows = ref_dirichlet(ys, k, spec["alpha"], 10, spec.get("self_balancing", False), rng)
    elif m == "shards":
        rows = ref_shards(ys, k, spec["shards_per_client"], rng)
    elif m == "pathological":
        rows = ref_pathological(ys, k, spec["classes_per_client"],
                                spec.get("class_assignment_mode", "random"), rng)
    elif m == "inner_dirichlet":
        rows = ref_inner_dirichlet(ys, [len(y) // k + (j < len(y) % k) for j in range(k)],
                                   spec["alpha"], rng)
    else:
        rows = ref_size(len(y), k, spec["size_law"])
    return [set(perm[r].tolist()) for r in rows]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_each_partitioner_equals_its_numpy_restatement(name):
    for seed in (0, 5):
        ours = P.partition(LABELS, P.PartitionSpec(seed=seed, **SPECS[name]))
        assert [set(p.tolist()) for p in ours] == restated(LABELS, SPECS[name], seed)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_each_partitioner_equals_flower_datasets_row_for_row(name):
    """The same rows in the same order as Flower Datasets' recorded partition, every client."""
    for seed in SEEDS:
        ours = P.partition(LABELS, P.PartitionSpec(seed=seed, **SPECS[name]))
        theirs = recorded(name, seed)
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_recording_is_flower_datasets_own_partition(name):
    flwr = pytest.importorskip("flwr_datasets")   # the comparison above always runs
    import datasets
    for seed in SEEDS:
        theirs = flower_partition(flwr, datasets, SPECS[name], seed)
        want = recorded(name, seed)
        assert len(want) == len(theirs)
        for a, b in zip(want, theirs):
            np.testing.assert_array_equal(a, b)


def test_dirichlet_shares_have_the_dirichlet_mean_and_variance_over_50_seeds():
    """Without balancing and re-draws, client k's share of class c is a Dir(alpha 1_K)
    coordinate cut to whole rows: mean 1/K, variance (1/K)(1 - 1/K) / (K alpha + 1)."""
    k, alpha, per_class = 10, 0.5, 500
    y = np.repeat(np.arange(10), per_class)
    shares = []
    for seed in range(50):
        parts = P.partition(y, P.PartitionSpec("dirichlet", k, alpha=alpha,
                                               min_partition_size=0, seed=seed))
        shares.append([np.bincount(y[p], minlength=10) / per_class for p in parts])
    shares = np.asarray(shares)                     # [50, K, C]
    var = (1 / k) * (1 - 1 / k) / (k * alpha + 1)   # 0.015
    assert abs(shares.mean() - 1 / k) < 0.002       # the floors lose < K rows of 500
    assert 0.85 * var < shares.var() < 1.15 * var   # 5000 draws: the variance's sd is ~3%


@pytest.mark.parametrize("name", ["iid", "dirichlet", "dirichlet_balanced", "shards",
                                  "pathological_first", "inner_dirichlet", "size_linear",
                                  "size_square", "size_exponential"])
def test_every_example_is_used_exactly_once(name):
    """These use every row: shards when K * shards_per_client divides n (3000 = 30 * 2 * 50),
    pathological first-deterministic when K >= the number of classes."""
    parts = P.partition(LABELS, P.PartitionSpec(seed=1, **SPECS[name]))
    rows = np.concatenate(parts)
    np.testing.assert_array_equal(np.sort(rows), np.arange(len(LABELS)))


def test_shards_use_each_example_at_most_once_when_shards_do_not_divide_n():
    parts = P.partition(LABELS[:2999], P.PartitionSpec("shards", 7, shards_per_client=3))
    rows = np.concatenate(parts)
    assert len(np.unique(rows)) == len(rows) and all(p.size == 3 * 142 for p in parts)


def test_min_partition_size_is_honoured_by_redrawing():
    y = np.random.default_rng(0).integers(0, 10, size=2000)
    spec = P.PartitionSpec("dirichlet", 40, alpha=0.2, min_partition_size=0, seed=3)
    first = P.partition(y, spec)
    assert min(p.size for p in first) < 15    # the first draw is too small: a re-draw is due
    parts = P.partition(y, P.PartitionSpec("dirichlet", 40, alpha=0.2, min_partition_size=15,
                                           seed=3))
    assert min(p.size for p in parts) >= 15
    with pytest.raises(DataError, match="after 11 draws.*--min_partition_size=45"):
        P.partition(y, P.PartitionSpec("dirichlet", 40, alpha=0.2, min_partition_size=45))


def test_the_same_seed_gives_the_same_partition_and_another_seed_another():
    for spec in SPECS.values():
        if spec["method"] == "size" or spec["method"] == "iid":
            continue   # their sizes are fixed; the rows still move with the seed (below)
        a = P.partition(LABELS, P.PartitionSpec(seed=11, **spec))
        b = P.partition(LABELS, P.PartitionSpec(seed=11, **spec))
        c = P.partition(LABELS, P.PartitionSpec(seed=12, **spec))
        assert all(np.array_equal(u, v) for u, v in zip(a, b))
        assert not all(np.array_equal(u, v) for u, v in zip(a, c))
    a = P.partition(None, P.PartitionSpec("iid", 4, seed=1), num_examples=20)
    c = P.partition(None, P.PartitionSpec("iid", 4, seed=2), num_examples=20)
    assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize("spec, message", [
    (P.PartitionSpec("dirichlet", 10, alpha=0.0), "--dirichlet_alpha must be > 0, got 0"),
    (P.PartitionSpec("inner_dirichlet", 10, alpha=-1.0), "--dirichlet_alpha must be > 0"),
    (P.PartitionSpec("shards", 800, shards_per_client=4), "3200 shards .* only 3000 examples"),
    (P.PartitionSpec("iid", 3001), "3001 clients .* only 3000 examples"),
    (P.PartitionSpec("pathological", 10, classes_per_client=11), "holds? 10 classes"),
    (P.PartitionSpec("size", 60, size_law="exponential"), "leave client 0 empty"),
    (P.PartitionSpec("iid", 10, seed=-1), "--partition_seed .* must be >= 0, got -1"),
    (P.PartitionSpec("iid", 0), "--num_clients must be at least 1, got 0"),
])
def test_impossible_partitions_are_one_line_errors(spec, message):
    with pytest.raises(DataError, match=message) as err:
        P.partition(LABELS, spec)
    assert "\n" not in str(err.value)


# ---- --dataset=npz without client columns ----

def centralised_npz(path, n=4000, n_test=2000, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(6, 10))
    x = rng.normal(size=(n + n_test, 6)).astype(np.float32)
    y = (x @ w).argmax(1)
    np.savez(path, train_x=x[:n], train_y=y[:n], test_x=x[n:], test_y=y[n:])
    return x[:n], y[:n], x[n:], y[n:]


def test_npz_without_clients_is_partitioned_train_and_test_alike(tmp_path):
    path = str(tmp_path / "c.npz")
    x, y, xt, yt = centralised_npz(path)
    config = DataConfig("npz", data_path=path, partition="dirichlet", dirichlet_alpha=0.3,
                        num_clients=20, partition_seed=4)
    data = load_dataset(config)
    want = P.partition(y, P.spec_of(config))
    want_test = P.partition(yt, P.PartitionSpec("dirichlet", 20, alpha=0.3,
                                                seed=P.test_split_seed(4)))
    assert data.train.num_clients == data.test.num_clients == 20
    for k in range(20):
        np.testing.assert_array_equal(data.train.client(k)[0], x[want[k]])
        np.testing.assert_array_equal(data.train.client(k)[1], y[want[k]])
        np.testing.assert_array_equal(data.test.client(k)[0], xt[want_test[k]])
    assert P.spec_of(config).seed == 4 and P.spec_of(DataConfig("npz", data_seed=9,
                                                                 partition="iid")).seed == 9


def test_partition_npz_holds_the_clients_kept_and_the_settings(tmp_path):
    from deltafl_jax.outputs.directory import RunWriter

    path = str(tmp_path / "c.npz")
    x, y, xt, yt = centralised_npz(path)
    data = load_dataset(DataConfig("npz", data_path=path, partition="shards", num_clients=20,
                                   max_train_clients=8, max_examples_per_client=50))
    RunWriter(str(tmp_path)).write_partition(data)
    with np.load(tmp_path / "partition.npz") as z:
        arrays = {k: z[k] for k in z.files}
    assert str(arrays["setting_method"]) == "shards"
    assert int(arrays["setting_shards_per_client"]) == 2
    rows = P.client_lists(arrays, "train")
    assert len(rows) == 8 and list(arrays["train_client_ids"]) == list(data.train.client_ids)
    for k, r in enumerate(rows):
        np.testing.assert_array_equal(x[r], data.train.client(k)[0])
    for k, r in enumerate(P.client_lists(arrays, "test")):
        np.testing.assert_array_equal(xt[r], data.test.client(k)[0])


def test_partition_is_refused_where_the_data_have_their_own_clients(tmp_path):
    with pytest.raises(DataError, match="--dataset=synthetic has its own clients"):
        load_dataset(DataConfig("synthetic", partition="iid"))
    path = tmp_path / "own.npz"
    np.savez(path, train_x=np.ones((4, 2)), train_client=np.arange(4), test_x=np.ones((2, 2)),
             test_client=np.arange(2))
    with pytest.raises(DataError, match="has its own clients .*drop --partition"):
        load_dataset(DataConfig("npz", data_path=str(path), partition="iid"))
    central = str(tmp_path / "c.npz")
    centralised_npz(central, n=40, n_test=20)
    with pytest.raises(DataError, match="no train_client/test_client arrays: pass --partition"):
        load_dataset(DataConfig("npz", data_path=central))
    np.savez(central, train_x=np.ones((40, 2)), test_x=np.ones((20, 2)))   # no labels
    with pytest.raises(DataError, match="train split: --partition=dirichlet needs labels"):
        load_dataset(DataConfig("npz", data_path=central, partition="dirichlet", num_clients=2))
    iid = load_dataset(DataConfig("npz", data_path=central, partition="iid", num_clients=4))
    assert iid.train.y is None and list(iid.train.sizes) == [10] * 4


def test_split_stats_count_a_hand_made_partition():
    from deltafl_jax import ClientData

    split = ClientData(x=np.zeros((6, 1)), y=np.array([0, 0, 1, 2, 2, 2]),
                       offsets=np.array([0, 3, 6]), client_ids=np.arange(2))
    s = P.split_stats(split, 3)
    assert s["label_histogram"] == [[2, 1, 0], [0, 0, 3]]
    assert s["classes_per_client_min"] == 1 and s["classes_per_client_max"] == 2
    # the split's labels are (2, 1, 3) / 6; client 0's (2, 1, 0) / 3: TV = 1/2 (1/3 + 1/6 + 1/2)
    assert s["label_tv_distance_mean"] == pytest.approx(0.5 * (0.5 + 0.5))
    assert (s["size_min"], s["size_max"], s["size_mean"]) == (3, 3, 3.0)


def _run(args, cwd):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("flags, message", [
    (["--dirichlet_alpha=0"], "--dirichlet_alpha must be > 0, got 0"),
    (["--min_partition_size=400"], "after 11 draws a client still has"),
])
def test_a_partition_that_cannot_be_made_exits_2_and_writes_nothing(tmp_path, flags, message):
    path = str(tmp_path / "c.npz")
    centralised_npz(path)
    out = tmp_path / "out"
    proc = _run(["experiments.run", "--dataset=npz", f"--data_path={path}",
                 "--partition=dirichlet", "--num_clients=20", "--model=linear",
                 f"--output_dir={out}", *flags], REPO)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["c.npz"]


@pytest.mark.slow
def test_npz_dirichlet_100_clients_trains_and_writes_its_partition(tmp_path):
    path = str(tmp_path / "c.npz")
    x, y, xt, yt = centralised_npz(path, n=10000, n_test=5000)
    out = tmp_path / "run"
    proc = _run(["experiments.run", "--dataset=npz", f"--data_path={path}",
                 "--partition=dirichlet", "--dirichlet_alpha=0.3", "--num_clients=100",
                 "--model=linear", "--thetas=1.0,0.5", "--seeds=1", "--num_rounds=4",
                 "--clients_per_round=10", "--batch_size=16", "--learning_rate=0.05",
                 "--eval_every=2", f"--output_dir={out}"], REPO)
    assert proc.returncode == 0, proc.stderr
    for name in ("metrics.jsonl", "summary.json", "rounds.npz", "clients.npz", "models",
                 "partition.npz"):
        assert (out / name).exists(), name
    with np.load(out / "partition.npz") as z:
        arrays = {k: z[k] for k in z.files}
    with np.load(out / "clients.npz") as z:
        train_sizes, test_sizes = z["train_sizes"], z["test_sizes"]
    train, test = P.client_lists(arrays, "train"), P.client_lists(arrays, "test")
    assert [r.size for r in train] == list(train_sizes) and len(train) == 100
    assert [r.size for r in test] == list(test_sizes) and len(test) == 100
    np.testing.assert_array_equal(np.sort(np.concatenate(train)), np.arange(len(y)))
    assert min(r.size for r in train) >= 10 and float(arrays["setting_alpha"]) == 0.3
    want = P.partition(y, P.PartitionSpec("dirichlet", 100, alpha=0.3, seed=0))
    assert all(np.array_equal(a, b) for a, b in zip(train, want))
    summary = json.loads((out / "summary.json").read_text())
    assert "partition" in json.dumps(summary)


@pytest.mark.slow
def test_data_prep_stats_prints_the_partition_statistics(tmp_path):
    path = str(tmp_path / "c.npz")
    centralised_npz(path, n=400, n_test=200)
    proc = _run(["data_prep.stats", "--dataset=npz", f"--data_path={path}",
                 "--partition=pathological", "--num_clients=5", "--json", "--histogram"], REPO)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    hist = np.asarray(stats["partition"]["train"]["label_histogram"])
    assert hist.shape == (5, 10) and hist.sum() == stats["partition"]["train"]["examples"]
    assert ((hist > 0).sum(axis=1) == 2).all()
