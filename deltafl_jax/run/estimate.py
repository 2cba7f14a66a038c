"""What a run will cost before it runs: build it, compile it, time a few rounds and one
evaluation, and project the whole run's wall-clock (``python -m experiments.run --estimate``,
and ``bench.paper_grid``, which report the same figures).

    est = estimate_run(config, data)          # builds, compiles, times; writes nothing
    print("\\n".join(est.lines()))

The projection models the run as :func:`deltafl_jax.run.runner.run_experiment` does it::

    projected_s = build_s + compile_s + num_rounds * round_s + evaluations * eval_s

``build_s``: loading the data (when :func:`estimate_run` loads it), building the experiment
(placement, device copies of the splits, the jitted functions) and the resume fingerprint (the
data's hash), as the runner does before its first round. ``compile_s``: compiling the round and
the evaluation (both happen once per run). ``round_s``: the mean over ``timed_rounds`` rounds
of the loop's own round body (the jitted round, the next round's host-side plan, the metrics
brought to the host) over at least ``timed_rounds`` rounds and ``min_seconds`` seconds, on
plans of round indices spread over the run, so that the sampled clients (and so the
local-SGD trips) vary as they do over the whole run. ``eval_s``: one
evaluation of every replica on all training and test clients, after its compilation.

An asynchronous run (FedBuff, FedAsync: a spec with ``asynchronous``) is estimated the same
way with its server steps as rounds: ``round_s`` is the mean of consecutive server steps from
the start (the schedulers' events are sequential; each step trains its K jobs in lanes, each
from its base version in the ring), the projection is over ``num_rounds`` server steps, and
the block adds the bytes of the ring of model versions the device keeps (every replica's
V versions, :func:`deltafl_jax.asynchronous.scheduler.ring_size`). With
``--stop_at_virtual_time`` (either kind of run) the projection is still over ``num_rounds``
rounds, and the block says that the virtual stop may end the run earlier.

Device memory: the peak that the backend reports (``memory_stats()['peak_bytes_in_use']``,
the largest over the run's devices) where it reports one; on XLA:CPU, which does not, what the
compiled round holds (:class:`RoundMemory`: its arguments, the state, the plan with the
examples it indexes and the keys, plus its outputs not aliased to them and its temporaries,
the lanes' local models and optimizer states and the per-job results among them, from XLA's
``memory_analysis()`` of the program the run executes), whatever the algorithm keeps (APFL's
second model, SCAFFOLD's and FedDyn's per-client state) and however many jobs its plan holds
(a Poisson plan's cap, not m). :class:`RoundMemory` also keeps the bytes of the actual state
and plan arrays, against which the compiled arguments are checked.

Nothing is written to the run's output directory: it is neither created nor read. The timed
rounds run on a scratch state, with the run's own callbacks (the recorder, metrics.jsonl,
TensorBoard's scalars: host work of every round and evaluation, e.g. 12 replicas' scalars cost
about 5 ms a round) writing into a temporary directory that is removed afterwards; checkpoints
(written in the background every ``--checkpoint_every_s``) are not modelled. The measurements
are wall-clock seconds of this process on this machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import jax
import numpy as np

from deltafl_jax.data import FederatedDataset
from deltafl_jax.datasets.known_shapes import load_or_stand_in
from deltafl_jax.engine.mesh import tree_to_host
from deltafl_jax.run import loop, resume
from deltafl_jax.run.callbacks import Callback, RunContext
from deltafl_jax.run.config import ExperimentConfig
from deltafl_jax.run.experiment import Experiment, build_experiment
from deltafl_jax.run.loop import Recorder
from deltafl_jax.run.placement import frozen_bytes, lanes_text, tree_nbytes
from deltafl_jax.run.runner import standard_callbacks

DEFAULT_TIMED_ROUNDS = 5
DEFAULT_MIN_SECONDS = 5.0
WORK_METRICS = ("train_trips", "eval_trips", "train_real_examples", "train_padded_examples",
                "eval_real_examples", "eval_padded_examples")


@dataclasses.dataclass(frozen=True)
class RoundMemory:
    """What the compiled round holds on a device, in bytes.

    data: the clients' examples kept on the device (both splits, and the evaluation's index
      streams once it has run; none with ``--client_data=host``).
    state, plan, keys: the actual arrays the round is given besides them: the server state
      (every replica's model, the algorithm's and the server optimizer's state, the per-client
      state), the round's plan (its job slots: m, or a Poisson plan's cap; with
      ``--client_data=host`` the round's buffer of examples too) and the replicas' keys.
    arguments, outputs, aliased, temporaries: XLA's ``memory_analysis()`` of the compiled
      round: the bytes of the arguments it reads (at most data's train split + state + plan
      + keys: an input it does not read is dropped), of its outputs (the new state and the
      metrics), of the outputs that reuse an argument's buffer, and of its temporaries (the
      lanes' step states: local models, optimizer states, an algorithm's second model; the
      per-job results).
    tables: on CPU, the lanes' slot tables, kept from one round to the next
      (:class:`deltafl_jax.run.program.TableRound`): arguments and aliased outputs of the
      round rather than temporaries; 0 elsewhere.
    frozen: the model's frozen part (a pretrained base under LoRA:
      :func:`deltafl_jax.run.placement.frozen_bytes`), once, whatever the lanes and replicas:
      the round closes over it, so the compiled program holds one copy that every lane and
      replica reads (JAX 0.10 embeds a closed-over array in the program as a constant, which
      none of ``memory_analysis()``'s figures above counts); 0 for a model without one.
    The arrays are summed over their global shapes: on one device these are its bytes.
    """

    data: int
    state: int
    plan: int
    keys: int
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    tables: int = 0
    frozen: int = 0

    @property
    def total(self) -> int:
        """The arrays held + the outputs that do not reuse them + the temporaries."""
        return (self.data + self.state + self.plan + self.keys + self.tables + self.frozen
                + self.outputs - self.aliased + self.temporaries)


def round_memory(compiled, exp: Experiment, state, round_data, keys) -> Optional[RoundMemory]:
    """The :class:`RoundMemory` of `exp`'s compiled round on its arguments (None where the
    backend gives no memory analysis)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # pylint: disable=broad-except
        return None
    if m is None:
        return None
    splits = jax.tree.leaves(exp.program.store.device_splits)
    shared = {id(x) for x in splits}    # the train split's arrays, passed in round_data too
    plan = [x for x in jax.tree.leaves(round_data) if id(x) not in shared]
    owner = getattr(compiled, "owner", None)   # a TableRound's compiled round
    tables = tree_nbytes(owner.tables) if owner is not None and owner.tables else 0
    return RoundMemory(data=tree_nbytes(splits), state=tree_nbytes(state),
                       plan=tree_nbytes(plan), keys=tree_nbytes(keys),
                       arguments=int(m.argument_size_in_bytes),
                       outputs=int(m.output_size_in_bytes), aliased=int(m.alias_size_in_bytes),
                       temporaries=int(m.temp_size_in_bytes), tables=tables,
                       frozen=frozen_bytes(exp.model))


@dataclasses.dataclass(frozen=True)
class VersionRing:
    """An asynchronous run's K jobs per server step (`buffer_size`), its ring of model
    versions (`versions` per replica) and that ring's `bytes` over every replica."""

    buffer_size: int
    versions: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """A program's device memory: `nbytes` held on a device, `source` where that figure comes
    from (``peak_bytes_in_use``, ``compiled round`` or ``start-up footprint``) and
    `compiled_round` the compiled round's :class:`RoundMemory` (None where the backend gives
    no memory analysis)."""

    nbytes: int
    source: str
    compiled_round: Optional[RoundMemory] = None


# The keys of Estimate.to_json() before the ring's and the derived figures, in their order.
JSON_FIELDS = ("name", "num_rounds", "eval_every", "build_s", "compile_s", "round_s", "eval_s",
               "memory_bytes", "memory_source", "flops_per_round", "train_trips", "work",
               "backend", "devices", "replicas", "lanes", "round_memory", "data_note",
               "projected_from", "stop_at_virtual_time")


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The measured parts of one program's run and the projection they make.

    name: what was estimated (the method of --algorithm, e.g. ``deltafl``).
    num_rounds, eval_every: the run's T and evaluation period (:attr:`evaluations`: how many
      the loop does, every eval_every rounds and after the last).
    build_s, compile_s, round_s, eval_s: seconds (see the module docstring).
    memory: the device memory the run holds (:class:`DeviceMemory`: its bytes, where that
      figure comes from and the compiled round's :class:`RoundMemory`); to_json() writes its
      parts as ``memory_bytes``, ``memory_source`` and ``round_memory``.
    data_note: what the run was measured on when not its data (a dataset's known shape,
      :mod:`deltafl_jax.datasets.known_shapes`); "" on its data.
    projected_from: "" for a program measured (built, compiled and timed); for one projected
      from others' measurements (:func:`project`), their names; its `work` then holds the
      cost model's figures (``train_steps``, ``s_per_step``, ``loss_examples``,
      ``s_per_loss_example``, ``eval_examples``, ``s_per_example``) and nothing of it was
      compiled or timed.
    flops_per_round: the compiled round's FLOPs from XLA's cost analysis (None where the
      backend gives none; XLA counts a while loop's body once, so this is not the round's
      work). train_trips: the critical-path local-SGD trips of each timed round (one per
      round timed for round_s: :attr:`timed_rounds`). work: the
      mean per timed round of the round's work metrics (WORK_METRICS: trips on the critical
      path, real and padded examples evaluated and trained).
    backend, devices, replicas, lanes: the placement the run gets.
    ring: an asynchronous run's :class:`VersionRing` (None for a synchronous run).
    stop_at_virtual_time: the run's ``--stop_at_virtual_time`` (None: unset).
    lanes_line: the lanes of the round's jobs and why (a model's CPU preference,
      ``--clients_per_step``, or on an accelerator the device's memory:
      :func:`deltafl_jax.run.placement.fit_lanes`); "" for a projected program.
    """

    name: str
    num_rounds: int
    eval_every: int
    build_s: float
    compile_s: float
    round_s: float
    eval_s: float
    memory: DeviceMemory
    flops_per_round: Optional[float]
    train_trips: List[int]
    work: Dict[str, float]
    backend: str
    devices: int
    replicas: int
    lanes: int
    data_note: str = ""
    projected_from: str = ""
    ring: Optional[VersionRing] = None
    stop_at_virtual_time: Optional[float] = None
    lanes_line: str = ""

    @property
    def evaluations(self) -> int:
        return num_evaluations(self.num_rounds, self.eval_every)

    @property
    def timed_rounds(self) -> int:
        """Rounds timed for round_s (0: a projected program)."""
        return len(self.train_trips)

    @property
    def rounds_s(self) -> float:
        return self.num_rounds * self.round_s

    @property
    def evaluations_s(self) -> float:
        return self.evaluations * self.eval_s

    @property
    def projected_s(self) -> float:
        """The whole run: build + compile + rounds x s/round + evaluations x s/eval."""
        return self.build_s + self.compile_s + self.rounds_s + self.evaluations_s

    def to_json(self) -> Dict[str, Any]:
        fields = dataclasses.asdict(self)
        memory = fields.pop("memory")
        fields.update(memory_bytes=memory["nbytes"], memory_source=memory["source"],
                      round_memory=memory["compiled_round"])
        out = {k: fields[k] for k in JSON_FIELDS}
        ring = fields["ring"] or {}
        out.update(buffer_size=ring.get("buffer_size", 0), ring_versions=ring.get("versions", 0),
                   ring_bytes=ring.get("bytes", 0), evaluations=self.evaluations,
                   timed_rounds=self.timed_rounds, lanes_line=self.lanes_line)
        out.update(rounds_s=self.rounds_s, evaluations_s=self.evaluations_s,
                   projected_s=self.projected_s)
        return out

    def lines(self) -> List[str]:
        """The printed block (its figures are the fields, so a reader can redo the sum)."""
        if self.projected_from:
            return self._projected_lines()
        ring = self.ring
        steps = "server steps" if ring else "rounds"
        timed = f"timed server steps of {ring.buffer_size} jobs" if ring else "timed rounds"
        return [
            f"estimate of {self.name}: {self.replicas} replicas, {self.num_rounds} {steps}, "
            f"{self.evaluations} evaluations (every {self.eval_every}), {self.devices} "
            f"{self.backend} device(s) x {self.lanes} lane(s)",
        ] + ([f"  {self.lanes_line}"] if self.lanes_line else []) + [
            f"  build          {self.build_s:10.3f} s",
            f"  compile        {self.compile_s:10.3f} s",
            f"  {steps:<14} {self.num_rounds} x {self.round_s:.6f} s = {self.rounds_s:.3f} s "
            f"(mean of {self.timed_rounds} {timed})",
            f"  evaluations    {self.evaluations} x {self.eval_s:.6f} s = "
            f"{self.evaluations_s:.3f} s",
            f"  projected run  {self.projected_s:10.3f} s ({_human(self.projected_s)})",
        ] + self._stop_lines(steps) + [
            f"  device memory  {_mb(self.memory.nbytes)} ({self.memory.source})",
        ] + ([] if self.memory.compiled_round is None
             else [_round_memory_line(self.memory.compiled_round)]) + (
            [f"  version ring   {_mb(ring.bytes)}: {ring.versions} model versions x "
             f"{self.replicas} replicas (--concurrency, --buffer_size, --max_staleness)"]
            if ring else []) + (
            [f"  measured on    {self.data_note}"] if self.data_note else [])

    def _stop_lines(self, steps: str) -> List[str]:
        if self.stop_at_virtual_time is None:
            return []
        return [f"  virtual stop   --stop_at_virtual_time={self.stop_at_virtual_time:g} s may "
                f"end the run before its {self.num_rounds} {steps}; projected over all "
                f"{self.num_rounds}"]

    def _projected_lines(self) -> List[str]:
        w = self.work
        return [
            f"estimate of {self.name} (projected from {self.projected_from}): "
            f"{self.replicas} replicas, {self.num_rounds} rounds, {self.evaluations} "
            f"evaluations (every {self.eval_every}), {self.devices} {self.backend} device(s)",
            f"  build          {self.build_s:10.3f} s (the measured programs' mean)",
            f"  compile        {self.compile_s:10.3f} s (the measured programs' mean)",
            f"  rounds         {self.num_rounds} x {self.round_s:.6f} s = {self.rounds_s:.3f} s "
            f"({w['train_steps']:.0f} local steps x {w['s_per_step']:.3e} s + "
            f"{w['loss_examples']:.0f} loss examples x {w['s_per_loss_example']:.3e} s)",
            f"  evaluations    {self.evaluations} x {self.eval_s:.6f} s = "
            f"{self.evaluations_s:.3f} s ({w['eval_examples']:.0f} examples x "
            f"{w['s_per_example']:.3e} s)",
            f"  projected run  {self.projected_s:10.3f} s ({_human(self.projected_s)})",
            f"  device memory  {self.memory.source}",
        ]


def _round_memory_line(m: RoundMemory) -> str:
    return (f"  round memory   {_mb(m.total)}: "
            + (f"frozen base {_mb(m.frozen)} (once per device), " if m.frozen else "")
            + f"data {_mb(m.data)}, state {_mb(m.state)}, "
            f"plan {_mb(m.plan)}, " + (f"slot tables {_mb(m.tables)}, " if m.tables else "")
            + f"new outputs {_mb(m.outputs - m.aliased)}, temporaries "
            f"{_mb(m.temporaries)} (lanes, per-job results)")


def total_lines(estimates: List[Estimate]) -> List[str]:
    """The closing lines of several programs (a multi-method run): their sum."""
    total = sum(e.projected_s for e in estimates)
    projected = sum(1 for e in estimates if e.projected_from)
    how = (f" ({len(estimates) - projected} measured, {projected} projected)" if projected
           else "")
    return [f"estimate of all {len(estimates)} programs{how}: projected run {total:.3f} s "
            f"({_human(total)}), compile {sum(e.compile_s for e in estimates):.3f} s, device "
            f"memory at most {_mb(max(e.memory.nbytes for e in estimates))}"
            + (" (of the measured programs)" if projected else "")]


def _human(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _mb(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MB"


def num_evaluations(num_rounds: int, eval_every: int) -> int:
    """Evaluations of the loop: after every eval_every-th round and after the last."""
    return num_rounds // eval_every + (1 if num_rounds % eval_every else 0)


def device_memory(exp: Experiment, held: Optional[RoundMemory] = None) -> "tuple[int, str]":
    """(bytes, source): the largest reported peak over the run's devices, else what the
    compiled round holds (`held`), else the start-up footprint."""
    devices = jax.devices() if exp.program.mesh is None else list(exp.program.mesh.devices.flat)
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # pylint: disable=broad-except
            stats = None
        if stats and stats.get("peak_bytes_in_use"):
            peaks.append(int(stats["peak_bytes_in_use"]))
    if peaks:
        return max(peaks), "peak_bytes_in_use"
    if held is not None:
        return held.total, (f"compiled round: arguments + outputs + temporaries; "
                            f"{exp.backend} reports no memory stats")
    return int(exp.program.footprint.total if exp.program.footprint is not None else 0), (
        f"start-up footprint; {exp.backend} reports no memory stats")


def _flops(compiled) -> Optional[float]:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # pylint: disable=broad-except
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops is not None and flops > 0 else None


def round_indices(num_rounds: int, count: int) -> List[int]:
    """`count` round indices spread over 0..T-1 whatever `count` is (a golden-ratio stride, so
    that any prefix covers the run evenly; repeating when count > T)."""
    T = max(int(num_rounds), 1)
    return [int(((i * 0.6180339887498949) % 1.0) * T) for i in range(count)]


def _time_rounds(exp, compiled, state, keys, indices, least: int, most: int,
                 min_seconds: float, run: RunContext, callbacks: Sequence[Callback]):
    """The loop's round body (:func:`deltafl_jax.run.loop.run_rounds`: the round, the next
    plan while it runs, the metrics to the host, the callbacks' hooks) on the plans of
    indices[1:], at least `least`
    and `min_seconds`, at most `most` rounds: (state, last metrics, train trips of each round,
    work metrics of each round, mean seconds per round)."""
    pending = exp.round_data(indices[1], state)
    trips, work = [], []
    t0 = time.perf_counter()
    while True:
        state, metrics = compiled(state, pending, keys)
        done = len(trips) + 1
        last = done >= most or (done >= least and time.perf_counter() - t0 >= min_seconds)
        if not last:
            pending = exp.round_data(indices[done + 1], state)
        metrics = host_metrics(exp, indices[done], metrics)
        run.state = state
        for cb in callbacks:
            cb.on_round_end(run, done, metrics)
        trips.append(int(metrics["train_trips"]))
        work.append({k: float(np.sum(metrics[k])) for k in WORK_METRICS if k in metrics})
        if last:
            return state, metrics, trips, work, (time.perf_counter() - t0) / len(trips)


def _time_evaluation(exp, state, T, metrics, run, callbacks) -> float:
    t0 = time.perf_counter()
    ev = loop.evaluate(exp, state, T, metrics, 0.0)
    for cb in callbacks:
        cb.on_evaluation(run, ev)
    return time.perf_counter() - t0


def program_key(exp: Experiment, lowered) -> str:
    """What makes two runs' measurements the same: the round's lowered program (its shapes,
    constants and code), the shapes of the examples on the device (the evaluation's inputs)
    and the placement."""
    splits = [(x.shape, str(x.dtype)) for x in jax.tree.leaves(exp.program.store.device_splits)]
    text = f"{lowered.as_text()}|{splits}|{exp.placement}|{exp.backend}"
    return hashlib.sha256(text.encode()).hexdigest()


def measure(exp: Experiment, build_s: float = 0.0, timed_rounds: int = DEFAULT_TIMED_ROUNDS,
            log: Optional[Callable[[str], None]] = None, name: Optional[str] = None,
            min_seconds: float = DEFAULT_MIN_SECONDS, callbacks: Sequence[Callback] = (),
            output_dir: Optional[str] = None,
            cache: Optional[Dict[str, Estimate]] = None) -> Estimate:
    """Compile `exp`'s round, time at least `timed_rounds` rounds (and more, up to the run's
    T, until `min_seconds` have passed: a mean over a few milliseconds-long rounds is noise on
    a shared machine) and one evaluation, and return the :class:`Estimate` (`build_s`: the
    seconds it took to build `exp`; the initial state's are added). `callbacks` (writing into
    `output_dir`, a scratch directory) run in the timed rounds and evaluation as in the run:
    the host work of the run's own callbacks (TensorBoard's scalars, metrics.jsonl) is part of
    its rounds. `cache` (a dict kept across calls): a program already measured
    (:func:`program_key`) is not compiled or timed again; its measurements are reused with
    this run's name, rounds and build time."""
    log = log or (lambda line: None)
    if timed_rounds < 1:
        raise ValueError(f"timed_rounds must be at least 1, got {timed_rounds}")
    config = exp.config
    T = config.training.num_rounds
    t0 = time.perf_counter()
    state, keys = exp.initial_state(), exp.keys()
    jax.block_until_ready(state)
    build_s = build_s + time.perf_counter() - t0   # the runner builds the state before round 1
    count = max(timed_rounds, T) + 1
    # an asynchronous run's server steps follow its schedulers' events: consecutive steps
    indices = round_indices(T, count) if exp.buffered is None else list(range(count))
    pending = exp.round_data(indices[0], state)
    lower = exp.round_fn.lower if exp.buffered is None else exp.buffered.lower
    lowered = lower(state, pending, keys)
    key = program_key(exp, lowered) if cache is not None else None
    every = config.evaluation.eval_every
    figures = dict(name=name or config.method, num_rounds=T, eval_every=every,
                   build_s=float(build_s),
                   stop_at_virtual_time=config.timing.stop_at_virtual_time)
    if key is not None and key in cache:
        log(f"estimate: the program of {cache[key].name} again: its measurements reused")
        return dataclasses.replace(cache[key], **figures)
    log(f"estimate: compiling the round of {exp.replicas.size} replicas ...")
    t0 = time.perf_counter()
    compiled = lowered.compile()
    measured = _measure_compiled(exp, compiled, time.perf_counter() - t0, state, pending, keys,
                                 indices, timed_rounds, min_seconds, log, callbacks,
                                 output_dir)
    est = Estimate(**figures, **measured)
    if key is not None:
        cache[key] = est
    return est


def _measure_compiled(exp, compiled, compile_round, state, pending, keys, indices,
                      timed_rounds, min_seconds, log, callbacks, output_dir) -> Dict[str, Any]:
    """The fields of an :class:`Estimate` that the compiled round's runs measure."""
    T = exp.config.training.num_rounds
    held = round_memory(compiled, exp, state, pending, keys)
    state, metrics = compiled(state, pending, keys)   # a first run (warm-up, not timed)
    host_metrics(exp, indices[0], metrics)
    log(f"estimate: round compiled in {compile_round:.1f} s; timing at least {timed_rounds} "
        f"rounds ({min_seconds:g} s) ...")
    run = RunContext(view=exp.view(), num_rounds=T, state=state, output_dir=output_dir)
    for cb in callbacks:
        cb.on_run_start(run)
    state, metrics, trips, work, round_s = _time_rounds(
        exp, compiled, state, keys, indices, timed_rounds, max(timed_rounds, T), min_seconds,
        run, callbacks)
    log(f"estimate: {round_s:.4f} s per round ({len(trips)} rounds); compiling and timing one "
        f"evaluation ...")
    first_eval = _time_evaluation(exp, state, T, metrics, run, callbacks)   # compiles
    eval_s = _time_evaluation(exp, state, T, metrics, run, callbacks)
    jax.block_until_ready(state)
    if held is not None:   # the evaluation keeps its index streams on the device
        held = dataclasses.replace(held, data=tree_nbytes(jax.tree.leaves(
            exp.program.store.device_splits)))
    memory, source = device_memory(exp, held)
    return dict(
        compile_s=compile_round + max(0.0, first_eval - eval_s), round_s=round_s,
        eval_s=eval_s, memory=DeviceMemory(memory, source, held),
        flops_per_round=_flops(compiled), train_trips=trips,
        work={k: float(np.mean([w[k] for w in work])) for k in work[0]}, backend=exp.backend,
        devices=exp.placement.devices, replicas=exp.replicas.size, lanes=exp.lanes,
        ring=_ring(exp, state), lanes_line=lanes_text(exp.placement))


def _ring(exp: Experiment, state) -> Optional[VersionRing]:
    """An asynchronous run's K, its ring's versions per replica and the ring's bytes (the
    state's versions of every replica); None for a synchronous run."""
    if exp.buffered is None:
        return None
    return VersionRing(buffer_size=int(exp.num_sampled),
                       versions=int(exp.buffered.run.schedulers[0].V),
                       bytes=int(tree_nbytes(state.ring)))


def host_metrics(exp: Experiment, index: int, metrics) -> Dict[str, Any]:
    """A timed round's metrics on the host; an asynchronous run's with the host's counts of
    server step `index` (its time, updates aggregated and stale drops), as the loop adds
    them."""
    metrics = tree_to_host(metrics)
    if exp.buffered is not None:
        metrics = {**metrics, **exp.count_round(index)}
    return metrics


def estimate_run(config: ExperimentConfig, data: Optional[FederatedDataset] = None,
                 timed_rounds: int = DEFAULT_TIMED_ROUNDS, min_seconds: float = DEFAULT_MIN_SECONDS,
                 log: Optional[Callable[[str], None]] = None, replicas=None,
                 load_s: float = 0.0, cache: Optional[Dict[str, Estimate]] = None,
                 data_note: str = "") -> Estimate:
    """Build `config`'s run as :func:`~deltafl_jax.run.runner.run_experiment` does (loading
    the data unless given, the experiment, the resume fingerprint) and :func:`measure` it
    (`cache`: as :func:`measure`'s).
    `load_s`: seconds the caller spent before (starting the process and the backend, loading
    the `data` it passes), counted in build_s. Without `data`, a dataset that is not here
    but has a known shape is measured on its stand-in
    (:func:`deltafl_jax.datasets.known_shapes.load_or_stand_in`); `data_note` says so when
    the caller passes such a stand-in.
    Nothing is written, whatever ``config.output.output_dir`` says."""
    log = log or (lambda line: None)
    log(f"estimate: building {config.method} ...")
    t0 = time.perf_counter()
    if data is None:
        data, note = load_or_stand_in(config.data)
        data_note = note or data_note
    exp = build_experiment(config, data, replicas)
    fingerprint = resume.fingerprint(config, exp.data)   # the runner hashes the data before its rounds
    build_s = time.perf_counter() - t0 + load_s
    with tempfile.TemporaryDirectory(prefix="deltafl_estimate_") as scratch:
        # The run's own callbacks but the progress lines, writing into a scratch directory
        # (never config.output.output_dir); no checkpoints (they are written in the background).
        recorder = Recorder()
        scratch_config = dataclasses.replace(config, output=dataclasses.replace(
            config.output, output_dir=scratch, verbose=False))
        cbs = standard_callbacks(scratch_config,
                                 exp, lambda line: None, recorder, None, fingerprint)
        est = measure(exp, build_s, timed_rounds, log, min_seconds=min_seconds,
                      callbacks=[recorder, *cbs], output_dir=scratch, cache=cache)
    return dataclasses.replace(est, data_note=data_note)


# --------------------------------------------------------------------------------------------
# Projection: a program's cost from other programs' measurements and its own work counts


@dataclasses.dataclass(frozen=True)
class ProgramWork:
    """What a program computes, counted on the host from its resolved configuration, without
    building or compiling it (the cost model of :func:`project`).

    replicas, rounds, eval_every, evaluations: R, T, the evaluation period and how many
      evaluations the loop does.
    train_steps: the expected local minibatch steps of one round over every replica's jobs,
      each weighted by its spec's :meth:`~deltafl_jax.algorithms.spec.AlgorithmSpec.expected_work`
      w_r: sum_r w_r x m x mean_k s_k, with s_k the steps of training client k
      (:meth:`deltafl_jax.sampling.plan.LocalWork.steps_for`) and m the clients a round samples
      (uniformly, m of N: the expected sum of the sampled clients' steps is m x their mean).
    loss_examples: the expected examples of one round's loss evaluations over every
      replica: R x m x mean_k n_k for an algorithm that reads the sampled clients' losses
      F_k(w_t) (``uses_losses``; FedAvg's round skips them), and as many again for one that
      evaluates a second sample (``probe``, DRFA).
    eval_examples: the examples one evaluation reads: R x (training + test examples).
    """

    replicas: int
    rounds: int
    eval_every: int
    evaluations: int
    train_steps: float
    loss_examples: float
    eval_examples: float


def program_work(config: ExperimentConfig, data: FederatedDataset,
                 replicas=None) -> ProgramWork:
    """The :class:`ProgramWork` of `config`'s run on `data` (`replicas`: as
    :func:`~deltafl_jax.run.experiment.build_experiment`'s), from its resolved run
    (:func:`deltafl_jax.run.resolve.resolve`: host-side, nothing placed or compiled)."""
    from deltafl_jax.run.resolve import resolve
    run = resolve(config, data, replicas)
    m = run.expected if run.expected is not None else run.num_sampled
    sizes = run.data.train.sizes
    per_client = float(np.mean(run.work.steps_for(sizes)))
    weights = sum(run.spec.expected_work(label) for label in run.replicas.labels)
    evaluated = int(run.algorithm.uses_losses) + int(run.algorithm.probe is not None)
    examples = run.data.train.num_examples + run.data.test.num_examples
    T, every, R = config.training.num_rounds, config.evaluation.eval_every, run.replicas.size
    return ProgramWork(replicas=R, rounds=T, eval_every=every,
                       evaluations=num_evaluations(T, every),
                       train_steps=weights * m * per_client,
                       loss_examples=float(evaluated * R * m * np.mean(sizes)),
                       eval_examples=float(R * examples))


def round_costs(calibrations: Sequence["tuple[Estimate, ProgramWork]"]
                ) -> "tuple[float, float]":
    """(seconds per local step, seconds per loss-evaluated example) of a round, fitted to the
    measured programs' round_s = a x train_steps + b x loss_examples: solved by least squares
    when their work spans both (e.g. FedAvg, which evaluates no loss, and Delta-FL), and both
    come out >= 0; otherwise b = 0 and a = (sum of their round_s) / (sum of their
    train_steps)."""
    A = np.array([[w.train_steps, w.loss_examples] for _, w in calibrations], np.float64)
    y = np.array([e.round_s for e, _ in calibrations], np.float64)
    if len(y) >= 2 and np.linalg.matrix_rank(A) == 2:
        (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
        if a >= 0 and b >= 0:
            return float(a), float(b)
    return float(y.sum() / max(A[:, 0].sum(), 1e-12)), 0.0


def project(name: str, work: ProgramWork,
            calibrations: Sequence["tuple[Estimate, ProgramWork]"]) -> Estimate:
    """The :class:`Estimate` of a program that is not built, compiled or timed, from the
    measured `calibrations` (each a measured Estimate and its program's ProgramWork):

        round_s   = train_steps x a + loss_examples x b      (a, b: :func:`round_costs`)
        eval_s    = eval_examples x (sum of their eval_s) / (sum of their eval_examples)
        compile_s, build_s = the mean of theirs (each program compiles its round and its
                             evaluation once, as they did)

    so that a program with the work of a calibration gets its measurements back (exactly
    when one calibration or two that fix a and b). Device memory is not projected (0)."""
    if not calibrations:
        raise ValueError("project needs at least one measured program")
    measured = [e for e, _ in calibrations]
    s_step, s_loss = round_costs(calibrations)
    s_example = (sum(e.eval_s for e in measured)
                 / max(sum(w.eval_examples for _, w in calibrations), 1e-12))
    first = measured[0]
    return Estimate(
        name=name, num_rounds=work.rounds, eval_every=work.eval_every,
        build_s=float(np.mean([e.build_s for e in measured])),
        compile_s=float(np.mean([e.compile_s for e in measured])),
        round_s=work.train_steps * s_step + work.loss_examples * s_loss,
        eval_s=work.eval_examples * s_example,
        memory=DeviceMemory(0, "not measured (a projected program is never built)"),
        flops_per_round=None, train_trips=[],
        work=dict(train_steps=work.train_steps, s_per_step=s_step,
                  loss_examples=work.loss_examples, s_per_loss_example=s_loss,
                  eval_examples=work.eval_examples, s_per_example=s_example),
        backend=first.backend, devices=first.devices, replicas=work.replicas, lanes=0,
        projected_from=", ".join(e.name for e in measured))


def calibration_programs(hosts: Sequence[str], works: Sequence[ProgramWork]) -> List[int]:
    """Which programs of a setting to measure (the rest are projected from them): its first
    program, and of the programs of another algorithm (`hosts`: each program's) the one with
    the most local steps in all (rounds x train_steps), among those that evaluate losses when
    the first evaluates none (so that the two fix both costs of :func:`round_costs`); one
    program when all share the first's algorithm."""
    if not works:
        return []
    others = [i for i, h in enumerate(hosts) if h != hosts[0]]
    if not others:
        return [0]
    by_losses = works[0].loss_examples == 0

    def size(i):
        w = works[i]
        return (by_losses and w.loss_examples > 0, w.rounds * w.train_steps, -i)

    return [0, max(others, key=size)]

__all__ = ["Estimate", "VersionRing", "RoundMemory", "round_memory", "WORK_METRICS", "DEFAULT_TIMED_ROUNDS", "DEFAULT_MIN_SECONDS",
           "round_indices", "program_key", "measure", "estimate_run", "total_lines", "num_evaluations",
           "device_memory", "DeviceMemory", "ProgramWork", "program_work", "project", "round_costs",
           "calibration_programs"]
