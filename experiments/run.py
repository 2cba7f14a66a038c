r"""Train Delta-FL (or a baseline) for every theta x seed in one compiled program.

    python -m experiments.run --flagfile=experiments/synthetic.flags [--flag=value ...]

This file is the only place that reads flags: it turns them into a frozen
:class:`deltafl_jax.ExperimentConfig` and calls :func:`deltafl_jax.run_experiment`. Bad input
prints one line naming the problem to stderr and exits with code 2, before any output
directory is created.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging

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
flags.DEFINE_string("algorithm", "deltafl", "deltafl | fedavg (= deltafl at theta=1)")
flags.DEFINE_string("filter", "exact", "exact: tail weights of the superquantile (fractional "
                    "boundary client) | reference: every client with F_k >= eta, full weight")
flags.DEFINE_list("thetas", [], "conformity levels, e.g. 1.0,0.8,0.5,0.1 (default: these four "
                  "for deltafl, 1.0 for fedavg)")
flags.DEFINE_list("seeds", ["1"], "seeds; each seeds sampling, shuffling and initialisation")
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


def config_from_flags():
    """The frozen experiment configuration described by the flags."""
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
        data=data, model=FLAGS.model, algorithm=FLAGS.algorithm, filter=FLAGS.filter,
        thetas=_floats("thetas", FLAGS.thetas), seeds=_ints("seeds", FLAGS.seeds),
        num_rounds=FLAGS.num_rounds, clients_per_round=FLAGS.clients_per_round,
        local_epochs=FLAGS.local_epochs, local_steps=FLAGS.local_steps,
        batch_size=FLAGS.batch_size, learning_rate=FLAGS.learning_rate,
        lr_decay=FLAGS.lr_decay, lr_decay_every=FLAGS.lr_decay_every, l2_reg=FLAGS.l2_reg,
        eval_every=FLAGS.eval_every, clients_per_step=FLAGS.clients_per_step,
        eval_chunk=FLAGS.eval_chunk, output_dir=FLAGS.output_dir, overwrite=FLAGS.overwrite,
        conv_impl=FLAGS.conv_impl, save_models=FLAGS.save_models)


def fail(message: str) -> None:
    """One line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_flags_or_fail(argv):
    try:
        return FLAGS(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0] if str(e) else "bad flags")


def main(argv):
    logging.set_verbosity(logging.WARNING)  # keep jax's backend probing out of the output
    if len(argv) > 1:
        fail(f"unexpected arguments {' '.join(argv[1:])!r} (flags look like --name=value)")
    from deltafl_jax import ConfigError, DataError, run_experiment

    try:
        config = config_from_flags()
        run_experiment(config)
    except (UsageError, ConfigError, DataError) as e:
        fail(str(e))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags_or_fail)
