"""--normalize against NumPy written from the authors' rule.

The authors' models/main.py sets every input feature to (x_j - mu_j) / mu_j, mu_j the mean of
feature j over the examples of the split being normalised (train clients for train, the test
set's own mean for test). ``standard`` is the z-score with the training statistics. The
expected arrays below are computed in float64 from the raw inputs, never with the library.
"""

import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import run_runner  # noqa: E402
from fixtures import federated_files as ff  # noqa: E402

from deltafl_jax.data import ClientData, DataError, FederatedDataset  # noqa: E402
from deltafl_jax.datasets import DataConfig, load_dataset  # noqa: E402
from deltafl_jax.datasets.normalize import normalize  # noqa: E402
from deltafl_jax.models import ModelOptions, build_model  # noqa: E402

SIZES = {"f0000_14": 12, "f0001_41": 9, "f0002_07": 15, "f0003_33": 8, "f0004_11": 10,
         "f0005_02": 7, "f0006_19": 11, "f0007_25": 13}


@pytest.fixture(scope="module")
def femnist_source(tmp_path_factory):
    writers = ff.femnist_writers(SIZES, seed=4)
    return ff.write_tff_h5(str(tmp_path_factory.mktemp("femnist_h5")), writers)


def femnist(source, tmp_path, normalize="none"):
    return load_dataset(DataConfig(dataset="femnist", data_path=source, data_dir=str(tmp_path),
                                   min_client_examples=7,
                                   normalize=normalize))


def test_femnist_reference_divides_each_pixel_by_its_split_mean(femnist_source, tmp_path):
    raw = femnist(femnist_source, tmp_path)
    got = femnist(femnist_source, tmp_path, "reference")
    assert got.x_scale is None and got.train.x.dtype == np.float32
    for split in ("train", "test"):
        pixels = getattr(raw, split).x.astype(np.float64) / 255.0   # LEAF's pixel in [0, 1]
        mu = pixels.mean(axis=0)                                    # this split's own mean
        want = (pixels - mu) / mu
        np.testing.assert_allclose(getattr(got, split).x, want, rtol=2e-5, atol=2e-6)
        np.testing.assert_array_equal(getattr(got, split).y, getattr(raw, split).y)
        np.testing.assert_array_equal(getattr(got, split).offsets, getattr(raw, split).offsets)
    # Each split is centred on its own mean, so both have mean 0 feature by feature.
    assert np.abs(got.test.x.astype(np.float64).mean(0)).max() < 1e-5


def test_standard_uses_the_training_mean_and_std_for_both_splits(tiny_synthetic):
    got = normalize(tiny_synthetic, "standard")
    tr = tiny_synthetic.train.x.astype(np.float64)
    mu, sd = tr.mean(axis=0), tr.std(axis=0)
    np.testing.assert_allclose(got.train.x, (tr - mu) / sd, rtol=1e-5, atol=1e-5)
    te = tiny_synthetic.test.x.astype(np.float64)
    np.testing.assert_allclose(got.test.x, (te - mu) / sd, rtol=1e-5, atol=1e-5)
    assert normalize(tiny_synthetic, "none") is tiny_synthetic


def dataset_with_means(means, n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = (np.asarray(means) + 0.1 * rng.standard_normal((n, len(means)))).astype(np.float32)
    x[:, -1] = 0.0          # a feature that is exactly zero everywhere (mean 0)
    x[:n // 2, 0] -= 1e-6   # and one whose mean is 1e-6 (set exactly below)
    x[n // 2:, 0] += 1e-6
    x[:, 0] += 1e-6 - x[:, 0].mean()
    split = ClientData.from_clients([x[:n // 2], x[n // 2:]],
                                    [np.zeros(n // 2, np.int32), np.ones(n // 2, np.int32)])
    return FederatedDataset("npz", split, split, 2)


def test_reference_warns_once_about_tiny_means_and_only_centres_zero_means():
    data = dataset_with_means([0.0, 1.0, 2.0, 0.0])
    lines = []
    got = normalize(data, "reference", warn=lines.append)
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "2 of 4 in the train split" in lines[0] and "divides" in lines[0]
    x = data.train.x.astype(np.float64)
    mu = x.mean(axis=0)
    assert mu[-1] == 0.0
    want = (x - mu) / np.where(mu == 0, 1.0, mu)       # a zero mean: centred only
    np.testing.assert_allclose(got.train.x, want.astype(np.float32), rtol=1e-4, atol=1e-4)
    assert np.all(np.isfinite(got.train.x))
    # No warning when every mean is large (all within a factor of 3 of the largest).
    rng = np.random.default_rng(1)
    x = (np.array([1.0, 2.0, 3.0]) + 0.1 * rng.standard_normal((40, 3))).astype(np.float32)
    split = ClientData.from_clients([x[:20], x[20:]],
                                    [np.zeros(20, np.int32), np.ones(20, np.int32)])
    quiet = []
    got = normalize(FederatedDataset("npz", split, split, 2), "reference", warn=quiet.append)
    assert quiet == []
    mu = x.astype(np.float64).mean(axis=0)     # and it did divide by the means
    np.testing.assert_allclose(got.train.x, (x - mu) / mu, rtol=1e-4, atol=1e-5)


def sent140_like(seed=0):
    rng = np.random.default_rng(seed)
    table = np.concatenate([np.zeros((2, 50)), rng.normal(0.3, 1.0, (10, 50))]).astype(np.float32)
    xs, ys = [], []
    for _ in range(4):
        x = np.zeros((9, 7), np.int32)
        for row in x:
            k = rng.integers(0, 8)
            row[:k] = rng.integers(1, 12, k)       # 1 = UNK, a zero vector
        xs.append(x)
        ys.append(rng.integers(0, 2, 9).astype(np.int32))
    train = ClientData.from_clients(xs[:2], ys[:2])
    test = ClientData.from_clients(xs[2:], ys[2:])
    return FederatedDataset("sent140", train, test, 2, None,
                            {"embeddings": table, "pad_id": 0, "unk_id": 1})


def mean_glove(ids, table):
    """The mean GloVe vector of each tweet, written as a loop over its tokens."""
    out = np.zeros((len(ids), table.shape[1]))
    for i, row in enumerate(ids):
        tokens = [t for t in row if t != 0]
        for t in tokens:
            out[i] += table[t]
        if tokens:
            out[i] /= len(tokens)
    return out


def test_sent140_reference_normalises_the_mean_glove_vectors(tmp_path):
    data = sent140_like()
    table = data.metadata["embeddings"].astype(np.float64)
    got = normalize(data, "reference")
    assert got.metadata["features"] == "mean_embedding" and "embeddings" not in got.metadata
    for split in ("train", "test"):
        feats = mean_glove(getattr(data, split).x, table)
        mu = feats.mean(axis=0)
        np.testing.assert_allclose(getattr(got, split).x, (feats - mu) / mu, rtol=1e-4,
                                   atol=1e-4)
    # sent140_linear is then logistic regression on those features: <w, x> (no bias).
    model = build_model("sent140_linear", got)
    params = model.init(jax.random.key(0))
    assert {k: v.shape for k, v in params["Dense_0"].items()} == {"kernel": (50, 1)}
    w = np.random.default_rng(1).normal(size=(50, 1)).astype(np.float32)
    out = model.apply({"Dense_0": {"kernel": w}}, got.train.x)
    np.testing.assert_allclose(out[:, 0], got.train.x.astype(np.float64) @ w[:, 0], rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="normalize=none"):
        build_model("lstm", got)
    # Without normalisation the model computes the same mean vectors from the ids.
    raw_model = build_model("sent140_linear", data, ModelOptions(use_bias=False))
    np.testing.assert_allclose(raw_model.apply({"Dense_0": {"kernel": w}}, data.train.x)[:, 0],
                               mean_glove(data.train.x, table) @ w[:, 0], rtol=1e-5, atol=1e-5)


def test_token_ids_are_never_normalised():
    rng = np.random.default_rng(0)
    split = ClientData.from_clients([rng.integers(0, 53, (5, 20)).astype(np.uint8)] * 2,
                                    [np.zeros(5, np.int32)] * 2)
    data = FederatedDataset("shakespeare", split, split, 53, None, {"input_vocab_size": 53})
    with pytest.raises(DataError, match="token ids"):
        normalize(data, "reference")
    with pytest.raises(DataError, match="normalize"):
        normalize(data, "minmax")


def test_the_flag_reaches_the_data_config(tmp_path, capsys):
    code, err, _ = run_runner(["--dataset=synthetic", "--synthetic_num_clients=8",
                               "--normalize=standard", "--num_rounds=1", "--clients_per_round=2",
                               "--thetas=1", "--eval_every=1", "--nosave_models",
                               f"--output_dir={tmp_path / 'run'}"], capsys)
    assert code in (0, None), err
    import json
    with open(tmp_path / "run" / "summary.json") as f:
        assert json.load(f)["config"]["data"]["normalize"] == "standard"
    code, err, _ = run_runner(["--normalize=zscore", f"--output_dir={tmp_path / 'x'}"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
