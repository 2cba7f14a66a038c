r"""Train Delta-FL (or a baseline) for every theta x seed in one compiled program.

    python -m experiments.run --flagfile=experiments/synthetic.flags [--flag=value ...]

``--algorithm`` may list several methods (``--algorithm=deltafl,fedavg,qffl``): they run one
after another on the same data, each in its own compiled program, into
``<output_dir>/<algorithm>/``, and a table of the final test errors closes the run.

This file is the only place that reads flags: it turns them into a frozen
:class:`deltafl_jax.ExperimentConfig` and calls :func:`deltafl_jax.run_experiment`. Bad input
prints one line naming the problem to stderr and exits with code 2, before any output
directory is created.
"""

from __future__ import annotations

from absl import app, flags, logging

from experiments.cli import fail, parse_flags_or_fail

FLAGS = flags.FLAGS

# --- data
flags.DEFINE_string("dataset", "synthetic", "synthetic | gaussian_toy | npz | shakespeare | "
                    "sent140 | femnist")
flags.DEFINE_string("data_path", None, "npz file, or the raw source of a real dataset")
flags.DEFINE_string("data_dir", None, "prepared-dataset cache (default $DELTAFL_DATA or "
                    "~/.cache/deltafl_jax)")
flags.DEFINE_integer("data_seed", 0, "seed of data generation and of the train/test split")
flags.DEFINE_integer("min_client_examples", None, "keep clients with at least this many "
                     "examples (default: the dataset's paper value)")
flags.DEFINE_integer("max_examples_per_client", None, "keep each client's first N examples")
flags.DEFINE_integer("max_train_clients", None, "keep a seeded subset of the train clients")
flags.DEFINE_integer("max_test_clients", None, "keep a seeded subset of the test clients")
flags.DEFINE_float("synthetic_alpha", 1.0, "Synthetic(alpha, beta): model heterogeneity")
flags.DEFINE_float("synthetic_beta", 1.0, "Synthetic(alpha, beta): feature heterogeneity")
flags.DEFINE_integer("synthetic_num_clients", 100, "Synthetic: clients, half train half test")
flags.DEFINE_integer("synthetic_max_examples", 1000, "Synthetic: cap of the client sizes")
flags.DEFINE_float("synthetic_shared", 0.0, "Synthetic: weight of the labelling model shared "
                   "by all clients, in [0, 1) (0 = the original benchmark)")
flags.DEFINE_string("toy_means", "0,0;4,0;1,1", "gaussian_toy: means 'x,y;x,y;...'")
flags.DEFINE_integer("toy_examples_per_client", 500, "gaussian_toy: samples per client")
# --- model and algorithm
flags.DEFINE_string("model", "linear", "linear | cnn | mlp | mean | gru | lstm | "
                    "sent140_linear")
flags.DEFINE_string("conv_impl", None, "cnn convolutions: im2col_wgrad (CPU) | xla "
                    "(default: by backend)")
flags.DEFINE_list("algorithm", ["deltafl"], "one or more of deltafl, fedavg (= deltafl at "
                  "theta=1), fedavg_sub, fedprox, qffl, afl_qffl (q-FFL at q=10), afl, term; "
                  "several run one after another into <output_dir>/<algorithm>/")
flags.DEFINE_string("filter", "exact", "exact: tail weights of the superquantile (fractional "
                    "boundary client) | reference: every client with F_k >= eta, full weight")
flags.DEFINE_list("thetas", [], "conformity levels, e.g. 1.0,0.8,0.5,0.1 (default: these four "
                  "for deltafl, 1.0 for fedavg)")
flags.DEFINE_list("seeds", ["1"], "seeds; each seeds sampling, shuffling and initialisation")
# --- baselines: each list is swept in one program (empty: the algorithm's default grid)
flags.DEFINE_list("fedavg_sub_clients", [], "fedavg_sub: clients averaged per round (default: "
                  "as many as Delta-FL keeps at each theta < 1 of --thetas)")
flags.DEFINE_list("fedprox_mu", [], "fedprox: proximal weights mu >= 0 (default "
                  "0.001,0.01,0.1,1)")
flags.DEFINE_list("qffl_q", [], "qffl: exponents q >= 0 (default 0.001,0.01,0.1,1,10)")
flags.DEFINE_list("afl_lambda_lr", [], "afl: step sizes >= 0 of the projected ascent on lambda "
                  "(default 0.01)")
flags.DEFINE_list("term_t", [], "term: tilts t (default 0.1,1,10)")
# --- training
flags.DEFINE_integer("num_rounds", 100, "communication rounds")
flags.DEFINE_integer("clients_per_round", 10, "m, clients sampled per round")
flags.DEFINE_integer("local_epochs", 1, "local epochs of minibatch SGD per kept client")
flags.DEFINE_integer("local_steps", None, "local SGD steps instead of epochs")
flags.DEFINE_integer("batch_size", 10, "local minibatch size")
flags.DEFINE_float("learning_rate", 0.1, "client learning rate gamma_0")
flags.DEFINE_float("lr_decay", 1.0, "divide the learning rate by this every lr_decay_every "
                   "rounds (>= 1)")
flags.DEFINE_integer("lr_decay_every", 0, "rounds between learning-rate decays (0: constant)")
flags.DEFINE_float("l2_reg", 0.0, "lambda: local steps w <- (1 - lr lambda) w - lr grad, and "
                   "F_k includes (lambda/2)||w||^2")
flags.DEFINE_integer("clients_per_step", None, "client lanes trained at once (1: one client "
                     "at a time; m: all sampled clients vmapped); default chosen per backend")
flags.DEFINE_integer("eval_chunk", None, "examples per evaluation work item (default by model)")
# --- outputs
flags.DEFINE_integer("eval_every", 10, "evaluate on all train and test clients every N rounds")
flags.DEFINE_string("output_dir", None, "where metrics.jsonl, summary.json and models/ go")
flags.DEFINE_bool("overwrite", False, "replace results already in --output_dir")
flags.DEFINE_bool("save_models", True, "save the final model of every replica")


class UsageError(ValueError):
    pass


def _floats(name, values):
    try:
        return tuple(float(v) for v in values)
    except ValueError:
        raise UsageError(f"--{name} must be a comma-separated list of numbers, got "
                         f"{','.join(values)!r}") from None


def _ints(name, values):
    try:
        return tuple(int(v) for v in values)
    except ValueError:
        raise UsageError(f"--{name} must be a comma-separated list of integers, got "
                         f"{','.join(values)!r}") from None


def _toy_means(text):
    try:
        means = tuple(tuple(float(v) for v in pair.split(",")) for pair in text.split(";")
                      if pair.strip())
    except ValueError:
        raise UsageError(f"--toy_means must look like '0,0;4,0;1,1', got {text!r}") from None
    if len(means) < 2 or any(len(m) != 2 for m in means):
        raise UsageError(f"--toy_means must list at least two x,y pairs, got {text!r}")
    return means


def config_from_flags(algorithm: str = None):
    """The frozen experiment configuration described by the flags (for `algorithm`, default
    the first of --algorithm)."""
    from deltafl_jax import DataConfig, ExperimentConfig

    data = DataConfig(
        dataset=FLAGS.dataset, data_path=FLAGS.data_path, data_dir=FLAGS.data_dir,
        data_seed=FLAGS.data_seed, min_client_examples=FLAGS.min_client_examples,
        max_examples_per_client=FLAGS.max_examples_per_client,
        max_train_clients=FLAGS.max_train_clients, max_test_clients=FLAGS.max_test_clients,
        synthetic_alpha=FLAGS.synthetic_alpha, synthetic_beta=FLAGS.synthetic_beta,
        synthetic_num_clients=FLAGS.synthetic_num_clients,
        synthetic_max_examples=FLAGS.synthetic_max_examples,
        synthetic_shared=FLAGS.synthetic_shared, toy_means=_toy_means(FLAGS.toy_means),
        toy_examples_per_client=FLAGS.toy_examples_per_client)
    return ExperimentConfig(
        data=data, model=FLAGS.model,
        algorithm=algorithm if algorithm is not None else (FLAGS.algorithm or [""])[0],
        filter=FLAGS.filter,
        thetas=_floats("thetas", FLAGS.thetas), seeds=_ints("seeds", FLAGS.seeds),
        num_rounds=FLAGS.num_rounds, clients_per_round=FLAGS.clients_per_round,
        local_epochs=FLAGS.local_epochs, local_steps=FLAGS.local_steps,
        batch_size=FLAGS.batch_size, learning_rate=FLAGS.learning_rate,
        lr_decay=FLAGS.lr_decay, lr_decay_every=FLAGS.lr_decay_every, l2_reg=FLAGS.l2_reg,
        eval_every=FLAGS.eval_every, clients_per_step=FLAGS.clients_per_step,
        eval_chunk=FLAGS.eval_chunk, output_dir=FLAGS.output_dir, overwrite=FLAGS.overwrite,
        conv_impl=FLAGS.conv_impl, save_models=FLAGS.save_models,
        fedavg_sub_clients=_ints("fedavg_sub_clients", FLAGS.fedavg_sub_clients),
        fedprox_mu=_floats("fedprox_mu", FLAGS.fedprox_mu),
        qffl_q=_floats("qffl_q", FLAGS.qffl_q),
        afl_lambda_lr=_floats("afl_lambda_lr", FLAGS.afl_lambda_lr),
        term_t=_floats("term_t", FLAGS.term_t))


def configs_from_flags():
    """One configuration per method of --algorithm. With several methods, each writes into
    <output_dir>/<algorithm>/, and fedavg ignores --thetas (which then sets Delta-FL's levels
    and FedAvg-Sub's client counts)."""
    import dataclasses
    import os

    names = [a.strip() for a in FLAGS.algorithm]
    if not names or any(not a for a in names):
        raise UsageError(f"--algorithm must name at least one method, got "
                         f"{','.join(FLAGS.algorithm)!r}")
    if len(set(names)) != len(names):
        raise UsageError(f"--algorithm lists a method twice: {','.join(names)}")
    if len(names) == 1:
        return [config_from_flags(names[0])]
    configs = []
    for name in names:
        config = config_from_flags(name)
        changes = {}
        if config.output_dir:
            changes["output_dir"] = os.path.join(config.output_dir, name)
        if name == "fedavg":
            changes["thetas"] = ()
        configs.append(dataclasses.replace(config, **changes))
    return configs


def comparison_lines(results):
    """Rows 'method, swept value: mean and p90 of the final per-client test error, each the
    mean over seeds' of a multi-method run. results: [(algorithm, summary dict)]."""
    from deltafl_jax.outputs import replica_key

    lines = [f"{'method':<28} {'test error mean':>16} {'test error p90':>15}  seeds"]
    for name, summary in results:
        groups = {}
        for lab in summary["replicas"]:
            if "param_name" in lab:
                what = f"{lab['param_name']}={lab['param_value']:g}"
            else:
                what = f"theta={lab['theta']:g}"
            groups.setdefault(what, []).append(summary["final"][replica_key(lab)])
        for what, finals in groups.items():
            mean = sum(f["test_error_mean"] for f in finals) / len(finals)
            p90 = sum(f["test_error_p90"] for f in finals) / len(finals)
            lines.append(f"{name + ' ' + what:<28} {100 * mean:15.2f}% {100 * p90:14.2f}%  "
                         f"{len(finals)}")
    return lines


def main(argv):
    logging.set_verbosity(logging.WARNING)  # keep jax's backend probing out of the output
    if len(argv) > 1:
        fail(f"unexpected arguments {' '.join(argv[1:])!r} (flags look like --name=value)")
    from deltafl_jax import ConfigError, DataError, load_dataset, outputs, run_experiment

    try:
        configs = configs_from_flags()
        for config in configs:  # refuse before anything runs
            if (config.output_dir and outputs.has_results(config.output_dir)
                    and not config.overwrite):
                raise ConfigError(f"--output_dir={config.output_dir} already holds results; "
                                  f"pass --overwrite or choose another directory")
        data = load_dataset(configs[0].data)
        results = []
        for config in configs:
            summary = run_experiment(config, data)
            results.append((config.algorithm, summary))
    except (UsageError, ConfigError, DataError) as e:
        fail(str(e))
    if len(configs) > 1 and configs[0].verbose:
        print("\n".join(["", "Final test error per method (mean over seeds):"]
                        + comparison_lines(results)), flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags_or_fail)
