"""The test error by availability quintile (deltafl_jax/evaluation/by_availability.py): the quintiles
by rank with ties by index, against hand-computed cases; each quintile's mean, p90 and worst-10%
error and its participation counts against a NumPy restatement (loops over the clients, the
lower weighted quantile and the superquantile's LP written out); the split of an evaluation
(seen clients, test devices, a sampled evaluation) and of a run's metrics.jsonl and
summary.json; the report's figure of error against availability."""

import dataclasses
import json
import math
import os

import numpy as np
import pytest

from deltafl_jax.evaluation.by_availability import (QUINTILES, AvailabilitySplit,
                                                 availability_quintiles, population_split,
                                                 quintile_split)


# --------------------------------------------------------------------------------------------
# The NumPy restatement


def ref_quintiles(rates):
    """Quintile of each client: rank by (rate, index), rank r of N -> floor(5 r / N)."""
    n = len(rates)
    ranked = sorted(range(n), key=lambda i: (float(rates[i]), i))
    out = [0] * n
    for r, i in enumerate(ranked):
        out[i] = (5 * r) // n
    return out


def ref_lower_quantile(values, weights, level):
    """The smallest value whose cumulative weight (ascending) reaches level x the total."""
    pairs = sorted(zip(values, weights))
    total = sum(w for _, w in pairs)
    cum = 0.0
    for v, w in pairs:
        cum += w
        if w > 0 and cum >= level * total:
            return v
    raise AssertionError("unreachable")


def ref_worst10(values, weights):
    """The superquantile at 0.9 as its LP's solution: the largest values take their full
    weight until 10% of the total is filled, the boundary one the fraction that completes it."""
    total = sum(weights)
    left, acc = 0.1 * total, 0.0
    for v, w in sorted(zip(values, weights), key=lambda p: -p[0]):
        take = min(w, left)
        acc += take * v
        left -= take
        if left <= 0:
            break
    return acc / (0.1 * total)


def ref_split(errors, clients, rates, weights, counts):
    """{key: [R]} of the split, by loops."""
    errors = np.atleast_2d(errors)
    q = ref_quintiles(rates)
    out = {}
    for j in range(5):
        cols = [c for c in range(errors.shape[1]) if q[clients[c]] == j]
        out[f"q{j + 1}_clients"] = [len(cols)] * len(errors)
        members = [i for i in range(len(rates)) if q[i] == j]
        out[f"q{j + 1}_rate_mean"] = [sum(rates[i] for i in members) / len(members)
                                      if members else math.nan] * len(errors)
        for stat in ("mean", "p90", "worst10"):
            out[f"q{j + 1}_error_{stat}"] = []
        for row in errors:
            v = [row[c] for c in cols]
            w = [weights[c] for c in cols]
            if not cols or any(math.isnan(x) for x in v):
                got = (math.nan,) * 3
            else:
                got = (sum(a * b for a, b in zip(v, w)) / sum(w),
                       ref_lower_quantile(v, w, 0.9), ref_worst10(v, w))
            for stat, g in zip(("mean", "p90", "worst10"), got):
                out[f"q{j + 1}_error_{stat}"].append(g)
        for name, c in counts.items():
            c = np.atleast_2d(c)
            out[f"q{j + 1}_{name}"] = [sum(c[min(r, len(c) - 1)][i] for i in members)
                                       for r in range(len(errors))]
    return out


def assert_split_equal(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)


# --------------------------------------------------------------------------------------------
# The quintiles


def test_quintiles_by_rank_with_ties_broken_by_index_hand_cases():
    rates = [0.3, 0.1, 0.1, 0.9, 0.5, 0.2, 0.0, 0.7, 0.4, 0.6]
    # ascending: 6 (0.0), 1 and 2 (0.1: 1 first), 5, 0, 8, 4, 9, 7, 3; two per quintile
    assert availability_quintiles(rates).tolist() == [2, 0, 1, 4, 3, 1, 0, 4, 2, 3]
    # 7 clients: ranks 0..6 -> floor(5 r / 7) = 0 0 1 2 2 3 4 (sizes 2, 1, 2, 1, 1)
    assert availability_quintiles([6, 5, 4, 3, 2, 1, 0]).tolist() == [4, 3, 2, 2, 1, 0, 0]
    # equal rates: a split by index; fewer than five clients: q1 holds the least available
    assert availability_quintiles(np.full(10, 0.2)).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert availability_quintiles([0.5, 0.1, 0.9]).tolist() == [1, 0, 3]
    assert availability_quintiles([0.4]).tolist() == [0]


@pytest.mark.parametrize("n", [1, 3, 5, 7, 12, 23, 100])
def test_quintiles_against_the_restatement_and_as_equal_as_n_allows(n):
    rng = np.random.default_rng(n)
    rates = rng.integers(0, 4, n) / 4.0         # many ties
    got = availability_quintiles(rates)
    assert got.tolist() == ref_quintiles(rates)
    sizes = np.bincount(got, minlength=QUINTILES)
    assert sizes.sum() == n and set(sizes.tolist()) <= {n // 5, -(-n // 5)}
    # a more available client is never in a lower quintile
    order = np.argsort(rates, kind="stable")
    assert np.all(np.diff(got[order]) >= 0)


def test_bad_rates_are_refused_in_one_line():
    with pytest.raises(ValueError, match="one finite availability per client"):
        availability_quintiles([0.1, np.nan])
    with pytest.raises(ValueError, match="one finite availability per client"):
        AvailabilitySplit(train_rates=np.ones((2, 3)))


# --------------------------------------------------------------------------------------------
# The statistics of each quintile


def test_a_hand_computed_split():
    # 10 clients, two per quintile (the rates of the first hand case above); q1 = clients 6
    # and 1, weighted 3 and 1.
    rates = [0.3, 0.1, 0.1, 0.9, 0.5, 0.2, 0.0, 0.7, 0.4, 0.6]
    errors = np.array([[0.5, 0.2, 0.3, 0.0, 0.1, 0.7, 0.6, 0.05, 0.25, 0.15]])
    weights = np.array([1, 1, 1, 1, 1, 1, 3, 1, 1, 1], float)
    counts = np.array([4, 1, 2, 9, 6, 3, 0, 8, 5, 7])
    got = quintile_split(errors, rates, weights, counts)
    # q1: values 0.6 (weight 3) and 0.2 (weight 1): mean (1.8 + 0.2) / 4 = 0.5; lower p90:
    # the cumulative weight of 0.2 is 1 < 3.6, of 0.6 is 4 -> 0.6; worst 10%: 0.4 of weight,
    # all from 0.6 -> 0.6; participation 0 + 1; mean rate (0.0 + 0.1) / 2.
    assert got["q1_error_mean"] == pytest.approx([0.5])
    assert got["q1_error_p90"] == pytest.approx([0.6])
    assert got["q1_error_worst10"] == pytest.approx([0.6])
    assert got["q1_participation"].tolist() == [1.0] and got["q1_clients"].tolist() == [2.0]
    assert got["q1_rate_mean"] == pytest.approx([0.05])
    # q2: clients 2 (0.3) and 5 (0.7): mean 0.5, p90 and worst 10% 0.7, participation 5
    assert got["q2_error_mean"] == pytest.approx([0.5])
    assert got["q2_error_p90"] == pytest.approx([0.7])
    assert got["q2_participation"].tolist() == [5.0]
    # q5: clients 7 (0.05) and 3 (0.0): mean 0.025, worst 0.05; participation 17
    assert got["q5_error_mean"] == pytest.approx([0.025])
    assert got["q5_error_worst10"] == pytest.approx([0.05])
    assert got["q5_participation"].tolist() == [17.0]


def test_a_hand_computed_boundary_client_in_the_worst_ten_percent():
    # One quintile's three clients (N = 3: quintiles q1, q2, q4) is too few: put 15 clients in
    # five quintiles of three and look at q1: errors 0.2, 0.6, 1.0 weighted 8, 1.5, 0.5.
    rates = np.repeat(np.arange(5.0), 3)
    errors = np.tile([0.2, 0.6, 1.0], 5)[None]
    weights = np.tile([8.0, 1.5, 0.5], 5)
    got = quintile_split(errors, rates, weights)
    # mean (1.6 + 0.9 + 0.5) / 10 = 0.3; p90: cumulative 8, 9.5, 10 >= 9 first at 0.6;
    # worst 10% (weight 1): 1.0 x 0.5 + 0.6 x 0.5 -> 0.8
    for j in range(1, 6):
        assert got[f"q{j}_error_mean"] == pytest.approx([0.3])
        assert got[f"q{j}_error_p90"] == pytest.approx([0.6])
        assert got[f"q{j}_error_worst10"] == pytest.approx([0.8])


@pytest.mark.parametrize("n,r", [(3, 1), (10, 2), (23, 3), (61, 2)])
def test_split_against_the_restatement(n, r):
    rng = np.random.default_rng(100 + n)
    rates = rng.integers(0, 6, n) / 10.0
    errors = rng.integers(0, 21, (r, n)) / 20.0
    weights = rng.integers(0, 4, n).astype(float)
    weights[0] = 1.0
    counts = rng.integers(0, 30, (r, n))
    got = quintile_split(errors, rates, weights, counts)
    want = ref_split(errors, list(range(n)), rates, weights, {"participation": counts})
    assert_split_equal(got, want)
    # equal weights (the test errors' convention)
    got = quintile_split(errors, rates)
    assert_split_equal(got, ref_split(errors, list(range(n)), rates, np.ones(n), {}))


def test_equal_weights_give_the_packages_own_metrics_of_each_quintile():
    from deltafl_jax.evaluation.metrics import summarize_population, tail_summaries
    rng = np.random.default_rng(7)
    rates, errors = rng.random(40), rng.random((2, 40))
    got = quintile_split(errors, rates)
    q = availability_quintiles(rates)
    for j in range(5):
        sub = errors[:, q == j]
        own = summarize_population("x", sub, sub, [90])
        np.testing.assert_allclose(got[f"q{j + 1}_error_mean"], own["x_error_mean"])
        np.testing.assert_allclose(got[f"q{j + 1}_error_p90"], own["x_error_p90"])
        np.testing.assert_allclose(got[f"q{j + 1}_error_worst10"], own["x_error_worst10"])
        np.testing.assert_allclose(got[f"q{j + 1}_error_worst10"],
                                   tail_summaries(sub, None)["test_error_worst10"])


def test_linear_percentiles_are_numpys_of_each_quintile():
    rng = np.random.default_rng(8)
    rates, errors = rng.random(17), rng.random((2, 17))
    got = quintile_split(errors, rates, method="linear")
    q = availability_quintiles(rates)
    for j in range(5):
        np.testing.assert_allclose(got[f"q{j + 1}_error_p90"],
                                   np.percentile(errors[:, q == j], 90, axis=1))


def test_nan_and_empty_quintiles():
    errors = np.array([[0.1, np.nan, 0.3], [0.1, 0.2, 0.3]])
    got = quintile_split(errors, [0.9, 0.1, 0.5])   # quintiles 3, 0, 1 (q4, q1, q2)
    # the diverged client's quintile is NaN in its replica only
    for stat in ("mean", "p90", "worst10"):
        assert np.isnan(got[f"q1_error_{stat}"][0]) and got[f"q1_error_{stat}"][1] == \
            pytest.approx(0.2)
        assert got[f"q2_error_{stat}"] == pytest.approx([0.3, 0.3])
        assert np.isnan(got[f"q3_error_{stat}"]).all() and np.isnan(got[f"q5_error_{stat}"]).all()
    assert [got[f"q{j}_clients"][0] for j in range(1, 6)] == [1, 1, 0, 1, 0]
    assert np.isnan(got["q3_rate_mean"]).all() and got["q4_rate_mean"] == pytest.approx([.9, .9])


def test_a_sample_is_placed_by_the_populations_quintiles():
    rng = np.random.default_rng(9)
    n, k = 50, 13
    rates = rng.integers(0, 5, n) / 5.0
    clients = np.sort(rng.choice(n, k, replace=False))
    errors = rng.integers(0, 11, (2, k)) / 10.0
    online, sampled = rng.integers(0, 40, (2, n)), rng.integers(0, 9, n)
    counts = {"rounds_online": online, "rounds_sampled": sampled}
    got = population_split(errors, rates, clients, None, counts)
    want = ref_split(errors, list(clients), rates, np.ones(k), counts)
    assert_split_equal(got, want)
    # the participation is the whole quintile's, sampled or not
    q = np.asarray(ref_quintiles(rates))
    assert got["q2_rounds_online"].tolist() == online[:, q == 1].sum(axis=1).tolist()
    with pytest.raises(ValueError, match="indices into the 50 clients"):
        population_split(errors, rates, clients + 40)


# --------------------------------------------------------------------------------------------
# An evaluation's per-client arrays


def evaluation(rng, r=2, n_train=20, n_test=15, k=None):
    """Per-client arrays of an evaluation with a personalised one (seen / unseen, after 0 and
    5 steps); with k, the seen clients and the test devices are samples of k."""
    pc = {"train_loss": rng.random((r, n_train)), "train_error": rng.random((r, n_train)),
          "test_loss": rng.random((r, k or n_test)), "test_error": rng.random((r, k or n_test)),
          "rounds_sampled": rng.integers(0, 9, (r, n_train))}
    for fam in ("seen", "unseen", "seen_ft5", "unseen_ft5"):
        size = k or (n_train if fam.startswith("seen") else n_test)
        pc[f"{fam}_error"], pc[f"{fam}_loss"] = rng.random((r, size)), rng.random((r, size))
    if k:
        pc["seen_clients"] = np.sort(rng.choice(n_train, k, replace=False))
        pc["test_clients"] = pc["unseen_clients"] = np.sort(rng.choice(n_test, k, False))
    return pc


@pytest.mark.parametrize("k", [None, 6])
def test_an_evaluation_is_split_per_family_by_its_populations_rates(k):
    rng = np.random.default_rng(10)
    pc = evaluation(rng, k=k)
    train_rates, test_rates = rng.random(20), rng.random(15)
    split = AvailabilitySplit(train_rates, test_rates, ("rounds_sampled",))
    got = split.summaries(pc)
    for fam in ("test", "seen", "unseen", "seen_ft5", "unseen_ft5"):
        seen = fam.startswith("seen")
        clients = pc.get(("seen" if seen else fam.partition("_")[0]) + "_clients")
        want = ref_split(pc[f"{fam}_error"],
                         list(range(20 if seen else 15)) if clients is None else list(clients),
                         train_rates if seen else test_rates,
                         np.ones(pc[f"{fam}_error"].shape[1]),
                         {"rounds_sampled": pc["rounds_sampled"]} if seen else {})
        assert_split_equal({k2[len(fam) + 7:]: v for k2, v in got.items()
                            if k2.startswith(f"{fam}_avail_")}, want)
    assert not any(key.startswith("train") for key in got)
    # only the populations that have rates; nothing at all without
    only_test = AvailabilitySplit(test_rates=test_rates).summaries(pc)
    assert {key.partition("_avail_")[0] for key in only_test} == {"test", "unseen", "unseen_ft5"}
    assert AvailabilitySplit().summaries(pc) == {}
    with pytest.raises(ValueError, match="no participation counts 'rounds_online'"):
        AvailabilitySplit(train_rates, participation=("rounds_online",)).summaries(pc)


@pytest.fixture(scope="module")
def built(tiny_synthetic):
    from deltafl_jax.run.experiment import build_experiment
    from tests.conftest import tiny_config
    return build_experiment(tiny_config(client_holdout=0.25), tiny_synthetic)


def test_experiment_summarize_adds_the_split_only_when_given(built):
    rng = np.random.default_rng(11)
    n_train, n_test = built.data.train.num_clients, built.data.test.num_clients
    pc = evaluation(rng, built.replicas.size, n_train, n_test)
    del pc["seen_ft5_error"], pc["unseen_ft5_error"], pc["rounds_sampled"]
    plain = built.summarize(pc)
    assert not any("_avail_" in key for key in plain)
    split = AvailabilitySplit(rng.random(n_train), rng.random(n_test))
    got = dataclasses.replace(built, evaluator=dataclasses.replace(
        built.evaluator, availability_split=split)).summarize(pc)
    extra = split.summaries(pc)
    assert list(got) == list(plain) + list(extra)
    for key in plain:
        np.testing.assert_array_equal(got[key], plain[key])
    for key in extra:
        np.testing.assert_array_equal(got[key], extra[key])
    assert {key.partition("_avail_")[0] for key in extra} == {"test", "seen", "unseen"}


@pytest.mark.slow
def test_a_runs_metrics_and_summary_hold_the_split(tiny_synthetic, tmp_path, monkeypatch):
    """End to end: each metrics.jsonl record and summary.json's final metrics hold the split,
    equal to the split of the final per-client arrays that clients.npz keeps."""
    from deltafl_jax.run import runner
    from deltafl_jax.run.runner import run_experiment
    from tests.conftest import tiny_config
    n_train, n_test = tiny_synthetic.train.num_clients, tiny_synthetic.test.num_clients
    split = AvailabilitySplit(np.linspace(0.0, 1.0, n_train)[::-1], np.arange(n_test) % 3)
    build = runner.build_experiment

    def with_split(*a, **kw):
        exp = build(*a, **kw)
        return dataclasses.replace(exp, evaluator=dataclasses.replace(
            exp.evaluator, availability_split=split))

    monkeypatch.setattr(runner, "build_experiment", with_split)
    out = str(tmp_path / "run")
    run_experiment(tiny_config(client_holdout=0.25, output_dir=out), tiny_synthetic)
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    final = json.load(open(os.path.join(out, "summary.json")))["final"]
    clients = dict(np.load(os.path.join(out, "clients.npz")))
    want = split.summaries(clients)
    assert {key.partition("_avail_")[0] for key in want} == {"test", "seen", "unseen"}
    last = [rec for rec in records if rec["round"] == records[-1]["round"]]
    assert len(last) == len(final) == 2
    for r, values in enumerate(final.values()):
        for name, v in want.items():
            assert values[name] == pytest.approx(float(v[r]), nan_ok=True), name
            assert last[r][name] == pytest.approx(float(v[r]), nan_ok=True), name


# --------------------------------------------------------------------------------------------
# The report's figure


def hand_made_final(summary, families, shift):
    """summary.json's "final" with a hand-made split: replica (theta, seed) of quintile j has
    error `stat` = 0.1 j + offset(stat) + 0.01 seed + shift + 0.2 (theta < 1), mean rate 0.1 j."""
    offsets = {"mean": 0.0, "p90": 0.05, "worst10": 0.08}
    final = {}
    for lab in summary["replicas"]:
        key = lab.get("key") or f"theta={lab['theta']:g}_seed={lab['seed']}"
        row = {}
        for fam in families:
            for j in range(1, 6):
                for stat, off in offsets.items():
                    row[f"{fam}_avail_q{j}_error_{stat}"] = (
                        0.1 * j + off + 0.01 * lab["seed"] + shift
                        + 0.2 * (lab["theta"] < 1.0))
                row[f"{fam}_avail_q{j}_rate_mean"] = 0.1 * j
        final[key] = row
    return final


@pytest.mark.slow   # a run or a figure end to end: CI's second step
def test_the_report_draws_the_error_against_availability(tmp_path):
    from deltafl_jax import report
    from deltafl_jax.outputs.directory import RunReader, RunWriter
    from deltafl_jax.report.figures import method_styles
    from tests.test_figures import fake_run
    root = tmp_path / "runs"
    for name, algorithm, param, values, shift in (("delta", "deltafl", None, (1.0, 0.5), 0.0),
                                                  ("prox", "fedprox", "fedprox_mu", (0.1,),
                                                   0.03)):
        path = fake_run(root / name, algorithm, param, values)
        reader = RunReader(path)
        summary = {k: v for k, v in reader.summary().items() if k != "schema_version"}
        keys = reader.keys()
        final = hand_made_final(summary, ("test", "seen"), shift)
        summary["final"] = dict(zip(keys, final.values()))
        RunWriter(path).write_summary(summary)
    runs, skipped = report.load([str(root)])
    assert skipped == []
    got = report.write_report(runs, str(tmp_path / "out"), dpi=40)
    name = "availability_error_synthetic_linear.png"
    assert name in got["drawn"] and os.path.exists(tmp_path / "out" / name)
    fig = got["drawn"][name]
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert [ax.get_title().replace("\n", " ") for ax in panels] == [
        f"{who}: {stat}" for who in ("test devices", "seen clients (held-out data)")
        for stat in ("mean", "p90", "worst 10%")]
    order = ["FedAvg [delta]", "Δ-FL, θ = 0.5 [delta]", "FedProx, μ = 0.1 [prox]"]
    styles = method_styles(order)
    # each line: the hand-made values' mean over seeds 1 and 2 (0.015), per quintile
    want = {"FedAvg [delta]": 0.015, "Δ-FL, θ = 0.5 [delta]": 0.215,
            "FedProx, μ = 0.1 [prox]": 0.045}
    for ax, off in zip(panels, [0.0, 0.05, 0.08] * 2):
        lines = ax.get_lines()
        assert [ln.get_label() for ln in lines] == order
        for ln in lines:
            assert ln.get_color() == styles[ln.get_label()].color
            np.testing.assert_allclose(ln.get_xdata(), [1, 2, 3, 4, 5])
            np.testing.assert_allclose(ln.get_ydata(),
                                       0.1 * np.arange(1, 6) + off + want[ln.get_label()])
    FigureCanvas(fig)
    for ax in panels[3:]:    # the lowest row: the quintiles, each with its mean rate
        assert [t.get_text() for t in ax.get_xticklabels()] == [
            f"q{j}\n{0.1 * j:.3g}" for j in range(1, 6)]
    # a run without the split draws no such figure
    plain = tmp_path / "plain"
    fake_run(plain / "delta", "deltafl", None, (1.0, 0.5))
    runs, _ = report.load([str(plain)])
    assert not any(k.startswith("availability_")
                   for k in report.write_report(runs, str(tmp_path / "out2"), dpi=40)["drawn"])


def FigureCanvas(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig).draw()
