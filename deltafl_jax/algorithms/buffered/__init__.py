"""The buffered asynchronous rules, one module each, and the list the registry reads.

A rule module exports ``SPEC``, an :class:`~deltafl_jax.algorithms.spec.AlgorithmSpec` whose
``asynchronous`` field holds its :class:`~deltafl_jax.asynchronous.rule.AsyncStep`
(:func:`~deltafl_jax.algorithms.buffered.spec.rule_spec` writes the shared fields), and
``POSITION``, its place in ``--help`` and the flag reference. The package finds the modules
itself (:data:`SPECS`), so adding a rule is one file (docs/guides/asynchronous.md, "Adding an
asynchronous rule"). The shipped rules: FedBuff (:mod:`.fedbuff`), FedAsync
(:mod:`.fedasync`), FedBuff in FedScale's form (:mod:`.fedscale`) and Delta-FL under
buffered asynchrony (:mod:`.deltafl_buffered`); what they share (the events, the ring of
versions, the server step, the host side) is :mod:`deltafl_jax.asynchronous`.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Tuple

from deltafl_jax.algorithms.spec import AlgorithmSpec


def discover(package: str, path) -> Tuple[AlgorithmSpec, ...]:
    """The ``SPEC`` of every module of `package` (its `path`) that has one, by ``POSITION``
    then name; TypeError for a SPEC that is not an asynchronous spec."""
    found = []
    for info in pkgutil.iter_modules(path):
        module = importlib.import_module(f"{package}.{info.name}")
        spec = getattr(module, "SPEC", None)
        if spec is None:
            continue
        if not isinstance(spec, AlgorithmSpec) or spec.asynchronous is None:
            raise TypeError(f"{package}.{info.name}.SPEC must be an AlgorithmSpec with "
                            "asynchronous set (a buffered rule)")
        found.append((getattr(module, "POSITION", 1000), spec.name, spec))
    return tuple(spec for _, _, spec in sorted(found, key=lambda f: f[:2]))


SPECS = discover(__name__, __path__)
