"""The command line shared by ``experiments.run``, ``experiments.tune`` and
``data_prep.prepare``: the flag declarations, here, and the names of its other jobs, each in
its own module: parsing and one-line errors (:mod:`experiments.command`), what runs before the
backend starts (:mod:`experiments.backend`) and flags -> frozen configs
(:mod:`experiments.configs`).

Library code never reads flags: each command calls :func:`define_data_flags` /
:func:`define_experiment_flags`, parses with :func:`parse_flags_or_fail`, and turns the flags
into a :class:`deltafl_jax.ExperimentConfig` with :func:`config_from_flags`. The flags of an
algorithm's swept hyper-parameters and of its options come from its spec
(:mod:`deltafl_jax.algorithms.registry`).
"""

from __future__ import annotations

from typing import List

from absl import flags

from deltafl_jax import declared
from deltafl_jax.errors import UsageError
from experiments.backend import import_model_module, start_backend
from experiments.command import (COMMAND_LINE, FLAGFILE_HELP, FLAGS, HELP_FLAGS, fail,
                                 parse_flags_or_fail, usage)
from experiments.configs import (check_flags_read, config_from_flags, configs_from_flags,
                                 data_config_from_flags, floats, ints, method_entries)

__all__ = ["COMMAND_LINE", "DEFINED", "FLAGFILE_HELP", "FLAGS", "HELP_FLAGS", "UsageError",
           "check_flags_read", "config_from_flags", "configs_from_flags",
           "data_config_from_flags", "define_data_flags", "define_experiment_flags", "fail",
           "floats", "import_model_module", "ints", "method_entries", "parse_flags_or_fail",
           "start_backend", "usage"]


DEFINED: List[str] = []   # the flags this module declared, in order


def _define(kind, name, default, help, **kw):
    if name not in FLAGS:
        kind(name=name, default=default, help=help, **kw)
        DEFINED.append(name)


_KINDS = {"string": flags.DEFINE_string, "integer": flags.DEFINE_integer,
          "float": flags.DEFINE_float, "bool": flags.DEFINE_bool, "list": flags.DEFINE_list,
          "enum": flags.DEFINE_enum}


def _define_settings(cls) -> None:
    """One flag per setting of the group `cls` (:mod:`deltafl_jax.declared`): its name,
    default, help and choices are the field's, written once there."""
    for f in declared.fields_of(cls):
        flag, kind = declared.flag_of(f), declared.kind_of(f)
        extra = {"enum_values": list(flag.choices)} if kind == "enum" else {}
        _define(_KINDS[kind], flag.name, declared.flag_default(f), flag.help, **extra)


def define_data_flags() -> None:
    """The flags of :class:`deltafl_jax.DataConfig` (idempotent)."""
    from deltafl_jax import DataConfig
    _define_settings(DataConfig)


def _define_sweep_flags() -> None:
    from deltafl_jax.algorithms import registry
    for sweep in registry.sweeps():
        grid = ",".join(f"{v:g}" for v in sweep.default)
        _define(flags.DEFINE_list, sweep.flag, [],
                f"{sweep.help}; empty: the algorithm's grid" + (f" {grid}" if grid else ""))


_OPTION_FLAG_KINDS = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer,
                      float: flags.DEFINE_float, str: flags.DEFINE_string}


def _define_option_flags() -> None:
    """The algorithms' options, one flag each (an enum when it has choices), from the specs."""
    from deltafl_jax.algorithms import registry
    for name, option in registry.options():
        if option.choices:
            _define(flags.DEFINE_enum, name, option.default, option.help,
                    enum_values=list(option.choices))
        else:
            _define(_OPTION_FLAG_KINDS[type(option.default)], name, option.default, option.help)


def _define_client_flags() -> None:
    """The client optimizer (deltafl_jax.client_optimizer)."""
    from deltafl_jax.client_optimizer import ClientOptimizer
    _define_settings(ClientOptimizer)


def _define_sampling_flags() -> None:
    """Client sampling (deltafl_jax.sampling; docs/guides/sampling.md)."""
    from deltafl_jax.sampling import Sampling
    _define_settings(Sampling)


def _define_availability_flags() -> None:
    """Client availability (deltafl_jax.sampling.availability; docs/guides/availability.md)."""
    from deltafl_jax.sampling.availability import AvailabilitySettings
    _define_settings(AvailabilitySettings)


def _define_timing_flags() -> None:
    """Device speeds and the virtual clock (deltafl_jax.sampling.speeds, clock;
    docs/guides/device-speeds.md)."""
    from deltafl_jax.sampling.speeds import TimingSettings
    _define_settings(TimingSettings)


def _define_async_flags() -> None:
    """Buffered asynchronous aggregation (deltafl_jax.sampling.asynchronous;
    docs/guides/asynchronous.md)."""
    from deltafl_jax.sampling.asynchronous import AsyncSettings
    _define_settings(AsyncSettings)


def _define_privacy_flags() -> None:
    """Client-level differential privacy (deltafl_jax.privacy; docs/guides/privacy.md)."""
    from deltafl_jax.privacy import Privacy
    _define_settings(Privacy)


def _define_server_flags() -> None:
    """The server optimizer (deltafl_jax.server_optimizer; Reddi et al. 2021, Algorithm 2)."""
    from deltafl_jax.server_optimizer import ServerOptimizer
    _define_settings(ServerOptimizer)


def _define_training_flags() -> None:
    """The model, the seeds, the rounds and the clients' local steps
    (deltafl_jax.config.Training)."""
    from deltafl_jax.config import Training
    _define_settings(Training)


def _define_placement_flags() -> None:
    """Placement: devices, client lanes, evaluation chunks, loop body, convolutions
    (deltafl_jax.config.Placement)."""
    from deltafl_jax.config import Placement
    _define_settings(Placement)


def _define_evaluation_flags() -> None:
    """Evaluation (deltafl_jax.config.Evaluation)."""
    from deltafl_jax.config import Evaluation
    _define_settings(Evaluation)


def _define_personal_flags() -> None:
    """Personalised evaluation (deltafl_jax.config.Personalisation)."""
    from deltafl_jax.config import Personalisation
    _define_settings(Personalisation)


def _define_output_flags() -> None:
    """Outputs and checkpoints (deltafl_jax.config.Output)."""
    from deltafl_jax.config import Output
    _define_settings(Output)


def _define_device_flags() -> None:
    """Where the process runs: joining several processes, determinism."""
    _define(flags.DEFINE_bool, "distributed", False, "join a run of several processes with "
            "jax.distributed (TPU pods and Slurm are detected; else give the three flags below)")
    _define(flags.DEFINE_string, "coordinator_address", None, "with --distributed: host:port of "
            "process 0")
    _define(flags.DEFINE_integer, "num_processes", None, "with --distributed: processes in all")
    _define(flags.DEFINE_integer, "process_id", None, "with --distributed: this process, "
            "0..num_processes-1 (0 writes the outputs)")
    _define(flags.DEFINE_integer, "distributed_timeout_s", 120, "with --distributed: give up "
            "joining after this many seconds")
    _define(flags.DEFINE_bool, "deterministic", False, "bit-reproducible runs on GPU (XLA's "
            "deterministic scatter-adds; slower); no effect on CPU, which is deterministic")


def define_experiment_flags() -> None:
    """Every flag of :class:`deltafl_jax.ExperimentConfig` (idempotent)."""
    from deltafl_jax.algorithms import registry
    define_data_flags()
    _define(flags.DEFINE_string, "model_module", None, "a Python module (a dotted name, or a "
            "path to a .py file) imported before the run, whose deltafl_jax.register_model "
            "calls add models for --model (docs/guides/own-model.md)")
    _define(flags.DEFINE_list, "algorithm", ["deltafl"], "one or more of "
            f"{', '.join(registry.names())}; several run one after another into "
            "<output_dir>/<algorithm>/; an entry NAME+OPTIMIZER (fedavg+adam) runs NAME with "
            "that server optimizer at --server_lr, and then the entries without one take the "
            "plain step (sgd, learning rate 1)")
    _define_option_flags()
    _define_sweep_flags()
    _define_training_flags()
    _define_server_flags()
    _define_client_flags()
    _define_sampling_flags()
    _define_availability_flags()
    _define_timing_flags()
    _define_async_flags()
    _define_privacy_flags()
    _define_placement_flags()
    _define_device_flags()
    _define_evaluation_flags()
    _define_personal_flags()
    _define_output_flags()
