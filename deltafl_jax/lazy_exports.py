"""A package's public names imported on first use (PEP 562's module ``__getattr__``).

The package root, :mod:`deltafl_jax.run` and :mod:`deltafl_jax.report` list each public name
with the module that defines it; importing the package then imports none of them, so that a
command that only parses its flags, or a tool that reads a run's files, does not start JAX,
Flax or optax. This module imports nothing of the package."""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Dict, Sequence, Tuple


def lazy_attributes(package: str, exports: Dict[str, str],
                    public: Sequence[str]) -> Tuple[Callable, Callable]:
    """(``__getattr__``, ``__dir__``) for the package named `package`: a name of `exports`
    is read from its module on first use; any other name is a module or subpackage of the
    package (``deltafl_jax.engine``), imported on first use; each is then kept as the
    package's attribute. `public`: the package's ``__all__``."""

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        elif not name.startswith("__"):
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__
