"""Serving a finished run's models: :func:`load_model` rebuilds the network from
``models/index.json`` and restores the final parameters w_theta of one replica (the paper's
Figure 1: a user picks a conformity level and gets its model), as a :class:`LoadedModel`
with ``predict`` and ``predict_labels``.

The files are read through :class:`deltafl_jax.outputs.directory.RunReader`; this module only turns
them into a network.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

import jax
import numpy as np

from deltafl_jax.data import ClientData, FederatedDataset
from deltafl_jax.errors import DeltaFLError
from deltafl_jax.models import Model, ModelOptions, build_model
from deltafl_jax.outputs.directory import MODELS, RunReader
from deltafl_jax.replicas.labels import ReplicaLabel


@dataclasses.dataclass(frozen=True, repr=False)
class LoadedModel:
    """A trained model w_theta of a finished run.

    params: the network's parameters. model: the network (:class:`deltafl_jax.models.Model`).
    labels: the replica's label fields (algorithm, theta, [param_name, param_value], seed);
    ``label`` gives them as a :class:`ReplicaLabel`. Printing it names the model, the replica
    and the parameter count, not the weights.
    """

    params: Any
    model: Model
    labels: Dict[str, Any]
    personal: Any = None     # [N, ...] every training client's personal model, or None
    input_shape: Optional[Tuple[int, ...]] = None   # one example's shape (None: unchecked)
    num_clients: Optional[int] = None   # the run's training clients (None: unknown)

    def for_client(self, k: int) -> "LoadedModel":
        """The model served to training client k (an index into the run's training clients):
        its personal model for an algorithm with per-client models (Ditto's v_k), the global
        one otherwise. Raises DeltaFLError for an index that is not an integer (1.5, True) or
        not in 0..N-1."""
        n = (int(jax.tree.leaves(self.personal)[0].shape[0]) if self.personal is not None
             else self.num_clients)
        span = f"0..{n - 1}" if n is not None else "0, 1, ..."
        try:
            index = None if isinstance(k, bool) else operator.index(k)
        except TypeError:
            index = None
        if index is None or index < 0 or (n is not None and index >= n):
            raise DeltaFLError(f"training client {k!r} is not in {span} (for_client takes the "
                               f"integer index of one of the run's training clients)")
        if self.personal is None:
            return self
        own = jax.tree.map(lambda a: np.asarray(a[index]), self.personal)
        return dataclasses.replace(self, params=own, personal=None,
                                   labels={**self.labels, "client": index})

    @property
    def label(self) -> ReplicaLabel:
        return ReplicaLabel.from_json(self.labels)

    def __repr__(self) -> str:
        sizes = [int(np.size(leaf)) for leaf in jax.tree.leaves(self.params)]
        client = f", client {self.labels['client']}" if "client" in self.labels else ""
        personal = ("" if self.personal is None else
                    f", with {int(jax.tree.leaves(self.personal)[0].shape[0]):,} personal "
                    f"models (for_client)")
        return (f"LoadedModel({self.model.name!r}, {self.label.key()}{client}, "
                f"{sum(sizes):,} parameters in {len(sizes)} arrays{personal})")

    def predict(self, x):
        """The network's outputs (scores) on raw inputs x [B, ...] as the dataset stores them:
        class scores (logits) [B, C] for softmax models, one logit [B, 1] for sigmoid models,
        the estimate for the squared-loss mean model. See :meth:`predict_labels` for classes.
        Raises DeltaFLError, naming both shapes, when x is not a batch of examples of the
        run's shape (a sequence model may take another length, if its network does)."""
        x = np.asarray(x)
        shape = None if self.input_shape is None else tuple(self.input_shape)
        if shape is None or tuple(x.shape[1:]) == shape:
            return self.model.apply(self.params, x)
        want = "(B, " + ", ".join(str(d) for d in shape) + ")"
        refusal = DeltaFLError(
            f"inputs of shape {tuple(x.shape)} do not fit model {self.model.name!r}, which "
            f"takes a batch of shape {want}"
            + (" (one example: x[None])" if tuple(x.shape) == shape else ""))
        if x.ndim != len(shape) + 1:
            raise refusal
        try:
            return self.model.apply(self.params, x)
        except Exception:  # pylint: disable=broad-except  (Flax's shape errors, and others)
            raise refusal from None

    def perplexity(self, x) -> float:
        """A language model's (``--model=llama``) perplexity on `x`: exp of the mean over the
        sequences of their mean token loss, the evaluation's per-client perplexity when `x` is
        one client's stored sequences [n, L]; a list of strings is tokenised first (each one
        sequence of the run's length, truncated)."""
        from deltafl_jax.models import llm
        model = self._language_model()
        if isinstance(x, (list, tuple)) and x and isinstance(x[0], str):
            x = llm.tokenised(model, list(x), int(self.input_shape[0]))
        return float(np.exp(np.mean(llm.sequence_losses(model, self.params, np.asarray(x)))))

    def generate(self, prompt: str, max_new_tokens: int = 32) -> str:
        """A language model's greedy continuation of `prompt` (the prompt included), decoded
        by the base's tokenizer (:func:`deltafl_jax.models.llm.generate`)."""
        from deltafl_jax.models import llm
        model = self._language_model()
        tok = llm.tokenizer_of(model)
        ids = llm.generate(model, self.params, tok.encode(prompt).ids, max_new_tokens,
                           llm.first_id(model.module.config.eos_token_id))
        return tok.decode(ids, skip_special_tokens=True)

    def _language_model(self):
        if not hasattr(self.model, "export"):
            raise DeltaFLError(f"model {self.model.name!r} is not a language model "
                               f"(--model=llama); perplexity and generate are its")
        return self.model

    def predict_labels(self, x) -> np.ndarray:
        """Predicted classes [B] (int32) on raw inputs x: the argmax of the scores for softmax
        models, ``logit > 0`` for sigmoid models (the rule of their error), the argmax for a
        custom model whose error is a misclassification rate. Raises DeltaFLError for the
        squared-loss mean model (and a custom model without classes), which predict no class."""
        kind = self.model.loss_kind
        if not self.model.is_classifier:
            raise DeltaFLError(f"model {self.model.name!r} predicts no class (its error is not a "
                               f"misclassification rate); use predict(x)")
        out = np.asarray(self.predict(x))
        if kind == "sigmoid":
            return (out.reshape(out.shape[0]) > 0).astype(np.int32)
        return np.argmax(out, axis=-1).astype(np.int32)


def spec_dataset(spec: Mapping[str, Any], mdir: str) -> FederatedDataset:
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


def spec_model(spec: Mapping[str, Any], mdir: str) -> Model:
    """The network of models/index.json's spec."""
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    if values.get("llm") is not None:   # --model=llama's settings (a dict in index.json)
        from deltafl_jax.models.llm import LLMSettings
        values["llm"] = LLMSettings(**values["llm"])
    options = ModelOptions(**values)
    return build_model(spec["model"], spec_dataset(spec, mdir), options)


def load_model(output_dir: str, theta: Optional[float] = None, seed: Optional[int] = None,
               **param: float) -> LoadedModel:
    """The final model of the replica with this theta (or swept value, e.g. qffl_q=1.0, or a
    tuning grid's coordinate) and seed. Arguments left out must be unambiguous in the run;
    raises DeltaFLError (a ValueError) naming the available replicas otherwise, and
    RunFormatError when the run has no readable models.

    Example: ``deltafl_jax.load_model("runs/synthetic", theta=0.5, seed=1).predict_labels(x)``.
    """
    reader = RunReader(output_dir)
    runs = ([] if reader.has(os.path.join(MODELS, "index.json"))
            else runs_inside(output_dir))
    if runs:
        shown = ", ".join(runs[:6]) + (f" and {len(runs) - 6} more" if len(runs) > 6 else "")
        raise DeltaFLError(f"{output_dir} holds {len(runs)} runs, not one: {shown}; load one "
                           f"of them, e.g. load_model({os.path.join(output_dir, runs[0])!r}, "
                           f"...)")
    spec = reader.model_index()
    entries = [(e, ReplicaLabel.from_json({k: v for k, v in e.items()
                                           if k not in ("file", "personal_file")}))
               for e in spec["replicas"]]
    matches = [(e, lab) for e, lab in entries if lab.matches(theta, seed, **param)]
    if len(matches) != 1:
        avail = ", ".join(e["file"][:-len(".msgpack")] for e, _ in entries)
        what = "no model matches" if not matches else "several models match"
        asked = " ".join([f"theta={theta}", f"seed={seed}"]
                         + [f"{k}={v}" for k, v in param.items()])
        raise DeltaFLError(f"{what} {asked} in {reader.output_dir}; available: {avail}")
    entry, _ = matches[0]
    model = spec_model(spec, reader.path(MODELS))
    template = model.init(jax.random.key(0))
    params = reader.read_model_params(template, entry["file"])
    personal = (reader.read_model_params(template, entry["personal_file"])
                if "personal_file" in entry else None)
    return LoadedModel(params=params, model=model, personal=personal,
                       labels={k: v for k, v in entry.items()
                               if k not in ("file", "personal_file")},
                       input_shape=tuple(int(d) for d in spec["feature_shape"]),
                       num_clients=_train_clients(reader))


def _train_clients(reader: RunReader) -> Optional[int]:
    """The run's training clients (summary.json's), or None when it does not say."""
    try:
        n = reader.summary().get("dataset", {}).get("num_train_clients")
    except DeltaFLError:
        return None
    return int(n) if isinstance(n, int) and not isinstance(n, bool) else None


def runs_inside(folder: str, depth: int = 2) -> List[str]:
    """The runs with saved models (``models/index.json``) in the subfolders of `folder`, down
    to `depth` levels (``<method>/``, ``<method>/seed_<s>/``), as paths relative to it, sorted."""
    found: List[str] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return found
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        if os.path.isfile(os.path.join(path, MODELS, "index.json")):
            found.append(name)
        elif depth > 1:
            found += [os.path.join(name, r) for r in runs_inside(path, depth - 1)]
    return found
