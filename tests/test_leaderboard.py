"""The tail leaderboard (deltafl_jax.studies.leaderboard, python -m experiments.leaderboard): every
method joins through its spec's Board; the choice of a grid point, the seed intervals, the
Pareto frontier and the tables against hand computations and scipy; bad flags are one line and
exit 2; the documentation's tables are the rendering of the records the command wrote. The slow test
runs the command at toy size and checks its choices and cells against NumPy recomputations
from the runs' clients.npz."""

import json
import math
import os
import shutil

import numpy as np
import pytest
from scipy import stats

from conftest import run_command
from deltafl_jax.algorithms import registry
from deltafl_jax.algorithms.leaderboard import BoardSetting
from deltafl_jax.errors import ConfigError
from deltafl_jax.replicas.labels import ReplicaLabel
from deltafl_jax.studies import leaderboard as lb

HERE = os.path.dirname(__file__)
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(REPO, "experiments", "leaderboard_results")
SMALL = BoardSetting(dataset="synthetic", model="linear", train_clients=200,
                     clients_per_round=20)


def run_board(argv, capsys):
    """experiments.leaderboard in-process (conftest.run_command); (exit code, stderr,
    stdout)."""
    from experiments import leaderboard as board
    return run_command(board, argv, capsys)


def test_every_board_is_valid():
    """Each spec's board grids name its own flags with values in range; a join names a
    method with a board; the controls and variants have none."""
    boards = {n: s.reporting.leaderboard for n, s in registry.SPECS.items()
              if s.reporting.leaderboard is not None}
    for name, board in boards.items():
        for quick in (True, False):
            lb.check_grid(name, board.grid_for(quick))
        if board.joins is not None:
            assert board.joins[0] in boards and boards[board.joins[0]].joins is None
    assert {"gifair", "fedmgda", "deltafl", "fedavg", "propfair", "ditto", "feddyn",
            "apfl"} <= set(boards)
    assert not {"fedavg_sub", "afl_qffl", "deltafl_alt"} & set(boards)
    # A method with Ditto's layer is no leaderboard method (it would inherit its base's board:
    # fedavg+ditto would claim to be Delta-FL at theta = 1).
    assert registry.get("fedavg+ditto").reporting.leaderboard is None
    assert registry.get("deltafl+ditto").reporting.leaderboard is None
    assert lb.board_methods(SMALL) == list(boards)
    assert lb.host_of("fedavg") == ("deltafl", 1.0)


def test_methods_that_do_not_apply_are_refused():
    big = SMALL._replace(train_clients=5000)
    assert "afl" not in lb.board_methods(big) and "afl" in lb.board_methods(SMALL)
    with pytest.raises(ConfigError, match="afl does not apply to synthetic / linear: it trains "
                                          "every training client every round"):
        lb.board_methods(big, ["deltafl", "afl"])
    with pytest.raises(ConfigError, match="fedavg_sub is not a leaderboard method"):
        lb.board_methods(SMALL, ["fedavg_sub"])
    with pytest.raises(ConfigError, match="needs m >= 2"):
        lb.board_methods(SMALL._replace(clients_per_round=1), ["gifair"])
    with pytest.raises(ConfigError, match="--gifair_coeff must be >= 0"):
        lb.check_grid("gifair", {"gifair_coeff": (-1.0,)})
    with pytest.raises(ConfigError, match="server_lr"):
        lb.check_grid("afl", {"server_lr": (0.5,)})       # AFL's server step is its own
    with pytest.raises(ConfigError, match="not one of its swept flags"):
        lb.check_grid("term", {"qffl_q": (1.0,)})


def test_points_and_choice():
    labels = [ReplicaLabel("fedmgda", 1.0, s, "fedmgda_epsilon", e, (("server_lr", 0.5),))
              for e in (0.1, 1.0) for s in (1, 2)]
    assert lb.point_of(labels[0], "fedmgda") == {"fedmgda_epsilon": 0.1, "server_lr": 0.5}
    assert lb.point_key({"server_lr": 0.5, "fedmgda_epsilon": 0.1}) == \
        "fedmgda_epsilon=0.1,server_lr=0.5"
    assert lb.point_of(ReplicaLabel("deltafl", 0.5, 1), "deltafl") == {"thetas": 0.5}
    final = {lab.key(): {"test_error_p90": p} for lab, p in zip(labels, (0.5, 0.7, 0.6, 0.6))}
    points = lb.per_point(labels, final, "fedmgda")
    assert list(points) == ["fedmgda_epsilon=0.1,server_lr=0.5",
                            "fedmgda_epsilon=1,server_lr=0.5"]
    assert points["fedmgda_epsilon=0.1,server_lr=0.5"]["seeds"] == [1, 2]
    # both means are 0.6: the tie goes to the first point in grid order
    assert lb.choose(points) == "fedmgda_epsilon=0.1,server_lr=0.5"
    points["fedmgda_epsilon=0.1,server_lr=0.5"]["test_error_p90"][1] = math.nan   # diverged
    assert lb.choose(points) == "fedmgda_epsilon=1,server_lr=0.5"


def _validation(points):
    """Fabricated validation records: point key -> (p90 per seed, train loss per seed)."""
    return {k: {"point": {"feddyn_alpha": float(k.split("=")[1])}, "seeds": [1, 2, 3],
                "test_error_p90": list(p90), "train_loss_mean": list(loss)}
            for k, (p90, loss) in points.items()}


def _by_hand(points, limit):
    """The rule written out: drop the seeds whose p90 or train loss is not finite or whose
    loss exceeds the limit; the points with the fewest dropped seeds; of those, the smallest
    mean p90 over the kept seeds, the first on ties."""
    ranked = []
    for i, (k, (p90, loss)) in enumerate(points.items()):
        keep = [p for p, l in zip(p90, loss) if math.isfinite(p) and math.isfinite(l)
                and l <= limit]
        if keep:
            ranked.append((len(p90) - len(keep), sum(keep) / len(keep), i, k))
    return min(ranked)[3] if ranked else None


def test_a_point_one_of_whose_seeds_diverged_is_passed_over():
    """The Shakespeare case: at alpha = 0.1 one seed of three went astray (train loss 5.06 over
    log 53 = 3.97, p90 0.95, finite) while its mean p90 is still the smallest; the rule passes
    it over for alpha = 0.01, whose seeds all trained."""
    limit = lb.loss_limit_of(53)
    assert limit == pytest.approx(np.log(53))
    points = {"feddyn_alpha=0.01": ([0.80, 0.81, 0.82], [2.1, 2.2, 2.1]),
              "feddyn_alpha=0.1": ([0.75, 0.76, 0.77], [2.4, 5.06, 2.4])}
    scores = _validation(points)
    assert lb.diverged_seeds(scores["feddyn_alpha=0.1"], loss_limit=limit) == [False, True,
                                                                                 False]
    assert lb.choose(scores, loss_limit=limit) == "feddyn_alpha=0.01" == _by_hand(points, limit)
    assert lb.choose(scores) == "feddyn_alpha=0.1"       # without the limit: the finite p90s


@pytest.mark.parametrize("case", [
    {"a=0.01": ([0.8, 0.7, 0.9], [9.6, 2.0, 2.0]), "a=0.1": ([0.75, 0.9, 0.8], [2, 5.1, 9])},
    {"a=0.01": ([0.8, math.nan, 0.9], [2, 2, 2]), "a=0.1": ([0.9, 0.9, 0.9], [2, 2, 2])},
    {"a=0.01": ([0.8, 0.7, 0.9], [2, math.inf, 2]), "a=0.1": ([0.6, 0.6, 0.6], [2, 2, 9])},
    {"a=0.01": ([0.8, 0.7, 0.9], [9, 9, 9]), "a=0.1": ([0.5, 0.6, 0.6], [9, 9, 9])},
    {"a=0.01": ([0.7, 0.8], [2.0, 2.0]), "a=0.1": ([0.8, 0.7], [2.0, 2.0])},
])
def test_choice_against_the_rule_by_hand(case):
    """Every seed diverged somewhere, a NaN p90, an infinite loss, every seed of every point
    astray (None), a tie (the first point)."""
    limit = lb.loss_limit_of(10)
    scores = {k: {"point": {}, "seeds": list(range(len(p))), "test_error_p90": list(p),
                  "train_loss_mean": list(l)} for k, (p, l) in case.items()}
    assert lb.choose(scores, loss_limit=limit) == _by_hand(case, limit)


@pytest.mark.parametrize("which,want", [("cpu", (1, 2, 3)), ("download", (1,)),
                                         ("paper", (1,))])
def test_default_tune_seeds(which, want):
    """The cpu set tunes on the final runs' seeds, the others on seed 1."""
    from types import SimpleNamespace
    from experiments import leaderboard as board
    board.FLAGS.unparse_flags()
    board.parse_flags_or_fail(["leaderboard", f"--set={which}"])
    try:
        got = board.default_tune_seeds(
            [SimpleNamespace(base=SimpleNamespace(training=SimpleNamespace(seeds=(1, 2, 3))))])
    finally:
        board.FLAGS.unparse_flags()
    assert got == want


def test_seed_interval_is_student_t():
    v = [0.31, 0.35, 0.30]
    mean, half = lb.seed_interval(v)
    s = np.std(v, ddof=1)
    assert mean == pytest.approx(np.mean(v))
    assert half == pytest.approx(stats.t.ppf(0.975, 2) * s / math.sqrt(3))
    assert math.isnan(lb.seed_interval([0.3])[1])


def test_pareto_front_by_brute_force():
    rng = np.random.default_rng(0)
    pts = [{"mean": float(a), "p90": float(b)} for a, b in rng.integers(0, 12, size=(40, 2))]
    front = lb.pareto(pts)
    for p in pts:
        dominated = any(q["mean"] <= p["mean"] and q["p90"] <= p["p90"] and q != p
                        and (q["mean"], q["p90"]) != (p["mean"], p["p90"]) for q in pts)
        assert (p in front) == (not dominated)
    assert [p["mean"] for p in front] == sorted(p["mean"] for p in front)


def _record():
    def entry(*p90s):
        return {"test_error_mean": [x / 2 for x in p90s], "test_error_p90": list(p90s),
                "test_error_worst10": [min(1.0, x + 0.1) for x in p90s],
                "test_error_std": [0.2, 0.2, 0.2]}
    return {"name": "toy", "title": "Toy", "methods": [
        {"display": "A", "chosen": "q=1", "chosen_text": "q = 1", "validation_p90": 0.7,
         "final": {"q=1": entry(0.8, 0.8, 0.8), "q=2": entry(0.9, 0.9, 0.9)}},
        {"display": "B", "chosen": "t=1", "chosen_text": "", "validation_p90": None,
         "final": {"t=1": entry(0.6, 0.7, 0.65)}}]}


def test_table_hand_case():
    table = lb.table_markdown(_record())
    lines = table.splitlines()
    assert lines[0] == "| method | chosen on validation (val. p90) | mean | p90 | worst 10% | std |"
    # B first (lower p90), its cells the mean ± t_{0.975,2} s / sqrt(3) in %; the best in bold
    half = stats.t.ppf(0.975, 2) * np.std([60, 70, 65], ddof=1) / math.sqrt(3)
    assert lines[2].startswith(
        f"| B | — | **32.50** ± {half / 2:.2f} | **65.00** ± {half:.2f} |")
    assert lines[3].startswith("| A | q = 1 (70.00) | 40.00 ± 0.00 | 80.00 ± 0.00 |")
    assert "| **20.00** ± 0.00 |" in lines[2] and "| **20.00** ± 0.00 |" in lines[3]  # a tie
    readme = "x\n<!-- leaderboard: toy -->\nold\n<!-- /leaderboard -->\ny"
    new = lb.replace_block(readme, _record())
    assert new.startswith("x\n") and new.endswith("\ny") and lb.readme_table(new, "toy") == table
    with pytest.raises(ValueError):
        lb.replace_block("no markers", _record())
    points = lb.frontier_points(_record())
    assert [(p["method"], p["chosen"]) for p in points] == [("A", True), ("A", False),
                                                            ("B", True)]


def test_readme_tables_are_the_commands():
    """Every setting of the CPU set has a table in the documentation (the page that holds its
    markers, docs/results/leaderboard.md), and it is the rendering of the record the command
    wrote (experiments/leaderboard_results/, written with --readme)."""
    from experiments.leaderboard import SETS
    from experiments.pages import pages_holding
    for name in SETS["cpu"]:
        (page,) = pages_holding(f"<!-- leaderboard: {name} -->")
        with open(page) as f:
            readme = f.read()
        with open(os.path.join(RESULTS, f"{name}.json")) as f:
            record = json.load(f)
        assert lb.readme_table(readme, name) == lb.table_markdown(record), name
        assert len(record["seeds"]) == 3 and record["grid"] == "quick"
        assert {m["name"] for m in record["methods"]} == set(lb.board_methods(
            BoardSetting(record["dataset"], record["model"], record["train_clients"],
                         record["clients_per_round"])))


def test_ditto_and_apfl_records_are_fedavgs_bit_for_bit():
    """docs/results/leaderboard.md: Ditto's and APFL's rows are FedAvg's on every setting (the
    global model they are scored on is FedAvg's, and FedAvg trained inside Delta-FL's program
    is FedAvg alone bit for bit): every per-seed test statistic of the stored records is
    equal (the mean training loss, summed in each method's own program, to float32
    rounding)."""
    from experiments.leaderboard import SETS
    for name in SETS["cpu"]:
        with open(os.path.join(RESULTS, f"{name}.json")) as f:
            methods = {m["name"]: m for m in json.load(f)["methods"]}
        (fedavg,) = methods["fedavg"]["final"].values()
        for other in ("ditto", "apfl"):
            (final,) = methods[other]["final"].values()
            stats = [k for k in final if k.startswith("test_")]
            assert len(stats) >= 5 and final["seeds"] == fedavg["seeds"]
            assert {k: final[k] for k in stats} == {k: fedavg[k] for k in stats}, (name, other)
            np.testing.assert_allclose(final["train_loss_mean"], fedavg["train_loss_mean"],
                                       rtol=1e-6)


BAD = {
    "not a leaderboard method": (["--methods=fedavg_sub"], "fedavg_sub is not a leaderboard"),
    "does not apply": (["--methods=afl", "--synthetic_num_clients=2400",
                        "--synthetic_max_examples=50"], "afl does not apply"),
    "out of range": (["--gifair_coeff=0.5,2"], "--gifair_coeff must be in [0, 1]"),
    "negative epsilon": (["--fedmgda_epsilon=-1"], "--fedmgda_epsilon must be >= 0"),
    "unknown setting": (["--settings=nope"], "--settings: unknown setting(s) nope"),
    "unknown method": (["--methods=nope"], "unknown algorithm 'nope'"),
    "bad multiplier": (["--lr_multipliers=0,1"], "--lr_multipliers must be finite and > 0"),
    "m above half": (["--clients_per_round=150"], "exceeds the 100 clients of the half"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_flags_one_line_exit_2(tmp_path, capsys, case):
    argv, message = BAD[case]
    out = tmp_path / "board"
    code, err, _ = run_board(["--settings=leaderboard_synthetic_1_1", f"--out={out}", *argv],
                             capsys)
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_results_are_never_clobbered(tmp_path, capsys):
    out = tmp_path / "board"
    (out / "leaderboard_synthetic_1_1").mkdir(parents=True)
    (out / "leaderboard_synthetic_1_1" / "leaderboard.json").write_text("{}")
    code, err, _ = run_board(["--settings=leaderboard_synthetic_1_1", f"--out={out}"], capsys)
    assert code == 2 and "already holds the leaderboard" in err
    assert (out / "leaderboard_synthetic_1_1" / "leaderboard.json").read_text() == "{}"


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_estimate_writes_nothing(tmp_path, capsys):
    """--estimate builds, compiles and times each program (here the learning-rate grid and
    SCAFFOLD's final runs) and prints their sum; --out stays untouched."""
    out = tmp_path / "board"
    code, err, stdout = run_board(["--settings=leaderboard_synthetic_1_1", "--methods=scaffold",
                                   "--estimate", "--estimate_rounds=1", "--num_rounds=3",
                                   "--synthetic_num_clients=40", "--clients_per_round=5",
                                   f"--out={out}"], capsys)
    assert code in (0, None), err
    assert "estimate of leaderboard_synthetic_1_1 fedavg lr" in stdout
    assert "estimate of leaderboard_synthetic_1_1 scaffold final" in stdout
    assert "estimate of all 2 programs" in stdout and not out.exists()


# --------------------------------------------------------------------------------------------
# The command at toy size


TOY = ["--settings=leaderboard_synthetic_1_1", "--methods=deltafl,fedavg,gifair,fedmgda,scaffold",
       "--num_rounds=4", "--eval_every=2", "--synthetic_num_clients=40", "--clients_per_round=6",
       "--lr_multipliers=0.5,1", "--seeds=1,2"]


def _p90(errors):
    """The lower 90th percentile of each row: the ceil(0.9 K)-th smallest value."""
    k = errors.shape[1]
    return np.sort(errors, axis=1)[:, math.ceil(0.9 * k) - 1]


def _worst10(errors):
    k = errors.shape[1]
    j, f = divmod(0.1 * k, 1.0)
    desc = -np.sort(-errors, axis=1)
    return (desc[:, :int(j)].sum(axis=1) + f * desc[:, int(j)]) / (0.1 * k)


@pytest.mark.slow
def test_the_command_at_toy_size(tmp_path, capsys):
    from deltafl_jax.outputs.directory import RunReader
    out = tmp_path / "board"
    readme = tmp_path / "README.md"
    readme.write_text("head\n<!-- leaderboard: leaderboard_synthetic_1_1 -->\n"
                      "<!-- /leaderboard -->\ntail\n")
    code, err, stdout = run_board([*TOY, f"--out={out}", "--readme",
                                   f"--readme_path={readme}"], capsys)
    assert code in (0, None), err
    assert "[leaderboard 1/" in stdout and "ETA" in stdout
    root = out / "leaderboard_synthetic_1_1"
    record = json.loads((root / "leaderboard.json").read_text())
    table = lb.table_markdown(record)
    assert table in (root / "leaderboard.md").read_text()
    assert lb.readme_table(readme.read_text(), "leaderboard_synthetic_1_1") == table
    assert json.loads((tmp_path / "experiments" / "leaderboard_results" /
                       "leaderboard_synthetic_1_1.json").read_text()) == record
    assert (root / "frontier.png").stat().st_size > 1000
    methods = {m["name"]: m for m in record["methods"]}
    assert set(methods) == {"deltafl", "fedavg", "gifair", "fedmgda", "scaffold"}
    # The choice: the validation run's p90 recomputed from its clients.npz, mean over seeds.
    for name in ("deltafl", "gifair", "fedmgda"):
        reader = RunReader(str(root / name / "validation"))
        clients = reader.clients()
        p90 = _p90(np.asarray(clients["test_error"], np.float64))
        by_point = {}
        for lab, v in zip(reader.labels(), p90):
            by_point.setdefault(lb.point_key(lb.point_of(lab, name)), []).append(v)
        means = {k: np.mean(v) for k, v in by_point.items()}
        assert methods[name]["chosen"] == min(means, key=lambda k: (means[k], list(means).index(k)))
    # The cells: the final runs' per-client errors, recomputed.
    reader = RunReader(str(root / "deltafl" / "final"))
    err = np.asarray(reader.clients()["test_error"], np.float64)
    labels = reader.labels()
    fedavg = [r for r, lab in enumerate(labels) if lab.theta == 1.0]
    assert len(fedavg) == 2                      # FedAvg ran in Delta-FL's program
    got = methods["fedavg"]["final"]["thetas=1"]
    np.testing.assert_allclose(got["test_error_mean"], err[fedavg].mean(axis=1), rtol=1e-12)
    np.testing.assert_allclose(got["test_error_p90"], _p90(err[fedavg]), rtol=1e-6)
    np.testing.assert_allclose(got["test_error_worst10"], _worst10(err[fedavg]), rtol=1e-9)
    np.testing.assert_allclose(got["test_error_std"], err[fedavg].std(axis=1), rtol=1e-9)
    assert "thetas=1" not in methods["deltafl"]["final"]
    # Rerun: refused without --overwrite; with the record gone, every program is read back.
    code, err_text, _ = run_board([*TOY, f"--out={out}"], capsys)
    assert code == 2 and "already holds the leaderboard" in err_text
    os.remove(root / "leaderboard.json")
    code, _, stdout = run_board([*TOY, f"--out={out}"], capsys)
    assert code in (0, None) and stdout.count("read back") >= 7
    assert json.loads((root / "leaderboard.json").read_text()) == record
