"""--dataset=text:PATH (deltafl_jax/datasets/text.py): rows of jsonl, csv and parquet files
tokenised by the base's tokenizer, against sequences built here from the tokenizer's own
encode(); clients by a column or by --partition; the loss mask of instruction pairs; the
one-line refusals that write nothing."""

import csv
import os

import numpy as np
import pytest

from deltafl_jax.data import DataError
from deltafl_jax.datasets import DataConfig, load_dataset
from deltafl_jax.datasets.text import decode, encode
from llm_fixtures import tokenizer_folder, user_rows, write_jsonl

EOS, PAD = 1, 2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("base"))
    return folder, tokenizer_folder(folder)


def _config(path, base, tmp_path, **settings):
    return DataConfig(f"text:{path}", base_model=base, data_dir=str(tmp_path / "cache"),
                      **settings)


def _expected(tok, text, length):
    """One document's stored sequence, built from the tokenizer directly: BOS + tokens + EOS,
    truncated to `length`, padded with unscored PAD."""
    ids = tok.encode(text).ids + [EOS]
    ids = ids[:length]
    out = np.full(length, -PAD - 1, np.int64)
    out[:len(ids)] = ids
    return out


def _by_client(data):
    out = {}
    for split in (data.train, data.test):
        for k, cid in enumerate(split.client_ids):
            out[str(cid)] = split.client(k)[0]
    return out


def test_encode_decode_round_trip():
    ids = np.array([[0, 5, 7, 2], [3, 0, 9, 1]])
    scored = np.array([[False, True, True, False], [True, False, True, True]])
    x = encode(ids, scored)
    assert x.dtype == np.int32 and (x[scored] >= 0).all() and (x[~scored] < 0).all()
    back, mask = decode(x)
    np.testing.assert_array_equal(back, ids)
    np.testing.assert_array_equal(mask, scored)


def test_jsonl_clients_by_column(tmp_path, base):
    folder, tok = base
    rows = user_rows(users=6, per_user=3)
    path = write_jsonl(str(tmp_path / "rows.jsonl"), rows)
    data = load_dataset(_config(path, folder, tmp_path, client_column="user", max_length=10))
    assert data.train.num_clients + data.test.num_clients == 6
    assert data.train.num_clients == 3 and data.train.y is None
    got = _by_client(data)
    for user in sorted(got):
        mine = [r["text"] for r in rows if r["user"] == user]
        want = np.stack([_expected(tok, t, 10) for t in mine])
        np.testing.assert_array_equal(got[user], want)
    assert data.metadata["task"] == "causal_lm" and data.metadata["base_model"] == folder
    # a second load reads the cache: the same arrays
    again = _by_client(load_dataset(_config(path, folder, tmp_path, client_column="user",
                                            max_length=10)))
    assert all(np.array_equal(again[k], got[k]) for k in got)


def test_csv_and_parquet_equal_jsonl(tmp_path, base):
    folder, _ = base
    rows = user_rows(users=4, per_user=2, seed=3)
    jsonl = write_jsonl(str(tmp_path / "rows.jsonl"), rows)
    path = str(tmp_path / "rows.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["user", "text"])
        w.writeheader()
        w.writerows(rows)
    settings = dict(client_column="user", max_length=12)
    want = _by_client(load_dataset(_config(jsonl, folder, tmp_path, **settings)))
    got = _by_client(load_dataset(_config(path, folder, tmp_path, **settings)))
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    pa = pytest.importorskip("pyarrow", reason="pyarrow reads parquet files")
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "rows.parquet"))
    got = _by_client(load_dataset(_config(str(tmp_path / "rows.parquet"), folder, tmp_path,
                                          **settings)))
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_instruction_pairs_score_the_response_only(tmp_path, base):
    folder, tok = base
    rows = [{"user": f"u{i % 2}", "q": "the king", "a": "long live the queen"} for i in range(4)]
    path = write_jsonl(str(tmp_path / "pairs.jsonl"), rows)
    data = load_dataset(_config(path, folder, tmp_path, client_column="user",
                                prompt_column="q", response_column="a", max_length=40,
                                prompt_template="Q: {prompt}\\nA: "))
    x = data.train.x[0]
    ids, scored = decode(x)
    prompt = tok.encode("Q: the king\nA: ").ids
    response = tok.encode("long live the queen", add_special_tokens=False).ids + [EOS]
    n = len(prompt) + len(response)
    np.testing.assert_array_equal(ids[:n], prompt + response)
    assert not scored[:len(prompt)].any() and scored[len(prompt):n].all()
    assert not scored[n:].any() and (ids[n:] == PAD).all()


def test_pack_joins_and_cuts(tmp_path, base):
    folder, tok = base
    rows = user_rows(users=2, per_user=5, seed=1)
    path = write_jsonl(str(tmp_path / "rows.jsonl"), rows)
    data = load_dataset(_config(path, folder, tmp_path, client_column="user", max_length=8,
                                pack=True))
    got = _by_client(data)
    for user, x in got.items():
        stream = [t for r in rows if r["user"] == user for t in tok.encode(r["text"]).ids + [EOS]]
        rows_ = len(stream) // 8 + (len(stream) % 8 >= 2)   # a last token alone predicts nothing
        n = min(len(stream), 8 * rows_)
        flat = decode(x)[0].reshape(-1)
        np.testing.assert_array_equal(flat[:n], stream[:n])
        assert x.shape == (rows_, 8) and (flat[n:] == PAD).all()


def test_partition_without_client_column(tmp_path, base):
    folder, _ = base
    rows = user_rows(users=10, per_user=4, seed=2)
    path = write_jsonl(str(tmp_path / "rows.jsonl"), [{"text": r["text"]} for r in rows])
    data = load_dataset(_config(path, folder, tmp_path, partition="iid",
                                num_clients=4, max_length=10))
    assert data.train.num_clients == 4 and data.test.num_clients == 4
    assert data.train.num_examples + data.test.num_examples == 40


@pytest.mark.parametrize("case", ["client_column", "too_long", "no_tokenizer", "no_config",
                                  "no_partition"])
def test_refusals_write_nothing(tmp_path, base, case):
    folder, _ = base
    path = write_jsonl(str(tmp_path / "rows.jsonl"), user_rows(users=4, per_user=2))
    settings = dict(client_column="user", max_length=10)
    want = {"client_column": "--client_column=speaker: ", "too_long": "--max_length=65",
            "no_tokenizer": "has no tokenizer.json", "no_config": "has no config.json",
            "no_partition": "without --client_column"}[case]
    if case == "client_column":
        settings["client_column"] = "speaker"
    elif case == "too_long":
        settings["max_length"] = 65     # the base has 64 positions
    elif case == "no_partition":
        del settings["client_column"]
    elif case in ("no_tokenizer", "no_config"):
        broken = str(tmp_path / "broken")
        os.makedirs(broken)
        if case == "no_tokenizer":
            os.link(os.path.join(folder, "config.json"), os.path.join(broken, "config.json"))
        folder = broken
    with pytest.raises(DataError) as err:
        load_dataset(_config(path, folder, tmp_path, **settings))
    message = str(err.value)
    assert want in message and "\n" not in message, message
    if case == "client_column":
        assert "'speaker'" in message
    assert not os.path.exists(tmp_path / "cache")
