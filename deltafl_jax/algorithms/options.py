"""An algorithm's own flags: its options (one scalar each, the same for every replica) and its
sweeps (a list of values, one replica each), both declared through :mod:`deltafl_jax.declared`.

- An algorithm's options are a settings group like the configuration's: a frozen dataclass
  whose fields are made by :func:`deltafl_jax.declared.setting` (the field's name is the flag;
  its default, help, choices and :class:`~deltafl_jax.declared.Bounds` are written there), or
  :class:`NoOptions` for none. An option that several specs read is an :class:`Option`,
  written once, whose :meth:`Option.field` each of their groups uses (``--weighting``).
  :func:`option_flags` lists a group's declarations, :func:`build_options` builds and
  :func:`check_options` checks the options of a run, :func:`stored_options` reads them back
  from a finished run.
- :class:`Sweep` declares a swept hyper-parameter: its flag, the hyper field it sets, its
  default grid and how replicas are labelled; :meth:`Sweep.declaration` is its flag's
  :class:`~deltafl_jax.declared.Flag`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple

from deltafl_jax.declared import (Bounds, Flag, check_group, check_settings, check_value,
                                  finite_in, from_flat, setting)
from deltafl_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Option:
    """An option that several specs read, written once: each of their options groups makes
    its field with :meth:`field` (a :func:`~deltafl_jax.declared.setting`), so that the
    flag's default, help, choices and bounds are the same declaration everywhere (Delta-FL,
    FedAvg and the FedAvg-based specs: ``weighting``).

    default: the value when the flag is not given (its type is the flag's type).
    help: the flag's help text.
    choices: the values allowed (an enum flag); () for a number or a free string.
    bounds: a number's range (None: any value of its type).
    """

    default: Any
    help: str
    choices: Tuple[str, ...] = ()
    bounds: Optional[Bounds] = None

    def field(self) -> Any:
        """A settings field with this declaration."""
        return setting(self.default, self.help, choices=self.choices, bounds=self.bounds)

    def check(self, flag: str, value) -> None:
        """ConfigError naming --flag when the value is not one of the choices or out of
        bounds."""
        check_value(Flag(name=flag, choices=self.choices, bounds=self.bounds), value)


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of an algorithm that has none."""


def option_flags(options_type: type) -> Tuple[Flag, ...]:
    """The declaration of each option of an options group, in order; TypeError unless it is
    a frozen dataclass whose every field is a declared setting."""
    return check_group(options_type)


def check_options(options) -> None:
    """ConfigError naming the flag at fault: each field's choices and bounds, then the
    options' own ``check()`` (checks across fields), when they have one."""
    check_settings(options)
    own = getattr(options, "check", None)
    if own is not None:
        own()


def build_options(options_type: type, given: Mapping[str, Any]):
    """The options of type `options_type` from a mapping flag -> value (a flag it lacks takes
    its default; flags of other algorithms are not read), checked."""
    options = from_flat(options_type, given)
    check_options(options)
    return options


def stored_options(options_type: type, run_config: Optional[Mapping[str, Any]]):
    """The options of type `options_type` as a finished run's configuration holds them
    (summary.json's ``config``: its ``options`` mapping; runs written before options had their
    own mapping hold them at the top level), unchecked."""
    run_config = dict(run_config or {})
    return from_flat(options_type, {**run_config, **dict(run_config.get("options") or {})})


@dataclasses.dataclass(frozen=True)
class Sweep:
    """The hyper-parameter that a spec sweeps: one replica per value x seed, in one program.

    flag: the command-line flag that lists the values ("thetas" for theta).
    field: the field of the spec's hyper NamedTuple that receives the value.
    default: the default grid.
    help: the flag's help text (without its default, which absl prints).
    minimum: values must be >= minimum (None: any finite value).
    interval: (lo, hi): values must lie in (lo, hi] (None: no such bound).
    integer: values must be integers.
    labelled_by_theta: replicas are labelled by theta (label.theta = value); otherwise by
      param_name = flag and param_value = value.
    symbol: how the value reads in a report column ("θ", "q", "μ"; empty: the flag).
    tuned: the value is a hyper-parameter to tune (a baseline's q, mu, t, ...: the tuner's
      --tune_param picks one, the report's --best keeps the best column); False: every value
      is a model the user asks for (Delta-FL's theta).
    declared_by: the sweep that declares the flag, when this one reads another's flag with a
      grid of its own (FedAvg-Sub's theta levels: Delta-FL's ``--thetas``, whose help names
      Delta-FL's grid); None: this sweep declares it.
    """

    flag: str
    field: str
    default: Tuple[float, ...]
    help: str
    minimum: Optional[float] = None
    interval: Optional[Tuple[float, float]] = None
    integer: bool = False
    labelled_by_theta: bool = False
    symbol: str = ""
    tuned: bool = True
    declared_by: Optional["Sweep"] = None

    def declaration(self) -> Flag:
        """Its flag as the command line declares it: a list, empty unless given (then the
        spec's grid applies), whose help names the grid."""
        if self.declared_by is not None:
            return self.declared_by.declaration()
        grid = ",".join(f"{v:g}" for v in self.default)
        return Flag(name=self.flag, kind="list", flag_default=[],
                    help=f"{self.help}; empty: the algorithm's grid" + (f" {grid}" if grid else ""))

    @property
    def coordinate(self) -> str:
        """The name of its value in a replica label: "theta" or the flag."""
        return "theta" if self.labelled_by_theta else self.flag

    def check(self, values) -> Tuple[float, ...]:
        """The values as floats; ConfigError naming the flag if one is bad."""
        out = []
        for v in values:
            if not finite_in(v):
                raise ConfigError(f"--{self.flag} must be finite numbers, got {v!r}")
            if self.integer and float(v) != int(v):
                raise ConfigError(f"--{self.flag} must be integers, got {v!r}")
            if self.minimum is not None and v < self.minimum:
                raise ConfigError(f"--{self.flag} must be >= {self.minimum:g}, got {v!r}")
            if self.interval is not None and not self.interval[0] < v <= self.interval[1]:
                lo, hi = self.interval
                raise ConfigError(f"--{self.flag} must lie in ({lo:g}, {hi:g}], got {v!r}")
            out.append(float(v))
        if len(set(out)) != len(out):
            raise ConfigError(f"--{self.flag} lists a value twice: {list(values)}")
        return tuple(out)
