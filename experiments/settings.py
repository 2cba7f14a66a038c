"""The command line's settings that are no setting of :class:`deltafl_jax.ExperimentConfig`:
which methods run and what is imported first (:class:`Command`), and where the process runs
(:class:`Process`). Each is a group of :mod:`deltafl_jax.declared` settings, so that
``experiments/cli.py`` declares their flags in the same loop as every other flag;
``experiments/backend.py`` and ``experiments/configs.py`` read them."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from deltafl_jax.algorithms import registry
from deltafl_jax.declared import setting


@dataclasses.dataclass(frozen=True)
class Command:
    """The run: the algorithms and the model module."""

    model_module: Optional[str] = setting(
        None, "a Python module (a dotted name, or a path to a .py file) imported before the run, "
        "whose deltafl_jax.register_model calls add models for --model "
        "(docs/guides/own-model.md)", kind="string")
    algorithm: Tuple[str, ...] = setting(
        ("deltafl",), f"one or more of {', '.join(registry.names())}; several run one after "
        "another into <output_dir>/<algorithm>/; an entry NAME+OPTIMIZER (fedavg+adam) runs "
        "NAME with that server optimizer at --server_lr, and then the entries without one take "
        "the plain step (sgd, learning rate 1)", kind="list")


@dataclasses.dataclass(frozen=True)
class Process:
    """Where the process runs: joining several processes, determinism."""

    distributed: bool = setting(
        False, "join a run of several processes with jax.distributed (TPU pods and Slurm are "
        "detected; else give the three flags below)")
    coordinator_address: Optional[str] = setting(
        None, "with --distributed: host:port of process 0", kind="string")
    num_processes: Optional[int] = setting(None, "with --distributed: processes in all",
                                           kind="integer")
    process_id: Optional[int] = setting(
        None, "with --distributed: this process, 0..num_processes-1 (0 writes the outputs)",
        kind="integer")
    distributed_timeout_s: int = setting(
        120, "with --distributed: give up joining after this many seconds")
    deterministic: bool = setting(
        False, "bit-reproducible runs on GPU (XLA's deterministic scatter-adds; slower); no "
        "effect on CPU, which is deterministic")
