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


def define_data_flags() -> None:
    """The flags of :class:`deltafl_jax.DataConfig` (idempotent)."""
    _define(flags.DEFINE_string, "dataset", "synthetic", "synthetic | gaussian_toy | npz | "
            "shakespeare | sent140 | femnist | stackoverflow")
    _define(flags.DEFINE_string, "data_path", None, "npz file, or the raw source of a real "
            "dataset")
    _define(flags.DEFINE_string, "data_dir", None, "prepared-dataset cache; unset: "
            "$DELTAFL_DATA or ~/.cache/deltafl_jax")
    _define(flags.DEFINE_integer, "data_seed", 0, "seed of data generation and of the "
            "train/test split")
    _define(flags.DEFINE_integer, "min_client_examples", None, "keep clients with at least "
            "this many examples; unset: the dataset's paper value")
    _define(flags.DEFINE_integer, "max_examples_per_client", None, "keep each client's first N "
            "examples")
    _define(flags.DEFINE_integer, "max_train_clients", None, "keep a seeded subset of the "
            "train clients")
    _define(flags.DEFINE_integer, "max_test_clients", None, "keep a seeded subset of the test "
            "clients")
    _define(flags.DEFINE_float, "synthetic_alpha", 1.0, "Synthetic(alpha, beta): model "
            "heterogeneity")
    _define(flags.DEFINE_float, "synthetic_beta", 1.0, "Synthetic(alpha, beta): feature "
            "heterogeneity")
    _define(flags.DEFINE_integer, "synthetic_num_clients", 100, "Synthetic: clients, half "
            "train half test")
    _define(flags.DEFINE_integer, "synthetic_max_examples", 1000, "Synthetic: cap of the "
            "client sizes")
    _define(flags.DEFINE_float, "synthetic_shared", 0.0, "Synthetic: weight in [0, 1) of the "
            "labelling model shared by all clients (0 = the original benchmark)")
    _define(flags.DEFINE_bool, "synthetic_on_demand", None, "Synthetic: generate each client "
            "when a round or an evaluation reads it (its own random stream); unset: above "
            "100000 clients")
    _define(flags.DEFINE_string, "toy_means", "0,0;4,0;1,1", "gaussian_toy: means "
            "'x,y;x,y;...'")
    _define(flags.DEFINE_integer, "toy_examples_per_client", 500, "gaussian_toy: samples per "
            "client")
    _define(flags.DEFINE_float, "writer_fraction", 0.5, "femnist: fraction of the eligible "
            "writers kept (the paper: 0.5; 1.0 keeps them all)")
    _define(flags.DEFINE_bool, "resample_writers_per_seed", False, "redraw the data (femnist's "
            "writer subsample; every dataset's train/test split) from each seed, as the "
            "authors do; each seed then runs as its own program into <output_dir>/seed_<s>/")
    _define(flags.DEFINE_enum, "normalize", "none", "float inputs: none | reference (the "
            "authors' code: (x - mu) / mu per feature, mu the mean of each split's own "
            "examples) | standard (z-scores with the training statistics); sent140: of the "
            "mean GloVe vectors (sent140_linear)", enum_values=["none", "reference", "standard"])


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
    """The client optimizer (deltafl_jax.client_optimizer): one flag per field, its help
    written once there."""
    from deltafl_jax.client_optimizer import FIELDS, HELP, NAMES, ClientOptimizer
    d = ClientOptimizer()
    _define(flags.DEFINE_enum, "client_optimizer", d.name, HELP["client_optimizer"],
            enum_values=list(NAMES))
    for flag, field in FIELDS.items():
        _define(flags.DEFINE_float, flag, getattr(d, field), HELP[flag])


def _define_privacy_flags() -> None:
    """Client-level differential privacy (deltafl_jax.privacy; docs/guides/privacy.md)."""
    from deltafl_jax.privacy import Privacy
    d = Privacy()
    _define(flags.DEFINE_string, "dp_clip", None, "client-level DP (DP-FedAvg): clip each "
            "client's update to this L2 norm C; 'adaptive': a clip per replica that follows "
            "the --dp_clip_quantile of the update norms (Andrew et al. 2021); unset: not "
            "private")
    _define(flags.DEFINE_float, "dp_clip_init", 0.1, "--dp_clip=adaptive: the initial clip "
            "C_0")
    _define(flags.DEFINE_float, "dp_clip_quantile", d.clip_quantile, "--dp_clip=adaptive: the "
            "target quantile gamma of the update norms (the fraction left unclipped)")
    _define(flags.DEFINE_float, "dp_clip_lr", d.clip_lr, "--dp_clip=adaptive: eta_C of the "
            "geometric step C <- C exp(-eta_C (b - gamma))")
    _define(flags.DEFINE_float, "dp_clip_count_noise", d.clip_count_noise, "--dp_clip=adaptive:"
            " the noise std of the unclipped count, relative to z (accounted)")
    _define(flags.DEFINE_enum, "dp_kept_weight", d.kept_weight, "private Delta-FL: divide the "
            "noised update by the kept weight released with noise (noised) or by its "
            "expectation theta m, fixed and not released (expected)",
            enum_values=["noised", "expected"])
    _define(flags.DEFINE_enum, "dp_mechanism", d.mechanism, "gaussian: independent noise each "
            "round | bandmf: DP-FTRL's banded matrix factorisation (correlated noise; needs "
            "--client_sampling=cyclic)", enum_values=["gaussian", "bandmf"])
    _define(flags.DEFINE_integer, "dp_bands", None, "--dp_mechanism=bandmf: the bands b of "
            "the Toeplitz strategy (each replica keeps b - 1 noise vectors); unset: min(G, "
            "rounds), G = N // m")
    _define(flags.DEFINE_enum, "dp_accountant", None, "pld | rdp: dp-accounting's accountant; "
            "unset: rdp with --client_sampling=fixed (replace-one), pld with poisson "
            "(add-or-remove)", enum_values=["pld", "rdp"])
    _define(flags.DEFINE_list, "dp_noise_multiplier", ["0"], "z: the server adds N(0, (z C "
            "a_max)^2) to the sum of the clipped updates; several values train as replicas")
    _define(flags.DEFINE_list, "dp_target_epsilon", [], "epsilon at --dp_delta after the run's "
            "rounds, each value calibrated to a z before the run (inf: no noise); several "
            "values train as replicas; instead of --dp_noise_multiplier")
    _define(flags.DEFINE_float, "dp_delta", None, "delta of the accounting; unset: 1 / N^1.1 "
            "with N the training clients")
    _define(flags.DEFINE_float, "dp_quantile_noise_ratio", d.quantile_noise_ratio, "private "
            "Delta-FL: the noise multiplier of each secure sum of its quantile, relative to z")
    _define(flags.DEFINE_float, "dp_loss_bound", d.loss_bound, "private Delta-FL: the losses "
            "are clipped to [0, B] for the quantile's secure sums")
    _define(flags.DEFINE_float, "dp_mm_floor", d.mm_floor, "private Delta-FL: the MM weights "
            "are 1 / max(|F_k - mu|, xi), which bounds their sensitivity")


def _define_server_flags() -> None:
    """The server optimizer (deltafl_jax.server_optimizer; Reddi et al. 2021, Algorithm 2)."""
    from deltafl_jax.server_optimizer import NAMES, ServerOptimizer
    d = ServerOptimizer()
    _define(flags.DEFINE_enum, "server_optimizer", d.name, "the server step on the pseudo-"
            "gradient -Delta: sgd (w + eta Delta; eta = 1: the plain average) | momentum "
            "(FedAvgM) | adam (FedAdam) | yogi (FedYogi) | adagrad (FedAdagrad), as Reddi et al. "
            "2021, Algorithm 2", enum_values=list(NAMES))
    _define(flags.DEFINE_list, "server_lr", [f"{v:g}" for v in d.learning_rates], "server "
            "learning rate eta; several values train as replicas of one program")
    _define(flags.DEFINE_float, "server_momentum", d.momentum, "momentum: beta of v <- beta v + "
            "Delta")
    _define(flags.DEFINE_float, "server_beta1", d.beta1, "adam / yogi / adagrad: beta1 of the "
            "first moment")
    _define(flags.DEFINE_float, "server_beta2", d.beta2, "adam / yogi: beta2 of the second "
            "moment")
    _define(flags.DEFINE_float, "server_eps", d.eps, "adam / yogi / adagrad: tau, added to "
            "sqrt(v) (and v_{-1} = tau^2)")


def _define_device_flags() -> None:
    """Where the rounds run: devices, processes, determinism."""
    _define(flags.DEFINE_integer, "devices", None, "devices that share each round's client "
            "work (one mesh axis); unset: every local device (and every process's, with "
            "--distributed); 1: one device, no collectives")
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
    _define(flags.DEFINE_string, "model", "linear", "linear | cnn | mlp | mean | gru | lstm | "
            "sent140_linear | lstm_nwp, or a model of your own registered by --model_module")
    _define(flags.DEFINE_string, "model_module", None, "a Python module (a dotted name, or a "
            "path to a .py file) imported before the run, whose deltafl_jax.register_model "
            "calls add models for --model (docs/guides/own-model.md)")
    _define(flags.DEFINE_bool, "use_bias", None, "linear and sent140_linear: add a bias b "
            "(L2 then applies to it too); unset: no bias on femnist and sent140 (the papers' "
            "w in R^{62x784}, w in R^50), a bias on every other dataset")
    _define(flags.DEFINE_string, "conv_impl", None, "cnn convolutions: im2col_wgrad (CPU) | "
            "xla; unset: by backend")
    _define(flags.DEFINE_list, "algorithm", ["deltafl"], "one or more of "
            f"{', '.join(registry.names())}; several run one after another into "
            "<output_dir>/<algorithm>/; an entry NAME+OPTIMIZER (fedavg+adam) runs NAME with "
            "that server optimizer at --server_lr, and then the entries without one take the "
            "plain step (sgd, learning rate 1)")
    _define_option_flags()
    _define(flags.DEFINE_list, "seeds", ["1"], "seeds; each seeds sampling, shuffling and "
            "initialisation")
    _define_sweep_flags()
    _define_server_flags()
    _define_client_flags()
    _define_privacy_flags()
    _define(flags.DEFINE_integer, "num_rounds", 100, "communication rounds")
    _define(flags.DEFINE_integer, "clients_per_round", 10, "m, clients sampled per round "
            "(poisson: expected)")
    _define(flags.DEFINE_enum, "client_sampling", "fixed", "fixed: m distinct clients drawn "
            "uniformly each round | poisson: each client joins a round independently with "
            "probability q = m / N (DP's add-or-remove accounting) | cyclic: G = N // m fixed "
            "groups of m, round t trains group t mod G (DP-FTRL's participation)",
            enum_values=["fixed", "poisson", "cyclic"])
    _define(flags.DEFINE_integer, "local_epochs", 1, "local epochs of minibatch SGD per kept "
            "client")
    _define(flags.DEFINE_integer, "local_steps", None, "local SGD steps instead of epochs")
    _define(flags.DEFINE_integer, "batch_size", 10, "local minibatch size")
    _define(flags.DEFINE_float, "learning_rate", 0.1, "client learning rate gamma_0")
    _define(flags.DEFINE_float, "lr_decay", 1.0, "divide the learning rate by this every "
            "lr_decay_every rounds (>= 1)")
    _define(flags.DEFINE_integer, "lr_decay_every", 0, "rounds between learning-rate decays "
            "(0: constant)")
    _define(flags.DEFINE_list, "l2_reg", ["0"], "lambda: local steps w <- (1 - lr lambda) w - "
            "lr grad, and F_k includes (lambda/2)||w||^2; one value, or one per swept value "
            "(e.g. per theta of --thetas)")
    _define(flags.DEFINE_integer, "clients_per_step", None, "client lanes trained at once "
            "(1: one client at a time; m: all sampled clients vmapped); unset: by model and "
            "backend")
    _define_device_flags()
    _define(flags.DEFINE_integer, "eval_chunk", None, "examples per evaluation work item; "
            "unset: by model and backend")
    _define(flags.DEFINE_string, "placement_backend", None, "cpu | gpu | tpu: choose the "
            "lanes, lane mode, evaluation chunk and lanes, loop body and convolutions as on this "
            "backend (gpu on a CPU runs the accelerator's program); unset: the backend running")
    _define(flags.DEFINE_bool, "branchless", None, "local SGD: a lane's restart and a job's "
            "bookkeeping as masked selects on every step instead of behind a lax.cond; unset: "
            "by backend")
    _define(flags.DEFINE_string, "client_data", "auto", "device | host | auto: keep the "
            "clients' examples on every device, or on the host and ship each round's sampled "
            "clients; auto: device while both splits fit in a quarter of a device's memory")
    _define(flags.DEFINE_integer, "eval_clients", None, "evaluate K train and K test clients "
            "drawn per evaluation, with 95% confidence intervals (0: every client); unset: every "
            "client up to 100000 clients in all, 1000 beyond")
    _define(flags.DEFINE_float, "target_accuracy", 0.5, "test_share_below_target: the share "
            "of test clients whose accuracy is below this (classifiers; in (0, 1])")
    _define(flags.DEFINE_integer, "eval_every", 10, "evaluate on all train and test clients "
            "every N rounds")
    _define(flags.DEFINE_float, "client_holdout", 0.0, "personalised evaluation: every "
            "client keeps this fraction of its examples (at least one) as its own held-out "
            "data; seen clients (their personal or the global model) and unseen devices (after "
            "--finetune_steps on the rest) are evaluated on it; 0: none")
    _define(flags.DEFINE_list, "finetune_steps", ["0"], "with --client_holdout: adaptation "
            "steps of each evaluated client on its own data before its held-out evaluation "
            "(the algorithm's adaptation: plain fine-tuning, or Ditto's proximal steps); "
            "several values: one evaluation each (metrics unseen_ft<k>_*)")
    _define(flags.DEFINE_float, "finetune_lr", None, "learning rate of the adaptation steps; "
            "unset: each replica's client learning rate of the last round")
    _define(flags.DEFINE_string, "output_dir", None, "where metrics.jsonl, summary.json and "
            "models/ go")
    _define(flags.DEFINE_bool, "overwrite", False, "replace the run already in --output_dir "
            "(a folder that is not a run of deltafl_jax is refused, with or without it)")
    _define(flags.DEFINE_bool, "save_models", True, "save the final model of every replica")
    _define(flags.DEFINE_integer, "checkpoint_every", 0, "save a checkpoint every N rounds "
            "under <output_dir>/checkpoints/ (0: by time only)")
    _define(flags.DEFINE_float, "checkpoint_every_s", 120.0, "save a checkpoint when this many "
            "seconds have passed since the last one (0: by rounds only); a paper run loses at "
            "most this plus one round when killed")
    _define(flags.DEFINE_bool, "stop_on_divergence", False, "stop a replica whose mean training "
            "loss is NaN or above 3x its value at w_0 (the reference code's rule); the others "
            "go on")
    _define(flags.DEFINE_enum, "tensorboard", "auto", "write TensorBoard event files under "
            "<output_dir>/tb/ (auto: when tensorboardX is installed)",
            enum_values=["auto", "yes", "no"])


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


def floats(name: str, values: Sequence[str]) -> Tuple[float, ...]:
    try:
        return tuple(float(v) for v in values)
    except ValueError:
        raise UsageError(f"--{name} must be a comma-separated list of numbers, got "
                         f"{','.join(values)!r}") from None


def ints(name: str, values: Sequence[str]) -> Tuple[int, ...]:
    try:
        return tuple(int(v) for v in values)
    except ValueError:
        raise UsageError(f"--{name} must be a comma-separated list of integers, got "
                         f"{','.join(values)!r}") from None


def clip_flag(value):
    """--dp_clip: None, 'adaptive' or a number."""
    if value is None or value.strip() == "adaptive":
        return None if value is None else "adaptive"
    try:
        return float(value)
    except ValueError:
        raise UsageError(f"--dp_clip must be a number C > 0 or 'adaptive', got {value!r}") \
            from None


def _toy_means(text):
    try:
        means = tuple(tuple(float(v) for v in pair.split(",")) for pair in text.split(";")
                      if pair.strip())
    except ValueError:
        raise UsageError(f"--toy_means must look like '0,0;4,0;1,1', got {text!r}") from None
    if len(means) < 2 or any(len(m) != 2 for m in means):
        raise UsageError(f"--toy_means must list at least two x,y pairs, got {text!r}")
    return means


DATA_FIELDS = ("dataset", "data_path", "data_dir", "data_seed", "min_client_examples",
               "max_examples_per_client", "max_train_clients", "max_test_clients",
               "synthetic_alpha", "synthetic_beta", "synthetic_num_clients",
               "synthetic_max_examples", "synthetic_shared", "synthetic_on_demand",
               "toy_examples_per_client",
               "normalize", "writer_fraction", "resample_writers_per_seed")
SCALAR_FIELDS = ("model", "num_rounds", "clients_per_round", "local_epochs",
                 "local_steps", "batch_size", "learning_rate", "lr_decay", "lr_decay_every",
                 "eval_every", "clients_per_step", "eval_chunk", "placement_backend",
                 "client_data", "eval_clients", "target_accuracy",
                 "branchless", "output_dir", "overwrite", "conv_impl", "save_models", "checkpoint_every", "checkpoint_every_s",
                 "stop_on_divergence", "devices", "use_bias", "server_optimizer",
                 "server_momentum", "server_beta1", "server_beta2", "server_eps",
                 "client_optimizer", "client_momentum", "client_beta1", "client_beta2",
                 "client_eps", "client_holdout", "finetune_lr",
                 "dp_delta", "dp_quantile_noise_ratio", "dp_loss_bound", "dp_mm_floor",
                 "client_sampling", "dp_accountant", "dp_clip_init", "dp_clip_quantile",
                 "dp_clip_lr", "dp_clip_count_noise", "dp_kept_weight",
                 "dp_mechanism", "dp_bands")


def data_config_from_flags():
    from deltafl_jax import DataConfig
    return DataConfig(**{f: FLAGS[f].value for f in DATA_FIELDS},
                      toy_means=_toy_means(FLAGS.toy_means))


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
    l2 = floats("l2_reg", FLAGS.l2_reg)
    scalars = {f: FLAGS[f].value for f in SCALAR_FIELDS}
    server_lr = floats("server_lr", FLAGS.server_lr)
    if server_optimizer is not None:
        scalars["server_optimizer"] = server_optimizer or "sgd"
        server_lr = server_lr if server_optimizer else (1.0,)
    return ExperimentConfig(
        data=data_config_from_flags(), **scalars,
        algorithm=name, options=options, thetas=thetas, seeds=ints("seeds", FLAGS.seeds),
        l2_reg=l2[0] if len(l2) == 1 else l2, sweeps=sweeps, server_lr=server_lr,
        dp_noise_multiplier=floats("dp_noise_multiplier", FLAGS.dp_noise_multiplier),
        dp_target_epsilon=floats("dp_target_epsilon", FLAGS.dp_target_epsilon),
        finetune_steps=ints("finetune_steps", FLAGS.finetune_steps),
        dp_clip=clip_flag(FLAGS.dp_clip),
        tensorboard={"yes": True, "no": False}.get(FLAGS.tensorboard))


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
