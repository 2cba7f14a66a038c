"""The command line shared by ``experiments.run``, ``experiments.tune`` and
``data_prep.prepare``: the flag declarations, here, and the names of its other jobs, each in
its own module: parsing and one-line errors (:mod:`experiments.command`), what runs before the
backend starts (:mod:`experiments.backend`) and flags -> frozen configs
(:mod:`experiments.configs`).

Library code never reads flags: each command calls :func:`define_data_flags` /
:func:`define_experiment_flags`, parses with :func:`parse_flags_or_fail`, and turns the flags
into a :class:`deltafl_jax.ExperimentConfig` with :func:`config_from_flags`. Every flag is
declared once, on a field or a sweep (:mod:`deltafl_jax.declared`), and defined here by one
loop (:func:`_define_flags`) over the groups that declare them: :class:`deltafl_jax.DataConfig`,
the run's (:mod:`experiments.settings`), the algorithms' options and sweeps (their specs,
:mod:`deltafl_jax.algorithms.registry`), the groups of ExperimentConfig and the process's.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

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
SECTION: Dict[str, str] = {}   # flag -> the title of what declares it (the flag reference's)

_KINDS = {"string": flags.DEFINE_string, "integer": flags.DEFINE_integer,
          "float": flags.DEFINE_float, "bool": flags.DEFINE_bool, "list": flags.DEFINE_list,
          "enum": flags.DEFINE_enum}

# The sections of the flags of ExperimentConfig's groups (and of the process's), in the order
# they are declared, with their titles in the flag reference; a group of ExperimentConfig not
# named here comes after them, titled by the first line of its docstring.
GROUP_TITLES = {
    "training": "Training: model, seeds, rounds, local steps (deltafl_jax.run.config.Training)",
    "server": "The server optimizer (deltafl_jax.optimizers.server)",
    "client": "The client optimizer (deltafl_jax.optimizers.client)",
    "sampling": "Client sampling (deltafl_jax.sampling; docs/guides/sampling.md)",
    "online": "Client availability (deltafl_jax.sampling.availability; "
              "docs/guides/availability.md)",
    "timing": "Device speeds and the virtual clock (deltafl_jax.sampling.speeds, clock; "
              "docs/guides/device-speeds.md)",
    "asynchronous": "Buffered asynchronous aggregation (deltafl_jax.asynchronous.scheduler; "
                    "docs/guides/asynchronous.md)",
    "privacy": "Client-level differential privacy and client sampling (deltafl_jax.privacy.dp)",
    "placement": "Placement: devices, lanes, chunks (deltafl_jax.run.config.Placement)",
    "precision": "Mixed precision (deltafl_jax.models.precision)",
    "process": "Where the process runs: joining several processes, determinism",
    "evaluation": "Evaluation (deltafl_jax.run.config.Evaluation)",
    "personal": "Personalised evaluation (deltafl_jax.run.config.Personalisation)",
    "output": "Outputs and checkpoints (deltafl_jax.run.config.Output)",
}
OPTIONS_TITLE, SWEEPS_TITLE = "Algorithm options", "Swept hyper-parameters"

Section = Tuple[str, Sequence[Tuple[str, declared.Flag]]]   # (title, ((declarer, Flag), ...))


def _define_flags(sections: Sequence[Section]) -> None:
    """The one loop that declares flags: each Flag of `sections` once (a flag that several
    declare alike, e.g. an option several specs read, once), as absl's flag of its kind, with
    its default, help and choices; a flag defined already is left as it is (idempotent).
    TypeError when two declarations of one flag differ (:func:`deltafl_jax.declared.unique`)."""
    found = [(title, where, flag) for title, pairs in sections for where, flag in pairs]
    titles: Dict[str, str] = {}
    for title, _, flag in found:
        titles.setdefault(flag.name, title)
    for _, flag in declared.unique((where, flag) for _, where, flag in found):
        if flag.name in FLAGS:
            continue
        extra = {"enum_values": list(flag.choices)} if flag.kind == "enum" else {}
        _KINDS[flag.kind](name=flag.name, default=flag.flag_default, help=flag.help, **extra)
        DEFINED.append(flag.name)
        SECTION[flag.name] = titles[flag.name]


def _group(title: str, cls: type) -> Section:
    """The section of a group of settings: the Flag of each of its fields (its groups'
    included)."""
    return title, tuple((cls.__name__, flag) for flag in declared.declarations(cls))


def _data_section() -> Section:
    from deltafl_jax import DataConfig
    return _group("Data", DataConfig)


def _title(cls: type) -> str:
    return (cls.__doc__ or cls.__name__).strip().split("\n")[0].rstrip(".")


def _sections() -> List[Section]:
    """Every flag of the experiment commands, by section: the data, the run, the algorithms'
    options and sweeps (from their specs), then ExperimentConfig's groups and the process's."""
    from deltafl_jax import ExperimentConfig
    from deltafl_jax.algorithms import registry
    from experiments.settings import Command, Process
    groups = {**dict(declared.groups(ExperimentConfig)), "process": Process}
    ordered = [(GROUP_TITLES[name], groups.pop(name)) for name in GROUP_TITLES]
    ordered += [(_title(cls), cls) for cls in groups.values()]
    return [_data_section(), _group("The run: the algorithms and the model module", Command),
            (OPTIONS_TITLE, tuple(("the algorithms' options", flag)
                                  for _, flag in registry.options())),
            (SWEEPS_TITLE, tuple(("the algorithms' sweeps", sweep.declaration())
                                 for sweep in registry.sweeps()))] + \
        [_group(title, cls) for title, cls in ordered]


def define_data_flags() -> None:
    """The flags of :class:`deltafl_jax.DataConfig` (idempotent)."""
    _define_flags([_data_section()])


def define_experiment_flags() -> None:
    """Every flag of :class:`deltafl_jax.ExperimentConfig`, of the algorithms' options and
    sweeps, and of the process (idempotent)."""
    _define_flags(_sections())
