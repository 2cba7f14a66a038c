"""The output directory's files: RunWriter -> RunReader round trips on small hand-made arrays,
atomic writes, torn metrics lines, truncate_metrics, prepare_dir, the schema version, and
load_model with predict_labels against NumPy."""

import json
import os

import jax
import numpy as np
import pytest

from deltafl_jax.data import ClientData, FederatedDataset
from deltafl_jax.errors import ConfigError, DeltaFLError
from deltafl_jax.models import Linear, Model, ModelOptions, build_model
from deltafl_jax.outputs import directory as outputs
from deltafl_jax.outputs.directory import (SCHEMA_VERSION, RunFormatError, RunReader, RunWriter,
                                           prepare_dir)
from deltafl_jax.outputs.serving import LoadedModel, load_model
from deltafl_jax.replicas.labels import ReplicaLabel

LABELS = (ReplicaLabel("deltafl", 1.0, 1), ReplicaLabel("deltafl", 0.5, 1),
          ReplicaLabel("deltafl", 0.5, 2))
QFFL = (ReplicaLabel("qffl", 1.0, 1, "qffl_q", 0.1), ReplicaLabel("qffl", 1.0, 1, "qffl_q", 1.0))
GRID = (ReplicaLabel("fedavg", 1.0, 3, extra=(("learning_rate", 0.1), ("lr_decay", 2.0))),)


def dataset(num_classes=3, dim=4, seed=0):
    """3 training clients (2, 3, 1 examples) and 2 test clients (2, 2), ids as strings."""
    rng = np.random.default_rng(seed)

    def split(sizes, ids):
        n = sum(sizes)
        y = rng.integers(0, num_classes, n).astype(np.int32) if num_classes else None
        return ClientData(x=rng.normal(size=(n, dim)).astype(np.float32), y=y,
                          offsets=np.concatenate([[0], np.cumsum(sizes)]),
                          client_ids=np.asarray(ids))

    return FederatedDataset("hand", split([2, 3, 1], ["a", "b", "c"]), split([2, 2], ["d", 7]),
                            num_classes=num_classes, metadata={"note": "x"})


def records_of(labels, rounds):
    return [{"round": t, **lab.to_json(), "train_loss_mean": 0.5 + 0.01 * t + r,
             "test_error_p90": np.float32(0.25), "num_selected": np.int64(2)}
            for t in rounds for r, lab in enumerate(labels)]


def write_run(path, labels=LABELS, data=None):
    data = data or dataset()
    prepare_dir(str(path), overwrite=False)
    w = RunWriter(str(path))
    R = len(labels)
    w.append_metrics(records_of(labels, [1]))
    w.append_metrics(records_of(labels, [2]))
    per_round = {"num_selected": np.arange(2 * R).reshape(2, R),
                 "learning_rate": np.full((2, R), 0.1, np.float32)}
    per_client = {f"{s}_{q}": np.arange(R * n, dtype=np.float64).reshape(R, n) / 10
                  for s, n in (("train", 3), ("test", 2)) for q in ("loss", "error")}
    history = {"rounds": np.array([1, 2]),
               **{k: np.stack([v, v + 1]).astype(np.float32) for k, v in per_client.items()}}
    w.write_rounds(per_round, labels)
    w.write_clients(per_client, data, labels)
    w.write_clients_history(history)
    w.write_summary({"config": {"num_rounds": 2}, "replicas": list(labels),
                     "final": {lab.key(): {"x": np.float64(1.5)} for lab in labels}})
    return per_round, per_client, history


def test_writer_and_reader_round_trip(tmp_path):
    per_round, per_client, history = write_run(tmp_path / "run")
    reader = RunReader(str(tmp_path / "run"))
    assert reader.is_complete() and not reader.in_progress()
    assert reader.labels() == LABELS
    assert reader.keys() == ("theta=1_seed=1", "theta=0.5_seed=1", "theta=0.5_seed=2")
    summary = reader.summary()
    assert summary["schema_version"] == SCHEMA_VERSION == reader.schema_version()
    assert list(summary)[0] == "schema_version"
    assert summary["replicas"][1] == {"algorithm": "deltafl", "theta": 0.5, "seed": 1}
    assert summary["final"]["theta=0.5_seed=2"] == {"x": 1.5}

    rounds = reader.rounds()
    np.testing.assert_array_equal(rounds["num_selected"], per_round["num_selected"])
    assert rounds["learning_rate"].dtype == np.float32
    assert list(rounds["replica_keys"]) == list(reader.keys())
    clients = reader.clients()
    for k, v in per_client.items():
        np.testing.assert_array_equal(clients[k], v)
    np.testing.assert_array_equal(clients["train_sizes"], [2, 3, 1])
    np.testing.assert_array_equal(clients["test_sizes"], [2, 2])
    assert list(clients["train_client_ids"]) == ["a", "b", "c"]
    assert list(clients["test_client_ids"]) == ["d", "7"]
    assert clients["test_client_ids"].dtype.kind == "U"
    assert list(clients["replica_keys"]) == list(reader.keys())
    got = reader.clients_history()
    assert set(got) == set(history)
    for k, v in history.items():
        np.testing.assert_array_equal(got[k], v)

    records = reader.records()
    assert [r["round"] for r in records] == [1, 1, 1, 2, 2, 2]
    assert records[4] == {"round": 2, "algorithm": "deltafl", "theta": 0.5, "seed": 1,
                          "train_loss_mean": 1.52, "test_error_p90": 0.25, "num_selected": 2}
    assert reader.record_replicas(records) == [0, 1, 2, 0, 1, 2]
    assert reader.record_replicas([{"round": 1, "theta": 0.3, "seed": 1}]) == [None]


def test_metrics_lines_are_one_json_object_each(tmp_path):
    recs = records_of(LABELS + QFFL + GRID, [1, 2])
    RunWriter(str(tmp_path)).append_metrics(recs[:4])
    RunWriter(str(tmp_path)).append_metrics(recs[4:])
    plain = [{k: (v.item() if isinstance(v, np.generic) else v) for k, v in r.items()}
             for r in recs]
    want = "".join(json.dumps(r) + "\n" for r in plain)
    assert (tmp_path / "metrics.jsonl").read_text() == want
    # The key helper names dict labels (older runs) and ReplicaLabels alike.
    for lab in LABELS + QFFL + GRID:
        assert outputs.replica_key(lab) == lab.key()
    for lab in LABELS + QFFL:
        assert outputs.replica_key(lab.to_json()) == lab.key()


def test_labels_with_their_own_key_keep_it(tmp_path):
    labels = [{"algorithm": "fedavg", "theta": 1.0, "learning_rate": 0.1, "seed": 1,
               "key": "lr=0.1_seed=1"}]
    RunWriter(str(tmp_path)).write_summary({"replicas": labels})
    reader = RunReader(str(tmp_path))
    assert reader.keys() == ("lr=0.1_seed=1",)
    assert reader.labels() == (ReplicaLabel("fedavg", 1.0, 1, extra=(("learning_rate", 0.1),)),)
    assert reader.record_replicas([{"round": 3, **labels[0], "m": 1.0}]) == [0]


def test_leftover_temporary_files_are_never_read(tmp_path):
    write_run(tmp_path)
    (tmp_path / "clients.npz.tmp").write_bytes(b"half a zip")
    (tmp_path / "summary.json.tmp").write_text("{")
    reader = RunReader(str(tmp_path))
    assert reader.summary()["config"] == {"num_rounds": 2}
    assert reader.clients()["train_sizes"].tolist() == [2, 3, 1]
    os.remove(tmp_path / "rounds.npz")
    (tmp_path / "rounds.npz.tmp").write_bytes(b"PK")
    with pytest.raises(RunFormatError, match="no rounds.npz"):
        reader.rounds()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    write_run(tmp_path)
    before = (tmp_path / "clients.npz").read_bytes()

    def broken_savez(f, **arrays):
        f.write(b"PK\x03\x04 partial")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        RunWriter(str(tmp_path)).write_clients({}, dataset(), LABELS)
    assert (tmp_path / "clients.npz").read_bytes() == before
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_a_torn_last_metrics_line_is_skipped(tmp_path):
    w = RunWriter(str(tmp_path))
    w.append_metrics(records_of(LABELS, [1, 2]))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"round": 3, "algorithm": "delt')
    reader = RunReader(str(tmp_path))
    assert [r["round"] for r in reader.records()] == [1] * 3 + [2] * 3
    assert reader.in_progress() and not reader.is_complete()
    # A broken line that is not the last is an error, not silently skipped.
    lines = (tmp_path / "metrics.jsonl").read_text().split("\n")
    lines[1] = lines[1][:10]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    with pytest.raises(RunFormatError, match="metrics.jsonl line 2 is not JSON"):
        reader.records()


def test_truncate_metrics_keeps_the_rounds_up_to_a_checkpoint(tmp_path):
    w = RunWriter(str(tmp_path))
    w.append_metrics(records_of(LABELS, [1, 2, 3]))
    text = (tmp_path / "metrics.jsonl").read_text()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"round": 4, "al')
    w.truncate_metrics(after_round=2)
    kept = (tmp_path / "metrics.jsonl").read_text()
    assert kept == "".join(text.splitlines(keepends=True)[:6])
    assert [r["round"] for r in RunReader(str(tmp_path)).records()] == [1] * 3 + [2] * 3
    w.append_metrics(records_of(LABELS, [3]))          # resume appends after it
    assert (tmp_path / "metrics.jsonl").read_text() == text
    w.truncate_metrics(after_round=0)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    RunWriter(str(tmp_path / "none")).truncate_metrics(after_round=5)   # no file: nothing


def test_prepare_dir_refuses_and_overwrites_only_result_files(tmp_path):
    out = tmp_path / "run"
    prepare_dir(str(out), overwrite=False)             # created
    assert out.is_dir() and not outputs.has_results(str(out))
    (out / "notes.txt").write_text("mine")
    prepare_dir(str(out), overwrite=False)             # unrelated files are not results
    w = RunWriter(str(out))
    w.append_metrics(records_of(LABELS, [1]))
    assert outputs.has_results(str(out))
    with pytest.raises(ConfigError) as e:
        prepare_dir(str(out), overwrite=False)
    assert str(e.value) == (f"--output_dir={out} already holds results; pass --overwrite or "
                            f"choose another directory")
    for d in ("models", "tb", "checkpoints", "data"):
        (out / d).mkdir()
        (out / d / "f").write_text("x")
    for f in ("summary.json", "rounds.npz", "clients.npz", "clients_history.npz",
              "summary.json.tmp", "metrics.jsonl.bak"):
        (out / f).write_text("x")
    prepare_dir(str(out), overwrite=True)
    assert sorted(os.listdir(out)) == ["data", "metrics.jsonl.bak", "notes.txt"]
    assert (out / "data" / "f").read_text() == "x"


def test_a_newer_schema_version_is_refused_and_a_missing_one_is_read(tmp_path):
    write_run(tmp_path)
    summary = json.load(open(tmp_path / "summary.json"))
    summary["schema_version"] = SCHEMA_VERSION + 1
    json.dump(summary, open(tmp_path / "summary.json", "w"))
    with pytest.raises(RunFormatError) as e:
        RunReader(str(tmp_path)).labels()
    assert isinstance(e.value, DeltaFLError)
    assert e.value.reason.startswith(f"summary.json has output format version "
                                     f"{SCHEMA_VERSION + 1}")
    assert "\n" not in str(e.value) and str(e.value).startswith(str(tmp_path))
    del summary["schema_version"]
    json.dump(summary, open(tmp_path / "summary.json", "w"))
    assert RunReader(str(tmp_path)).schema_version() == 0
    assert RunReader(str(tmp_path)).labels() == LABELS


def test_missing_and_unreadable_files_raise_run_format_error(tmp_path):
    reader = RunReader(str(tmp_path))
    with pytest.raises(RunFormatError, match="no summary.json"):
        reader.summary()
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(RunFormatError, match="summary.json cannot be read"):
        reader.summary()
    (tmp_path / "clients.npz").write_bytes(b"garbage")
    with pytest.raises(RunFormatError, match="clients.npz cannot be read"):
        reader.clients()
    with pytest.raises(RunFormatError, match="no saved models"):
        load_model(str(tmp_path), theta=1.0)


def stacked_params(model, count, seed=0):
    """`count` random parameter sets of `model`, stacked on a leading axis."""
    keys = jax.random.split(jax.random.key(seed), count)
    template = model.init(keys[0])
    return jax.tree.map(lambda t: np.stack([
        np.asarray(jax.random.normal(k, t.shape)) for k in keys]), template)


def test_load_model_matches_labels_and_predicts_labels(tmp_path):
    data = dataset(num_classes=3, dim=4)
    model = build_model("linear", data, ModelOptions())
    labels = LABELS + QFFL + GRID
    params = stacked_params(model, len(labels))
    prepare_dir(str(tmp_path), overwrite=False)
    RunWriter(str(tmp_path)).save_models(params, labels, model, ModelOptions(), data)
    index = RunReader(str(tmp_path)).model_index()
    assert [e["file"] for e in index["replicas"]] == [lab.key() + ".msgpack" for lab in labels]
    assert index["replicas"][3] == {"file": "qffl_q=0.1_seed=1.msgpack", **QFFL[0].to_json()}

    x = np.random.default_rng(1).normal(size=(9, 4)).astype(np.float32)
    for r, ask in ((2, dict(theta=0.5, seed=2)), (4, dict(qffl_q=1.0)),
                   (5, dict(learning_rate=0.1, seed=3)), (5, dict(seed=3))):
        served = load_model(str(tmp_path), **ask)
        assert served.label == labels[r]
        W, b = params["Dense_0"]["kernel"][r], params["Dense_0"]["bias"][r]
        np.testing.assert_array_equal(served.params["Dense_0"]["kernel"], W)
        scores = x @ W + b                              # NumPy, independently of the model
        np.testing.assert_allclose(np.asarray(served.predict(x)), scores, rtol=1e-5,
                                   atol=1e-5)
        want = np.argmax(scores, axis=1)
        np.testing.assert_array_equal(served.predict_labels(x), want)
        # Printing names the model and replica and counts the weights (4 x 3 + 3), never
        # dumps them.
        assert repr(served) == (f"LoadedModel('linear', {labels[r].key()}, "
                                f"15 parameters in 2 arrays)")
    with pytest.raises(ValueError, match="several models match"):
        load_model(str(tmp_path), theta=0.5)
    with pytest.raises(ValueError, match="several models match"):   # theta=1 and both q's
        load_model(str(tmp_path), theta=1.0, seed=1)
    with pytest.raises(ValueError, match="no model matches") as e:
        load_model(str(tmp_path), theta=0.3, seed=1)
    assert "theta=0.5_seed=2" in str(e.value)


def test_predict_labels_of_sigmoid_and_mean_models():
    x = np.random.default_rng(2).normal(size=(7, 4)).astype(np.float32)
    model = Model("one_logit", Linear(1), "sigmoid", (4,))
    params = model.init(jax.random.key(3))
    params = jax.tree.map(lambda a: a + 0.3, params)   # nonzero logits
    served = LoadedModel(params=params, model=model, labels=LABELS[0].to_json())
    logits = x @ np.asarray(params["Dense_0"]["kernel"]) + np.asarray(params["Dense_0"]["bias"])
    np.testing.assert_array_equal(served.predict_labels(x), (logits[:, 0] > 0).astype(int))

    mean = build_model("mean", dataset(num_classes=0), ModelOptions())
    served = LoadedModel(params=mean.init(jax.random.key(0)), model=mean,
                         labels=LABELS[0].to_json())
    assert np.asarray(served.predict(x)).shape[0] == 7
    with pytest.raises(DeltaFLError, match="predicts no class"):
        served.predict_labels(x)
