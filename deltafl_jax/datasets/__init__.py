"""Federated datasets, built offline and deterministically from a seed.

Every loader takes a :class:`DataConfig` and returns a
:class:`deltafl_jax.data.FederatedDataset` with disjoint train and test clients. Loaders raise
:class:`deltafl_jax.data.DataError` with one line that names what is missing or wrong.

- ``synthetic``: Synthetic(alpha, beta) of the FedProx / q-FFL papers (:mod:`.synthetic`).
- ``gaussian_toy``: the three Gaussians of the paper's Figure 3 (:mod:`.synthetic`).
- ``npz``: the user's own federated arrays (:mod:`.npz`; the format is in README.md).
- ``shakespeare``, ``sent140``, ``femnist``: the papers' real datasets, prepared by
  ``python -m data_prep.prepare`` (modules :mod:`.shakespeare`, :mod:`.sent140`, :mod:`.femnist`).
- ``stackoverflow``: TFF's StackOverflow next-word prediction (:mod:`.stackoverflow`); its
  train and test clients are TFF's train and test users (not a split of one set of clients).

Centralised image data (:data:`CENTRALISED`: ``mnist``, ``fashion_mnist``, ``cifar10``,
``cifar100``, ``tfds:NAME``) is not split into clients here: :func:`load_centralised` gives its
train and test arrays (:mod:`.centralised`), prepared once by ``python -m data_prep.prepare``.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import warnings
from typing import Callable, Dict, Optional, Tuple

from deltafl_jax.data import DataError, FederatedDataset
from deltafl_jax.declared import Bounds, flat_paths, group, set_fields, setting
from deltafl_jax.datasets.home import default_data_dir
from deltafl_jax.errors import UsageError


def toy_means_flag(name: str, text: str) -> Tuple[Tuple[float, float], ...]:
    """--toy_means 'x,y;x,y;...' as pairs (UsageError naming the flag otherwise)."""
    try:
        means = tuple(tuple(float(v) for v in pair.split(",")) for pair in text.split(";")
                      if pair.strip())
    except ValueError:
        raise UsageError(f"--{name} must look like '0,0;4,0;1,1', got {text!r}") from None
    if len(means) < 2 or any(len(m) != 2 for m in means):
        raise UsageError(f"--{name} must list at least two x,y pairs, got {text!r}")
    return means


@dataclasses.dataclass(frozen=True)
class ClientLimits:
    """Which clients and examples of a dataset are kept (``config.data.limits``).

    Attributes:
      min_client_examples: keep clients with at least this many examples
        (None: the dataset's paper default, 100 for FEMNIST/Shakespeare, 50 for Sent140).
      max_examples_per_client: keep at most this many examples per client (None: all);
        used by the CPU-sized flagfiles.
      max_train_clients / max_test_clients: keep a seeded random subset of this many clients
        of each split after the split (None: all).
    """

    min_client_examples: Optional[int] = setting(
        None, "keep clients with at least this many examples; unset: the dataset's paper value",
        kind="integer")
    max_examples_per_client: Optional[int] = setting(
        None, "keep each client's first N examples", kind="integer")
    max_train_clients: Optional[int] = setting(
        None, "keep a seeded subset of the train clients", kind="integer")
    max_test_clients: Optional[int] = setting(
        None, "keep a seeded subset of the test clients", kind="integer")


@dataclasses.dataclass(frozen=True)
class SyntheticSettings:
    """The generator of Synthetic(alpha, beta) (``config.data.synthetic``; the flags
    ``--synthetic_<field>``; :mod:`deltafl_jax.datasets.synthetic`).

    Attributes:
      alpha, beta: model and feature heterogeneity of Synthetic(alpha, beta).
      num_clients: clients in total, half for training and half for testing.
      max_examples: cap of the power-law client sizes.
      shared: weight rho of the labelling model common to all clients (0: the original
        benchmark, where held-out clients share nothing learnable).
      on_demand: generate each client when it is read (None: above 10^5 clients).
    """

    alpha: float = setting(1.0, "Synthetic(alpha, beta): model heterogeneity",
                           flag="synthetic_alpha")
    beta: float = setting(1.0, "Synthetic(alpha, beta): feature heterogeneity",
                          flag="synthetic_beta")
    num_clients: int = setting(100, "Synthetic: clients, half train half test",
                               flag="synthetic_num_clients")
    max_examples: int = setting(1000, "Synthetic: cap of the client sizes",
                                flag="synthetic_max_examples")
    shared: float = setting(
        0.0, "Synthetic: weight in [0, 1) of the labelling model shared by all clients (0 = the "
        "original benchmark)", flag="synthetic_shared")
    on_demand: Optional[bool] = setting(
        None, "Synthetic: generate each client when a round or an evaluation reads it (its own "
        "random stream); unset: above 100000 clients", kind="bool", flag="synthetic_on_demand")


@dataclasses.dataclass(frozen=True)
class ToySettings:
    """The Gaussians of the paper's Figure 3 (``config.data.toy``; the flags ``--toy_<field>``;
    ``--dataset=gaussian_toy``).

    Attributes:
      means: the means of the Gaussians, one (x, y) pair per client.
      examples_per_client: samples per Gaussian.
    """

    means: Tuple[Tuple[float, float], ...] = setting(
        ((0.0, 0.0), (4.0, 0.0), (1.0, 1.0)), "gaussian_toy: means 'x,y;x,y;...'",
        kind="string", flag_default="0,0;4,0;1,1", parse=toy_means_flag,
        restore=lambda v: tuple(tuple(float(x) for x in pair) for pair in v), flag="toy_means")
    examples_per_client: int = setting(500, "gaussian_toy: samples per client",
                                       flag="toy_examples_per_client")


@dataclasses.dataclass(frozen=True)
class Partitioner:
    """How centralised data are split into clients (``config.data.partitioner``;
    :mod:`deltafl_jax.datasets.partition`).

    Attributes:
      method: ``--partition``: none (the dataset's own clients), iid, dirichlet, shards,
        pathological, inner_dirichlet or size.
      num_clients: clients of each split (train, and test) made by the partition.
      dirichlet_alpha, min_partition_size, self_balancing: ``dirichlet``'s (alpha also
        ``inner_dirichlet``'s).
      shards_per_client: ``shards``'. classes_per_client: ``pathological``'s.
      size_law: ``size``'s share of client k: linear, square or exponential in k.
      seed: ``--partition_seed``, the partition's seed (None: the data's, ``data_seed``).
    """

    method: str = setting(
        "none", "split centralised data (an npz without train_client) into clients with Flower "
        "Datasets' partitioners, the test split into test clients of its own alike; none: the "
        "dataset's own clients",
        choices=("none", "iid", "dirichlet", "shards", "pathological", "inner_dirichlet",
                 "size"), flag="partition")
    num_clients: int = setting(100, "--partition: clients of each split (train, and test)")
    dirichlet_alpha: float = setting(
        0.5, "--partition=dirichlet | inner_dirichlet: the concentration alpha > 0 of Dir(alpha)")
    min_partition_size: int = setting(
        10, "--partition=dirichlet: every client's fewest examples (the draw is repeated up to "
        "10 times)")
    self_balancing: bool = setting(
        False, "--partition=dirichlet: a client holding more than the average gets no more")
    shards_per_client: int = setting(2, "--partition=shards: label-sorted shards per client")
    classes_per_client: int = setting(2, "--partition=pathological: classes per client")
    size_law: str = setting(
        "linear", "--partition=size: client k of K holds a share of the examples proportional "
        "to k, k^2 or e^k", choices=("linear", "square", "exponential"))
    seed: Optional[int] = setting(
        None, "--partition: the seed of the partition; unset: --data_seed", kind="integer",
        flag="partition_seed")


@dataclasses.dataclass(frozen=True)
class TextSettings:
    """Text with natural clients, ``--dataset=text:PATH`` (``config.data.text``;
    :mod:`deltafl_jax.datasets.text`), tokenised with the tokenizer of ``--base_model``.

    Attributes:
      base_model: the pretrained base (a Hugging Face folder, or a hub id with
        ``download_base_model``) whose tokenizer tokenises the text and which ``--model=llama``
        fine-tunes.
      download_base_model: fetch a hub id with huggingface_hub (never at run time otherwise).
      text_column: the column of the text (unless prompt and response columns are given).
      prompt_column, response_column: an instruction/response pair, joined by
        ``prompt_template``; only the response's tokens are scored by the loss.
      client_column: the column naming each row's client (None: ``--partition`` splits).
      max_length: tokens per sequence (longer ones truncated, shorter ones padded).
      pack: join a client's documents, each ended by EOS, and cut them into sequences of
        ``max_length`` instead of one truncated sequence per document.
    """

    base_model: Optional[str] = setting(
        None, "--model=llama: the pretrained base, a Hugging Face folder (config.json, "
        "model.safetensors, tokenizer.json) or a hub id with --download_base_model; "
        "--dataset=text:PATH is tokenised by its tokenizer", kind="string")
    download_base_model: bool = setting(
        False, "--base_model names a Hugging Face hub id: download it with huggingface_hub "
        "(otherwise nothing is fetched)")
    text_column: str = setting("text", "--dataset=text:PATH: the column holding the text")
    prompt_column: Optional[str] = setting(
        None, "--dataset=text:PATH: the instruction column of an instruction/response pair (with "
        "--response_column; the loss scores the response's tokens only)", kind="string")
    response_column: Optional[str] = setting(
        None, "--dataset=text:PATH: the response column of an instruction/response pair",
        kind="string")
    prompt_template: str = setting(
        "### Instruction:\\n{prompt}\\n\\n### Response:\\n",
        "--dataset=text:PATH: how an instruction is shown to the model ({prompt} is replaced by "
        "it, \\n by a newline; the response follows)")
    client_column: Optional[str] = setting(
        None, "--dataset=text:PATH: the column naming each row's client (user_id, ...); unset: "
        "--partition splits the rows into clients", kind="string")
    max_length: int = setting(
        128, "--dataset=text:PATH: tokens per sequence (longer truncated, shorter padded); at "
        "most the base's max_position_embeddings", bounds=Bounds(1, math.inf, integer=True))
    pack: bool = setting(
        False, "--dataset=text:PATH: join each client's documents (each ended by EOS) and cut "
        "them into sequences of --max_length, instead of one truncated sequence per document")


@dataclasses.dataclass(frozen=True, init=False)
class DataConfig:
    """Everything a dataset loader may read: the fields that choose the data, and the settings
    of the data's parts in groups. Unused settings are ignored by a loader.

    Attributes:
      dataset: registry name.
      data_path: a user file (npz) or a raw source (LEAF json dir, TFF h5/sqlite).
      data_dir: cache of prepared datasets (None: :func:`default_data_dir`).
      data_seed: seed of the data generation and of the train/test client split.
      limits: the clients and examples kept (:class:`ClientLimits`).
      synthetic: Synthetic(alpha, beta)'s generator (:class:`SyntheticSettings`).
      toy: the Gaussians of ``gaussian_toy`` (:class:`ToySettings`).
      normalize: "none", "reference" (the authors' (x - mu) / mu per feature, mu of each
        split) or "standard" (z-scores with the training statistics); float features only,
        applied after the client limits (:mod:`deltafl_jax.datasets.normalize`).
      writer_fraction: FEMNIST: the fraction of the eligible writers kept (the paper: 0.5).
      resample_writers_per_seed: redraw the data (FEMNIST's writer subsample, every dataset's
        train/test split) for each seed, as the authors do; each seed is then its own dataset
        and its own program (:mod:`deltafl_jax.replicas.seed_programs`).
      partitioner: how centralised data are split into clients (:class:`Partitioner`).
      text: ``--dataset=text:PATH``'s columns, tokenizer and sequences (:class:`TextSettings`).

    A setting of a group is read through it (``config.limits.max_train_clients``,
    ``config.synthetic.alpha``, ``config.partitioner.method``); :data:`FLAT` maps each of
    their flags to its (group, field). The flags remain a shorthand of the public API: the
    constructor and ``dataclasses.replace`` take them as keywords
    (``DataConfig("synthetic", synthetic_num_clients=10, max_train_clients=5)`` sets
    ``synthetic.num_clients`` and ``limits.max_train_clients``), and ``config.dirichlet_alpha``
    still reads ``config.partitioner.dirichlet_alpha``, with a :class:`DeprecationWarning`
    naming the nested path. :func:`deltafl_jax.declared.flat_values` is the flag -> value view
    that outputs and resumes store.
    """

    dataset: str = setting(
        help="synthetic | gaussian_toy | npz | shakespeare | sent140 | femnist | stackoverflow | "
        "text:PATH (jsonl, csv or parquet, tokenised by --base_model's tokenizer)",
        kind="string", flag_default="synthetic")
    data_path: Optional[str] = setting(None, "npz file, or the raw source of a real dataset",
                                       kind="string")
    data_dir: Optional[str] = setting(None, "prepared-dataset cache; unset: $DELTAFL_DATA or "
                                      "~/.cache/deltafl_jax", kind="string")
    data_seed: int = setting(0, "seed of data generation and of the train/test split")
    limits: ClientLimits = group(ClientLimits)
    synthetic: SyntheticSettings = group(SyntheticSettings)
    toy: ToySettings = group(ToySettings)
    normalize: str = setting(
        "none", "float inputs: none | reference (the authors' code: (x - mu) / mu per feature, "
        "mu the mean of each split's own examples) | standard (z-scores with the training "
        "statistics); sent140: of the mean GloVe vectors (sent140_linear)",
        choices=("none", "reference", "standard"))
    writer_fraction: float = setting(
        0.5, "femnist: fraction of the eligible writers kept (the paper: 0.5; 1.0 keeps them "
        "all)")
    resample_writers_per_seed: bool = setting(
        False, "redraw the data (femnist's writer subsample; every dataset's train/test split) "
        "from each seed, as the authors do; each seed then runs as its own program into "
        "<output_dir>/seed_<s>/")
    partitioner: Partitioner = group(Partitioner)
    text: TextSettings = group(TextSettings)

    def __init__(self, dataset: str, **settings):
        set_fields(self, dict(settings, dataset=dataset))

    def __getattr__(self, name):
        """Deprecated: a setting of a group by its flag's name (``config.max_train_clients``
        is ``config.limits.max_train_clients``), with a :class:`DeprecationWarning` that names
        the nested path."""
        where = FLAT.get(name)
        if where is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(f"config.{name} is config.{where[0]}.{where[1]} (a DataConfig): read the "
                      f"setting through its group (the flat names are deprecated)",
                      DeprecationWarning, stacklevel=2)
        return getattr(object.__getattribute__(self, where[0]), where[1])

    @property
    def resolved_data_dir(self) -> str:
        return self.data_dir or default_data_dir()


# The flat names of DataConfig's grouped settings: flag -> (group, field).
FLAT: Dict[str, Tuple[str, str]] = {flag: path for flag, path in flat_paths(DataConfig).items()
                                    if len(path) == 2}


DATASETS: Dict[str, str] = {
    "synthetic": "deltafl_jax.datasets.synthetic:load_synthetic",
    "gaussian_toy": "deltafl_jax.datasets.synthetic:load_gaussian_toy",
    "npz": "deltafl_jax.datasets.npz:load_npz",
    "shakespeare": "deltafl_jax.datasets.shakespeare:load",
    "sent140": "deltafl_jax.datasets.sent140:load",
    "femnist": "deltafl_jax.datasets.femnist:load",
    "stackoverflow": "deltafl_jax.datasets.stackoverflow:load",
}


# The real datasets that are prepared once from a raw source into the cache:
# name -> "module:function" taking (DataConfig) -> the prepared directory.
PREPARABLE: Dict[str, str] = {
    "shakespeare": "deltafl_jax.datasets.shakespeare:prepare",
    "sent140": "deltafl_jax.datasets.sent140:prepare",
    "femnist": "deltafl_jax.datasets.femnist:prepare",
    "stackoverflow": "deltafl_jax.datasets.stackoverflow:prepare",
}

# The prepared datasets that --download can fetch: name -> "module:function" taking the data
# directory and returning the downloaded source, which the dataset's prepare(config,
# source=...) reads.
DOWNLOADABLE: Dict[str, str] = {
    "femnist": "deltafl_jax.datasets.femnist:download",
    "stackoverflow": "deltafl_jax.datasets.stackoverflow:download",
}


# Centralised image-classification data (:mod:`deltafl_jax.datasets.centralised`): name ->
# "module:function" preparing it, taking (DataConfig, download). "tfds:NAME" stands for every
# tensorflow-datasets name.
CENTRALISED: Dict[str, str] = {
    name: "deltafl_jax.datasets.centralised:prepare"
    for name in ("mnist", "fashion_mnist", "cifar10", "cifar100", "tfds:NAME")}


def centralised_key(name: str) -> Optional[str]:
    """The key of `name` in :data:`CENTRALISED` (tfds:NAME for any tfds:...), else None."""
    key = "tfds:NAME" if name.startswith("tfds:") else name
    return key if key in CENTRALISED else None


def load_centralised(name: str, data_path: Optional[str] = None,
                     cache_dir: Optional[str] = None, download: bool = False):
    """Centralised train/test image arrays of `name` (:data:`CENTRALISED`), prepared into the
    cache under `cache_dir` on first use; see :func:`deltafl_jax.datasets.centralised
    .load_centralised`."""
    from deltafl_jax.datasets import centralised  # local import: read on first use
    return centralised.load_centralised(name, data_path, cache_dir, download)


def dataset_names():
    return sorted(DATASETS)


def prepare_dataset(config: "DataConfig", download: bool = False) -> str:
    """Prepare a real dataset from its raw source (FEMNIST, StackOverflow and the centralised
    image datasets: after downloading it when `download`); returns the prepared directory.
    DataError for anything else."""
    key = centralised_key(config.dataset)
    if key is not None:
        module_name, fn_name = CENTRALISED[key].split(":")
        return getattr(importlib.import_module(module_name), fn_name)(config, download=download)
    if config.dataset not in DATASETS:
        raise DataError(f"unknown dataset {config.dataset!r}; choose one of "
                        f"{', '.join(dataset_names())} (this command prepares "
                        f"{', '.join(sorted(PREPARABLE) + sorted(CENTRALISED))})")
    if config.dataset not in PREPARABLE:
        raise DataError(f"--dataset={config.dataset} needs no preparation; prepared datasets: "
                        f"{', '.join(sorted(PREPARABLE) + sorted(CENTRALISED))}")
    module_name, fn_name = PREPARABLE[config.dataset].split(":")
    prepare = getattr(importlib.import_module(module_name), fn_name)
    if download:
        if config.dataset not in DOWNLOADABLE:
            can = ", ".join(sorted(DOWNLOADABLE) + sorted(CENTRALISED))
            raise DataError(f"--download is for {can} only; {config.dataset} has no download")
        module_name, fn_name = DOWNLOADABLE[config.dataset].split(":")
        fetch = getattr(importlib.import_module(module_name), fn_name)
        return prepare(config, source=fetch(config.resolved_data_dir))
    return prepare(config)


# The loaders of centralised data, which split it into clients by ``--partition`` (and every
# name of :data:`CENTRALISED`).
PARTITIONABLE = ("npz",)


TEXT_PREFIX = "text:"   # --dataset=text:PATH (:mod:`deltafl_jax.datasets.text`)


def _loader(name: str) -> Callable[[DataConfig], FederatedDataset]:
    if name.startswith(TEXT_PREFIX):
        from deltafl_jax.datasets import text   # local import: text imports this package
        return text.load
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(dataset_names())}")
    module_name, fn_name = DATASETS[name].split(":")
    return getattr(importlib.import_module(module_name), fn_name)


def load_dataset(config: DataConfig) -> FederatedDataset:
    """Build or load the dataset named by `config.dataset`, then apply the client limits and
    the input normalisation (``config.normalize``)."""
    from deltafl_jax.datasets import limits, normalize, npz, partition  # local: read on use

    # Every setting is checked before a loader prepares, caches or writes anything.
    limits.check_limits(config)
    if config.normalize != "none":
        normalize.check_method(config.normalize)
    if config.partitioner.method != "none":
        partition.check_spec(partition.spec_of(config))
    if centralised_key(config.dataset) is not None:
        data = partition.kept(limits.apply_limits(npz.load_partitioned_images(config), config))
        return normalize.normalize(data, config.normalize)
    method = config.partitioner.method
    if method != "none" and config.dataset not in PARTITIONABLE and \
            not config.dataset.startswith(TEXT_PREFIX):
        raise DataError(f"--partition={method}: --dataset={config.dataset} has its "
                        f"own clients; --partition splits centralised data "
                        f"({', '.join(PARTITIONABLE)} without a client column)")
    data = _loader(config.dataset)(config)
    kept = config.limits
    if any(v is not None for v in (kept.max_examples_per_client, kept.max_train_clients,
                                   kept.max_test_clients)):
        data = limits.apply_limits(data, config)
    if data.partition is not None:
        data = partition.kept(data)
    return data if config.normalize == "none" else normalize.normalize(data, config.normalize)
