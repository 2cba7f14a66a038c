"""FEMNIST writers: --writer_fraction and --resample_writers_per_seed.

The paper keeps writers with >= 100 images, then "subsample 50% of them (1730 writers) and
split them half for training, half for testing" (reference-notes.md); the authors redraw both
for every seed ("a different sampling of train and test devices", CISS Sec. V). Expected
counts and cells are computed here from the fixture's sizes and from clients.npz with NumPy.
"""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import run_runner  # noqa: E402
from fixtures import federated_files as ff  # noqa: E402

from deltafl_jax import ExperimentConfig  # noqa: E402
from deltafl_jax.data import DataError  # noqa: E402
from deltafl_jax.datasets import DataConfig, load_dataset  # noqa: E402
from deltafl_jax.replicas.seed_programs import seed_programs  # noqa: E402

SIZES = {f"f{i:04d}_{i % 7:02d}": n for i, n in
         enumerate([12, 9, 15, 8, 10, 7, 11, 13, 9, 14, 8, 10, 3, 16])}
MIN = 8
ELIGIBLE = sorted(w for w, n in SIZES.items() if n >= MIN)   # 12 writers


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return ff.write_tff_h5(str(tmp_path_factory.mktemp("h5")), ff.femnist_writers(SIZES, 2))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def config(source, cache, **kw):
    return DataConfig(dataset="femnist", data_path=source, data_dir=cache,
                      min_client_examples=MIN, **kw)


def writer_ids(data):
    return set(data.train.client_ids) | set(data.test.client_ids)


@pytest.mark.parametrize("fraction, kept", [(0.5, 6), (1.0, 12), (0.25, 3)])
def test_writer_fraction_keeps_that_share_of_the_eligible_writers(source, cache, fraction,
                                                                  kept):
    assert len(ELIGIBLE) == 12
    data = load_dataset(config(source, cache, writer_fraction=fraction))
    ids = writer_ids(data)
    assert ids <= set(ELIGIBLE) and len(ids) == kept
    assert data.train.num_clients == kept // 2 and data.test.num_clients == kept - kept // 2
    assert data.metadata["writer_fraction"] == fraction


def test_the_default_is_the_papers_half(source, cache):
    assert DataConfig("femnist").writer_fraction == 0.5
    assert len(writer_ids(load_dataset(config(source, cache)))) == 6


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_a_fraction_outside_0_1_is_a_data_error(source, cache, fraction):
    with pytest.raises(DataError, match="writer_fraction"):
        load_dataset(config(source, cache, writer_fraction=fraction))


def test_seed_groups_redraw_the_writers_from_each_seed(source, cache):
    base = ExperimentConfig(data=config(source, cache, resample_writers_per_seed=True),
                            thetas=(1.0, 0.5), seeds=(1, 2, 3), output_dir="out")
    groups = seed_programs(base)
    assert [g.seeds for g in groups] == [(1,), (2,), (3,)]
    assert [g.output_dir for g in groups] == [os.path.join("out", f"seed_{s}") for s in (1, 2, 3)]
    assert [g.thetas for g in groups] == [(1.0, 0.5)] * 3
    draws = [load_dataset(g.data) for g in groups]
    # With --data_seed=0, seed s draws the writers and the split of --data_seed=s.
    for s, d in zip((1, 2, 3), draws):
        same = load_dataset(config(source, cache, data_seed=s))
        assert list(d.train.client_ids) == list(same.train.client_ids)
        assert list(d.test.client_ids) == list(same.test.client_ids)
    assert len({tuple(d.train.client_ids) for d in draws}) > 1
    # Without the flag every seed shares one dataset and one program.
    plain = ExperimentConfig(data=config(source, cache), seeds=(1, 2), output_dir="out")
    assert seed_programs(plain) == [plain]


@pytest.mark.slow
def test_runner_writes_one_run_per_seed_and_the_report_pools_them(source, cache, tmp_path,
                                                                  capsys):
    out = tmp_path / "run"
    code, err, stdout = run_runner(
        ["--dataset=femnist", f"--data_path={source}", f"--data_dir={cache}",
         f"--min_client_examples={MIN}", "--writer_fraction=1", "--resample_writers_per_seed",
         "--model=linear", "--algorithm=deltafl,fedprox", "--thetas=1,0.5",
         "--fedprox_mu=0.1", "--seeds=1,2", "--num_rounds=2", "--clients_per_round=3",
         "--eval_every=1", "--batch_size=4", f"--output_dir={out}"], capsys)
    assert code in (0, None), err
    cells = {}
    for alg in ("deltafl", "fedprox"):
        for s in (1, 2):
            run = out / alg / f"seed_{s}"
            with open(run / "summary.json") as f:
                summary = json.load(f)
            assert summary["config"]["seeds"] == [s]
            assert summary["config"]["data"]["data_seed"] == s
            with np.load(run / "clients.npz") as c:
                for r, key in enumerate(c["replica_keys"]):
                    err_k = np.sort(c["test_error"][r])       # unweighted lower p90
                    p90 = err_k[int(np.ceil(0.9 * err_k.size)) - 1]
                    cells.setdefault((alg, str(key).rsplit("_seed=", 1)[0]), []).append(p90)
    assert "seeds" in stdout and "deltafl theta=0.5" in stdout
    from deltafl_jax.report import columns, load, table
    runs, skipped = load([str(out)])
    assert len(runs) == 4 and not skipped
    cols = columns(runs)
    assert sorted(len(c.seeds) for c in cols) == [2, 2, 2]   # FedAvg, theta 0.5, FedProx
    # Two experiments share the row: each column names its own (the seeds' common dir).
    assert sorted(c.label for c in cols) == ["FedAvg [deltafl]", "FedProx, μ = 0.1 [fedprox]",
                                             "Δ-FL, θ = 0.5 [deltafl]"]
    rows, labels, got = table(cols, "test_error_p90", percent=True)
    assert len(rows) == 1
    for c in cols:
        alg = "fedprox" if c.label.startswith("FedProx") else "deltafl"
        key = "fedprox_mu=0.1" if alg == "fedprox" else (
            "theta=1" if c.label.startswith("FedAvg ") else "theta=0.5")
        want = cells[(alg, key)]
        assert got[(rows[0], c.label)].mean == pytest.approx(100 * np.mean(want))
        assert got[(rows[0], c.label)].std == pytest.approx(100 * np.std(want))
    from deltafl_jax.report import write_report
    report = write_report(runs, str(tmp_path / "report"))
    assert os.path.exists(report["report"]) and report["figures"]
