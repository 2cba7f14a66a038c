"""How a report names a method: the column names of the papers' style ('q-FFL, q = 10',
'Δ-FL, θ = 0.5', 'FedAdam, η_s = 0.03'), from a replica label, the algorithm's spec and the
run's configuration as summary.json stores it."""

from __future__ import annotations

import math
from typing import Any, List, Mapping, Optional, Tuple

from deltafl_jax.optimizers.server import DISPLAY as SERVER_DISPLAY
from deltafl_jax.optimizers.server import SYMBOLS as SERVER_SYMBOLS
from deltafl_jax.optimizers.server import ServerOptimizer, from_run_config
from deltafl_jax.replicas.labels import ReplicaLabel

# How the platform's replica coordinates read in a report column.
PLATFORM_SYMBOLS = {"server_lr": "η_s", "dp_target_epsilon": "ε", "dp_noise_multiplier": "z"}

# How the literature names a method with a server optimizer, by the method's report column:
# FedAvg (and Delta-FL at theta = 1, which is FedAvg) with momentum is Hsu et al.'s FedAvgM,
# with the adaptive steps Reddi et al.'s FedAdam, FedYogi, FedAdagrad.
SERVER_NAMES = {"FedAvg": {"momentum": "FedAvgM", "adam": "FedAdam", "yogi": "FedYogi",
                           "adagrad": "FedAdagrad"}}


def _g(v) -> str:
    return "∞" if float(v) == math.inf else f"{float(v):g}"


def label_parts(display_name: str, label: ReplicaLabel,
                symbols: Optional[Mapping[str, str]] = None) -> List[str]:
    """A report column name in parts: 'display_name, symbol = value' of the swept coordinate,
    then 'symbol = value' for each further coordinate (``label.extra``). `symbols` maps a
    coordinate (``theta``, a flag) to its symbol; theta reads as θ, any other name as itself."""
    symbols = {"theta": "θ", **dict(symbols or {})}
    name, value = label.swept()
    return ([f"{display_name}, {symbols.get(name, name)} = {_g(value)}"]
            + [f"{symbols.get(k, k)} = {_g(v)}" for k, v in label.extra])


def method_name(spec, label: ReplicaLabel, run_config: Optional[Mapping[str, Any]] = None) -> str:
    """The report's column name of a replica label of `spec` (an
    :class:`~deltafl_jax.algorithms.spec.AlgorithmSpec`), in the papers' style ('q-FFL, q = 10',
    'Δ-FL, θ = 0.5'); further coordinates follow as 'symbol = value'. `run_config`: the run's
    configuration as summary.json stores it (its options may name the column)."""
    symbols = {s.coordinate: s.symbol for s in spec.sweeps() if s.symbol}
    parts = label_parts(spec.display_name, label, {**symbols, **PLATFORM_SYMBOLS})
    if not spec.reporting.names_value:
        parts[0] = spec.display_name
    if spec.reporting.column_name is not None:
        parts[0] = spec.reporting.column_name(label, spec.stored_options(run_config), parts[0])
    return ", ".join(_server_parts(parts, run_config) + _dp_parts(label, run_config))


def _server_parts(parts: List[str], run_config) -> List[str]:
    """The column's parts with the run's server step named (nothing for the plain step
    w + Delta): the optimizer after the swept value ("Δ-FL, θ = 0.5, server Adam"), or
    the literature's name of the method with it ("FedAdam": :data:`SERVER_NAMES`), then
    its learning rate η_s unless the label names it (a sweep), and its settings that
    differ from the defaults ("τ = 0.01")."""
    server = from_run_config(dict(run_config or {}))
    if server.is_default:
        return parts
    named = SERVER_NAMES.get(parts[0], {}).get(server.name)
    head = [named or parts[0]]
    if named is None and server.name != "sgd":
        head.append(f"server {SERVER_DISPLAY[server.name]}")
    lrs = server.learning_rates
    defaults = dict(ServerOptimizer(name=server.name).settings())
    settings = [f"{SERVER_SYMBOLS[f]} = {_g(v)}" for f, v in server.settings()
                if v != defaults[f]]
    return (head + ([f"η_s = {_g(lrs[0])}"] if len(lrs) == 1 else []) + settings
            + parts[1:])


def _dp_parts(label: ReplicaLabel, run_config) -> List[str]:
    """A private run's DP value when its label does not name it (one value): 'ε = 8' (the
    target) or 'z = 1.1'."""
    config = dict(run_config or {})
    if config.get("dp_clip") is None:
        return []
    flag = "dp_target_epsilon" if config.get("dp_target_epsilon") else "dp_noise_multiplier"
    values = config.get(flag) or (0.0,)
    if len(values) == 1 and flag not in dict(label.extra):
        return [f"{PLATFORM_SYMBOLS[flag]} = {_g(values[0])}"]
    return []


# --------------------------------------------------------------------------------------------
# The order of a report's methods (its tables' columns, its figures' panels and legends, the
# leaderboard's figure): FedAvg first, the reference every method is compared with (the
# ``fedavg`` spec, and any column its spec names as FedAvg: Δ-FL at θ = 1 is FedAvg bit for
# bit), then the methods in the registry's order (``registry.SPECS``: Δ-FL, FedAvg-Sub,
# FedProx, q-FFL, AFL-q-FFL, AFL, TERM, Δ-FL (alt), SCAFFOLD, Ditto, FedDyn, APFL, GIFAIR-FL,
# FedMGDA+, DRFA, PropFair), a layered method (``deltafl+ditto``) right after its base; an
# algorithm that is not registered comes last. Columns of one method keep their run's order
# (the sort that uses the key is stable).

FEDAVG = "fedavg"


def is_fedavg(algorithm: str, label: Optional[ReplicaLabel] = None) -> bool:
    """Whether a method (a column `label` of `algorithm`, or the algorithm itself) is FedAvg,
    as its spec names it: the ``fedavg`` spec, or a column named by its spec's
    ``reporting.column_name`` as the ``fedavg`` spec's display name (Δ-FL at θ = 1)."""
    from deltafl_jax.algorithms import registry
    if algorithm == FEDAVG:
        return True
    spec = registry.find(algorithm)
    if spec is None or label is None or spec.reporting.column_name is None:
        return False
    return (spec.reporting.column_name(label, spec.options_type(), spec.display_name)
            == registry.SPECS[FEDAVG].display_name)


def method_order(algorithm: str, label: Optional[ReplicaLabel] = None) -> Tuple[int, int, int]:
    """The sort key of a method in reports (see above): (0 for FedAvg else 1, the base
    algorithm's index in the registry, 1 for a layered method else 0)."""
    from deltafl_jax.algorithms import registry
    base, plus, _ = algorithm.partition("+")
    names = list(registry.SPECS)
    index = names.index(base) if base in names else len(names)
    return (0 if is_fedavg(algorithm, label) else 1, index, 1 if plus else 0)
