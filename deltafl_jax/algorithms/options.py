"""An algorithm's own flags: its options (one scalar each, the same for every replica) and its
sweeps (a list of values, one replica each).

- :class:`Option` declares one option; an algorithm's options are a frozen dataclass of
  :meth:`Option.field` fields (:class:`NoOptions` for none), whose names are the flags:
  :func:`declared_options` lists them, :func:`build_options` builds and :func:`check_options`
  checks the options of a run.
- :class:`Sweep` declares a swept hyper-parameter: its flag, the hyper field it sets, its
  default grid and how replicas are labelled.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple

from deltafl_jax.declared import finite_in
from deltafl_jax.errors import ConfigError

OPTION = "deltafl_jax.option"   # the metadata key of an options field's Option


@dataclasses.dataclass(frozen=True)
class Option:
    """One scalar option of an algorithm: a flag whose value is the same for every replica.

    An algorithm declares its options as a frozen dataclass whose fields are made by
    :meth:`field`; the field's name is the flag. Specs that read the same option share one
    Option object (Delta-FL, FedAvg and deltafl_alt: ``weighting``), so that its default, help
    and choices are written once; the registry refuses two different Options under one flag.

    default: the value when the flag is not given (its type is the flag's type).
    help: the flag's help text.
    choices: the values allowed (an enum flag); () for a number or a free string.
    """

    default: Any
    help: str
    choices: Tuple[str, ...] = ()

    def field(self) -> Any:
        """A dataclass field with this default that carries this Option."""
        return dataclasses.field(default=self.default, metadata={OPTION: self})

    def check(self, flag: str, value) -> None:
        """ConfigError naming --flag when the value is not one of the choices."""
        if self.choices and value not in self.choices:
            raise ConfigError(f"unknown --{flag}={value!r}; choose one of "
                              f"{', '.join(self.choices)}")


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of an algorithm that has none."""


def declared_options(options_type: type) -> Tuple[Tuple[str, Option], ...]:
    """(flag, Option) of each field of an options dataclass, in order; TypeError when it is not
    a frozen dataclass or a field was not made by :meth:`Option.field`."""
    params = getattr(options_type, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"options {options_type!r} must be a frozen dataclass")
    out = []
    for f in dataclasses.fields(options_type):
        option = f.metadata.get(OPTION)
        if not isinstance(option, Option):
            raise TypeError(f"{options_type.__name__}.{f.name} must be made by Option.field()")
        out.append((f.name, option))
    return tuple(out)


def check_options(options) -> None:
    """ConfigError naming the flag at fault: each field's choices, then the options' own
    ``check()`` (checks across fields, ranges), when they have one."""
    for flag, option in declared_options(type(options)):
        option.check(flag, getattr(options, flag))
    own = getattr(options, "check", None)
    if own is not None:
        own()


def build_options(options_type: type, given: Mapping[str, Any]):
    """The options of type `options_type` from a mapping flag -> value (a flag it lacks takes
    its default; flags of other algorithms are not read), checked."""
    names = [flag for flag, _ in declared_options(options_type)]
    options = options_type(**{k: given[k] for k in names if k in given})
    check_options(options)
    return options


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
