"""Checkpoints with orbax and preemption handling.

- save/restore of the state pytree is bit-identical: float32/int32 leaves, a NamedTuple or an
  empty () algorithm state, a zero-size leaf;
- the recorder's histories are read back from the output files, cut back to the checkpoint;
- the last 2 checkpoints are kept;
- a damaged newest checkpoint (a file deleted, truncated or altered; its metadata deleted)
  falls back to the previous one with one warning line;
- a save killed midway (a leftover orbax tmp directory, and a real SIGKILL during saves) is
  never loaded;
- a state saved sharded over 2 devices restores on 1;
- the state is copied before save returns: donating its buffers right after is safe;
- fingerprint_diff names the differing settings; a state of other shapes is a mismatch;
- CheckpointCallback saves every N rounds, on a stop request and at the end, its first timed
  checkpoint early, after writing the histories; several processes agree on saves and stops;
- Preemption turns SIGTERM/SIGINT into run.stop_requested and restores the old handlers.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltafl_jax.errors import ConfigError
from deltafl_jax.rounds import ServerState
from deltafl_jax.run import checkpoint as ckpt
from deltafl_jax.run.callbacks import Evaluation, RunContext
from deltafl_jax.run.checkpoint import (Checkpointer, CheckpointCallback, CheckpointMismatch,
                                        Preemption)
from deltafl_jax.run.resume import fingerprint_diff

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class AlgoState(NamedTuple):
    lam: jax.Array
    count: jax.Array


def make_state(round, algo=True, r=3):
    rng = np.random.default_rng(round)
    params = {"Dense_0": {"kernel": jnp.asarray(rng.standard_normal((r, 5, 4), np.float32)),
                          "bias": jnp.asarray(rng.standard_normal((r, 4), np.float32))}}
    algo_state = (AlgoState(jnp.asarray(rng.random(r, np.float32)),
                            jnp.asarray(rng.integers(0, 9, r, np.int32))) if algo else ())
    return ServerState(params=params, algo_state=algo_state, round=jnp.int32(round),
                       client_state={"none_yet": jnp.zeros((r, 0), jnp.float32)})


FINGERPRINT = {"learning_rate": 0.05, "thetas": (1.0, 0.5), "data": "abc123"}


def assert_trees_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("algo", [True, False], ids=["namedtuple_algo_state", "empty_algo_state"])
def test_round_trip_is_bit_identical(tmp_path, algo):
    state = make_state(4, algo)
    with Checkpointer(str(tmp_path / "checkpoints")) as checkpointer:
        assert checkpointer.restore(state) is None
        checkpointer.save(4, state, FINGERPRINT)
        round, restored = checkpointer.restore(make_state(0, algo))
        saved_round, fingerprint = checkpointer.read_fingerprint()
    assert round == saved_round == 4
    assert fingerprint == {"learning_rate": 0.05, "thetas": [1.0, 0.5], "data": "abc123"}
    assert fingerprint_diff(fingerprint, FINGERPRINT) == []
    assert isinstance(restored, ServerState)
    if algo:
        assert isinstance(restored.algo_state, AlgoState)
    else:
        assert restored.algo_state == ()
    assert_trees_identical(restored, state)
    assert restored.client_state["none_yet"].shape == (3, 0)   # zero-size: from the template
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(restored))

    # a NumPy template gives NumPy arrays back
    with Checkpointer(str(tmp_path / "checkpoints")) as checkpointer:
        _, again = checkpointer.restore(jax.tree.map(np.asarray, state))
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(again))
    assert_trees_identical(again, state)


def test_keeps_the_last_two_and_saves_a_round_once(tmp_path):
    with Checkpointer(str(tmp_path)) as checkpointer:
        for r in (1, 2, 3):
            checkpointer.save(r, make_state(r), FINGERPRINT)
        checkpointer.save(3, make_state(3), FINGERPRINT)  # already there: kept
        checkpointer.wait()
        assert checkpointer.rounds() == [2, 3]
        assert_trees_identical(checkpointer.restore(make_state(0))[1], make_state(3))
    assert sorted(os.listdir(tmp_path)) == ["2", "3"]


def _largest_file(folder):
    """The largest data file of an orbax item: OCDBT keeps the arrays in <item>/d/<hash>
    (the copies under ocdbt.process_0/ are not read once merged)."""
    data = os.path.join(folder, "d")
    return max((os.path.join(data, f) for f in os.listdir(data)), key=os.path.getsize)


def _damage(step_dir, how):
    if how == "delete_state_data":
        os.remove(_largest_file(os.path.join(step_dir, "state")))
    elif how == "truncate_state_data":
        big = _largest_file(os.path.join(step_dir, "state"))
        with open(big, "r+b") as f:
            f.truncate(os.path.getsize(big) // 2)
    elif how == "alter_state_data":   # a flipped byte that the file format may not notice
        big = _largest_file(os.path.join(step_dir, "state"))
        with open(big, "r+b") as f:
            f.seek(os.path.getsize(big) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x55]))
    elif how == "delete_meta":
        shutil.rmtree(os.path.join(step_dir, "meta"))
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how", ["delete_state_data", "truncate_state_data", "alter_state_data",
                                 "delete_meta"])
def test_damaged_latest_falls_back_to_the_previous_with_one_warning(tmp_path, capsys, how):
    with Checkpointer(str(tmp_path)) as checkpointer:
        for r in (2, 3):
            checkpointer.save(r, make_state(r), FINGERPRINT)
    _damage(str(tmp_path / "3"), how)
    capsys.readouterr()
    with Checkpointer(str(tmp_path)) as checkpointer:
        round, restored = checkpointer.restore(make_state(0))
        err = capsys.readouterr().err
        assert round == 2
        assert_trees_identical(restored, make_state(2))
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert "warning" in lines[0] and "round 3" in lines[0] and "round 2" in lines[0]
        assert checkpointer.rounds() == [2]  # the damaged one is gone: round 3 can be saved again
        checkpointer.save(3, make_state(3), FINGERPRINT)
        assert checkpointer.restore(make_state(0))[0] == 3


def test_leftover_of_a_killed_save_is_ignored(tmp_path, capsys):
    with Checkpointer(str(tmp_path)) as checkpointer:
        checkpointer.save(2, make_state(2), FINGERPRINT)
        checkpointer.save(3, make_state(3), FINGERPRINT)
    # what a save killed midway leaves: orbax's tmp directory, here with a file missing
    leftover = tmp_path / "4.orbax-checkpoint-tmp-1700000000123456"
    shutil.copytree(tmp_path / "3", leftover)
    shutil.rmtree(leftover / "meta")
    capsys.readouterr()
    with Checkpointer(str(tmp_path)) as checkpointer:
        assert checkpointer.rounds() == [2, 3]
        assert checkpointer.restore(make_state(0))[0] == 3
        assert capsys.readouterr().err == ""
        checkpointer.save(4, make_state(4), FINGERPRINT)
        checkpointer.wait()
        assert checkpointer.rounds() == [3, 4]
    assert not leftover.exists()  # orbax removes it before its next save


KILLED_SAVER = textwrap.dedent("""
    import sys
    import numpy as np, jax.numpy as jnp
    from deltafl_jax.rounds import ServerState
    from deltafl_jax.run.checkpoint import Checkpointer
    checkpointer = Checkpointer(sys.argv[1], async_save=sys.argv[2] == "async")
    for r in range(1, 1000):
        # 8 MB per state, a function of r alone
        state = ServerState(params={"w": jnp.full((2, 1 << 20), r, jnp.float32)},
                            algo_state=(), round=jnp.int32(r))
        checkpointer.save(r, state, {"x": 1})
        print(r, flush=True)
""")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_during_saves_leaves_a_complete_checkpoint(tmp_path, mode):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVER, str(tmp_path), mode], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = 0
    while seen < 3:  # a few saves, then kill it in the middle of the next ones
        line = proc.stdout.readline()
        assert line, "the saver died"
        seen = int(line)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    template = ServerState(params={"w": jnp.zeros((2, 1 << 20), jnp.float32)}, algo_state=(),
                           round=jnp.int32(0))
    with Checkpointer(str(tmp_path)) as checkpointer:
        r, restored = checkpointer.restore(template)
    assert r >= 2
    assert int(restored.round) == r
    assert np.all(np.asarray(restored.params["w"]) == r)


SHARDED_SAVER = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from deltafl_jax.rounds import ServerState
    from deltafl_jax.run.checkpoint import Checkpointer
    assert jax.device_count() == 2
    mesh = Mesh(np.array(jax.devices()), ("r",))
    w = jax.device_put(jnp.arange(4 * 6, dtype=jnp.float32).reshape(4, 6),
                       NamedSharding(mesh, P("r")))
    state = ServerState(params={"w": w}, algo_state=(), round=jnp.int32(7))
    with Checkpointer(sys.argv[1]) as checkpointer:
        checkpointer.save(7, state, {"x": 1})
""")


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_state_saved_on_two_devices_restores_on_one(tmp_path):
    subprocess.run([sys.executable, "-c", SHARDED_SAVER, str(tmp_path)], cwd=REPO, check=True,
                   capture_output=True)
    template = ServerState(params={"w": jax.ShapeDtypeStruct((4, 6), jnp.float32)},
                           algo_state=(), round=jax.ShapeDtypeStruct((), jnp.int32))
    with Checkpointer(str(tmp_path)) as checkpointer:
        round, restored = checkpointer.restore(template)
    assert round == 7
    w = restored.params["w"]
    assert isinstance(w, jax.Array) and len(w.devices()) == 1
    np.testing.assert_array_equal(np.asarray(w), np.arange(24, dtype=np.float32).reshape(4, 6))


def test_donating_the_state_right_after_an_async_save_is_safe(tmp_path):
    state = make_state(5)
    expected = jax.tree.map(np.array, state)
    overwrite = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 + 7, s), donate_argnums=0)
    with Checkpointer(str(tmp_path), async_save=True) as checkpointer:
        checkpointer.save(5, state, FINGERPRINT)
        new = overwrite(state)  # the next round reuses the buffers at once
        jax.block_until_ready(new)
        assert all(x.is_deleted() for x in jax.tree.leaves(state))  # the donation happened
        _, restored = checkpointer.restore(make_state(0))
    assert_trees_identical(restored, expected)


def test_a_state_of_other_shapes_is_a_mismatch(tmp_path):
    with Checkpointer(str(tmp_path)) as checkpointer:
        checkpointer.save(2, make_state(2, r=3), FINGERPRINT)
        with pytest.raises(CheckpointMismatch, match="params/Dense_0/bias"):
            checkpointer.restore(make_state(0, r=4))
        with pytest.raises(CheckpointMismatch, match="algo_state"):
            checkpointer.restore(make_state(0, algo=False))
        assert checkpointer.rounds() == [2]  # a mismatch deletes nothing
        assert checkpointer.read_fingerprint() == (2, {"learning_rate": 0.05,
                                                       "thetas": [1.0, 0.5], "data": "abc123"})


def test_fingerprint_diff():
    saved = {"learning_rate": 0.05, "thetas": [1.0, 0.5], "l2": float("nan"),
             "data": {"hash": "abc", "dataset": "synthetic"}, "gone": 1}
    current = {"learning_rate": 0.1, "thetas": (1.0, 0.5), "l2": float("nan"),
               "data": {"hash": "abd", "dataset": "synthetic"}, "new": 2}
    assert fingerprint_diff(saved, current) == ["data.hash", "gone", "learning_rate", "new"]
    assert fingerprint_diff(saved, saved) == []


def test_checkpoint_callback_saves_every_n_rounds_on_stop_and_at_the_end(tmp_path):
    checkpointer = Checkpointer(str(tmp_path))
    history, written = [], []   # written: what before_save saw (the runner writes the files)
    callback = CheckpointCallback(checkpointer, FINGERPRINT, every=3, every_s=0,
                                  before_save=lambda r: written.append((r, list(history))))
    run = RunContext(view=None, num_rounds=10)
    callback.on_run_start(run)
    for r in range(1, 11):
        run.state = make_state(r)
        history.append(r)
        if r == 5:
            run.stop_requested, run.stop_reason = True, "SIGTERM"
        callback.on_round_end(run, r, {})
        if run.stop_requested:
            break
    callback.on_run_end(run, None)
    assert checkpointer.rounds() == [3, 5]
    assert written == [(3, [1, 2, 3]), (5, [1, 2, 3, 4, 5])]
    assert_trees_identical(checkpointer.restore(make_state(0))[1], make_state(5))

    # resumed: rounds 6..10, an evaluation after round 9 reported after on_round_end(9)
    history, written = history[:5], []
    callback = CheckpointCallback(checkpointer, FINGERPRINT, every=3, every_s=0,
                                  evaluated=lambda r: r % 9 == 0,
                                  before_save=lambda r: written.append((r, list(history))))
    run = RunContext(view=None, num_rounds=10, start_round=5)
    callback.on_run_start(run)
    for r in range(6, 11):
        run.state = make_state(r)
        history.append(r)
        callback.on_round_end(run, r, {})
        if r == 9:
            checkpointer.wait()
            assert checkpointer.rounds() == [5, 6]  # waits for the evaluation
            history.append("evaluation 9")
            callback.on_evaluation(run, Evaluation(9, {}, {}, [], 0.0))
            checkpointer.wait()
            assert checkpointer.rounds() == [6, 9]
    callback.on_run_end(run, None)
    assert checkpointer.rounds() == [9, 10]
    assert [r for r, _ in written] == [6, 9, 10]
    assert written[1][1][-2:] == [9, "evaluation 9"]
    assert checkpointer.restore(make_state(0))[0] == 10
    checkpointer.close()


def test_first_timed_checkpoint_comes_early_then_every_s(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "FIRST_CHECKPOINT_S", 0.2)
    with Checkpointer(str(tmp_path), async_save=False) as checkpointer:
        callback = CheckpointCallback(checkpointer, FINGERPRINT, every=0, every_s=60)
        run = RunContext(view=None, num_rounds=4)
        callback.on_run_start(run)
        for r in range(1, 5):
            if r in (1, 3):   # the first round (it compiles), then past the first interval
                time.sleep(0.25)
            run.state = make_state(r)
            callback.on_round_end(run, r, {})
        # the interval counts from the end of round 1; after round 3's save it is every_s
        assert checkpointer.rounds() == [3]


def test_processes_agree_on_saves_and_stops(tmp_path):
    """With several processes, a save or a stop on any one is made on every one (`agree` here
    stands for another process that wants a save after round 2 and a stop after round 3)."""
    other = {2: [True, False], 3: [False, True]}
    asked = []

    def agree(flags):
        asked.append(list(flags))
        mine = other.get(len(asked), [False, False])
        return [a or b for a, b in zip(flags, mine)]

    with Checkpointer(str(tmp_path), async_save=False) as checkpointer:
        callback = CheckpointCallback(checkpointer, FINGERPRINT, every=0, every_s=0, agree=agree)
        run = RunContext(view=None, num_rounds=9)
        callback.on_run_start(run)
        for r in range(1, 10):
            run.state = make_state(r)
            callback.on_round_end(run, r, {})
            if run.stop_requested:
                break
        assert r == 3 and run.stop_reason == "a stop on another process"
        assert asked == [[False, False]] * 3
        assert checkpointer.rounds() == [2, 3]


def test_preemption_sets_the_stop_flag_and_restores_the_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    run = RunContext(view=None, num_rounds=3)
    with Preemption() as preemption:
        preemption.on_run_start(run)
        assert signal.getsignal(signal.SIGTERM) == preemption._handle
        os.kill(os.getpid(), signal.SIGTERM)
        assert run.stop_requested and run.stop_reason == "SIGTERM"
        assert preemption.exit_code == 128 + signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM changes nothing
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C aborts at once
            os.kill(os.getpid(), signal.SIGINT)
        hint = preemption.resume_hint(["python", "-m", "experiments.run", "--flagfile=a b"],
                                      "/out/checkpoints", round=2)
        assert "SIGTERM" in hint and "after round 2" in hint and "'--flagfile=a b'" in hint
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_before_the_run_starts_is_applied_at_run_start():
    run = RunContext(view=None, num_rounds=3)
    with Preemption() as preemption:
        os.kill(os.getpid(), signal.SIGINT)
        assert preemption.signum == signal.SIGINT and not run.stop_requested
        preemption.on_run_start(run)
        assert run.stop_requested and run.stop_reason == "SIGINT"
        preemption.on_run_end(run, None)
        assert signal.getsignal(signal.SIGINT) is not preemption._handle


def test_histories_are_read_back_from_the_output_files_cut_back_to_the_checkpoint(tmp_path):
    """What a resume continues: rounds.npz rows 1..r, the evaluations of rounds <= r of
    clients_history.npz and metrics.jsonl (files written at a later round than the checkpoint
    that is restored, as after a kill during a save, are cut back)."""
    from deltafl_jax.outputs.directory import RunWriter
    from deltafl_jax.replicas.labels import ReplicaLabel
    from deltafl_jax.run.loop import Recorder
    from deltafl_jax.run.resume import Resume, histories

    rng = np.random.default_rng(0)
    labels = [ReplicaLabel(algorithm="deltafl", theta=t, seed=1) for t in (1.0, 0.5)]
    per_round = {"num_selected": rng.integers(0, 5, (6, 2)).astype(np.int32),
                 "sampled_loss_mean": rng.standard_normal((6, 2)).astype(np.float32)}
    evals = np.array([2, 4, 6])
    clients = {"rounds": evals, "test_error": rng.random((3, 2, 7)).astype(np.float32)}
    writer = RunWriter(str(tmp_path))
    writer.write_rounds(per_round, labels)
    writer.write_clients_history(clients)
    for t in evals:
        writer.append_metrics([{"round": int(t), "theta": lab.theta, "x": float(t) / 3}
                               for lab in labels])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"round": 8, "th')   # a torn line

    got_rounds, got_clients, records = histories(str(tmp_path), 5)
    assert sorted(got_rounds) == sorted(per_round)
    for k, v in per_round.items():
        assert got_rounds[k].dtype == v.dtype
        np.testing.assert_array_equal(got_rounds[k], v[:5])
    np.testing.assert_array_equal(got_clients["rounds"], [2, 4])
    np.testing.assert_array_equal(got_clients["test_error"], clients["test_error"][:2])
    assert [(r["round"], r["theta"], r["x"]) for r in records] == [
        (t, lab.theta, t / 3) for t in (2, 4) for lab in labels]

    recorder = Recorder()
    recorder.resume(Resume(5, None, got_rounds, got_clients, records))
    assert recorder.rounds_done == 5 and recorder.client_history["rounds"] == [2, 4]
    for k, v in per_round.items():
        np.testing.assert_array_equal(recorder.per_round_arrays()[k], v[:5])
    np.testing.assert_array_equal(recorder.client_history_arrays()["test_error"],
                                  clients["test_error"][:2])

    with pytest.raises(ConfigError, match="fewer than 7 rounds"):
        histories(str(tmp_path), 7)
    os.remove(tmp_path / "rounds.npz")
    with pytest.raises(ConfigError, match="no rounds.npz"):
        histories(str(tmp_path), 4)


def test_deferred_preemption_requests_the_stop_at_the_round_end():
    run = RunContext(view=None, num_rounds=3)
    with Preemption(defer=True) as preemption:
        preemption.on_run_start(run)
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.signum == signal.SIGTERM and not run.stop_requested
        preemption.on_round_end(run, 1, {})
        assert run.stop_requested and run.stop_reason == "SIGTERM"
