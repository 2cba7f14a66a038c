"""experiments.report --best: each baseline at its best swept value by the
test 90th percentile, as the papers' tables ("report q with the smallest 90th percentile of
misclassification error on test devices", CISS 2021 Sec. V). The expected winner is computed
here from clients.npz with NumPy."""

import os

import numpy as np
import pytest

from test_report import cli, parse_tables, table_of, tiny_run

pytestmark = pytest.mark.slow   # CI's second step (see .ci/run)


def p90_by_value(run_dir):
    """swept value -> mean over seeds of the unweighted lower 90th percentile of the test
    error: sort, take the ceil(0.9 N)-th smallest."""
    z = np.load(os.path.join(run_dir, "clients.npz"))
    per = {}
    for r, key in enumerate(z["replica_keys"]):
        e = np.sort(z["test_error"][r])
        value = str(key).rsplit("_seed=", 1)[0]
        per.setdefault(value, []).append(e[-(-9 * e.size // 10) - 1])
    return {v: float(np.mean(p)) for v, p in per.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("best")
    tiny_run(root / "delta")
    tiny_run(root / "fedprox", algorithm="fedprox", thetas=(), sweeps={"fedprox_mu": (0.0, 1.0, 5.0)},
             learning_rate=0.2)
    tiny_run(root / "qffl", algorithm="qffl", thetas=(), sweeps={"qffl_q": (0.01, 5.0)})
    return str(root)


def test_best_keeps_each_baselines_best_value_and_marks_it(runs, tmp_path, capsys):
    code, err, _ = cli([runs, f"--out={tmp_path / 'all'}"], capsys)
    assert code in (0, None), err
    header_all, _ = table_of(parse_tables(open(tmp_path / "all" / "report.md").read()),
                             "Table 2")
    assert sum(h.startswith("FedProx") for h in header_all) == 3
    code, err, _ = cli([runs, "--best", f"--out={tmp_path / 'best'}"], capsys)
    assert code in (0, None), err
    md = open(tmp_path / "best" / "report.md").read()
    header, rows = table_of(parse_tables(md), "Table 2")
    (row,) = rows.values()
    assert "smallest mean over seeds of the test 90th percentile" in md
    for alg, name in (("fedprox", "FedProx"), ("qffl", "q-FFL")):
        scores = p90_by_value(os.path.join(runs, alg))
        win = min(scores, key=scores.get)
        (col,) = [i for i, h in enumerate(header) if h.startswith(name)]
        assert header[col].endswith("†")
        assert header[col].split(" = ")[1].split()[0] == f"{float(win.split('=')[1]):g}"
        mean = float(row[col].replace("**", "").split("±")[0])
        assert mean == pytest.approx(100 * scores[win], abs=0.006)
    # Delta-FL's theta are all kept, unmarked; the CSV keeps every value.
    assert "FedAvg [delta]" in header and "Δ-FL, θ = 0.5 [delta]" in header
    final_csv = open(tmp_path / "best" / "final.csv").read()
    assert final_csv.count("fedprox_mu") >= 6
