"""Flags -> frozen configurations: one :class:`deltafl_jax.ExperimentConfig` per entry of
``--algorithm``, each group of settings built from its flags (:mod:`deltafl_jax.declared`), and
the check that every flag given on the command line is read by some method of the run."""

from __future__ import annotations

import dataclasses
import os
from typing import List, Sequence, Tuple

from absl import flags

from deltafl_jax import declared
from deltafl_jax.errors import ConfigError, UsageError
from experiments.command import COMMAND_LINE

FLAGS = flags.FLAGS


floats, ints = declared.floats, declared.ints


def _value(flag: str):
    return FLAGS[flag].value


def data_config_from_flags():
    from deltafl_jax import DataConfig
    return declared.from_flags(DataConfig, _value)


def config_from_flags(algorithm: str = None, beside_others: bool = False,
                      server_optimizer: str = None):
    """The frozen experiment configuration described by the flags (for `algorithm`, default
    the first of --algorithm), with the options that its spec declares. `beside_others`: the
    method runs with others (several --algorithm), so a spec whose sweep is fixed (FedAvg:
    theta = 1) does not read the values of that sweep's flag, which are the others' grid.
    `server_optimizer`: this method's own (an entry NAME+OPTIMIZER), at --server_lr; "" for the
    plain step (sgd at learning rate 1); None: --server_optimizer and --server_lr."""
    from deltafl_jax import ExperimentConfig
    from deltafl_jax.algorithms import registry
    from deltafl_jax.run.config import GROUPS
    if algorithm is None:   # the first entry of --algorithm (NAME or NAME+OPTIMIZER)
        _, algorithm, named = method_entries(FLAGS.algorithm)[0]
        server_optimizer = named or server_optimizer
    name = algorithm
    spec = registry.find(name)   # None: ExperimentConfig names the unknown algorithm
    sweeps = {s.flag: (ints if s.integer else floats)(s.flag, FLAGS[s.flag].value)
              for s in registry.sweeps()}
    if beside_others and spec is not None and spec.grid.fixed_sweep:
        sweeps.pop(spec.sweep.flag, None)
    options = {f: FLAGS[f].value for f in (spec.option_flags() if spec is not None else ())}
    groups = {where: declared.from_flags(cls, _value) for where, cls in GROUPS}
    if server_optimizer is not None:
        server = groups["server"]
        groups["server"] = dataclasses.replace(
            server, name=server_optimizer or "sgd",
            learning_rates=server.learning_rates if server_optimizer else (1.0,))
    return ExperimentConfig(data=data_config_from_flags(), algorithm=name, options=options,
                            sweeps=sweeps, **groups)


def method_entries(entries: Sequence[str]) -> List[Tuple[str, str, str]]:
    """(entry, algorithm, server optimizer) of each --algorithm entry NAME, NAME+OPTIMIZER,
    NAME+LAYER or NAME+LAYER+OPTIMIZER ("" when the entry names no optimizer; the algorithm is
    NAME+LAYER with a layer, e.g. deltafl+ditto); UsageError for an empty, repeated or
    malformed entry, ConfigError for a layer that cannot go over NAME."""
    from deltafl_jax.algorithms import registry
    from deltafl_jax.optimizers.server import NAMES
    names = [a.strip() for a in entries]
    if not names or any(not a for a in names):
        raise UsageError(f"--algorithm must name at least one method, got "
                         f"{','.join(entries)!r}")
    if len(set(names)) != len(names):
        raise UsageError(f"--algorithm lists a method twice: {','.join(names)}")
    out = []
    for entry in names:
        name, *mods = entry.split("+")
        layers = [m for m in mods if m in registry.LAYERS]
        optimizers = [m for m in mods if m in NAMES]
        if len(layers) > 1 or len(optimizers) > 1 or len(layers) + len(optimizers) != len(mods):
            raise UsageError(f"--algorithm entry {entry!r}: after '+' come at most one layer "
                             f"({', '.join(registry.layers())}) and one server optimizer "
                             f"({', '.join(NAMES)})")
        algorithm = "+".join([name] + layers)
        try:
            if layers:
                registry.get(algorithm)
        except ConfigError as e:   # a layer over itself (ditto+ditto)
            raise UsageError(f"--algorithm entry {entry!r}: {e}") from None
        out.append((entry, algorithm, optimizers[0] if optimizers else ""))
    return out


def configs_from_flags() -> List:
    """One configuration per entry of --algorithm. With several, each writes into
    <output_dir>/<entry>/, and a method whose sweep is fixed ignores that sweep's flag
    (FedAvg ignores --thetas, which then sets Delta-FL's levels and FedAvg-Sub's client
    counts).

    An entry NAME+OPTIMIZER (``fedavg+adam``) trains NAME with that server optimizer at
    --server_lr; when the list has such entries, the entries without one take the plain step
    (sgd at learning rate 1), so that one command compares FedAvg with FedAdam, and
    --server_optimizer is not given."""
    entries = method_entries(FLAGS.algorithm)
    named = any(opt for _, _, opt in entries)
    if named and FLAGS["server_optimizer"].present:
        raise UsageError("--server_optimizer cannot be combined with --algorithm entries that "
                         "name their server optimizer (NAME+OPTIMIZER); name it in each entry")
    if len(entries) == 1:
        _, name, optimizer = entries[0]
        configs = [config_from_flags(name, server_optimizer=optimizer or None)]
        check_flags_read(configs)
        return configs
    configs = []
    for entry, name, optimizer in entries:
        config = config_from_flags(name, beside_others=True,
                                   server_optimizer=optimizer if named else None)
        if config.output.output_dir:
            config = dataclasses.replace(config, output_dir=os.path.join(config.output.output_dir,
                                                                         entry))
        configs.append(config)
    check_flags_read(configs)
    return configs


def check_flags_read(configs) -> None:
    """UsageError naming a flag given on the command line that no method of the run reads: an
    option or a swept value of another algorithm, or a server optimizer's setting that none of
    the run's server optimizers reads. A flagfile may set flags for other methods (it is often
    run with another --algorithm)."""
    from deltafl_jax.algorithms import registry
    from deltafl_jax.optimizers.server import READS
    methods = ", ".join(c.method for c in configs)
    read = {f for c in configs for f in registry.get(c.algorithm).reads()}
    own = sorted({f for name in registry.names() for f in registry.get(name).reads()})
    for flag in own:
        if flag in COMMAND_LINE and flag not in read:
            users = [n for n in registry.names() if flag in registry.get(n).reads()]
            raise UsageError(f"--{flag} is read by --algorithm={','.join(users)}, not by "
                             f"{methods}")
    used = {f for c in configs for f in c.server.reads()}
    for flag in sorted({f for reads in READS.values() for f in reads}):
        if flag in COMMAND_LINE and flag not in used:
            users = [n for n, reads in READS.items() if flag in reads]
            raise UsageError(f"--{flag} is read by --server_optimizer={','.join(users)}, not by "
                             f"the server step of {methods}")
