"""The text models through the whole engine: real Shakespeare roles (GRU) and a Sent140 fixture
(LSTM, frozen GloVe), trained by run_experiment, saved, and served by load_model."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest import tiny_config  # noqa: E402
from fixtures import federated_files as ff  # noqa: E402

import deltafl_jax  # noqa: E402
from deltafl_jax import DataConfig, load_dataset, run_experiment  # noqa: E402

pytestmark = pytest.mark.slow   # end-to-end runs: CI's second step


def test_gru_on_real_shakespeare_roles_learns_and_is_served(tmp_path):
    data_cfg = DataConfig("shakespeare", data_dir=str(tmp_path / "cache"), max_train_clients=6,
                          max_test_clients=4, max_examples_per_client=96)
    data = load_dataset(data_cfg)
    assert data.train.num_clients == 6 and data.num_classes == 53
    out = tmp_path / "run"
    cfg = tiny_config(data=data_cfg, model="gru", thetas=(1.0, 0.5), num_rounds=8,
                      clients_per_round=4, batch_size=16, learning_rate=1.0, eval_every=8,
                      output_dir=str(out), save_models=True)
    summary = run_experiment(cfg, data)
    for key, final in summary.final.items():
        # A uniform guess over 53 characters costs log 53 = 3.97 nats; 8 rounds of SGD on the
        # roles' text must do clearly better (spaces and 'e' alone are ~25% of the text).
        assert np.isfinite(final["train_loss_mean"]) and final["train_loss_mean"] < 3.6, key
    served = deltafl_jax.load_model(str(out), theta=0.5, seed=1)
    x, _ = data.test.client(0)
    assert np.asarray(served.predict(x[:5])).shape == (5, 53)


# The LSTM reads its state after the 25th step and pads short tweets with zero vectors after
# the text (as the reference code), so a 4-word tweet's signal must survive 21 empty steps and
# a few rounds barely move it. Tweets of 24 tokens, the sentiment word last, make a task that
# the model learns in a few rounds.
_FILL = "we went to the city on a long day and then we saw a film with some friends and it was "
_TWEETS = ([(_FILL + w, 1) for w in ("great", "good", "wonderful", "awesome")]
           + [(_FILL + w, 0) for w in ("awful", "bad", "terrible", "horrible")])


def test_lstm_on_sent140_fixture_trains_and_keeps_glove_frozen(tmp_path):
    users = {f"user{u}": _TWEETS for u in range(8)}
    source = ff.write_leaf_sent140(str(tmp_path / "src" / "all_data_0.json"), users)
    data_cfg = DataConfig("sent140", data_path=source, data_dir=str(tmp_path / "cache"),
                          min_client_examples=5)
    data = load_dataset(data_cfg)
    table = np.array(data.metadata["embeddings"])
    out = tmp_path / "run"
    cfg = tiny_config(data=data_cfg, model="lstm", thetas=(1.0,), num_rounds=5,
                      clients_per_round=data.train.num_clients, batch_size=4,
                      learning_rate=0.5, eval_every=1, output_dir=str(out), save_models=True)
    summary = run_experiment(cfg, data)
    losses = [rec["train_loss_mean"] for rec in summary.history if "train_loss_mean" in rec]
    assert len(losses) == 5 and np.all(np.isfinite(losses))
    # Training lowers the loss at every evaluation, and clearly below a constant guess's log 2.
    assert np.all(np.diff(losses) < 0), losses
    assert losses[-1] < np.log(2) - 0.02, losses
    # The table is a constant of the model, not a parameter: not in the saved parameters.
    served = deltafl_jax.load_model(str(out), theta=1.0, seed=1)
    sizes = [np.asarray(v).size for v in __import__("jax").tree.leaves(served.params)]
    assert table.size not in sizes
    np.testing.assert_array_equal(served.model.module.table.array, table)
    x, _ = data.test.client(0)
    assert np.asarray(served.predict(x)).shape == (len(x), 1)
