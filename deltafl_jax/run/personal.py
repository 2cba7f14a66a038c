"""Personalised evaluation of a run's models: seen clients on their own held-out data, unseen
devices after adapting on their own data (``--client_holdout``, ``--finetune_steps``).

Two populations (:mod:`deltafl_jax.evaluation.holdout`):

- ``seen``: the training clients. Each is served its personal model (the algorithm's
  ``client_model``, e.g. Ditto's v_k) or the global one, adapts it on its training examples,
  and is evaluated on its held-out examples;
- ``unseen``: the test clients. Each is served the global model, adapts it on its adaptation
  examples, and is evaluated on its held-out examples.

Each value k of ``--finetune_steps`` is one evaluation of both populations after k adaptation
steps (the algorithm's ``adapt_step``: plain fine-tuning with the client optimizer by default)
at ``--finetune_lr`` (default: each replica's client learning rate of the last round); its
per-client arrays are ``{population}[_ft{k}]_{error,loss}`` (k = 0 has no suffix), [R, K].

The fine-tuning minibatches are a pure function of (seed, round, population, client), from the
stream ``[seed, round, PERSONAL_STREAM, population, client]``, so every replica and every rerun
adapts on the same examples. On a sampled evaluation (``--eval_clients=K``) the unseen devices
are the evaluation's test sample and the seen clients a uniform sample of K training clients
without replacement (``[seed, round, PERSONAL_STREAM, 2]``), so both are summarised like the
test errors (:func:`deltafl_jax.evaluation.sample.summarize_sample`'s intervals).

A seen client whose personal model is not finite (or any client whose adapted model is not:
its held-out loss is not finite) has a NaN error, and its population's summaries are NaN
for that replica: the round's state check (:mod:`deltafl_jax.run.divergence`) counts and
names such state.

Clients go to the device in blocks of a fixed number of clients, with every buffer padded to
capacities fixed for the run (:class:`BlockCaps`), so each population's program compiles once.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.engine import mesh as mesh_lib
from deltafl_jax.engine.adapt import AdaptBlock, AdaptConfig, AdaptPlan, adapt_and_evaluate
from deltafl_jax.engine.train import ClientInputs
from deltafl_jax.evaluation.metrics import summarize_population
from deltafl_jax.evaluation.sample import summarize_population_sample
from deltafl_jax.run.config import PERCENTILES, Personalisation

PERSONAL_STREAM = 0x5EE
POPULATIONS = ("seen", "unseen")
BLOCK_EXAMPLES = 1 << 17      # examples of one block's buffer (at most)
BLOCK_CLIENTS = 1024          # clients of one block (at most)


def family(population: str, steps: int) -> str:
    """The name of a population's metrics after `steps` adaptation steps: 'unseen',
    'unseen_ft5'."""
    return population if steps == 0 else f"{population}_ft{steps}"


def families(finetune_steps: Sequence[int]) -> Tuple[Tuple[str, str, int], ...]:
    """(family, population, steps) of every evaluation a run makes."""
    return tuple((family(p, k), p, int(k)) for k in finetune_steps for p in POPULATIONS)


def adapt_stream_length(adapt_sizes, steps: int, batch: int) -> np.ndarray:
    """Entries of each client's adaptation stream: ceil(k B / a) permutations of its a
    examples (0 without adaptation)."""
    a = np.asarray(adapt_sizes, np.int64)
    if steps == 0:
        return np.zeros_like(a)
    return -(-(steps * batch) // a) * a


def marked(error, loss) -> np.ndarray:
    """`error` [R, K] with NaN where the client's held-out `loss` is not finite: its model
    (its personal one, or the served or adapted one) holds a NaN or an infinity, and the
    class it picks from such scores is no measurement."""
    return np.where(np.isfinite(loss), error, np.nan)


def _nan_rows(summaries: Dict[str, np.ndarray], rows) -> Dict[str, np.ndarray]:
    """The summaries with NaN in the replicas `rows` [R] bool."""
    return {k: np.where(rows, np.nan, np.asarray(v, np.float64)) for k, v in summaries.items()}


def summarize_populations(per_client, finetune_steps, num_seen: int, num_unseen: int,
                          method: str = "lower") -> Dict[str, np.ndarray]:
    """Every family's summaries in `per_client` (:func:`deltafl_jax.evaluation.metrics.
    summarize_population`, or with intervals when the family's population was sampled: its
    ``{population}_clients`` are given; every summary of a replica NaN when one of its clients'
    errors is NaN, :func:`marked`) and, per k, the participation gap
    ``participation_gap[_ft{k}]`` = unseen mean error - seen mean error (pFL-Bench's gap
    between the clients that trained and those that did not); {} when there is none.
    num_seen / num_unseen: the populations' sizes (the finite-population correction)."""
    out: Dict[str, np.ndarray] = {}
    sizes = {"seen": num_seen, "unseen": num_unseen}
    present = [k for k in finetune_steps if f"{family('unseen', k)}_error" in per_client]
    for name, population, steps in families(present):
        error, loss = per_client[f"{name}_error"], per_client[f"{name}_loss"]
        if f"{population}_clients" in per_client:
            summaries = summarize_population_sample(name, error, loss, PERCENTILES,
                                                    num_population=sizes[population])
        else:
            summaries = summarize_population(name, error, loss, PERCENTILES, method)
        bad = np.isnan(np.asarray(error, np.float64)).any(axis=1)
        out.update(_nan_rows(summaries, bad) if bad.any() else summaries)
    for steps in present:
        gap = "participation_gap" + ("" if steps == 0 else f"_ft{steps}")
        out[gap] = (out[f"{family('unseen', steps)}_error_mean"]
                    - out[f"{family('seen', steps)}_error_mean"])
    return out


@dataclasses.dataclass(frozen=True)
class BlockCaps:
    """Static sizes of one block: clients, buffer rows, adaptation and held-out entries."""

    clients: int
    examples: int
    adapt: int
    held: int


def _top_sum(values, k: int) -> int:
    return int(np.sort(np.asarray(values, np.int64))[::-1][:k].sum())


def block_caps(populations: Sequence[Tuple[np.ndarray, np.ndarray]], max_steps: int,
               batch: int) -> BlockCaps:
    """Capacities that hold any block of any population: (adaptation sizes, held-out sizes) of
    each population's clients; as many clients per block as fit in BLOCK_EXAMPLES rows."""
    n = np.concatenate([a + h for a, h in populations])
    order = np.sort(n)[::-1]
    most = int(max(len(a) for a, _ in populations))
    fits = int(np.searchsorted(np.cumsum(order), BLOCK_EXAMPLES, side="right"))
    k = max(1, min(fits, BLOCK_CLIENTS, most))
    return BlockCaps(
        clients=k,
        examples=max(_top_sum(a + h, k) for a, h in populations),
        adapt=max(1, max(_top_sum(adapt_stream_length(a, max_steps, batch), k)
                         for a, _ in populations)),
        held=max(_top_sum(h, k) for _, h in populations))


def block_plan(adapt_split, held_split, clients: np.ndarray, steps: int, batch: int,
               caps: BlockCaps, rng_key: Sequence[int]):
    """(AdaptPlan, x, y) of one block of `clients` (host arrays, padded to `caps`): each
    client's adaptation examples (when steps > 0) then its held-out examples in the buffer."""
    K = caps.clients
    x = np.zeros((caps.examples,) + tuple(held_split.feature_shape), held_split.x_dtype)
    y = np.zeros((caps.examples,), np.int32)
    ids = np.zeros(K, np.int32)
    real = np.zeros(K, bool)
    adapt_idx = np.zeros(caps.adapt, np.int32)
    held_idx = np.zeros(caps.held, np.int32)
    adapt_start, adapt_len, held_start, held_len = (np.zeros(K, np.int32) for _ in range(4))
    train_steps, eval_steps = np.zeros(K, np.int32), np.zeros(K, np.int32)
    row = pa = ph = 0
    for i, k in enumerate(np.asarray(clients, np.int64)):
        ids[i], real[i] = k, True
        parts = [(held_split, False)] if steps == 0 else [(adapt_split, True),
                                                          (held_split, False)]
        for split, adapting in parts:
            xs, ys = split.client(int(k))
            n = len(xs)
            x[row:row + n] = xs
            if ys is not None:
                y[row:row + n] = ys
            if adapting:
                rng = np.random.default_rng([*rng_key, int(k)])
                epochs = -(-(steps * batch) // n)
                perm = np.concatenate([rng.permutation(n) for _ in range(epochs)])
                adapt_start[i], adapt_len[i] = pa, perm.size
                adapt_idx[pa:pa + perm.size] = row + perm
                pa += perm.size
                train_steps[i] = steps
            else:
                held_start[i], held_len[i] = ph, n
                held_idx[ph:ph + n] = row + np.arange(n)
                ph += n
                eval_steps[i] = -(-n // batch)
            row += n
    plan = AdaptPlan(ids=ids, real=real, adapt_idx=adapt_idx, adapt_start=adapt_start,
                     adapt_len=adapt_len, held_idx=held_idx, held_start=held_start,
                     held_len=held_len, train_steps=train_steps, eval_steps=eval_steps)
    return plan, x, y


class PersonalEvaluation:
    """The personalised evaluation of an experiment (module docstring).

    data: the FederatedDataset with its ``holdout``; model, algorithm, replicas: the run's;
    layout: the adaptation steps' batch size, lanes, lane mode, branchless flag and client
    optimizer ((lr, l2) -> optax), an :class:`AdaptConfig` whose other fields each program
    sets; settings: the run's :class:`Personalisation` (finetune_steps: the k values;
    finetune_lr: None for the replicas' own rates); put: host -> device(s); mesh: the device
    mesh or None.
    """

    def __init__(self, data, model, algorithm, replicas, layout: AdaptConfig,
                 settings: Personalisation, put: Callable, mesh=None):
        self.data, self.holdout, self.model = data, data.holdout, model
        self.algorithm, self.replicas, self.layout = algorithm, replicas, layout
        self.batch = layout.batch_size
        self.steps = tuple(int(k) for k in settings.finetune_steps)
        self.finetune_lr, self.put, self.mesh = settings.finetune_lr, put, mesh
        self.caps = block_caps([self._sizes(p) for p in POPULATIONS], max(self.steps),
                               self.batch)
        self._programs: Dict[Tuple[bool, bool], Callable] = {}

    def _sizes(self, population: str):
        adapt, held = self.holdout.population(self.data, population)
        return adapt.sizes, held.sizes

    def program(self, seen: bool, train: bool) -> Callable:
        """The jitted block evaluation of one population, with or without adaptation."""
        if (seen, train) not in self._programs:
            axis = (mesh_lib.SINGLE if self.mesh is None else
                    mesh_lib.DeviceAxis(self.mesh.devices.size, mesh_lib.AXIS))
            cfg = self.layout._replace(axis=axis, adapt_step=self.algorithm.adapt_step,
                                       client_model=self.algorithm.client_model, seen=seen,
                                       train=train)

            def run(params, block: AdaptBlock, hyper, lr, l2, server_state, client_state):
                return adapt_and_evaluate(self.model, params, block, hyper, lr, l2, cfg,
                                          ClientInputs(server_state, client_state, None))
            fn = run if self.mesh is None else mesh_lib.sharded(run, self.mesh, 7)
            self._programs[(seen, train)] = jax.jit(fn)
        return self._programs[(seen, train)]

    def seen_sample(self, seed: int, round_idx: int, k: int) -> np.ndarray:
        """K training clients drawn uniformly without replacement (sorted)."""
        rng = np.random.default_rng([int(seed), int(round_idx), PERSONAL_STREAM, 2])
        return np.sort(rng.choice(self.data.train.num_clients, size=k, replace=False))

    def learning_rates(self, round_idx: int) -> np.ndarray:
        """[R] the adaptation steps' learning rate of each replica."""
        if self.finetune_lr is not None:
            return np.full((self.replicas.size,), self.finetune_lr, np.float32)
        t = max(int(round_idx) - 1, 0)
        return np.asarray([float(s(t)) for s in self.replicas.schedules], np.float32)

    def evaluate(self, state, served, seed: int, round_idx: int,
                 test_clients: Optional[np.ndarray] = None,
                 sample_size: Optional[int] = None) -> Dict[str, np.ndarray]:
        """Per-client arrays of every family (``{family}_error`` / ``_loss`` [R, K], float64),
        and ``seen_clients`` / ``unseen_clients`` when the evaluation is sampled."""
        out: Dict[str, np.ndarray] = {}
        hyper = self.put(jax.tree.map(lambda v: np.asarray(v, np.float32), self.replicas.hyper))
        lr = self.put(self.learning_rates(round_idx))
        l2 = self.put(np.asarray(self.replicas.l2, np.float32))
        chosen = {"seen": None, "unseen": test_clients}
        if sample_size is not None:
            chosen["seen"] = self.seen_sample(seed, round_idx,
                                              min(sample_size, self.data.train.num_clients))
        for name, population, steps in families(self.steps):
            adapt, held = self.holdout.population(self.data, population)
            clients = chosen[population]
            clients = np.arange(held.num_clients) if clients is None else np.asarray(clients)
            seen = population == "seen"
            run = self.program(seen, steps > 0)
            loss, err = [], []
            K = self.caps.clients
            for lo in range(0, len(clients), K):
                block = clients[lo:lo + K]
                key = (int(seed), int(round_idx), PERSONAL_STREAM, POPULATIONS.index(population))
                plan, x, y = block_plan(adapt, held, block, steps, self.batch, self.caps, key)
                ls, es = run(served, self.put(AdaptBlock(x, y, plan)), hyper, lr, l2,
                             state.algo_state if seen else (),
                             state.client_state if seen else ())
                ls, es = mesh_lib.tree_to_host((ls, es))
                loss.append(np.asarray(ls)[:, :len(block)])
                err.append(np.asarray(es)[:, :len(block)])
            n = held.sizes[clients].astype(np.float64)
            out[f"{name}_loss"] = np.concatenate(loss, axis=1).astype(np.float64) / n
            out[f"{name}_error"] = marked(np.concatenate(err, axis=1).astype(np.float64) / n,
                                          out[f"{name}_loss"])
            if sample_size is not None:
                out[f"{population}_clients"] = np.asarray(clients, np.int64)
        return out
