"""Settings declared once: a frozen dataclass field that carries its command-line flag.

A group of settings (:class:`deltafl_jax.DataConfig`, :class:`deltafl_jax.ServerOptimizer`,
the groups of :class:`deltafl_jax.ExperimentConfig`, ...) is a frozen dataclass whose fields are
made by :func:`setting`: the field's default is the setting's, and its metadata holds a
:class:`Flag` (the flag's name, help, kind, choices, and how the flag's value becomes the
field's, its choices and its range). An algorithm's options are such a group too
(:mod:`deltafl_jax.algorithms.options`), and a swept flag declares a :class:`Flag` of its own.
``experiments/cli.py`` declares every flag in one loop over the :func:`declarations` of the
groups, refusing two different declarations of one flag (:func:`unique`), and builds the groups
from the flags with :func:`from_flags`; reports and resumes read the settings back by flag name
(:func:`flat_values`, :func:`from_flat`). So a setting's flag, default, range and help are
written once, on its field.

A group may hold groups of its own (:func:`group`: DataConfig's ``limits``, ``synthetic``,
``toy`` and ``partitioner``): :func:`fields_of`, :func:`from_flags`, :func:`from_flat` and
:func:`flat_values` walk them in their place, so their flags and their stored settings stay
flat, flag -> value; :func:`set_fields` lets such a class take its groups' settings by flag name.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Optional, Sequence, Tuple

from deltafl_jax.errors import ConfigError, UsageError

FLAG = "deltafl_jax.flag"   # the metadata key of a setting's Flag
_SAME = object()


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The range of a number setting: ``low <= value <= high``, an end excluded where it is
    open (:func:`finite_in`); `integer`: the value must be an int (never a bool)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def check(self, flag: str, value: Any) -> None:
        """ConfigError naming --flag and the range in one line unless the value is in it."""
        if not self.integer:
            check_finite(flag, value, self.low, self.high, low_open=self.low_open,
                         high_open=self.high_open)
        elif not isinstance(value, int) or not finite_in(
                value, self.low, self.high, low_open=self.low_open, high_open=self.high_open):
            bounds = range_text(self.low, self.high, low_open=self.low_open,
                                high_open=self.high_open)
            raise ConfigError(f"--{flag} must be an integer{' ' if bounds else ''}{bounds}, "
                              f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class Flag:
    """The command-line flag of one setting.

    name: the flag ("" = the field's name). help: its help text. kind: absl's flag type,
    string | integer | float | bool | enum | list ("" = from the default: bool, int, float,
    str; a tuple is a list). choices: an enum's values. flag_default: the value absl's flag
    holds when it is not given, where it is not the field's default written as the flag
    reads it (a tuple of numbers as its '%g' strings). parse: the flag's value -> the field's
    (a list of numbers, ``--dp_clip``'s number or 'adaptive'); None: as it is; ``from_flat``
    reads a stored value with ``restore`` (None: lists become tuples). bounds: a number's
    range (:class:`Bounds`), checked with the choices by :func:`check_value`.

    Two Flags of one name are one declaration when they are equal as :func:`resolved` makes
    them (name, kind, the flag's default, help, choices, ...): several groups may then hold it
    (the specs that read ``--weighting``); :func:`unique` refuses two that differ.
    """

    name: str = ""
    help: str = ""
    kind: str = ""
    choices: Tuple[str, ...] = ()
    flag_default: Any = _SAME
    parse: Optional[Callable[[str, Any], Any]] = None
    restore: Optional[Callable[[Any], Any]] = None
    bounds: Optional[Bounds] = None


def setting(default: Any = dataclasses.MISSING, help: str = "", *, flag: str = "",
            kind: str = "", choices: Sequence[str] = (), flag_default: Any = _SAME,
            parse: Optional[Callable[[str, Any], Any]] = None,
            restore: Optional[Callable[[Any], Any]] = None,
            bounds: Optional[Bounds] = None) -> Any:
    """A dataclass field with this default that carries its :class:`Flag`."""
    meta = {FLAG: Flag(name=flag, help=help, kind=kind, choices=tuple(choices),
                       flag_default=flag_default, parse=parse, restore=restore, bounds=bounds)}
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


def _paths(cls: type) -> Iterator[Tuple[Tuple[str, ...], dataclasses.Field]]:
    """(path of field names, field) of every setting of `cls`, its groups' included."""
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(FLAG)
        if isinstance(meta, Flag):
            yield (f.name,), f
        elif isinstance(meta, type):
            yield from (((f.name,) + path, sub) for path, sub in _paths(meta))


def flat_paths(cls: type) -> Dict[str, Tuple[str, ...]]:
    """flag -> the path of field names that holds it, through the groups of `cls`; TypeError
    when two of its settings declare one flag (:func:`unique`)."""
    found = tuple(_paths(cls))
    unique(((f"{cls.__name__}.{'.'.join(path)}", resolved(f)) for path, f in found),
           shared=False)
    return {flag_of(f).name: path for path, f in found}


def resolved(field: dataclasses.Field) -> Flag:
    """The field's Flag as the command line declares it: its name, kind and the flag's
    default filled in."""
    return dataclasses.replace(flag_of(field), kind=kind_of(field),
                               flag_default=flag_default(field))


def declarations(cls: type) -> Tuple[Flag, ...]:
    """The :func:`resolved` Flag of every setting of the group `cls`, its groups' included
    (nested groups in place), in field order: what ``experiments/cli.py`` declares."""
    return tuple(resolved(f) for _, f in _paths(cls))


def unique(found: Iterable[Tuple[str, Flag]], *,
           shared: bool = True) -> Tuple[Tuple[str, Flag], ...]:
    """The one check of flag declarations: each flag once, as (what declared it first, its
    Flag), in order. `found`: (what declares it, e.g. "DeltaFLOptions", its resolved Flag).
    TypeError naming both when two declarations of one flag differ; with ``shared=False``
    (the settings of one configuration, each held by one field) when one flag is declared
    twice at all."""
    seen: Dict[str, Tuple[str, Flag]] = {}
    for where, flag in found:
        if flag.name not in seen:
            seen[flag.name] = (where, flag)
            continue
        first_where, first = seen[flag.name]
        if first != flag:
            differ = ", ".join(f"{k.name} {getattr(first, k.name)!r} against "
                               f"{getattr(flag, k.name)!r}" for k in dataclasses.fields(Flag)
                               if getattr(first, k.name) != getattr(flag, k.name))
            raise TypeError(f"--{flag.name} is declared differently by {first_where} and by "
                            f"{where} ({differ}); declare it once and share that declaration")
        if not shared:
            raise TypeError(f"--{flag.name} is declared twice, by {first_where} and by {where}")
    return tuple(seen.values())


def check_group(cls: type) -> Tuple[Flag, ...]:
    """The :func:`declarations` of a flat group of settings (an algorithm's options);
    TypeError unless `cls` is a frozen dataclass whose every field is a :func:`setting`."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"settings group {cls!r} must be a frozen dataclass")
    for f in dataclasses.fields(cls):
        if not isinstance(f.metadata.get(FLAG), Flag):
            raise TypeError(f"{cls.__name__}.{f.name} must be made by declared.setting() "
                            "(or a shared Option's field())")
    return declarations(cls)


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
    return (f for _, f in _paths(cls))


def _build(cls: type, read: Callable[[Flag], Any], fixed: Mapping[str, Any]) -> Any:
    """The group `cls` with each setting's value ``read(flag)`` (``_SAME``: its default) and
    each of its groups built alike; `fixed`: fields given instead."""
    kw = {}
    for f in dataclasses.fields(cls):
        sub = f.metadata.get(FLAG)
        if f.name in fixed or sub is None:
            continue
        value = _build(sub, read, {}) if isinstance(sub, type) else read(flag_of(f))
        if value is not _SAME:
            kw[f.name] = value
    return cls(**kw, **fixed)


def from_flags(cls: type, value: Callable[[str], Any], **fixed) -> Any:
    """The group `cls` from the flags (``value(flag)``: the flag's parsed value), each parsed
    by its Flag, its groups built alike; `fixed`: fields given instead."""
    def read(flag: Flag) -> Any:
        raw = value(flag.name)
        return flag.parse(flag.name, raw) if flag.parse is not None else raw
    return _build(cls, read, fixed)


def _restore(flag: Flag, value):
    if flag.restore is not None:
        return flag.restore(value)
    return tuple(value) if isinstance(value, list) else value


def from_flat(cls: type, values: Mapping[str, Any], **fixed) -> Any:
    """The group `cls` from stored settings (flag -> value, e.g. summary.json's ``config``),
    its groups' included; a flag missing there (a run written before the setting existed)
    takes its default."""
    def read(flag: Flag) -> Any:
        stored = values.get(flag.name)
        return _SAME if stored is None else _restore(flag, stored)
    return _build(cls, read, fixed)


def check_choice(flag: Flag, value: Any) -> None:
    """ConfigError naming the flag when it has choices and the value is not one of them."""
    if flag.choices and value not in flag.choices:
        raise ConfigError(f"unknown --{flag.name}={value!r}; choose one of "
                          f"{', '.join(flag.choices)}")


def check_value(flag: Flag, value: Any) -> None:
    """ConfigError naming the flag unless the value is one of its choices and in its
    :class:`Bounds` (where it declares them)."""
    check_choice(flag, value)
    if flag.bounds is not None:
        flag.bounds.check(flag.name, value)


def check_settings(obj) -> None:
    """:func:`check_value` of every setting of the flat group `obj`, in field order."""
    for f in fields_of(type(obj)):
        check_value(flag_of(f), getattr(obj, f.name))


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


def declared_models(package: str, path: Iterable[str], base: type,
                    prefix: str) -> Tuple[type, ...]:
    """The ``MODEL`` of every module of `package` (its `path`) that has one, by its
    ``position`` then its ``name``: a table of models each declared in one module (the
    availability models, the device speeds). TypeError for a declaration the table cannot
    hold: not a named subclass of `base`, two models of one name, a settings flag that does
    not start with `prefix`."""
    found = []
    for info in pkgutil.iter_modules(list(path)):
        model = getattr(importlib.import_module(f"{package}.{info.name}"), "MODEL", None)
        if model is not None:
            found.append(model)
    found.sort(key=lambda m: (getattr(m, "position", 0), getattr(m, "name", "")))
    names: Dict[str, type] = {}
    for model in found:
        if not (isinstance(model, type) and issubclass(model, base) and model.name):
            raise TypeError(f"{model!r}: MODEL must be a named subclass of {base.__name__}")
        if model.name in names:
            raise TypeError(f"models {names[model.name].__name__} and {model.__name__} share "
                            f"the name {model.name!r}")
        names[model.name] = model
        bad = [f.name for f in dataclasses.fields(model.settings)
               if flag_of(f) is None or not flag_of(f).name.startswith(prefix)]
        if bad:
            raise TypeError(f"{model.__name__}.settings: fields {bad} need a flag starting "
                            f"with --{prefix}")
    return tuple(found)


def given(settings: Any, group: type) -> bool:
    """Whether any field of the group class `group` holds, in `settings` (a group merging it,
    :func:`merged_group`), another value than its default: a merged group checks only those
    of its groups (and the chosen model's), whose defaults are valid, so that a run enters
    no module of a model it does not use."""
    return any(getattr(settings, f.name) != default_of(f) for f in dataclasses.fields(group))


def group_of(settings: Any, group: type) -> Any:
    """The group class `group` made from the same-named fields of `settings` (a group that
    merges it, :func:`merged_group`): the group's own checks run as it is made."""
    return group(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(group)})


def merged_group(name: str, module: str, doc: str, parts: Sequence[Any],
                 namespace: Optional[Mapping[str, Any]] = None) -> type:
    """A frozen dataclass `name` (of `module`) holding the settings of `parts` flat, in order:
    a part is one field, (field name, type, :func:`setting`), or a group class, which gives
    each of its fields (the availability models' groups, the device speeds'). A field that
    several groups declare alike (one name, one Flag, one default) is kept once, where it
    first appears; TypeError naming it when two declarations of one name differ. `namespace`:
    its methods (``__post_init__``, properties)."""
    fields: Dict[str, Tuple[str, Any, dataclasses.Field]] = {}
    for part in parts:
        items = ([part] if isinstance(part, tuple) else
                 [(f.name, f.type, f) for f in dataclasses.fields(part)])
        for field_name, field_type, f in items:
            if field_name in fields:
                seen = fields[field_name][2]
                if (seen.metadata.get(FLAG) != f.metadata.get(FLAG)
                        or default_of(seen) != default_of(f)):
                    raise TypeError(f"{name}.{field_name} is declared differently by two of "
                                    f"its groups; declare it once and share that declaration")
                continue
            fields[field_name] = (field_name, field_type, dataclasses.field(
                default=f.default, default_factory=f.default_factory, metadata=f.metadata))
    cls = dataclasses.make_dataclass(name, list(fields.values()), frozen=True,
                                     namespace=dict(namespace or {}, __doc__=doc))
    cls.__module__ = module
    return cls


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
