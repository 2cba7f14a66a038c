"""The command-line layer shared by ``experiments.run``, ``experiments.tune`` and
``data_prep.prepare``: flag declarations, flags -> frozen configs, one-line errors (exit 2).

Library code never reads flags: each command calls :func:`define_data_flags` /
:func:`define_experiment_flags`, parses with :func:`parse_flags_or_fail`, and turns the flags
into a :class:`deltafl_jax.ExperimentConfig` with :func:`config_from_flags`. The flags of an
algorithm's swept hyper-parameters and of its options come from its spec
(:mod:`deltafl_jax.algorithms.registry`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import sys
from typing import List, Sequence, Tuple

from absl import flags

from deltafl_jax import declared
from deltafl_jax.errors import UsageError

FLAGS = flags.FLAGS
HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def fail(message: str) -> None:
    """One line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


COMMAND_LINE: set = set()   # the flags given on the command line itself (not by a flagfile)


FLAGFILE_HELP = ("--flagfile=FILE reads flags from FILE, one --flag=value a line (# starts a "
                 "comment);\nflags after it on the command line override the file's.")


def usage(program: str) -> str:
    """The usage lines of ``python -m experiments.NAME --help``: the command's own example
    line(s) from its module docstring when it is the running program, else a generic line,
    and how --flagfile works."""
    name = os.path.splitext(os.path.basename(program))[0]
    module = f"experiments.{name}"
    doc = getattr(sys.modules.get("__main__"), "__doc__", None) or ""
    lines = [line.strip() for line in doc.splitlines()
             if line.strip().startswith(f"python -m {module} ")]
    if not lines:
        lines = [f"python -m {module} [--flagfile=FILE] [--flag=value ...]"]
    return "\n".join(["usage: " + lines[0]] + ["       " + line for line in lines[1:]]
                     + ["", FLAGFILE_HELP])


def parse_flags_or_fail(argv):
    """absl's flag parsing; --help prints the flags and exits 0, a bad flag or a missing
    flagfile is one line and exit code 2."""
    COMMAND_LINE.clear()
    COMMAND_LINE.update(a.lstrip("-").split("=", 1)[0] for a in argv[1:] if a.startswith("--"))
    if any(a in HELP_FLAGS for a in argv[1:]):
        modules = [m for m in FLAGS.flags_by_module_dict() if not m.startswith("absl")]
        print(usage(argv[0]) + "\n\n" + "\n\n".join(FLAGS.module_help(m) for m in modules),
              flush=True)
        sys.exit(0)
    try:
        return FLAGS(argv)
    except flags.Error as e:
        text = str(e).splitlines()[0] if str(e) else "bad flags"
        fail(text.replace("ERROR:: ", "").strip())


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


def _define_privacy_flags() -> None:
    """Client-level differential privacy and client sampling (deltafl_jax.privacy;
    docs/guides/privacy.md)."""
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
    _define_privacy_flags()
    _define_placement_flags()
    _define_device_flags()
    _define_evaluation_flags()
    _define_personal_flags()
    _define_output_flags()


def import_model_module() -> None:
    """--model_module: import the module (a dotted name, or a path to a .py file) whose
    ``deltafl_jax.register_model`` calls make its models available to --model; once per
    process. UsageError (one line) when it cannot be imported."""
    name = FLAGS.model_module
    if not name:
        return
    try:
        if name.endswith(".py") or os.sep in name:
            path = os.path.abspath(name)
            if not os.path.isfile(path):
                raise UsageError(f"--model_module={name}: no such file")
            key = "deltafl_model_module_" + hashlib.sha1(path.encode()).hexdigest()[:12]
            if key in sys.modules:
                return
            spec = importlib.util.spec_from_file_location(key, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[key]
                raise
        else:
            importlib.import_module(name)
    except UsageError:
        raise
    except Exception as e:  # pylint: disable=broad-except
        first = (str(e).strip().splitlines() or [""])[0]
        raise UsageError(f"--model_module={name} cannot be imported ({type(e).__name__}: "
                         f"{first})") from None


def start_backend() -> None:
    """What must happen before JAX starts its backend: XLA flags and joining a distributed
    run. Raises ConfigError when the run cannot be joined."""
    if FLAGS.deterministic:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_deterministic_ops=true").strip()
    if FLAGS.distributed:
        from deltafl_jax.run import distributed
        distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes,
                               FLAGS.process_id, FLAGS.distributed_timeout_s)
    else:   # --devices=D > 1 on a CPU: D host devices
        from deltafl_jax.engine.mesh import host_device_flags
        os.environ["XLA_FLAGS"] = host_device_flags(os.environ.get("XLA_FLAGS", ""),
                                                    FLAGS.devices)


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
    from deltafl_jax.config import GROUPS
    if algorithm is None:   # the first entry of --algorithm (NAME or NAME+OPTIMIZER)
        _, algorithm, named = method_entries(FLAGS.algorithm)[0]
        server_optimizer = named or server_optimizer
    name = algorithm
    spec = registry.find(name)   # None: ExperimentConfig names the unknown algorithm
    sweeps = {s.flag: (ints if s.integer else floats)(s.flag, FLAGS[s.flag].value)
              for s in registry.sweeps() if s.flag != "thetas"}
    thetas = floats("thetas", FLAGS.thetas)
    if beside_others and spec is not None and spec.fixed_sweep:
        if spec.sweep.flag == "thetas":
            thetas = ()
        sweeps.pop(spec.sweep.flag, None)
    options = {f: FLAGS[f].value for f in (spec.option_flags() if spec is not None else ())}
    groups = {where: declared.from_flags(cls, _value) for where, cls in GROUPS}
    if server_optimizer is not None:
        server = groups["server"]
        groups["server"] = dataclasses.replace(
            server, name=server_optimizer or "sgd",
            learning_rates=server.learning_rates if server_optimizer else (1.0,))
    return ExperimentConfig(data=data_config_from_flags(), algorithm=name, options=options,
                            thetas=thetas, sweeps=sweeps, **groups)


def method_entries(entries: Sequence[str]) -> List[Tuple[str, str, str]]:
    """(entry, algorithm, server optimizer) of each --algorithm entry NAME, NAME+OPTIMIZER,
    NAME+LAYER or NAME+LAYER+OPTIMIZER ("" when the entry names no optimizer; the algorithm is
    NAME+LAYER with a layer, e.g. deltafl+ditto); UsageError for an empty, repeated or
    malformed entry."""
    from deltafl_jax.algorithms import registry
    from deltafl_jax.server_optimizer import NAMES
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
        out.append((entry, "+".join([name] + layers), optimizers[0] if optimizers else ""))
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
        if config.output_dir:
            config = dataclasses.replace(config, output_dir=os.path.join(config.output_dir,
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
    from deltafl_jax.server_optimizer import READS
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
