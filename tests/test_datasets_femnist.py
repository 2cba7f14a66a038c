"""FEMNIST from LEAF json, TFF h5 and TFF SQLite.

The fixture files are written here, in each exact format, from uint8 images and labels that the
test owns; every loaded array is compared with those, so the three formats must agree with each
other and with the source data.
"""

import os
import struct
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from fixtures import federated_files as ff  # noqa: E402

from deltafl_jax.data import DataError  # noqa: E402
from deltafl_jax.datasets import DataConfig, femnist, load_dataset  # noqa: E402

SIZES = {"f0000_14": 12, "f0001_41": 9, "f0002_07": 15, "f0003_33": 8, "f0004_11": 10,
         "f0005_02": 7, "f0006_19": 11, "f0007_25": 13, "f0008_30": 9, "f0009_01": 3}
MIN = 8  # writers f0005_02 (7) and f0009_01 (3) fall below it


@pytest.fixture(scope="module")
def writers():
    return ff.femnist_writers(SIZES, seed=3)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, writers):
    root = tmp_path_factory.mktemp("femnist_sources")
    return {
        "leaf_all_data": ff.write_leaf_femnist_all_data(str(root / "leaf_all"), writers),
        "leaf_train_test": ff.write_leaf_femnist_train_test(str(root / "leaf_split"), writers),
        "tff_h5": ff.write_tff_h5(str(root / "h5"), writers),
        "tff_sqlite": ff.write_tff_sqlite(str(root / "sqlite" / "emnist_all.sqlite"), writers),
    }


def test_fixture_pixels_follow_leaf_convention(writers):
    x, y = writers["f0000_14"]
    # Mostly background: pixel 1.0 in LEAF/TFF, i.e. 255 here.
    assert np.mean(x == 255) > 0.8
    assert set(np.concatenate([w[1] for w in writers.values()])) >= {0, 9, 10, 35, 36, 61}


@pytest.mark.parametrize("fmt", ["leaf_all_data", "leaf_train_test", "tff_h5", "tff_sqlite"])
def test_each_format_reads_the_writers_exactly(sources, writers, fmt, tmp_path):
    got = femnist.read_source(sources[fmt], str(tmp_path))
    assert list(got) == sorted(writers)
    for w, (x, y) in writers.items():
        np.testing.assert_array_equal(got[w][0], x)
        np.testing.assert_array_equal(got[w][1], y)
        assert got[w][0].dtype == np.uint8 and got[w][1].dtype == np.int32


def test_the_three_formats_load_to_identical_client_arrays(sources, writers, tmp_path):
    loaded = {}
    for fmt, path in sources.items():
        config = DataConfig(dataset="femnist", data_path=path, data_dir=str(tmp_path / fmt),
                            data_seed=5, min_client_examples=MIN)
        loaded[fmt] = load_dataset(config)
    ref = loaded["tff_sqlite"]
    for fmt, data in loaded.items():
        for split in ("train", "test"):
            a, b = getattr(data, split), getattr(ref, split)
            np.testing.assert_array_equal(a.x, b.x, err_msg=f"{fmt} {split}")
            np.testing.assert_array_equal(a.y, b.y)
            np.testing.assert_array_equal(a.offsets, b.offsets)
            assert list(a.client_ids) == list(b.client_ids)
    # And every client is exactly one of the test's writers.
    for split in (ref.train, ref.test):
        for k, w in enumerate(split.client_ids):
            x, y = split.client(k)
            np.testing.assert_array_equal(x, writers[w][0])
            np.testing.assert_array_equal(y, writers[w][1])


def test_paper_rules_min_size_half_of_writers_then_half_split(sources, tmp_path):
    config = DataConfig(dataset="femnist", data_path=sources["tff_h5"],
                        data_dir=str(tmp_path), data_seed=0, min_client_examples=MIN)
    data = load_dataset(config)
    eligible = {w for w, n in SIZES.items() if n >= MIN}  # 8 writers; f0003_33 has exactly 8
    ids = set(data.train.client_ids) | set(data.test.client_ids)
    assert ids <= eligible
    assert len(ids) == len(eligible) // 2 == 4  # the 50% subsample
    assert data.train.num_clients == 2 and data.test.num_clients == 2
    assert not set(data.train.client_ids) & set(data.test.client_ids)
    assert data.num_classes == 62
    assert data.train.x.dtype == np.uint8 and data.train.x.shape[1:] == (784,)
    assert data.x_scale == pytest.approx(1 / 255)
    # The engine sees x * x_scale: background 1.0, as LEAF's pixels.
    assert float(data.train.x.max()) * data.x_scale == pytest.approx(1.0)


def test_subsample_and_split_follow_data_seed(sources, tmp_path):
    def ids(seed):
        d = load_dataset(DataConfig(dataset="femnist", data_path=sources["tff_h5"],
                                    data_dir=str(tmp_path), data_seed=seed,
                                    min_client_examples=MIN))
        return tuple(d.train.client_ids), tuple(d.test.client_ids)

    assert ids(1) == ids(1)
    assert len({ids(s) for s in range(6)}) > 1


def test_min_client_examples_boundary(sources, tmp_path):
    # With min 9 the writer with exactly 8 images goes; the one with exactly 9 stays eligible.
    data = load_dataset(DataConfig(dataset="femnist", data_path=sources["tff_h5"],
                                   data_dir=str(tmp_path), min_client_examples=9))
    ids = set(data.train.client_ids) | set(data.test.client_ids)
    assert "f0003_33" not in ids and "f0005_02" not in ids
    assert data.stats()["min_examples"] >= 9


def test_parse_example_matches_protobuf_serialisation():
    pixels = np.linspace(0.0, 1.0, 784, dtype=np.float32)
    blob = ff.serialized_emnist_example(pixels, 61)
    parsed = femnist.parse_example(blob)
    np.testing.assert_array_equal(parsed["pixels"], pixels)
    assert parsed["pixels"].dtype == np.float32
    np.testing.assert_array_equal(parsed["label"], [61])


def test_parse_example_hand_assembled_unpacked_and_negative_int64():
    # Example{features{feature{"a": int64_list{value: [-2, 300]} (unpacked)},
    #                  feature{"b": float_list{value: [0.5]} (unpacked)},
    #                  feature{"c": bytes_list{value: ["hi"]}}}}
    neg2 = bytes([0xFE] + [0xFF] * 8 + [0x01])  # -2 as a 10-byte varint
    int_list = b"\x08" + neg2 + b"\x08\xac\x02"  # field 1 varint: -2, 300
    feat_a = b"\x1a" + bytes([len(int_list)]) + int_list  # Feature.int64_list = 3
    float_list = b"\x0d" + struct.pack("<f", 0.5)  # field 1, wire type 5
    feat_b = b"\x12" + bytes([len(float_list)]) + float_list  # Feature.float_list = 2
    bytes_list = b"\x0a\x02hi"
    feat_c = b"\x0a" + bytes([len(bytes_list)]) + bytes_list  # Feature.bytes_list = 1

    def entry(key, feature):
        body = b"\x0a" + bytes([len(key)]) + key + b"\x12" + bytes([len(feature)]) + feature
        return b"\x0a" + bytes([len(body)]) + body

    features = entry(b"a", feat_a) + entry(b"b", feat_b) + entry(b"c", feat_c)
    blob = b"\x0a" + bytes([len(features)]) + features
    parsed = femnist.parse_example(blob)
    np.testing.assert_array_equal(parsed["a"], [-2, 300])
    np.testing.assert_array_equal(parsed["b"], [0.5])
    assert parsed["c"] == [b"hi"]


def test_second_load_reads_the_prepared_records(sources, writers, tmp_path):
    import glob
    import shutil

    src = str(tmp_path / "copy.sqlite")
    shutil.copy(sources["tff_sqlite"], src)
    config = DataConfig(dataset="femnist", data_path=src, data_dir=str(tmp_path / "cache"),
                        min_client_examples=MIN)
    first = load_dataset(config)
    assert glob.glob(str(tmp_path / "cache" / "deltafl_femnist" / "min8" / "*" /
                         "*.array_record-*"))
    os.remove(src)  # the source is gone: a second load must come from the prepared files
    second = load_dataset(DataConfig(dataset="femnist", data_dir=str(tmp_path / "cache"),
                                     min_client_examples=MIN))
    np.testing.assert_array_equal(first.train.x, second.train.x)
    np.testing.assert_array_equal(first.test.y, second.test.y)
    assert "tensorflow" not in sys.modules


def test_missing_source_is_one_line_naming_the_file(tmp_path):
    with pytest.raises(DataError) as err:
        load_dataset(DataConfig(dataset="femnist", data_dir=str(tmp_path)))
    message = str(err.value)
    assert "\n" not in message
    assert "--data_path=" in message and "emnist_all.sqlite" in message
    assert os.path.join(str(tmp_path), "raw", "femnist") in message


def test_raw_dir_is_used_when_no_path_is_given(sources, writers, tmp_path):
    import shutil

    raw = tmp_path / "raw" / "femnist"
    shutil.copytree(sources["tff_h5"], raw)
    data = load_dataset(DataConfig(dataset="femnist", data_dir=str(tmp_path),
                                   min_client_examples=MIN))
    assert data.train.num_clients + data.test.num_clients == 4


def test_download_failure_is_one_line(tmp_path, monkeypatch):
    import urllib.error
    import urllib.request

    def refuse(*args, **kwargs):
        raise urllib.error.URLError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    with pytest.raises(DataError) as err:
        femnist.download(str(tmp_path))
    assert "\n" not in str(err.value)
    assert femnist.TFF_URL in str(err.value) and "--source=" in str(err.value)
    assert not list((tmp_path / "raw" / "femnist").glob("*.part"))


def test_pixels_out_of_range_are_rejected(tmp_path):
    bad = {"f1": (np.full((3, 784), 1.5), np.zeros(3, np.int32))}
    path = str(tmp_path / "bad")
    os.makedirs(path)
    import json
    with open(os.path.join(path, "all_data_0.json"), "w") as f:
        json.dump({"users": ["f1"], "num_samples": [3],
                   "user_data": {"f1": {"x": bad["f1"][0].tolist(), "y": [0, 0, 0]}}}, f)
    with pytest.raises(DataError, match=r"\[0, 1\]"):
        femnist.read_source(path, str(tmp_path))


def test_compressed_tff_sqlite_is_decompressed_into_the_raw_dir(sources, writers, tmp_path):
    import lzma

    packed = tmp_path / "emnist_all.sqlite.lzma"
    with open(sources["tff_sqlite"], "rb") as f:
        packed.write_bytes(lzma.compress(f.read()))
    got = femnist.read_source(str(packed), str(tmp_path / "data"))
    assert (tmp_path / "data" / "raw" / "femnist" / "emnist_all.sqlite").exists()
    for w, (x, y) in writers.items():
        np.testing.assert_array_equal(got[w][0], x)
        np.testing.assert_array_equal(got[w][1], y)
    broken = tmp_path / "broken" / "emnist_all.sqlite.lzma"
    broken.parent.mkdir()
    broken.write_bytes(packed.read_bytes()[:1000])
    with pytest.raises(DataError, match="not a complete"):
        femnist.read_source(str(broken), str(tmp_path / "data2"))
