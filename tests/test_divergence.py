"""--stop_on_divergence: a replica whose training loss exceeds 3x its value at w_0 (or is not
finite) stops, frozen; the others go on exactly as without the option."""

import jax
import numpy as np

from conftest import tiny_config
from deltafl_jax import run_experiment
from deltafl_jax.studies.tuning import lr_grid_replicas


def test_diverged_replica_stops_and_the_others_are_unchanged(tiny_synthetic):
    base = tiny_config(algorithm="fedavg", thetas=(), seeds=(1,), num_rounds=6, eval_every=2,
                       clients_per_step=1)
    replicas = lr_grid_replicas(base, (0.05, 50.0), (1.0,))
    plain = run_experiment(base, tiny_synthetic, replicas=replicas)
    stopped = run_experiment(base.__class__(**{**base.__dict__, "stop_on_divergence": True}),
                             tiny_synthetic, replicas=replicas)
    good, bad = (lab.key() for lab in replicas.labels)
    assert set(stopped.summary["diverged"]) == {bad}
    first = stopped.summary["diverged"][bad]
    # The loss that triggered the stop is above 3x the loss at w_0 (log 10 at zero init).
    recs = [h for h in stopped.history if h["theta"] == 1.0 and h["learning_rate"] == 50.0]
    at_stop = [h for h in recs if h["round"] == first][0]["train_loss_mean"]
    assert not np.isfinite(at_stop) or at_stop > 3 * np.log(10)
    # Frozen from then on: every later evaluation sees the same model.
    later = [h["train_loss_mean"] for h in recs if h["round"] >= first]
    assert len(later) >= 2 and all(v == later[0] or (np.isnan(v) and np.isnan(later[0]))
                                   for v in later)
    # The healthy replica is untouched by the option, bit for bit.
    for x, y in zip(jax.tree.leaves(plain.state.params), jax.tree.leaves(stopped.state.params)):
        np.testing.assert_array_equal(np.asarray(x)[0], np.asarray(y)[0])
    assert plain.final[good] == stopped.final[good]
    assert np.isfinite(plain.final[good]["train_loss_mean"])
