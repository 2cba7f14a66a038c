"""What a run leaves in its output directory, and how to read it back.

- ``metrics.jsonl``: one JSON object per evaluation and per replica (theta or swept value,
  seed): the round, the alpha-weighted train-loss mean and percentiles, the unweighted
  test-error mean and percentiles, the test-loss mean, the clients kept (num_selected) and
  the rejected (NaN/Inf) updates of that round.
- ``rounds.npz``: per-round arrays [num_rounds, R] (num_selected, num_rejected,
  sampled_loss_mean, learning_rate, ...) and the replica labels.
- ``clients.npz``: the final per-client arrays [R, N] (train loss, train error, test loss,
  test error) with the clients' sizes and ids, for re-plotting.
- ``clients_history.npz``: the same per-client arrays at every evaluation, float32
  [E, R, N], with ``rounds`` [E], so that any percentile convention can be recomputed.
- ``summary.json``: the configuration, the dataset's Table 1 row, the timings and the final
  metrics of every replica.
- ``models/``: the final model of every replica and what is needed to rebuild the network;
  ``deltafl_jax.load_model(output_dir, theta=0.5, seed=1)`` serves w_theta (the paper's
  Figure 1: a user picks a conformity level and gets its model).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional

import flax.serialization
import jax
import numpy as np

from deltafl_jax.data import ClientData, FederatedDataset
from deltafl_jax.errors import ConfigError
from deltafl_jax.models import Model, ModelOptions, build_model

RESULT_FILES = ("metrics.jsonl", "summary.json", "rounds.npz", "clients.npz",
                "clients_history.npz", "models")


def has_results(output_dir: str) -> bool:
    return os.path.isdir(output_dir) and any(
        os.path.exists(os.path.join(output_dir, f)) for f in RESULT_FILES)


def prepare_dir(path: str, overwrite: bool) -> None:
    """Refuse a directory that holds results (unless overwrite, which removes them); create it."""
    import shutil
    if has_results(path):
        if not overwrite:
            raise ConfigError(f"--output_dir={path} already holds results; pass --overwrite or "
                              f"choose another directory")
        for f in RESULT_FILES:
            p = os.path.join(path, f)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
    os.makedirs(path, exist_ok=True)


class RunWriter:
    """Writes the files of one output directory (temporary stand-in)."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir

    def _path(self, name):
        return os.path.join(self.output_dir, name)

    def append_metrics(self, records):
        append_jsonl(self._path("metrics.jsonl"), records)

    def write_rounds(self, per_round, labels):
        np.savez(self._path("rounds.npz"), **per_round,
                 replica_keys=np.asarray([lab.key() for lab in labels]))

    def write_clients(self, per_client, data, labels):
        np.savez(self._path("clients.npz"), **per_client,
                 train_sizes=data.train.sizes, test_sizes=data.test.sizes,
                 train_client_ids=np.asarray(data.train.client_ids).astype(str),
                 test_client_ids=np.asarray(data.test.client_ids).astype(str),
                 replica_keys=np.asarray([lab.key() for lab in labels]))

    def write_clients_history(self, history):
        np.savez(self._path("clients_history.npz"), **history)

    def save_models(self, params, labels, model, options, data):
        save_models(self.output_dir, params, [lab.to_json() for lab in labels], model, options,
                    data)

    def write_summary(self, summary):
        write_json(self._path("summary.json"), summary)


def replica_key(labels: Dict[str, Any]) -> str:
    """File-name key of a replica, e.g. 'theta=0.5_seed=1' or 'qffl_q=0.1_seed=1' (or the
    label "key" when a caller names replicas itself, e.g. a 2-D tuning grid)."""
    if "key" in labels:
        return str(labels["key"])
    if "param_name" in labels and labels["param_name"] != "theta":
        head = f"{labels['param_name']}={labels['param_value']:g}"
    else:
        head = f"theta={labels['theta']:g}"
    return f"{head}_seed={labels['seed']}"


def _jsonable(value):
    if isinstance(value, (np.floating, float)):
        return float(value)
    if isinstance(value, (np.integer, int)):
        return int(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_jsonable(obj), f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def append_jsonl(path: str, records: List[dict]) -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(_jsonable(r)) + "\n")


def save_models(output_dir: str, params, labels, model: Model, options: ModelOptions,
                data: FederatedDataset) -> None:
    """One msgpack file per replica, plus the model spec that :func:`load_model` rebuilds."""
    mdir = os.path.join(output_dir, "models")
    os.makedirs(mdir, exist_ok=True)
    host = jax.device_get(params)
    index = []
    for r, lab in enumerate(labels):
        one = jax.tree.map(lambda a: np.asarray(a[r]), host)
        name = replica_key(lab) + ".msgpack"
        with open(os.path.join(mdir, name), "wb") as f:
            f.write(flax.serialization.to_bytes(one))
        index.append({"file": name, **lab})
    arrays = {k: v for k, v in data.metadata.items() if isinstance(v, np.ndarray)}
    plain = {k: v for k, v in data.metadata.items() if not isinstance(v, np.ndarray)}
    spec = {
        "model": model.name,
        "options": dataclasses.asdict(options),
        "dataset": data.name,
        "num_classes": data.num_classes,
        "feature_shape": list(data.feature_shape),
        "x_dtype": str(data.train.x.dtype),
        "x_scale": data.x_scale,
        "metadata": plain,
        "replicas": index,
    }
    if arrays:
        np.savez(os.path.join(mdir, "metadata_arrays.npz"), **arrays)
    write_json(os.path.join(mdir, "index.json"), spec)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A trained model: ``params`` (w_theta) and ``predict(x)``, the network's outputs."""

    params: Any
    model: Model
    labels: Dict[str, Any]

    def predict(self, x):
        return self.model.apply(self.params, np.asarray(x))


def _spec_dataset(spec, mdir) -> FederatedDataset:
    """A one-example dataset with the run's shapes and metadata, to rebuild the network."""
    metadata = dict(spec.get("metadata") or {})
    arrays_path = os.path.join(mdir, "metadata_arrays.npz")
    if os.path.exists(arrays_path):
        with np.load(arrays_path, allow_pickle=False) as z:
            metadata.update({k: z[k] for k in z.files})
    x = np.zeros((1,) + tuple(spec["feature_shape"]), dtype=np.dtype(spec["x_dtype"]))
    y = np.zeros((1,), np.int32) if spec["num_classes"] else None
    one = ClientData(x=x, y=y, offsets=np.array([0, 1]), client_ids=np.array([0]))
    return FederatedDataset(name=spec["dataset"], train=one, test=one,
                            num_classes=spec["num_classes"], x_scale=spec["x_scale"],
                            metadata=metadata)


def load_model(output_dir: str, theta: Optional[float] = None, seed: Optional[int] = None,
               **param) -> LoadedModel:
    """The final model of the replica with this theta (or swept value, e.g. qffl_q=1.0) and
    seed. Arguments left out must be unambiguous in the run.

    Example: ``deltafl_jax.load_model("runs/synthetic", theta=0.5, seed=1).predict(x)``.
    """
    mdir = os.path.join(output_dir, "models")
    index_path = os.path.join(mdir, "index.json")
    if not os.path.exists(index_path):
        raise FileNotFoundError(f"no saved models in {output_dir} (missing models/index.json)")
    with open(index_path) as f:
        spec = json.load(f)
    matches = []
    for entry in spec["replicas"]:
        if theta is not None and not np.isclose(entry.get("theta", np.nan), theta):
            continue
        if seed is not None and entry["seed"] != seed:
            continue
        if param:
            (pname, pvalue), = param.items() if len(param) == 1 else (None, None)
            if entry.get("param_name") != pname or not np.isclose(entry["param_value"], pvalue):
                continue
        matches.append(entry)
    if len(matches) != 1:
        avail = ", ".join(e["file"][:-len(".msgpack")] for e in spec["replicas"])
        what = "no model matches" if not matches else "several models match"
        raise ValueError(f"{what} theta={theta} seed={seed} {param or ''}; available: {avail}")
    entry = matches[0]
    options = ModelOptions(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in spec["options"].items()})
    model = build_model(spec["model"], _spec_dataset(spec, mdir), options)
    import jax.random
    template = model.init(jax.random.key(0))
    with open(os.path.join(mdir, entry["file"]), "rb") as f:
        params = flax.serialization.from_bytes(template, f.read())
    labels = {k: v for k, v in entry.items() if k != "file"}
    return LoadedModel(params=params, model=model, labels=labels)
