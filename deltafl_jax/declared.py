"""Settings declared once: a frozen dataclass field that carries its command-line flag.

A group of settings (:class:`deltafl_jax.DataConfig`, :class:`deltafl_jax.ServerOptimizer`,
the groups of :class:`deltafl_jax.ExperimentConfig`, ...) is a frozen dataclass whose fields are
made by :func:`setting`: the field's default is the setting's, and its metadata holds a
:class:`Flag` (the flag's name, help, kind, choices, and how the flag's value becomes the
field's). ``experiments/cli.py`` declares one flag per such field and builds the groups from the
flags with :func:`from_flags`; reports and resumes read the settings back by flag name
(:func:`flat_values`, :func:`from_flat`). So a setting's flag, default and help are written once,
on its field, as an algorithm's options are (:func:`deltafl_jax.algorithms.spec.declared_options`).

A group may hold groups of its own (:func:`group`: DataConfig's ``limits``, ``synthetic``,
``toy`` and ``partitioner``): :func:`fields_of`, :func:`from_flags`, :func:`from_flat` and
:func:`flat_values` walk them in their place, so their flags and their stored settings stay
flat, flag -> value; :func:`set_fields` lets such a class take its groups' settings by flag name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple

from deltafl_jax.errors import ConfigError, UsageError

FLAG = "deltafl_jax.flag"   # the metadata key of a setting's Flag
_SAME = object()


@dataclasses.dataclass(frozen=True)
class Flag:
    """The command-line flag of one setting.

    name: the flag ("" = the field's name). help: its help text. kind: absl's flag type,
    string | integer | float | bool | enum | list ("" = from the default: bool, int, float,
    str; a tuple is a list). choices: an enum's values. flag_default: the value absl's flag
    holds when it is not given, where it is not the field's default written as the flag
    reads it (a tuple of numbers as its '%g' strings). parse: the flag's value -> the field's
    (a list of numbers, ``--dp_clip``'s number or 'adaptive'); None: as it is; ``from_flat``
    reads a stored value with ``restore`` (None: lists become tuples).
    """

    name: str = ""
    help: str = ""
    kind: str = ""
    choices: Tuple[str, ...] = ()
    flag_default: Any = _SAME
    parse: Optional[Callable[[str, Any], Any]] = None
    restore: Optional[Callable[[Any], Any]] = None


def setting(default: Any = dataclasses.MISSING, help: str = "", *, flag: str = "",
            kind: str = "", choices: Sequence[str] = (), flag_default: Any = _SAME,
            parse: Optional[Callable[[str, Any], Any]] = None,
            restore: Optional[Callable[[Any], Any]] = None) -> Any:
    """A dataclass field with this default that carries its :class:`Flag`."""
    meta = {FLAG: Flag(name=flag, help=help, kind=kind, choices=tuple(choices),
                       flag_default=flag_default, parse=parse, restore=restore)}
    return dataclasses.field(default=default, metadata=meta)


def group(cls: type) -> Any:
    """A field holding a group of settings (a dataclass of :func:`setting` fields), made by
    its defaults."""
    return dataclasses.field(default_factory=cls, metadata={FLAG: cls})


def flag_of(field: dataclasses.Field) -> Optional[Flag]:
    """The field's Flag (its name filled in), or None."""
    flag = field.metadata.get(FLAG)
    if not isinstance(flag, Flag):
        return None
    return flag if flag.name else dataclasses.replace(flag, name=field.name)


def groups(cls: type) -> Tuple[Tuple[str, type], ...]:
    """(field name, group class) of each group field of `cls`."""
    return tuple((f.name, f.metadata[FLAG]) for f in dataclasses.fields(cls)
                 if isinstance(f.metadata.get(FLAG), type))


def declared(cls: type) -> Tuple[Tuple[str, Flag], ...]:
    """(field name, Flag) of each field of `cls` that declares a flag, in order (a group's
    fields are not included: see :func:`flat_paths`)."""
    return tuple((f.name, flag) for f in dataclasses.fields(cls)
                 for flag in [flag_of(f)] if flag is not None)


def flat_paths(cls: type) -> Dict[str, Tuple[str, ...]]:
    """flag -> the path of field names that holds it, through the groups of `cls`."""
    out = {flag.name: (name,) for name, flag in declared(cls)}
    for name, sub in groups(cls):
        for flag, path in flat_paths(sub).items():
            if flag in out:
                raise TypeError(f"{cls.__name__}: two settings declare --{flag}")
            out[flag] = (name,) + path
    return out


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _g(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def flag_default(field: dataclasses.Field) -> Any:
    """The value absl's flag holds when it is not given."""
    flag = flag_of(field)
    if flag.flag_default is not _SAME:
        return flag.flag_default
    value = default_of(field)
    if kind_of(field) == "list":
        values = value if isinstance(value, (tuple, list)) else (value,)
        return [_g(v) for v in values]
    return value


def kind_of(field: dataclasses.Field) -> str:
    """absl's flag type of the field (Flag.kind, else from the default's type)."""
    flag = flag_of(field)
    if flag.kind:
        return flag.kind
    if flag.choices:
        return "enum"
    value = default_of(field)
    for t, kind in ((bool, "bool"), (int, "integer"), (float, "float"), (str, "string"),
                    (tuple, "list")):
        if isinstance(value, t):
            return kind
    raise TypeError(f"setting {field.name}: give its kind (its default {value!r} does not say)")


def fields_of(cls: type) -> Iterator[dataclasses.Field]:
    """The fields of `cls` that declare a flag, in order, the fields of each of its groups
    (:func:`group`) in the group's place."""
    for f in dataclasses.fields(cls):
        sub = f.metadata.get(FLAG)
        if isinstance(sub, type):
            yield from fields_of(sub)
        elif sub is not None:
            yield f


def from_flags(cls: type, value: Callable[[str], Any], **fixed) -> Any:
    """The group `cls` from the flags (``value(flag)``: the flag's parsed value), each parsed
    by its Flag, its groups built alike; `fixed`: fields given instead."""
    kw = {}
    for f in dataclasses.fields(cls):
        sub, flag = f.metadata.get(FLAG), flag_of(f)
        if f.name in fixed or sub is None:
            continue
        if isinstance(sub, type):
            kw[f.name] = from_flags(sub, value)
            continue
        raw = value(flag.name)
        kw[f.name] = flag.parse(flag.name, raw) if flag.parse is not None else raw
    return cls(**kw, **fixed)


def _restore(flag: Flag, value):
    if flag.restore is not None:
        return flag.restore(value)
    return tuple(value) if isinstance(value, list) else value


def from_flat(cls: type, values: Mapping[str, Any], **fixed) -> Any:
    """The group `cls` from stored settings (flag -> value, e.g. summary.json's ``config``),
    its groups' included; a flag missing there (a run written before the setting existed)
    takes its default."""
    kw = {}
    for f in dataclasses.fields(cls):
        sub, flag = f.metadata.get(FLAG), flag_of(f)
        if f.name in fixed or sub is None:
            continue
        if isinstance(sub, type):
            kw[f.name] = from_flat(sub, values)
        elif flag.name in values and values[flag.name] is not None:
            kw[f.name] = _restore(flag, values[flag.name])
    return cls(**kw, **fixed)


def flat_values(obj) -> Dict[str, Any]:
    """flag -> value of every setting of `obj` (a group), its groups' included."""
    out = {}
    for f in dataclasses.fields(obj):
        flag = flag_of(f)
        if flag is not None:
            out[flag.name] = getattr(obj, f.name)
        elif isinstance(f.metadata.get(FLAG), type):
            out.update(flat_values(getattr(obj, f.name)))
    return out


def set_fields(obj, settings: Dict[str, Any]) -> None:
    """Set every field of the frozen dataclass `obj` (one made with ``init=False``, in its
    ``__init__``): a field named in `settings` takes the value given, another its default; a
    name that is the flag of a setting of one of its groups (its flat name, :func:`flat_paths`)
    replaces that field of the group. TypeError naming any other name."""
    settings = dict(settings)
    own = {f.name: settings.pop(f.name) if f.name in settings else default_of(f)
           for f in dataclasses.fields(obj)}
    paths = flat_paths(type(obj))
    changes: Dict[str, Dict[str, Any]] = {}
    for name, value in settings.items():
        path = paths.get(name)
        if path is None or len(path) != 2:
            raise TypeError(f"{type(obj).__name__} got an unknown setting {name!r}")
        changes.setdefault(path[0], {})[path[1]] = value
    for where, fields in changes.items():
        own[where] = dataclasses.replace(own[where], **fields)
    for name, value in own.items():
        object.__setattr__(obj, name, value)


# --------------------------------------------------------------------------------------------
# The check of a number setting: finite, in a range.


def finite_in(value: Any, low: float = -math.inf, high: float = math.inf, *,
              low_open: bool = False, high_open: bool = False) -> bool:
    """Whether `value` is a number (an int or a float, never a bool), finite, and between `low`
    and `high`: each bound included unless `low_open` / `high_open` says it is excluded."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    return above and below


def range_text(low: float = -math.inf, high: float = math.inf, *, low_open: bool = False,
               high_open: bool = False) -> str:
    """The range of :func:`finite_in` in words: ">= 0", "> 0 and < 1", "" for none."""
    parts = ([f"{'>' if low_open else '>='} {low:g}"] if low > -math.inf else []) \
        + ([f"{'<' if high_open else '<='} {high:g}"] if high < math.inf else [])
    return " and ".join(parts)


def check_finite(flag: str, value: Any, low: float = -math.inf, high: float = math.inf, *,
                 low_open: bool = False, high_open: bool = False) -> None:
    """ConfigError "--flag must be a finite number >= low, got value" unless
    :func:`finite_in` (the range as :func:`range_text` writes it)."""
    if not finite_in(value, low, high, low_open=low_open, high_open=high_open):
        bounds = range_text(low, high, low_open=low_open, high_open=high_open)
        raise ConfigError(f"--{flag} must be a finite number{' ' if bounds else ''}{bounds}, "
                          f"got {value!r}")


# --------------------------------------------------------------------------------------------
# Parsers of flag values (UsageError naming the flag).


def _numbers(name: str, values: Sequence[str], kind: type, what: str) -> Tuple[Any, ...]:
    try:
        return tuple(kind(v) for v in values)
    except ValueError:
        raise UsageError(f"--{name} must be a comma-separated list of {what}, got "
                         f"{','.join(values)!r}") from None


def floats(name: str, values: Sequence[str]) -> Tuple[float, ...]:
    """A list flag's values as floats."""
    return _numbers(name, values, float, "numbers")


def ints(name: str, values: Sequence[str]) -> Tuple[int, ...]:
    """A list flag's values as integers."""
    return _numbers(name, values, int, "integers")


def one_or_floats(name: str, values: Sequence[str]):
    """One number, or a tuple of several (``--l2_reg``)."""
    out = floats(name, values)
    return out[0] if len(out) == 1 else out
