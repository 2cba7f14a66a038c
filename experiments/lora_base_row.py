r"""The base before fine-tuning, as a row of a LoRA run's table: the per-client perplexity of
the pretrained base on the run's clients, measured by the run's own evaluation.

    python -m experiments.lora_base_row --flagfile=experiments/lora_shakespeare_cpu.flags

With LoRA's B = 0 the served model of round 0 is the base itself (the adapters add nothing),
so this builds the run of the flags (its first --algorithm entry, its first seed), evaluates
the initial served model on every train and test client exactly as the run's evaluations do
(:meth:`deltafl_jax.run.experiment.Experiment.evaluate` and ``summarize``), and writes
``<output_dir>_base.json`` (beside the run's folder): the summaries (``test_ppl_mean``, ``test_ppl_p90``,
``test_ppl_worst10``, the losses and token errors) and each test client's perplexity.
Nothing is trained. With ``--table`` it then prints the results page's table
(docs/results/lora-shakespeare.md): this row and, for each method of the run found under
``--output_dir`` (``<output_dir>/<method>/summary.json``), the final per-client test perplexity
(mean, p90, worst 10%), mean ± std over the seeds (ddof = 0).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from experiments.cli import define_experiment_flags
from experiments.command import FLAGS, fail, parse_flags_or_fail

define_experiment_flags()
flags.DEFINE_bool("table", False, "print the markdown table of the base and the run's methods")

KEYS = ("test_ppl_mean", "test_ppl_p90", "test_ppl_worst10")


def table_lines(run_dir: str, base: dict):
    """Markdown rows: the base, then every replica group (method, swept value) of the run's
    methods, mean ± std over seeds of KEYS."""
    import glob
    import numpy as np
    rows = [("base (before fine-tuning)", [[base[k]] for k in KEYS])]
    for path in sorted(glob.glob(os.path.join(run_dir, "*", "summary.json"))):
        with open(path) as f:
            final = json.load(f)["final"]
        groups = {}
        for key, metrics in final.items():
            name = f"{os.path.basename(os.path.dirname(path))} " + key.rsplit("_seed=", 1)[0]
            groups.setdefault(name, []).append([metrics[k] for k in KEYS])
        rows += [(name, np.asarray(v).T.tolist()) for name, v in sorted(groups.items())]
    out = ["| model | seeds | test ppl mean | test ppl p90 | test ppl worst 10% |",
           "|---|---|---|---|---|"]
    for name, cols in rows:
        cells = [f"{np.mean(c):.2f} ± {np.std(c):.2f}" if len(c) > 1 else f"{c[0]:.2f}"
                 for c in cols]
        out.append(f"| {name} | {len(cols[0])} | " + " | ".join(cells) + " |")
    return out


def main(argv):
    del argv
    import dataclasses
    import numpy as np
    from deltafl_jax import ConfigError, DataError, build_experiment, load_dataset
    from experiments.backend import start_backend
    from experiments.configs import UsageError, configs_from_flags
    try:
        start_backend()
        config = configs_from_flags()[0]
        config = dataclasses.replace(config, training=dataclasses.replace(
            config.training, seeds=config.training.seeds[:1]))
        if config.training.model != "llama" or config.llm.finetune != "lora":
            raise UsageError("--model=llama with --finetune=lora: the base is the run's "
                             "round 0 only when the adapters start at B = 0")
        data = load_dataset(config.data)
        exp = build_experiment(config, data)
    except (UsageError, ConfigError, DataError) as e:
        fail(str(e))
    per_client = exp.evaluate(exp.served_params(exp.initial_state()), 0)
    summary = {k: float(np.asarray(v).ravel()[0]) for k, v in exp.summarize(per_client).items()}
    losses = np.asarray(per_client["test_loss"])[0]
    out = {"summary": summary,
           "test_ppl": {str(c): float(np.exp(l)) for c, l in zip(data.test.client_ids, losses)}}
    path = FLAGS.output_dir.rstrip("/") + "_base.json"   # beside the run, not inside it
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"base: test perplexity mean {summary['test_ppl_mean']:.2f}, p90 "
          f"{summary['test_ppl_p90']:.2f}, worst 10% {summary['test_ppl_worst10']:.2f} "
          f"({len(losses)} test clients); {path}", flush=True)
    if FLAGS.table:
        print("\n".join(table_lines(FLAGS.output_dir, summary)), flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags_or_fail)
