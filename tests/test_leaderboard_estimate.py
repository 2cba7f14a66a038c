"""The leaderboard's --estimate projection (deltafl_jax.run.estimate: program_work, project,
calibration_programs): a program's work counted by hand from its clients' sizes and its
spec's declared facts, a projected program's cost as its calibrations' cost times its work
ratio (hand-computed), and the command compiling the rounds of the two calibration programs
of a setting only (a counter on the compilations). No timing is asserted."""

import math

import numpy as np
import pytest

from conftest import tiny_config
from deltafl_jax import load_dataset
from deltafl_jax.run.estimate import (DeviceMemory, Estimate, ProgramWork,
                                      calibration_programs, program_work, project,
                                      total_lines)


def measured(name, build, compile_, round_s, eval_s, rounds=200, every=50, replicas=3):
    return Estimate(name=name, num_rounds=rounds, eval_every=every,
                    build_s=build, compile_s=compile_, round_s=round_s, eval_s=eval_s,
                    memory=DeviceMemory(2 ** 20, "compiled round"),
                    flops_per_round=None, train_trips=[], work={}, backend="cpu", devices=2,
                    replicas=replicas, lanes=2)


def work(steps, examples, rounds=200, every=50, replicas=3, losses=0.0):
    evaluations = rounds // every + (1 if rounds % every else 0)
    return ProgramWork(replicas=replicas, rounds=rounds, eval_every=every,
                       evaluations=evaluations, train_steps=steps, loss_examples=losses,
                       eval_examples=examples)


def test_one_calibration_scales_by_the_work_ratio():
    cal = measured("a", build=1.0, compile_=10.0, round_s=0.02, eval_s=0.1)
    est = project("b", work(1000.0, 5000.0, rounds=40, every=10),
                  [(cal, work(400.0, 2000.0))])
    assert est.round_s == pytest.approx(0.02 * 1000 / 400)        # 0.05
    assert est.eval_s == pytest.approx(0.1 * 5000 / 2000)         # 0.25
    assert (est.build_s, est.compile_s) == (1.0, 10.0)
    assert est.evaluations == 4 and est.num_rounds == 40
    assert est.projected_s == pytest.approx(1.0 + 10.0 + 40 * 0.05 + 4 * 0.25)   # 14
    assert est.projected_from == "a" and est.timed_rounds == 0
    # the calibration's own work gives its measurements back
    again = project("a'", work(400.0, 2000.0), [(cal, work(400.0, 2000.0))])
    assert again.projected_s == pytest.approx(cal.projected_s)


def test_two_calibrations_pool_their_cost_per_step():
    cals = [(measured("a", 1.0, 10.0, 0.02, 0.1), work(400.0, 2000.0)),
            (measured("b", 3.0, 14.0, 0.04, 0.3), work(600.0, 3000.0))]
    est = project("c", work(1000.0, 1000.0, replicas=12), cals)
    assert est.round_s == pytest.approx((0.02 + 0.04) / (400 + 600) * 1000)   # 0.06
    assert est.eval_s == pytest.approx((0.1 + 0.3) / (2000 + 3000) * 1000)    # 0.08
    assert est.build_s == pytest.approx(2.0) and est.compile_s == pytest.approx(12.0)
    assert est.projected_s == pytest.approx(2.0 + 12.0 + 200 * 0.06 + 4 * 0.08)
    assert est.replicas == 12 and est.projected_from == "a, b"
    lines = est.lines()
    assert lines[0].startswith("estimate of c (projected from a, b): 12 replicas, 200 rounds")
    assert "(1000 local steps x 6.000e-05 s + 0 loss examples x 0.000e+00 s)" in lines[3]
    total = total_lines([cals[0][0], cals[1][0], est])[0]
    summed = cals[0][0].projected_s + cals[1][0].projected_s + est.projected_s
    assert total.startswith("estimate of all 3 programs (2 measured, 1 projected): projected "
                            f"run {summed:.3f} s")
    with pytest.raises(ValueError):
        project("d", work(1.0, 1.0), [])


def test_a_round_without_losses_and_one_with_fix_both_costs():
    """FedAvg evaluates no loss: its round fixes the cost of a step; Delta-FL's round, which
    evaluates its sampled clients' losses, then fixes the cost of a loss-evaluated example."""
    fedavg = (measured("fedavg", 1.0, 10.0, 0.02, 0.1), work(400.0, 2000.0))
    deltafl = (measured("deltafl", 1.0, 10.0, 0.045, 0.1), work(300.0, 2000.0, losses=6000.0))
    a, b = 0.02 / 400, (0.045 - 300 * 0.02 / 400) / 6000          # 5e-5, 5e-6
    est = project("q-FFL", work(100.0, 2000.0, losses=3000.0), [fedavg, deltafl])
    assert est.round_s == pytest.approx(100 * a + 3000 * b)       # 0.02
    for cal, w in (fedavg, deltafl):                               # their own rounds back
        assert project("x", w, [fedavg, deltafl]).round_s == pytest.approx(cal.round_s)
    # a negative cost per loss example (here Delta-FL's rounds faster than its steps alone
    # cost at FedAvg's rate) is not fitted: one pooled cost per step instead
    fast = (measured("deltafl", 1.0, 10.0, 0.01, 0.1), deltafl[1])
    est = project("q-FFL", work(100.0, 2000.0, losses=3000.0), [fedavg, fast])
    assert est.round_s == pytest.approx(100 * (0.02 + 0.01) / (400 + 300))


def test_calibration_programs_are_the_first_and_the_largest_other():
    w = [work(100.0, 1.0), work(900.0, 1.0), work(500.0, 1.0), work(700.0, 1.0, rounds=400)]
    # program 1 shares program 0's algorithm; of the others, 3 has the most steps in all
    assert calibration_programs(["a", "a", "b", "c"], w) == [0, 3]
    assert calibration_programs(["a", "a"], w[:2]) == [0]
    # the first evaluates no loss: of the others that evaluate losses, the most steps in all
    w[2] = work(500.0, 1.0, losses=10.0)
    assert calibration_programs(["a", "a", "b", "c"], w) == [0, 2]
    assert calibration_programs([], []) == []


def _steps_by_hand(sizes, epochs, batch):
    return [epochs * math.ceil(n / batch) for n in sizes]


def test_program_work_counts_by_hand():
    config = tiny_config(algorithm="deltafl", thetas=(0.5, 1.0), seeds=(1, 2), local_epochs=2,
                         batch_size=10, clients_per_round=5, num_rounds=7, eval_every=3)
    data = load_dataset(config.data)
    sizes = [int(n) for n in data.train.sizes]
    mean_steps = sum(_steps_by_hand(sizes, 2, 10)) / len(sizes)
    w = program_work(config, data)
    # 2 seeds x (theta 0.5 + theta 1): Delta-FL keeps the mass theta of the sampled clients
    assert w.train_steps == pytest.approx(2 * (0.5 + 1.0) * 5 * mean_steps)
    # every replica evaluates its 5 sampled clients' losses F_k(w_t), which its filter reads
    assert w.loss_examples == pytest.approx(4 * 5 * sum(sizes) / len(sizes))
    assert (w.replicas, w.rounds, w.evaluations) == (4, 7, 3)
    assert w.eval_examples == 4 * (sum(sizes) + int(data.test.num_examples))


def test_program_work_reads_the_specs_declared_work():
    # Ditto steps a personal model beside the global one: twice FedAvg's local work
    config = tiny_config(algorithm="ditto", ditto_lambda=(0.1,), seeds=(1,), local_epochs=1,
                         batch_size=8, clients_per_round=6)
    data = load_dataset(config.data)
    mean_steps = np.mean(_steps_by_hand([int(n) for n in data.train.sizes], 1, 8))
    w = program_work(config, data)
    assert w.train_steps == pytest.approx(2 * 6 * mean_steps)
    assert w.loss_examples == 0   # over FedAvg, whose round evaluates no loss
    # AFL: every training client, one local step
    # (its spec's Clients(full_participation=True, local_steps=1))
    config = tiny_config(algorithm="afl", seeds=(1,), clients_per_round=6)
    data = load_dataset(config.data)
    w = program_work(config, data)
    assert w.train_steps == pytest.approx(w.replicas * data.train.num_clients * 1)


BOARD = ["--settings=leaderboard_synthetic_1_1", "--methods=deltafl,scaffold", "--lr_multipliers=1",
         "--num_rounds=2", "--eval_every=2", "--synthetic_num_clients=40",
         "--clients_per_round=5", "--tune_seeds=1", "--seeds=1", "--estimate"]
HEADS = ("estimate of leaderboard_synthetic_1_1 deltafl validation (measured): ",
         "estimate of leaderboard_synthetic_1_1 deltafl final (projected from "
         "leaderboard_synthetic_1_1 deltafl validation, leaderboard_synthetic_1_1 scaffold "
         "final): ",
         "estimate of leaderboard_synthetic_1_1 scaffold final (measured): ",
         "estimate of all 3 programs (2 measured, 1 projected)")


def _count_compiles(monkeypatch):
    import jax
    compiled = []
    real = jax.stages.Lowered.compile

    def counting(self, *args, **kwargs):
        compiled.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counting)
    return compiled


def _heads(stdout):
    return [line for line in stdout.splitlines() if line.startswith("estimate of ")]


def test_the_leaderboard_measures_two_programs_per_setting(tmp_path, capsys, monkeypatch):
    """Three programs (Delta-FL's validation and final runs, SCAFFOLD's final runs): the
    setting's first and the other algorithm's are measured (estimate_run, here a stand-in
    that records its programs), Delta-FL's final runs are projected from them, and nothing
    else compiles a round."""
    from deltafl_jax.run import estimate as estimate_lib
    from test_leaderboard import run_board
    compiled = _count_compiles(monkeypatch)
    runs = []

    def stand_in(config, data, replicas=None, **kwargs):
        runs.append((config.algorithm, data.train.num_clients))
        return measured(config.algorithm, 1.0, 10.0, 0.01 * len(runs), 0.1, rounds=2, every=2)

    monkeypatch.setattr(estimate_lib, "estimate_run", stand_in)
    out = tmp_path / "board"
    code, err, stdout = run_board([*BOARD, f"--out={out}"], capsys)
    assert code in (0, None), err
    # Delta-FL's validation runs train on half of the 20 training clients
    assert runs == [("deltafl", 10), ("scaffold", 20)] and compiled == []
    heads = _heads(stdout)
    assert len(heads) == 4 and all(h.startswith(w) for h, w in zip(heads, HEADS)), heads
    assert not out.exists()


@pytest.mark.slow   # compiles and times two programs
def test_the_leaderboard_compiles_two_rounds_per_setting(tmp_path, capsys, monkeypatch):
    """As above with the real measurements: two rounds compiled in all."""
    from test_leaderboard import run_board
    compiled = _count_compiles(monkeypatch)
    out = tmp_path / "board"
    code, err, stdout = run_board([*BOARD, f"--out={out}"], capsys)
    assert code in (0, None), err
    assert len(compiled) == 2
    heads = _heads(stdout)
    assert len(heads) == 4 and all(h.startswith(w) for h, w in zip(heads, HEADS)), heads
    assert not out.exists()
