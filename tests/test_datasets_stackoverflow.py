"""StackOverflow next-word prediction: TFF's SQLite + word counts read
without TensorFlow, the ids of TFF's to_ids rules, the client splits and limits, the cache, the
download, the lstm_nwp model's loss and error, and experiments/stackoverflow_nwp.flags.

The fixture files (tests/fixtures/stackoverflow/, made by make_fixtures.py there) hold the
users of ``make_fixtures.USERS``; the expected ids below are written by hand or computed by
:func:`reference_ids`, written here from TFF's description, not from the reader."""

import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FIXTURES = os.path.join(HERE, "fixtures", "stackoverflow")
sys.path.insert(0, FIXTURES)
import make_fixtures  # noqa: E402

from deltafl_jax.data import DataError  # noqa: E402
from deltafl_jax.datasets import DataConfig, limits, load_dataset, prepare_dataset  # noqa: E402
from deltafl_jax.datasets import stackoverflow as so  # noqa: E402

# The fixture's 12 words: "the" = 1 ... "code" = 12; OOV 13, BOS 14, EOS 15; 16 ids.
WORDS = ["the", ".", "to", "i", "a", "is", "you", "it", ",", "in", "this", "code"]
OOV, BOS, EOS = 13, 14, 15


def reference_ids(sentence, words=WORDS):
    """BOS, the first 20 space-separated words (OOV when unknown), EOS when there were fewer
    than 20, zeros up to 21."""
    pieces = sentence.split(" ")
    ids = [BOS] + [words.index(w) + 1 if w in words else OOV for w in pieces[:20]]
    if len(pieces) < 20:
        ids.append(EOS)
    return ids + [0] * (21 - len(ids))


def config(tmp_path, **kw):
    return DataConfig(dataset="stackoverflow", data_path=FIXTURES,
                      data_dir=str(tmp_path / "cache"), **kw)


def test_vocabulary_is_the_word_count_file_in_order(tmp_path):
    assert so.read_vocab(os.path.join(FIXTURES, "stackoverflow.word_count")) == WORDS
    big = tmp_path / "big.word_count"
    big.write_text("".join(f"w{i} {20000 - i}\n" for i in range(10005)))
    vocab = so.read_vocab(str(big))
    assert len(vocab) == 10000 and vocab[-1] == "w9999"
    assert so.special_ids(10000) == {"pad": 0, "oov": 10001, "bos": 10002, "eos": 10003,
                                     "num_ids": 10004}
    bad = tmp_path / "bad.word_count"
    bad.write_text("the 3\nnot a count line\n")
    with pytest.raises(DataError, match="bad.word_count:2"):
        so.read_vocab(str(bad))


def test_ids_of_known_sentences_by_hand():
    lookup = {w: i + 1 for i, w in enumerate(WORDS)}
    ids = lambda s: so.to_ids(s, lookup, len(WORDS)).tolist()
    assert ids("i think it is a bug .") == [14, 4, 13, 8, 6, 5, 13, 2, 15] + [0] * 12
    # Exactly 20 words: no EOS, no padding.
    assert ids(make_fixtures.TWENTY) == [14, 1, 12, 6, 10, 1, 13, 2, 4, 13, 8, 6, 5, 13, 9, 7,
                                         13, 13, 8, 10, 11]
    # 24 words: truncated to the first 20, no EOS.
    assert ids(make_fixtures.TWENTY_FOUR) == ids(make_fixtures.TWENTY)
    # 19 words: EOS is the 21st id.
    assert ids("the " * 18 + "code") == [14] + [1] * 18 + [12, 15]
    # Two spaces make an empty word, which is OOV (tf.strings.split with sep=' ').
    assert ids("is  it ?") == [14, 6, 13, 8, 13, 15] + [0] * 15
    assert ids("the") == [14, 1, 15] + [0] * 18


def test_reader_gives_tff_train_and_test_users_with_their_sentences(tmp_path):
    data = load_dataset(config(tmp_path))
    assert data.num_classes == 16 and data.metadata["input_vocab_size"] == 16
    assert (data.metadata["oov_id"], data.metadata["bos_id"], data.metadata["eos_id"]) == (
        OOV, BOS, EOS)
    for split, name in ((data.train, "train"), (data.test, "test")):
        users = make_fixtures.USERS[name]
        assert list(split.client_ids) == sorted(users)  # heldout's 00000010 is in neither
        assert split.y is None and split.x.dtype == np.int32 and split.x.shape[1] == 21
        for k, cid in enumerate(split.client_ids):
            want = np.array([reference_ids(s) for s in users[cid]])
            np.testing.assert_array_equal(split.client(k)[0], want)
    # User 00000001 wrote in both periods: a train client and a test client.
    assert "00000001" in data.train.client_ids and "00000001" in data.test.client_ids
    assert data.stats() == {"num_classes": 16, "num_train_clients": 4, "num_test_clients": 3,
                            "median_examples": 2.5, "min_examples": 1, "max_examples": 4}


def test_min_client_examples_keeps_users_with_enough_sentences(tmp_path):
    data = load_dataset(config(tmp_path, min_client_examples=3))
    assert list(data.train.client_ids) == ["00000001", "00000003"]
    assert list(data.test.client_ids) == ["00000006"]


@pytest.mark.parametrize("complete_first", [False, True])
def test_early_limits_equal_the_runners_limits_after_a_complete_load(tmp_path, complete_first):
    full = load_dataset(config(tmp_path / "full"))
    kw = dict(max_train_clients=2, max_test_clients=2, max_examples_per_client=2, data_seed=4)
    if complete_first:  # a complete preparation serves the limits, applied before reading
        load_dataset(config(tmp_path / "limited"))
    got = load_dataset(config(tmp_path / "limited", **kw))
    want = limits.apply_limits(full, config(tmp_path, **kw))
    for a, b in ((got.train, want.train), (got.test, want.test)):
        assert list(a.client_ids) == list(b.client_ids)
        np.testing.assert_array_equal(a.x, b.x)
        np.testing.assert_array_equal(a.offsets, b.offsets)
    assert got.train.num_clients == 2 and got.train.sizes.max() == 2
    configs = sorted(os.listdir(tmp_path / "limited" / "cache" / "deltafl_stackoverflow"))
    assert configs == (["min1"] if complete_first else ["min1-tr2-te2-ex2-seed4"])


def test_second_load_reads_the_prepared_records(tmp_path):
    src = tmp_path / "source"
    shutil.copytree(FIXTURES, src, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    first = load_dataset(DataConfig(dataset="stackoverflow", data_path=str(src),
                                    data_dir=str(tmp_path / "cache")))
    shutil.rmtree(src)
    second = load_dataset(DataConfig(dataset="stackoverflow", data_dir=str(tmp_path / "cache")))
    np.testing.assert_array_equal(first.train.x, second.train.x)
    np.testing.assert_array_equal(first.test.offsets, second.test.offsets)
    assert "tensorflow" not in sys.modules


def test_missing_source_is_one_line(tmp_path):
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(dataset="stackoverflow", data_dir=str(tmp_path)))
    assert "\n" not in str(err.value) and "stackoverflow.sqlite" in str(err.value)
    assert "--download" in str(err.value)


def _published_files():
    """The fixture files packed as TFF publishes them: .sqlite.lzma and .word_count.tar.bz2."""
    with open(os.path.join(FIXTURES, "stackoverflow.sqlite"), "rb") as f:
        sqlite_lzma = lzma.compress(f.read())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:bz2") as tar:
        tar.add(os.path.join(FIXTURES, "stackoverflow.word_count"),
                arcname="stackoverflow.word_count")
    return {so.SQLITE_URL: sqlite_lzma, so.WORD_COUNT_URL: buf.getvalue()}


def test_download_fetches_both_files_and_prepares_them(tmp_path, monkeypatch):
    import urllib.request

    files, asked = _published_files(), []

    class Response(io.BytesIO):
        headers = {}

    def fake_urlopen(url, timeout=None):
        asked.append(url)
        return Response(files[url])

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    cfg = DataConfig(dataset="stackoverflow", data_dir=str(tmp_path))
    path = prepare_dataset(cfg, download=True)
    assert sorted(asked) == sorted(files) and os.path.isdir(path)
    raw = tmp_path / "raw" / "stackoverflow"
    assert (raw / "stackoverflow.sqlite").read_bytes() == lzma.decompress(files[so.SQLITE_URL])
    data = load_dataset(cfg)
    reference = load_dataset(config(tmp_path / "ref"))
    np.testing.assert_array_equal(data.train.x, reference.train.x)
    np.testing.assert_array_equal(data.test.x, reference.test.x)
    with open(os.path.join(FIXTURES, "stackoverflow.word_count"), "rb") as f:
        assert (raw / "stackoverflow.word_count").read_bytes() == f.read()


def test_download_failure_is_one_line(tmp_path, monkeypatch):
    import urllib.error
    import urllib.request

    def refuse(*args, **kwargs):
        raise urllib.error.URLError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    with pytest.raises(DataError) as err:
        so.download(str(tmp_path))
    assert "\n" not in str(err.value) and so.SQLITE_URL in str(err.value)
    assert not any(f.endswith(".part") for _, _, fs in os.walk(tmp_path) for f in fs)


def test_stats_cli_prints_the_table_row(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "data_prep.stats", "--dataset=stackoverflow",
                           f"--data_path={FIXTURES}", f"--data_dir={tmp_path}", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"num_classes": 16, "num_train_clients": 4,
                                       "num_test_clients": 3, "median_examples": 2.5,
                                       "min_examples": 1, "max_examples": 4}


# ----------------------------------------------------------------------------- the model


def numpy_sequence_losses(logits, ids, pad, ignore):
    """Loop over sentences and steps: mean CE over non-pad targets; error rate over targets
    that are neither pad nor in `ignore`."""
    losses, errors = [], []
    for b in range(ids.shape[0]):
        ce, wrong, scored, kept = 0.0, 0, 0, 0
        for t in range(ids.shape[1] - 1):
            target = ids[b, t + 1]
            if target == pad:
                continue
            z = logits[b, t].astype(np.float64)
            ce += np.log(np.sum(np.exp(z - z.max()))) + z.max() - z[target]
            kept += 1
            if target not in ignore:
                scored += 1
                wrong += int(np.argmax(z) != target)
        losses.append(ce / kept if kept else 0.0)
        errors.append(wrong / scored if scored else 0.0)
    return np.array(losses), np.array(errors)


def test_sequence_loss_and_error_mask_padding_and_eos():
    from deltafl_jax.models import sequence_losses_and_errors

    # Vocabulary of 6 ids: pad 0, words 1-3, EOS 5. Two sentences of 5 ids (4 targets).
    ids = np.array([[4, 2, 3, 5, 0],    # targets 2, 3, EOS, pad
                    [4, 1, 1, 1, 2]])   # targets 1, 1, 1, 2: no pad, no EOS
    logits = np.zeros((2, 4, 6), np.float32)
    logits[0, 0, 2] = 3.0     # right
    logits[0, 1, 1] = 2.0     # wrong (target 3)
    logits[0, 2, 0] = 5.0     # EOS target: wrong, but EOS is not scored
    logits[0, 3, 4] = 9.0     # pad target: in neither
    logits[1, :, 1] = 1.0     # right, right, right, wrong (target 2)
    loss, err = sequence_losses_and_errors(logits, ids, pad_id=0, error_ignore_ids=(5,))
    want_loss, want_err = numpy_sequence_losses(logits, ids, 0, (5,))
    np.testing.assert_allclose(np.asarray(loss), want_loss, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(err), [0.5, 0.25])
    np.testing.assert_allclose(want_err, [0.5, 0.25])
    # By hand: sentence 0's loss averages 3 targets (2, 3 and EOS), not the padding.
    lse = lambda z: np.log(np.exp(z).sum())
    hand = (lse(logits[0, 0]) - 3.0 + lse(logits[0, 1]) - 0.0 + lse(logits[0, 2]) - 0.0) / 3
    np.testing.assert_allclose(float(loss[0]), hand, rtol=1e-6)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_lstm_nwp_losses_match_numpy_on_its_scores(tmp_path):
    import jax

    from deltafl_jax.models import build_model

    data = load_dataset(config(tmp_path))
    model = build_model("lstm_nwp", data)
    assert model.loss_kind == "sequence" and model.error_ignore_ids == (EOS,)
    params = model.init(jax.random.PRNGKey(0))
    x = data.train.x[:6]
    logits = np.asarray(model.apply(params, x))
    assert logits.shape == (6, 20, 16)
    loss, err = model.losses_and_errors(params, x, None)
    want_loss, want_err = numpy_sequence_losses(logits, x, 0, (EOS,))
    np.testing.assert_allclose(np.asarray(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(err), want_err)
    # The scores at step t depend only on the ids up to t (a left-to-right model).
    y = x.copy()
    y[:, 5:] = 3
    later = np.asarray(model.apply(params, y))
    np.testing.assert_allclose(later[:, :5], logits[:, :5], rtol=1e-5, atol=1e-6)


def test_lstm_nwp_has_reddi_et_al_parameter_count():
    import jax

    from deltafl_jax.models.text import WordLSTM

    shapes = jax.eval_shape(lambda: WordLSTM(vocab_size=10004).init(
        jax.random.PRNGKey(0), np.zeros((1, 21), np.int32)))
    count = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
    # Embedding 10004x96, LSTM 4x(96x670 + 670x670 + 670), dense 670x96+96, dense 96x10004+10004.
    assert count == 10004 * 96 + 4 * (96 * 670 + 670 * 670 + 670) + 670 * 96 + 96 + \
        96 * 10004 + 10004 == 4050748


def test_lstm_nwp_refuses_other_datasets(tiny_synthetic):
    from deltafl_jax.models import build_model

    with pytest.raises(ValueError, match="next-word"):
        build_model("lstm_nwp", tiny_synthetic)


# ----------------------------------------------------------------------------- the flagfile


def test_flagfile_carries_reddi_et_al_settings():
    from experiments import run as runner

    runner.FLAGS.unparse_flags()
    runner.parse_flags_or_fail(["run", "--flagfile=" + os.path.join(
        REPO, "experiments", "stackoverflow_nwp.flags")])
    (c,) = runner.planned_configs()
    assert (c.data.dataset, c.model, c.algorithm) == ("stackoverflow", "lstm_nwp", "deltafl")
    assert c.thetas == (1.0, 0.5)
    assert (c.clients_per_round, c.local_epochs, c.batch_size) == (50, 1, 16)
    assert c.data.limits.max_examples_per_client == 256 and c.num_rounds == 1500
    assert c.learning_rate == pytest.approx(10 ** -0.5, rel=1e-3)
    assert c.server.name == "adam" and c.server_lr == (0.01,)
    assert (c.server.beta1, c.server.beta2, c.server.eps) == (0.9, 0.99, 1e-5)


@pytest.mark.slow
def test_flagfile_runs_a_few_rounds_on_the_fixtures(tmp_path, capsys):
    from conftest import run_runner

    out = tmp_path / "run"
    code, err, _ = run_runner([
        "--flagfile=" + os.path.join(REPO, "experiments", "stackoverflow_nwp.flags"),
        f"--data_path={FIXTURES}", f"--data_dir={tmp_path / 'cache'}", "--num_rounds=2",
        "--clients_per_round=2", "--eval_every=2", f"--output_dir={out}"], capsys)
    assert code == 0, err
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert {r["theta"] for r in records} == {1.0, 0.5}
    assert all(np.isfinite(r["train_loss"]) for r in records if "train_loss" in r)
