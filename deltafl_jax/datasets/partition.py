"""Partitioners: centralised labelled data (x, y) split into federated clients.

A partition gives every client its example indices in the source split. The six partitioners
have the semantics of Flower Datasets' (``flwr-datasets``, ``datasets/flwr_datasets/partitioner/``
of github.com/adap/flower, read at commit fdef7afb1dca3030553be302366cfd285ed6632c): the same
parameters, the same defaults, the same random draws in the same order.

A partition of `labels` with seed s is what ``FederatedDataset(shuffle=True, seed=s)`` followed
by the partitioner with ``seed=s`` gives: the split is first shuffled by
``default_rng(s).permutation(n)`` (Hugging Face ``Dataset.shuffle(seed=s)``), the partitioner
then runs on the shuffled rows with its own ``default_rng(s)``, and its indices are mapped back to
the source rows. So the same seed gives the same partition on every machine (NumPy's PCG64
stream), and the same partition as Flower Datasets for the same seed.

- ``iid`` (IidPartitioner): the shuffled rows cut into `num_clients` contiguous blocks; the first
  ``n mod K`` blocks hold one row more.
- ``dirichlet`` (DirichletPartitioner; Yurochkin et al. 2019): for each class in ascending order,
  proportions p ~ Dir(alpha 1_K) over the clients, its rows cut at ``floor(cumsum(p) * n_c)``.
  With ``self_balancing`` a client already holding more than n / K rows gets no more (its
  proportion is set to 0, the others renormalised). When a client ends with fewer than
  ``min_partition_size`` rows the whole draw is repeated with the stream where it is, at most 10
  times more (11 draws in all); then :class:`deltafl_jax.errors.DataError`.
- ``shards`` (ShardPartitioner; McMahan et al. 2017): the shuffled rows stably sorted by label
  and cut into shards of ``shard_size = floor(n / (K * shards_per_client))`` consecutive rows;
  each client gets ``shards_per_client`` shards drawn without replacement
  (``permutation(#shards)[:K * shards_per_client]``).
- ``pathological`` (PathologicalPartitioner; Li et al. 2022): each client gets
  ``classes_per_client`` classes (``class_assignment_mode`` random, deterministic or
  first-deterministic); each class's rows are split evenly (``np.array_split``) among the
  clients holding it, in client order.
- ``inner_dirichlet`` (InnerDirichletPartitioner; Acar et al. 2021): client sizes are given
  (here: n split as evenly as possible); each client draws class priors ~ Dir(alpha 1_C); one
  row at a time a client with room is drawn uniformly and its class from its prior (an
  exhausted class's prior set to 0 and every prior renormalised). Classes are the sorted
  distinct labels (Flower's uses 0..C-1, the same when every class occurs).
- ``size`` (LinearPartitioner, SquarePartitioner, ExponentialPartitioner): client k = 1..K holds
  a share f(k) / sum_j f(j) of the rows (f = k, k^2 or e^k, ``size_law``), floored, the rows
  left over going to client K; contiguous blocks of the shuffled rows.

Every partitioner except ``dirichlet`` with its re-draws is one draw; within a client the rows
are shuffled (Flower's ``shuffle=True``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.errors import DataError

METHODS = ("iid", "dirichlet", "shards", "pathological", "inner_dirichlet", "size")
LABELLED = ("dirichlet", "shards", "pathological", "inner_dirichlet")
SIZE_LAWS = {"linear": lambda k: k, "square": np.square, "exponential": np.exp}
CLASS_MODES = ("random", "deterministic", "first-deterministic")
MAX_REDRAWS = 10   # Flower's DirichletPartitioner: 10 re-draws after the first draw
FLOWER_COMMIT = "fdef7afb1dca3030553be302366cfd285ed6632c"


@dataclasses.dataclass(frozen=True)
class PartitionSpec:
    """How to partition a split (the ``--partition`` flags; Flower's parameter in brackets).

    method: one of :data:`METHODS`. num_clients: K [num_partitions]. alpha: Dir(alpha) of
    ``dirichlet`` and ``inner_dirichlet`` [alpha]. min_partition_size: ``dirichlet``'s smallest
    client [min_partition_size]. self_balancing: ``dirichlet`` [self_balancing].
    shards_per_client [num_shards_per_partition]; shard_size (None: from n) [shard_size];
    keep_incomplete_shard [keep_incomplete_shard]. classes_per_client
    [num_classes_per_partition]; class_assignment_mode [class_assignment_mode]. size_law:
    ``size``'s f(k), linear | square | exponential. seed: the shuffle's and the partitioner's.
    """

    method: str
    num_clients: int = 100
    alpha: float = 0.5
    min_partition_size: int = 10
    self_balancing: bool = False
    shards_per_client: int = 2
    shard_size: Optional[int] = None
    keep_incomplete_shard: bool = False
    classes_per_client: int = 2
    class_assignment_mode: str = "random"
    size_law: str = "linear"
    seed: int = 0


def check_spec(spec: PartitionSpec) -> None:
    """DataError (one line naming the flag) for settings no data can meet."""
    if spec.method not in METHODS:
        raise DataError(f"--partition must be one of {', '.join(METHODS)}, got {spec.method!r}")
    if spec.num_clients < 1:
        raise DataError(f"--num_clients must be at least 1, got {spec.num_clients}")
    if spec.seed < 0:
        raise DataError(f"--partition_seed (or --data_seed) must be >= 0, got {spec.seed}")
    if spec.method in ("dirichlet", "inner_dirichlet") and not spec.alpha > 0:
        raise DataError(f"--dirichlet_alpha must be > 0, got {spec.alpha:g}")
    if spec.method == "dirichlet" and spec.min_partition_size < 0:
        raise DataError(f"--min_partition_size must be >= 0, got {spec.min_partition_size}")
    if spec.method == "shards" and spec.shards_per_client < 1:
        raise DataError(f"--shards_per_client must be at least 1, got {spec.shards_per_client}")
    if spec.method == "shards" and spec.shard_size is not None and spec.shard_size < 1:
        raise DataError(f"shard_size must be at least 1, got {spec.shard_size}")
    if spec.method == "pathological" and spec.classes_per_client < 1:
        raise DataError(f"--classes_per_client must be at least 1, got "
                        f"{spec.classes_per_client}")
    if spec.class_assignment_mode not in CLASS_MODES:
        raise DataError(f"class_assignment_mode must be one of {', '.join(CLASS_MODES)}, got "
                        f"{spec.class_assignment_mode!r}")
    if spec.size_law not in SIZE_LAWS:
        raise DataError(f"--size_law must be one of {', '.join(SIZE_LAWS)}, got "
                        f"{spec.size_law!r}")


def _shuffled(rng: np.random.Generator, parts: List[np.ndarray], shuffle: bool):
    """Each client's rows, shuffled in place in client order (Flower's ``shuffle=True``)."""
    out = [np.asarray(p, dtype=np.int64) for p in parts]
    if shuffle:
        for p in out:
            rng.shuffle(p)
    return out


def iid(num_examples: int, num_partitions: int) -> List[np.ndarray]:
    """IidPartitioner: contiguous blocks, the first ``n mod K`` one row longer."""
    div, mod = divmod(num_examples, num_partitions)
    starts = [div * i + min(i, mod) for i in range(num_partitions)]
    return [np.arange(s, s + div + (i < mod), dtype=np.int64) for i, s in enumerate(starts)]


def _dirichlet_draw(labels, classes, num_partitions, alpha, self_balancing, rng):
    """One draw of DirichletPartitioner: every client's rows, class by class."""
    parts: List[List[np.ndarray]] = [[] for _ in range(num_partitions)]
    sizes = np.zeros(num_partitions, np.int64)
    average = len(labels) / num_partitions
    for c in classes:
        rows = np.nonzero(labels == c)[0]
        prop = rng.dirichlet(alpha)
        if self_balancing:
            prop = np.where(sizes > average, 0.0, prop)
            prop = prop / np.cumsum(prop)[-1]   # sequential sum, as Python's sum()
        cuts = (np.cumsum(prop) * len(rows)).astype(int)[:-1]
        for k, piece in enumerate(np.split(rows, cuts)):
            parts[k].append(piece)
            sizes[k] += piece.size
    return [np.concatenate(p) for p in parts]


def dirichlet(labels: np.ndarray, num_partitions: int, alpha: float,
              min_partition_size: int = 10, self_balancing: bool = False,
              shuffle: bool = True, rng: Optional[np.random.Generator] = None):
    """DirichletPartitioner (module docstring); DataError when the 11th draw still leaves a
    client under `min_partition_size`."""
    rng = rng if rng is not None else np.random.default_rng(42)
    classes = np.unique(labels)
    alphas = np.full(num_partitions, float(alpha))
    for _ in range(MAX_REDRAWS + 1):
        parts = _dirichlet_draw(labels, classes, num_partitions, alphas, self_balancing, rng)
        smallest = min(p.size for p in parts)
        if smallest >= min_partition_size:
            return _shuffled(rng, parts, shuffle)
    raise DataError(
        f"--partition=dirichlet: after {MAX_REDRAWS + 1} draws a client still has {smallest} "
        f"< --min_partition_size={min_partition_size} examples ({len(labels)} examples, "
        f"{num_partitions} clients, --dirichlet_alpha={alpha:g}): raise the alpha, or lower "
        f"--num_clients or --min_partition_size")


def _shard_layout(n: int, num_partitions: int, per_partition: Optional[int],
                  shard_size: Optional[int], keep_incomplete: bool):
    """(shard_size, usable shards, shards of each client) as ShardPartitioner decides them."""
    if per_partition is not None:
        used = num_partitions * per_partition
        counts = np.full(num_partitions, per_partition)
        if shard_size is None:
            shard_size = int(n / used)
            if shard_size < 1:
                raise DataError(f"--partition=shards: {used} shards ({num_partitions} clients x "
                                f"--shards_per_client={per_partition}) but only {n} examples")
            usable = (math.ceil if keep_incomplete else math.floor)(n / shard_size)
        else:
            if shard_size * used > n:
                raise DataError(f"--partition=shards: {used} shards of {shard_size} need "
                                f"{shard_size * used} examples, there are {n}")
            usable = n // shard_size
    else:
        if shard_size is None:
            raise DataError("--partition=shards needs shards_per_client or shard_size")
        used = (math.ceil if keep_incomplete else math.floor)(n / shard_size)
        usable = used
        counts = np.full(num_partitions, used // num_partitions)
        counts[:used - num_partitions * (used // num_partitions)] += 1
    if usable < num_partitions:
        raise DataError(f"--partition=shards: {usable} shards of {shard_size} examples for "
                        f"{num_partitions} clients: some would be empty")
    return shard_size, int(usable), counts.astype(int)


def shards(labels: np.ndarray, num_partitions: int, num_shards_per_partition: Optional[int] = 2,
           shard_size: Optional[int] = None, keep_incomplete_shard: bool = False,
           shuffle: bool = True, rng: Optional[np.random.Generator] = None):
    """ShardPartitioner (module docstring)."""
    rng = rng if rng is not None else np.random.default_rng(42)
    n = len(labels)
    size, usable, counts = _shard_layout(n, num_partitions, num_shards_per_partition,
                                         shard_size, keep_incomplete_shard)
    order = np.argsort(labels, kind="stable")   # the rows sorted by label
    chosen = rng.permutation(usable)[:int(counts.sum())]
    parts = []
    for own in np.split(chosen, np.cumsum(counts))[:-1]:
        spans = [np.arange(s * size, min((s + 1) * size, n)) for s in own]
        parts.append(order[np.concatenate(spans)] if spans else np.zeros(0, np.int64))
    return _shuffled(rng, parts, shuffle)


def _classes_of_clients(classes: np.ndarray, num_partitions: int, per_client: int, mode: str,
                        rng: np.random.Generator) -> List[List[Any]]:
    """PathologicalPartitioner's classes of each client."""
    if per_client > classes.size:
        raise DataError(f"--classes_per_client={per_client} but the data hold {classes.size} "
                        f"classes")
    chosen: List[List[Any]] = []
    for k in range(num_partitions):
        if mode == "random":
            chosen.append(rng.choice(classes, size=per_client, replace=False).tolist())
        elif mode == "deterministic":
            chosen.append([classes[(k + i) % classes.size].item() for i in range(per_client)])
        else:   # first-deterministic
            own = [classes[k % classes.size].item()]
            while len(own) < per_client:
                c = rng.choice(classes, size=1)[0].item()
                if c not in own:
                    own.append(c)
            chosen.append(own)
    return chosen


def pathological(labels: np.ndarray, num_partitions: int, num_classes_per_partition: int = 2,
                 class_assignment_mode: str = "random", shuffle: bool = True,
                 rng: Optional[np.random.Generator] = None):
    """PathologicalPartitioner (module docstring)."""
    rng = rng if rng is not None else np.random.default_rng(42)
    classes = np.unique(labels)
    chosen = _classes_of_clients(classes, num_partitions, num_classes_per_partition,
                                 class_assignment_mode, rng)
    parts: List[List[np.ndarray]] = [[] for _ in range(num_partitions)]
    for c in classes.tolist():
        holders = [k for k in range(num_partitions) if c in chosen[k]]
        rows = np.where(labels == c)[0]
        if len(holders) > rows.size:
            raise DataError(f"--partition=pathological: class {c} is given to {len(holders)} "
                            f"clients but has {rows.size} examples: lower --num_clients or "
                            f"--classes_per_client")
        for k, piece in zip(holders, np.array_split(rows, len(holders)) if holders else []):
            parts[k].append(piece)
    return _shuffled(rng, [np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts],
                     shuffle)


def inner_dirichlet(labels: np.ndarray, partition_sizes: Sequence[int], alpha: float,
                    shuffle: bool = True, rng: Optional[np.random.Generator] = None):
    """InnerDirichletPartitioner (module docstring)."""
    rng = rng if rng is not None else np.random.default_rng(42)
    sizes = np.asarray(partition_sizes, dtype=np.int64)
    if sizes.sum() > len(labels):
        raise DataError(f"--partition=inner_dirichlet: the clients' sizes add to {sizes.sum()} "
                        f"but there are {len(labels)} examples")
    classes = np.unique(labels)
    priors = rng.dirichlet(alpha=np.full(classes.size, float(alpha)), size=sizes.size)
    rows_of = [np.where(labels == c)[0] for c in classes]
    left_in_class = [r.size for r in rows_of]
    out = [np.zeros(int(s), np.int64) for s in sizes]
    left = sizes.copy()
    open_clients = list(range(sizes.size))
    remaining = int(sizes.sum())
    while remaining:
        k = rng.choice(open_clients)
        if left[k] == 0:
            open_clients.remove(k)
            continue
        left[k] -= 1
        remaining -= 1
        while True:
            c = rng.choice(classes.size, p=priors[k])
            if left_in_class[c] == 0:
                priors[:, c] = 0
                priors = priors / priors.sum(axis=1, keepdims=True)
                continue
            left_in_class[c] -= 1
            out[k][left[k]] = rows_of[c][left_in_class[c]]
            break
    return _shuffled(rng, out, shuffle)


def by_size(num_examples: int, num_partitions: int, size_law: str = "linear"):
    """LinearPartitioner / SquarePartitioner / ExponentialPartitioner (module docstring)."""
    units = SIZE_LAWS[size_law](np.linspace(1, num_partitions, num_partitions))
    sizes = np.array(units / units.sum() * num_examples, dtype=np.int64)
    sizes[-1] += num_examples - sizes.sum()
    if sizes.min() < 1:
        raise DataError(f"--partition=size --size_law={size_law}: {num_partitions} clients "
                        f"over {num_examples} examples leave client {int(np.argmin(sizes))} "
                        f"empty: lower --num_clients")
    ends = np.cumsum(sizes)
    return [np.arange(e - s, e, dtype=np.int64) for s, e in zip(sizes, ends)]


def even_sizes(num_examples: int, num_partitions: int) -> np.ndarray:
    """n split as evenly as possible: the first ``n mod K`` clients one example more."""
    div, mod = divmod(num_examples, num_partitions)
    return np.array([div + (k < mod) for k in range(num_partitions)], dtype=np.int64)


def _on_shuffled(labels: Optional[np.ndarray], n: int, spec: PartitionSpec, rng):
    """The partitioner of `spec` on rows already shuffled."""
    k = spec.num_clients
    if spec.method == "iid":
        return iid(n, k)
    if spec.method == "size":
        return by_size(n, k, spec.size_law)
    if spec.method == "dirichlet":
        return dirichlet(labels, k, spec.alpha, spec.min_partition_size, spec.self_balancing,
                         rng=rng)
    if spec.method == "shards":
        return shards(labels, k, spec.shards_per_client, spec.shard_size,
                      spec.keep_incomplete_shard, rng=rng)
    if spec.method == "pathological":
        return pathological(labels, k, spec.classes_per_client, spec.class_assignment_mode,
                            rng=rng)
    return inner_dirichlet(labels, even_sizes(n, k), spec.alpha, rng=rng)


def partition(labels: Optional[np.ndarray], spec: PartitionSpec,
              num_examples: Optional[int] = None) -> List[np.ndarray]:
    """Every client's example indices into the split, by `spec` (module docstring).

    `labels` [n] (None for ``iid`` and ``size``, with `num_examples` then). DataError (one line)
    when it cannot be done: no client may be left without examples."""
    check_spec(spec)
    n = len(labels) if labels is not None else int(num_examples)
    if spec.method in LABELLED and labels is None:
        raise DataError(f"--partition={spec.method} needs labels (train_y, test_y)")
    if spec.num_clients > n:
        raise DataError(f"--partition={spec.method}: {spec.num_clients} clients (--num_clients) "
                        f"but only {n} examples")
    perm = np.random.default_rng(spec.seed).permutation(n)
    shuffled = None if labels is None else np.asarray(labels)[perm]
    parts = _on_shuffled(shuffled, n, spec, np.random.default_rng(spec.seed))
    empty = [k for k, p in enumerate(parts) if p.size == 0]
    if empty:
        raise DataError(f"--partition={spec.method} leaves client {empty[0]} with no examples "
                        f"({n} examples, {spec.num_clients} clients): lower --num_clients")
    return [perm[p] for p in parts]


def test_split_seed(seed: int) -> int:
    """The seed of the test split's partition: its own stream, derived from the train seed."""
    return int(np.random.SeedSequence([int(seed), 1]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class Partition:
    """A partitioned dataset's partition: every train and test client's example indices in its
    source split, and the settings that made it (written to ``partition.npz``).

    train, test: per client, int64 indices. train_ids, test_ids: the clients' ids (0..K-1 as
    made; fewer after ``--max_train_clients`` / ``--max_test_clients``). train_labels,
    test_labels: the source splits' labels (None: unlabelled), from which
    :meth:`label_histograms` counts each client's classes."""

    settings: Mapping[str, Any]
    train: Tuple[np.ndarray, ...]
    test: Tuple[np.ndarray, ...]
    train_ids: np.ndarray
    test_ids: np.ndarray
    train_labels: Optional[np.ndarray] = None
    test_labels: Optional[np.ndarray] = None

    def restricted(self, train_ids, train_sizes, test_ids, test_sizes) -> "Partition":
        """The partition of the clients kept (by id), each cut to its first `sizes` examples
        (what ``--max_*`` keep; :mod:`deltafl_jax.datasets.limits`)."""
        def keep(parts, ids, all_ids, sizes):
            where = {int(i): j for j, i in enumerate(all_ids)}
            return tuple(parts[where[int(i)]][:int(s)] for i, s in zip(ids, sizes))
        return dataclasses.replace(
            self, train=keep(self.train, train_ids, self.train_ids, train_sizes),
            test=keep(self.test, test_ids, self.test_ids, test_sizes),
            train_ids=np.asarray(train_ids), test_ids=np.asarray(test_ids))

    def arrays(self) -> Dict[str, np.ndarray]:
        """partition.npz: ``<split>_indices`` (concatenated), ``<split>_offsets`` [K + 1] (client
        k owns indices[offsets[k]:offsets[k+1]]), ``<split>_client_ids``, and every setting."""
        out: Dict[str, np.ndarray] = {}
        for split, parts, ids in (("train", self.train, self.train_ids),
                                  ("test", self.test, self.test_ids)):
            sizes = [p.size for p in parts]
            out[f"{split}_indices"] = (np.concatenate(parts).astype(np.int64) if parts
                                       else np.zeros(0, np.int64))
            out[f"{split}_offsets"] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            out[f"{split}_client_ids"] = np.asarray(ids, dtype=np.int64)
        for key, value in self.settings.items():
            out[key] = np.asarray("" if value is None else value)
        out.update(self.label_histograms())
        return out

    def label_histograms(self) -> Dict[str, np.ndarray]:
        """``<split>_label_histogram`` [K, C] int64 of each labelled split: client k's examples
        of class c, over the classes 0..C-1 of both splits (C = the largest label + 1)."""
        labelled = [(split, parts, labels) for split, parts, labels in
                    (("train", self.train, self.train_labels),
                     ("test", self.test, self.test_labels)) if labels is not None]
        sizes = [int(labels.max()) + 1 for _, _, labels in labelled if labels.size]
        width = max(sizes, default=0)
        out = {}
        for split, parts, labels in labelled:
            hist = np.zeros((len(parts), width), np.int64)
            for k, part in enumerate(parts):
                hist[k] = np.bincount(labels[part], minlength=width)[:width]
            out[f"{split}_label_histogram"] = hist
        return out


def client_lists(arrays: Mapping[str, np.ndarray], split: str) -> List[np.ndarray]:
    """The per-client index lists of one split of a ``partition.npz`` (:meth:`Partition.arrays`)."""
    idx, off = arrays[f"{split}_indices"], arrays[f"{split}_offsets"]
    return [idx[off[k]:off[k + 1]] for k in range(off.size - 1)]


def partition_splits(train_labels, test_labels, spec: PartitionSpec,
                     num_train: Optional[int] = None, num_test: Optional[int] = None):
    """The train split partitioned with ``spec.seed`` and the test split, its own devices, with
    the same partitioner and :func:`test_split_seed` (a :class:`Partition`)."""
    check_spec(spec)
    try:
        train = partition(train_labels, spec, num_train)
    except DataError as e:
        raise DataError(f"train split: {e}") from None
    tspec = dataclasses.replace(spec, seed=test_split_seed(spec.seed))
    try:
        test = partition(test_labels, tspec, num_test)
    except DataError as e:
        raise DataError(f"test split: {e}") from None
    settings = {f"setting_{k}": v for k, v in dataclasses.asdict(spec).items()}
    settings.update(setting_test_seed=tspec.seed, flwr_datasets_commit=FLOWER_COMMIT)
    return Partition(settings=settings, train=tuple(train), test=tuple(test),
                     train_ids=np.arange(len(train)), test_ids=np.arange(len(test)),
                     train_labels=_labels(train_labels), test_labels=_labels(test_labels))


def _labels(labels) -> Optional[np.ndarray]:
    return None if labels is None else np.asarray(labels, dtype=np.int64)


def spec_of(config) -> PartitionSpec:
    """The :class:`PartitionSpec` of a :class:`deltafl_jax.DataConfig` whose partitioner's
    method is set (``--partition``)."""
    p = config.partitioner
    return PartitionSpec(
        method=p.method, num_clients=p.num_clients, alpha=p.dirichlet_alpha,
        min_partition_size=p.min_partition_size, self_balancing=p.self_balancing,
        shards_per_client=p.shards_per_client, classes_per_client=p.classes_per_client,
        size_law=p.size_law, seed=config.data_seed if p.seed is None else p.seed)


def split_data(x: np.ndarray, y: Optional[np.ndarray], parts: Sequence[np.ndarray]):
    """(x, y, offsets) of the clients `parts` (index lists), one client after another."""
    idx = np.concatenate(parts)
    offsets = np.concatenate([[0], np.cumsum([p.size for p in parts])]).astype(np.int64)
    return x[idx], (None if y is None else y[idx]), offsets


def kept(data):
    """`data` with its partition cut to the clients and examples the client limits kept."""
    if data.partition is None:
        return data
    part = data.partition.restricted(data.train.client_ids, data.train.sizes,
                                     data.test.client_ids, data.test.sizes)
    return dataclasses.replace(data, partition=part)


def label_histogram(split, num_classes: int) -> np.ndarray:
    """[K, C] int64: client k's number of examples of class c (a split with labels)."""
    client = np.repeat(np.arange(split.num_clients), split.sizes)
    hist = np.zeros((split.num_clients, num_classes), np.int64)
    np.add.at(hist, (client, np.asarray(split.y, dtype=np.int64)), 1)
    return hist


def split_stats(split, num_classes: int) -> Dict[str, Any]:
    """A split's client sizes and, with labels, its label histogram's statistics: classes per
    client and the mean total-variation distance of a client's label distribution from the
    split's."""
    sizes = split.sizes
    out: Dict[str, Any] = {
        "clients": int(split.num_clients), "examples": int(sizes.sum()),
        "size_mean": float(sizes.mean()), "size_std": float(sizes.std()),
        "size_min": int(sizes.min()), "size_median": float(np.median(sizes)),
        "size_max": int(sizes.max())}
    if split.y is None or num_classes < 1:
        return out
    hist = label_histogram(split, num_classes)
    present = (hist > 0).sum(axis=1)
    mix = hist / hist.sum(axis=1, keepdims=True)
    overall = hist.sum(axis=0) / hist.sum()
    out.update(classes_per_client_mean=float(present.mean()),
               classes_per_client_min=int(present.min()),
               classes_per_client_max=int(present.max()),
               label_tv_distance_mean=float(0.5 * np.abs(mix - overall).sum(axis=1).mean()),
               label_histogram=hist.tolist())
    return out
