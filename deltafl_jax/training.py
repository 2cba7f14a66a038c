"""Run an experiment: every replica (theta or swept value x seed) in one compiled program.

:func:`build_experiment` loads the data, builds the model, the algorithm, the replicas and the
jitted round; :func:`run_experiment` runs the rounds, evaluates every ``eval_every`` rounds on
all training and all test clients (paper, App. C.2.3), prints a progress line per
evaluation, and writes the outputs described in :mod:`deltafl_jax.outputs`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax import engine, outputs, plan as plan_lib, rounds
from deltafl_jax.algorithms import registry
from deltafl_jax.config import PERCENTILES, ConfigError, ExperimentConfig, learning_rate_schedule
from deltafl_jax.data import FederatedDataset
from deltafl_jax.datasets import load_dataset
from deltafl_jax.metrics import summarize
from deltafl_jax.models import Model, ModelOptions, build_model


# Client lanes per step on a 2-core CPU, measured (bench/README.md): 2 for the ConvNet (unrolled)
# and the linear model, 4 for the recurrent models, whose small matrix products gain from
# batching a few clients.
CPU_LANES = {"gru": 4, "lstm": 4}


def default_clients_per_step(model: Model, m: int, backend: Optional[str] = None) -> int:
    """Client lanes per step: all sampled clients on accelerators; on CPU the measured best of
    CPU_LANES (unrolled lanes for convolutional models, whose unbatched convolutions are the
    fast form on XLA:CPU; vmapped lanes for the others)."""
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return m
    return min(m, CPU_LANES.get(model.name, 2))


def default_lane_mode(model: Model, backend: Optional[str] = None) -> str:
    """Unrolled lanes for convolutional models on CPU (a vmap over per-client weights turns
    convolutions into grouped convolutions, ~5x slower on XLA:CPU); vmap elsewhere."""
    backend = backend or jax.default_backend()
    return "unroll" if backend == "cpu" and model.name == "cnn" else "vmap"


def default_eval_chunk(model: Model, backend: Optional[str] = None) -> int:
    """Examples per evaluation work item: large enough to amortise the loop, small enough to
    keep the padding of each replica's last chunk small."""
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return 1024
    return 128 if model.name == "cnn" else 2048


def default_eval_lanes(num_replicas: int, backend: Optional[str] = None) -> int:
    """Evaluation items per step. One on CPU (a bigger chunk is the better batch there); on
    accelerators one lane per replica (up to 16), so a step evaluates all models at once."""
    backend = backend or jax.default_backend()
    return 1 if backend == "cpu" else max(1, min(num_replicas, 16))


@dataclasses.dataclass(eq=False)
class Experiment:
    """Everything a run needs, built once."""

    config: ExperimentConfig
    data: FederatedDataset
    model: Model
    model_options: ModelOptions
    algorithm: Any
    replicas: rounds.Replicas
    work: plan_lib.LocalWork
    caps: plan_lib.Capacities
    lanes: int
    eval_chunk: int
    round_fn: Callable   # jitted
    eval_fn: Callable    # jitted (params, x, y, idx, seg, length) -> (loss_sum, err_sum)
    device_train: Tuple[jax.Array, jax.Array]
    device_test: Tuple[jax.Array, jax.Array]
    train_plan: Any
    test_plan: Any
    eval_segments: int = 0  # segment count of the evaluation program (max of both splits)
    num_sampled: int = 0  # m: clients sampled per round (AFL: all training clients)
    served_fn: Optional[Callable] = None  # jitted (algo_state, params) -> served params

    @property
    def seeds(self):
        return self.config.seeds

    def initial_state(self):
        return rounds.init_state(self.model, self.algorithm, self.replicas, self.seeds)

    def keys(self):
        return rounds.replica_keys(self.replicas, self.seeds)

    def served_params(self, state):
        """The models that are evaluated and saved, [R, ...]: w_t, or what the algorithm
        serves instead (AFL: the averaged iterate)."""
        if self.served_fn is None:
            return state.params
        return self.served_fn(state.algo_state, state.params)

    def round_plan(self, round_idx: int):
        return plan_lib.make_round_plan(self.seeds, round_idx, self.data.train.offsets,
                                        self.num_sampled, self.work, self.caps)

    def round_data(self, round_idx: int) -> rounds.RoundData:
        x, y = self.device_train
        return rounds.RoundData(x=x, y=y, plan=jax.device_put(self.round_plan(round_idx)))


def _device_split(split):
    y = split.y if split.y is not None else np.zeros((split.num_examples,), np.int32)
    return jax.device_put(split.x), jax.device_put(y.astype(np.int32))


def build_replicas(config: ExperimentConfig, setup: "registry.AlgorithmSetup") -> rounds.Replicas:
    """Replicas = sweep values x seeds, value-major (theta 1.0 seeds 1..S, then theta 0.8, ...)."""
    groups, hyper, labels = [], {}, []
    names = [setup.sweep_name] + sorted(setup.fixed)
    for name in names:
        hyper[name] = []
    hyper["l2"] = []
    for value in setup.sweep_values:
        for g, seed in enumerate(config.seeds):
            groups.append(g)
            hyper[setup.sweep_name].append(value)
            for k in sorted(setup.fixed):
                hyper[k].append(setup.fixed[k])
            hyper["l2"].append(config.l2_reg)
            labels.append(setup.label(value, seed))
    schedule = learning_rate_schedule(config.learning_rate, config.lr_decay, config.lr_decay_every)
    return rounds.Replicas(
        group=np.asarray(groups, np.int32),
        hyper={k: np.asarray(v, np.float32) for k, v in hyper.items()},
        schedules=tuple(schedule for _ in groups),
        labels=tuple(labels))


def build_experiment(config: ExperimentConfig, data: Optional[FederatedDataset] = None,
                     replicas: Optional[rounds.Replicas] = None) -> Experiment:
    """Load the data and build the jitted round. Raises ConfigError / DataError on bad input.

    `replicas` may be given to train an arbitrary set of per-replica hyper-parameters (the
    tuner's learning-rate / l2 grids); by default they come from the config's sweep x seeds.
    """
    data = data if data is not None else load_dataset(config.data)
    options = ModelOptions(conv_impl=config.conv_impl)
    try:
        model = build_model(config.model, data, options)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    m = config.clients_per_round
    if m > data.train.num_clients:
        raise ConfigError(
            f"--clients_per_round={m} exceeds the {data.train.num_clients} training clients of "
            f"{data.name}")
    setup = registry.build(config, data)
    algorithm = setup.algorithm
    m = setup.clients_per_round or m
    replicas = replicas or build_replicas(config, setup)
    local_steps = setup.local_steps if setup.local_steps is not None else config.local_steps
    work = plan_lib.LocalWork(batch_size=config.batch_size, local_epochs=config.local_epochs,
                              local_steps=local_steps)
    lanes = config.clients_per_step or default_clients_per_step(model, m)
    lanes = min(lanes, m * replicas.size)
    eval_chunk = config.eval_chunk or default_eval_chunk(model)
    eval_lanes = default_eval_lanes(replicas.size)
    caps = plan_lib.capacities(data.train.sizes, m, work, eval_chunk)
    local = engine.LocalSGDConfig(batch_size=config.batch_size, lanes=lanes,
                                  make_optimizer=engine.sgd_with_weight_decay,
                                  use_prox=algorithm.use_prox,
                                  lane_mode=default_lane_mode(model))
    round_fn = jax.jit(rounds.build_round_fn(model, algorithm, replicas, local, eval_chunk,
                                             eval_lanes, m), donate_argnums=(0,))

    def eval_fn(params, x, y, idx, seg, length, num_segments):
        group = jnp.zeros((jax.tree.leaves(params)[0].shape[0],), jnp.int32)
        res = engine.evaluate_streams(model, params, x, y, idx, seg, length, group,
                                      num_segments, eval_chunk, eval_lanes)
        return res.loss_sum, res.error_sum

    eval_jit = jax.jit(eval_fn, static_argnames=("num_segments",))
    # Both splits use one segment count (the larger), so one evaluation program serves both.
    eval_segments = max(data.train.num_clients, data.test.num_clients)
    return Experiment(
        config=config, data=data, model=model, model_options=options, algorithm=algorithm,
        replicas=replicas, work=work, caps=caps, lanes=lanes, eval_chunk=eval_chunk,
        round_fn=round_fn, eval_fn=eval_jit, device_train=_device_split(data.train),
        device_test=_device_split(data.test),
        train_plan=jax.device_put(plan_lib.make_split_plan(data.train.offsets, eval_chunk,
                                                           eval_segments)),
        test_plan=jax.device_put(plan_lib.make_split_plan(data.test.offsets, eval_chunk,
                                                          eval_segments)),
        eval_segments=eval_segments,
        num_sampled=m,
        served_fn=(jax.jit(jax.vmap(algorithm.eval_params))
                   if algorithm.eval_params is not None else None))


def evaluate(exp: Experiment, params) -> Dict[str, np.ndarray]:
    """Per-client arrays [R, N] on all training clients and all test clients."""
    out = {}
    l2 = exp.replicas.hyper.get("l2", np.zeros(exp.replicas.size, np.float32))
    sqnorm = np.asarray(jax.vmap(engine._tree_sqnorm)(params))
    for split_name, split, (x, y), sp in (("train", exp.data.train, exp.device_train,
                                           exp.train_plan),
                                          ("test", exp.data.test, exp.device_test,
                                           exp.test_plan)):
        loss_sum, err_sum = exp.eval_fn(params, x, y, sp.eval_idx, sp.eval_seg, sp.eval_len,
                                        num_segments=exp.eval_segments)
        k = split.num_clients
        n = split.sizes.astype(np.float64)
        loss_sum, err_sum = np.asarray(loss_sum)[:, :k], np.asarray(err_sum)[:, :k]
        loss = np.asarray(loss_sum, np.float64) / n
        if split_name == "train":
            loss = loss + 0.5 * (l2.astype(np.float64) * sqnorm)[:, None]
        out[f"{split_name}_loss"] = loss
        out[f"{split_name}_error"] = np.asarray(err_sum, np.float64) / n
    return out


def summarize_clients(exp: Experiment, per_client, method="lower") -> Dict[str, np.ndarray]:
    return summarize(per_client["train_loss"], exp.data.train.sizes, per_client["test_error"],
                     per_client["test_loss"], PERCENTILES, method)


def _fmt_progress(exp: Experiment, t: int, total: int, elapsed: float, eta: float,
                  summary: Dict[str, np.ndarray]) -> str:
    """One line: round, time, ETA, and per swept value the seed-mean of the tail metrics."""
    by_value: Dict[Any, List[int]] = {}
    for r, lab in enumerate(exp.replicas.labels):
        key = lab.get("param_value", lab.get("theta"))
        by_value.setdefault((lab.get("param_name", "theta"), key), []).append(r)
    parts = []
    classify = exp.model.loss_kind != "squared"
    for (name, value), rs in by_value.items():
        short = "θ" if name == "theta" else name
        err, p90 = (np.mean(summary[k][rs]) for k in ("test_error_mean", "test_error_p90"))
        tail = (f"err {100 * err:.1f}% p90 {100 * p90:.1f}%" if classify
                else f"test loss {err:.3f} p90 {p90:.3f}")
        parts.append(f"{short}={value:g}: loss {np.mean(summary['train_loss_mean'][rs]):.3f} "
                     + tail)
    return (f"[round {t:>{len(str(total))}}/{total}] {elapsed:7.1f}s elapsed, ETA {eta:6.0f}s | "
            + " | ".join(parts))


def run_experiment(config: ExperimentConfig, data: Optional[FederatedDataset] = None,
                   log: Callable[[str], None] = None, replicas=None) -> Dict[str, Any]:
    """Train, evaluate, write outputs. Returns the summary dict (also in summary.json)."""
    log = log or (lambda s: print(s, flush=True))
    if not config.verbose:
        log = lambda s: None  # noqa: E731
    out_dir = config.output_dir
    if out_dir and outputs.has_results(out_dir) and not config.overwrite:
        raise ConfigError(f"--output_dir={out_dir} already holds results; pass --overwrite or "
                          f"choose another directory")
    t_build = time.perf_counter()
    exp = build_experiment(config, data, replicas)
    data = exp.data
    R = exp.replicas.size
    log(f"deltafl_jax: {data.name} ({data.train.num_clients} train / {data.test.num_clients} "
        f"test clients), model {exp.model.name}, {config.algorithm}, {R} replicas "
        f"({len(config.seeds)} seeds), m={exp.num_sampled}, "
        f"{exp.lanes} client lane(s) per step, backend {jax.default_backend()}")
    if out_dir:
        if config.overwrite and os.path.isdir(out_dir):
            for f in ("metrics.jsonl",):
                p = os.path.join(out_dir, f)
                if os.path.exists(p):
                    os.remove(p)
        os.makedirs(out_dir, exist_ok=True)
    metrics_path = os.path.join(out_dir, "metrics.jsonl") if out_dir else None

    state = exp.initial_state()
    keys = exp.keys()
    T = config.num_rounds
    per_round: Dict[str, List[np.ndarray]] = {}
    history = []
    client_history: Dict[str, List[np.ndarray]] = {"rounds": []}
    t_start = time.perf_counter()
    compile_s = None
    pending = exp.round_data(0)
    last_summary, per_client = None, None

    def do_eval(t, state):
        pc = evaluate(exp, exp.served_params(state))
        summ = summarize_clients(exp, pc)
        return pc, summ

    for t in range(T):
        data_t = pending
        state, metrics = exp.round_fn(state, data_t, keys)
        if t + 1 < T:
            pending = exp.round_data(t + 1)   # host work overlaps the device round
        metrics = jax.device_get(metrics)
        if compile_s is None:
            compile_s = time.perf_counter() - t_start
        for k, v in metrics.items():
            per_round.setdefault(k, []).append(np.asarray(v))
        if (t + 1) % config.eval_every == 0 or t + 1 == T:
            per_client, summ = do_eval(t + 1, state)
            last_summary = summ
            client_history["rounds"].append(t + 1)
            for k, v in per_client.items():
                client_history.setdefault(k, []).append(v.astype(np.float32))
            elapsed = time.perf_counter() - t_start
            eta = elapsed / (t + 1) * (T - t - 1)
            records = []
            for r, lab in enumerate(exp.replicas.labels):
                rec = {"round": t + 1, **lab}
                rec.update({k: float(v[r]) for k, v in summ.items()})
                rec["num_selected"] = int(metrics["num_selected"][r])
                rec["num_rejected"] = int(metrics["num_rejected"][r])
                rec["elapsed_s"] = round(elapsed, 3)
                records.append(rec)
            history.extend(records)
            if metrics_path:
                outputs.append_jsonl(metrics_path, records)
            log(_fmt_progress(exp, t + 1, T, elapsed, eta, summ))
            bad = [r for r in range(R) if not np.isfinite(summ["train_loss_mean"][r])]
            if bad:
                log(f"warning: the training loss of {len(bad)} replica(s) is not finite "
                    f"({', '.join(outputs.replica_key(exp.replicas.labels[r]) for r in bad)})")
    jax.block_until_ready(state)
    total_s = time.perf_counter() - t_start

    final = {outputs.replica_key(lab): {k: float(v[r]) for k, v in last_summary.items()}
             for r, lab in enumerate(exp.replicas.labels)}
    summary = {
        "config": dataclasses.asdict(config),
        "dataset": {"name": data.name, **data.stats()},
        "model": exp.model.name,
        "replicas": [dict(l) for l in exp.replicas.labels],
        "clients_per_round": exp.num_sampled,
        "clients_per_step": exp.lanes,
        "eval_chunk": exp.eval_chunk,
        "backend": jax.default_backend(),
        "timing": {"total_s": total_s, "first_round_s_incl_compile": compile_s,
                   "build_s": t_start - t_build},
        "final": final,
    }
    if out_dir:
        per_round_arr = {k: np.stack(v) for k, v in per_round.items()}
        np.savez(os.path.join(out_dir, "rounds.npz"), **per_round_arr,
                 replica_keys=np.asarray([outputs.replica_key(l) for l in exp.replicas.labels]))
        np.savez(os.path.join(out_dir, "clients_history.npz"),
                 **{k: np.stack(v) for k, v in client_history.items()})
        np.savez(os.path.join(out_dir, "clients.npz"), **per_client,
                 train_sizes=data.train.sizes, test_sizes=data.test.sizes,
                 train_client_ids=np.asarray(data.train.client_ids).astype(str),
                 test_client_ids=np.asarray(data.test.client_ids).astype(str),
                 replica_keys=np.asarray([outputs.replica_key(l) for l in exp.replicas.labels]))
        if config.save_models:
            outputs.save_models(out_dir, exp.served_params(state), exp.replicas.labels,
                                exp.model, exp.model_options, data)
        outputs.write_json(os.path.join(out_dir, "summary.json"), summary)
    summary["state"] = state
    summary["history"] = history
    return summary
