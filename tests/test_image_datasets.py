"""Centralised image datasets: MNIST / Fashion-MNIST IDX files, CIFAR python archives and
tensorflow-datasets, prepared once into the cache (deltafl_jax/datasets/centralised.py).

Never the network: the tests write tiny datasets in the published formats by hand (the IDX
header and big-endian values with struct; CIFAR's Python 2 pickles opcode by opcode, channel
planes built pixel by pixel) and use tfds.testing.mock_data for tfds, whose examples are checked
against tfds' own data source under the same mock.
"""

import gzip
import io
import os
import pickle
import struct
import subprocess
import sys
import tarfile
import tempfile

import numpy as np
import pytest

from deltafl_jax.datasets import DataConfig, centralised, idx, load_centralised, prepare_dataset
from deltafl_jax.errors import DataError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RNG = np.random.default_rng(7)


# ----------------------------------------------------------------------------- writers


def idx_bytes(array, code=0x08, fmt="B"):
    """The IDX file of `array` written from the format's description, not from the parser."""
    array = np.asarray(array)
    header = bytes([0, 0, code, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + struct.pack(f">{array.size}{fmt}", *array.ravel().tolist())


def write_mnist(folder, arrays, gz=True):
    os.makedirs(folder, exist_ok=True)
    for prefix, (x, y) in (("train", arrays["train"]), ("t10k", arrays["test"])):
        for kind, value in (("images-idx3", x), ("labels-idx1", y)):
            raw = idx_bytes(value)
            name = f"{prefix}-{kind}-ubyte" + (".gz" if gz else "")
            with open(os.path.join(folder, name), "wb") as f:
                f.write(gzip.compress(raw) if gz else raw)
    return folder


def mnist_arrays(n_train=5, n_test=3):
    return {"train": (RNG.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
                      RNG.integers(0, 10, n_train, dtype=np.uint8)),
            "test": (RNG.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
                     RNG.integers(0, 10, n_test, dtype=np.uint8))}


def _binstring(b):
    return (b"U" + bytes([len(b)]) + b) if len(b) < 256 else (b"T" + struct.pack("<i", len(b)) + b)


def _int(v):
    return b"K" + bytes([v]) if v < 256 else b"J" + struct.pack("<i", v)


def py2_pickle(entries):
    """A protocol-2 pickle of a dict as Python 2 writes CIFAR's batches: str keys and strings as
    (SHORT_)BINSTRING, ints as BININT, a uint8 array through numpy.core.multiarray._reconstruct
    and a BUILD of (1, shape, dtype, False, raw bytes)."""
    out = b"\x80\x02}(" 
    for key, value in entries.items():
        out += _binstring(key.encode())
        if isinstance(value, np.ndarray):
            out += (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + _int(0) +
                    b"\x85" + _binstring(b"b") + b"\x87R(" + _int(1) +
                    b"(" + b"".join(_int(d) for d in value.shape) + b"t" +
                    b"cnumpy\ndtype\n" + _binstring(b"u1") + _int(0) + _int(1) + b"\x87R(" +
                    _int(3) + _binstring(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xff" +
                    _int(0) + b"tb\x89" + _binstring(value.tobytes()) + b"tb")
        elif isinstance(value, list):
            out += b"](" + b"".join(_int(v) if isinstance(v, int) else _binstring(v.encode())
                                    for v in value) + b"e"
        else:
            out += _binstring(value.encode())
    return out + b"u."


def cifar_rows(images):
    """[n, 3072] rows of NHWC images: the red plane, then green, then blue, pixel by pixel."""
    rows = []
    for img in images:
        rows.append([int(img[r, c, ch]) for ch in range(3) for r in range(32) for c in range(32)])
    return np.asarray(rows, dtype=np.uint8)


def cifar_batch(images, labels, label_key):
    return py2_pickle({"batch_label": "batch", label_key: [int(v) for v in labels],
                       "data": cifar_rows(images),
                       "filenames": [f"img_{i}.png" for i in range(len(labels))]})


def write_cifar(folder, name, per_batch=2, n_test=3, extracted=False):
    """A tiny CIFAR-10 (5 train batches) or CIFAR-100 archive in the published layout; returns
    the expected arrays."""
    archive, sub, batches, label_key = centralised.CIFAR_LAYOUT[name]
    classes = centralised.PUBLISHED[name].num_classes
    members, expected = {}, {}
    for split, names in batches.items():
        xs, ys = [], []
        for batch in names:
            n = per_batch if split == "train" else n_test
            x = RNG.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
            y = RNG.integers(0, classes, n)
            members[f"{sub}/{batch}"] = cifar_batch(x, y, label_key)
            xs.append(x)
            ys.append(y)
        expected[split] = (np.concatenate(xs), np.concatenate(ys))
    os.makedirs(folder, exist_ok=True)
    if extracted:
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
        for member, raw in members.items():
            with open(os.path.join(folder, member), "wb") as f:
                f.write(raw)
    else:
        with tarfile.open(os.path.join(folder, archive), "w:gz") as tar:
            for member, raw in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
    return expected


def assert_arrays(data, expected, channels):
    for split, x, y in (("train", data.train_x, data.train_y), ("test", data.test_x, data.test_y)):
        want_x = expected[split][0]
        want_x = want_x[..., None] if channels == 1 else want_x
        np.testing.assert_array_equal(x, want_x)
        np.testing.assert_array_equal(y, expected[split][1])
        assert x.dtype == np.uint8 and y.dtype == np.int32


def tree_snapshot(root):
    out = {}
    for dirpath, dirs, files in os.walk(root):
        out[os.path.relpath(dirpath, root)] = None
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as h:
                out[os.path.relpath(os.path.join(dirpath, f), root)] = h.read()
    return out


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, env=dict(os.environ, **(env or {})), timeout=300)


def assert_one_line_exit_2(proc):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stdout == ""


OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "no_proxy": "", "NO_PROXY": ""}


# ----------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx_files_are_parsed_as_published(tmp_path, gz):
    expected = mnist_arrays()
    source = write_mnist(str(tmp_path / "mnist"), expected, gz=gz)
    data = load_centralised("mnist", source, str(tmp_path / "cache"))
    assert data.num_classes == 10 and data.train_x.shape == (5, 28, 28, 1)
    assert_arrays(data, expected, channels=1)


def test_idx_values_are_big_endian_of_every_type():
    shorts = np.array([[1, -2, 300], [-32768, 32767, 0]])
    np.testing.assert_array_equal(idx.parse_idx(idx_bytes(shorts, 0x0B, "h")), shorts)
    floats = np.array([1.5, -2.25, 1e-3], dtype=np.float32)
    np.testing.assert_array_equal(idx.parse_idx(idx_bytes(floats, 0x0D, "f")), floats)
    assert idx.parse_idx(idx_bytes(floats, 0x0D, "f")).dtype == np.float32


@pytest.mark.parametrize("raw, words", [
    (b"\x08\x03\x00\x00" + b"\x00" * 12, "not an IDX file"),          # MSB-first magic swapped
    (b"\x00\x00\x07\x01\x00\x00\x00\x01\x00", "not an IDX file"),     # unknown type code
    (idx_bytes(np.zeros((2, 3), np.uint8))[:-1], "needs 6 bytes"),    # truncated data
    (idx_bytes(np.zeros((2, 3), np.uint8)) + b"\x00", "needs 6 bytes"),  # trailing bytes
    (b"\x00\x00\x08\x03\x00\x00", "header truncated"),
])
def test_malformed_idx_is_one_line(raw, words):
    with pytest.raises(DataError, match=words) as err:
        idx.parse_idx(raw, "f.idx")
    assert "\n" not in str(err.value)


def test_fashion_mnist_reads_the_same_format_and_keeps_its_own_cache(tmp_path):
    mnist, fashion = mnist_arrays(4, 2), mnist_arrays(3, 2)
    cache = str(tmp_path / "cache")
    a = load_centralised("mnist", write_mnist(str(tmp_path / "m"), mnist), cache)
    b = load_centralised("fashion_mnist", write_mnist(str(tmp_path / "f"), fashion, gz=False),
                         cache)
    assert_arrays(a, mnist, channels=1)
    assert_arrays(b, fashion, channels=1)


# ----------------------------------------------------------------------------- CIFAR


@pytest.mark.parametrize("extracted", [False, True])
def test_cifar10_archive_and_extracted_batches(tmp_path, extracted):
    expected = write_cifar(str(tmp_path / "src"), "cifar10", extracted=extracted)
    data = load_centralised("cifar10", str(tmp_path / "src"), str(tmp_path / "cache"))
    assert data.train_x.shape == (10, 32, 32, 3) and data.num_classes == 10
    assert_arrays(data, expected, channels=3)


def test_cifar100_reads_fine_labels_from_the_archive_file(tmp_path):
    expected = write_cifar(str(tmp_path / "src"), "cifar100", per_batch=4)
    archive = str(tmp_path / "src" / "cifar-100-python.tar.gz")
    data = load_centralised("cifar100", archive, str(tmp_path / "cache"))
    assert data.num_classes == 100
    assert_arrays(data, expected, channels=3)


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_the_unpickler_refuses_anything_but_numpy_arrays(tmp_path):
    marker = tmp_path / "ran"
    raw = pickle.dumps({b"data": _Payload(str(marker)), b"labels": [0]}, protocol=2)
    with pytest.raises(DataError, match=r"refusing to unpickle (posix|os|nt)\.system"):
        centralised.cifar_files.load_pickle(raw, "evil")
    assert not marker.exists()


# ----------------------------------------------------------------------------- the cache


def test_a_second_load_reads_the_cache_without_parsing(tmp_path, monkeypatch):
    expected = write_cifar(str(tmp_path / "src"), "cifar10")
    cache = str(tmp_path / "cache")
    first = load_centralised("cifar10", str(tmp_path / "src"), cache)

    def no_parse(*args, **kwargs):
        raise AssertionError("parsed again")

    monkeypatch.setattr(centralised, "read_files", no_parse)
    for path in (str(tmp_path / "src"), None):  # the same source, or none given
        again = load_centralised("cifar10", path, cache)
        assert_arrays(again, expected, channels=3)
        assert again.metadata["prepared"] == first.metadata["prepared"]
    monkeypatch.undo()
    # Another source is prepared again.
    other = write_cifar(str(tmp_path / "other"), "cifar10", per_batch=1)
    assert_arrays(load_centralised("cifar10", str(tmp_path / "other"), cache), other, 3)


def test_records_split_into_chunks_come_back_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(centralised, "CHUNK", 2)
    expected = mnist_arrays(5, 3)  # 3 train records (2, 2, 1), 2 test records
    data = load_centralised("mnist", write_mnist(str(tmp_path / "m"), expected),
                            str(tmp_path / "cache"))
    assert data.metadata["split_records"] == {"train": 3, "test": 2}
    assert_arrays(data, expected, channels=1)


# ----------------------------------------------------------------------------- tfds


@pytest.mark.parametrize("name, shape, classes", [
    ("cifar10", (32, 32, 3), 10), ("mnist", (28, 28, 1), 10), ("cifar100", (32, 32, 3), 100),
    ("fashion_mnist", (28, 28, 1), 10), ("emnist/balanced", (28, 28, 1), 47)])
def test_tfds_mock_data_is_loaded_and_cached(tmp_path, monkeypatch, name, shape, classes):
    import tensorflow_datasets as tfds

    # tfds' own calls below (the reference data sources) make a tempfile.mkdtemp("tfds") each
    # that tfds never removes: into tmp_path, not /tmp (the package's calls clean up after
    # themselves, tfds_format.quiet).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cache = str(tmp_path / "cache")
    # The mock fakes every builder's preparation and data source, the cache's own included, so
    # the examples are read under it and cached after it.
    with tfds.testing.mock_data(num_examples=6):
        arrays, metadata = centralised.read_source(f"tfds:{name}", None, cache, download=True)
        reference = {split: tfds.data_source(name, split=split, data_dir=str(tmp_path / "t"))
                     for split in ("train", "test")}
        want = {s: (np.stack([reference[s][i]["image"] for i in range(6)]),
                    np.array([reference[s][i]["label"] for i in range(6)])) for s in reference}
    assert metadata["num_classes"] == classes and tuple(metadata["image_shape"]) == shape
    assert arrays["train"][0].shape == (6,) + shape
    centralised.write_cache(f"tfds:{name}", cache, arrays, metadata)
    monkeypatch.setattr(centralised.tfds_images, "read",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("read again")))
    data = load_centralised(f"tfds:{name}", None, cache)  # no mock, no network: the cache
    assert data.num_classes == classes
    assert_arrays(data, want, channels=3)  # the mock's images already have their channels


@pytest.mark.parametrize("name, words", [
    ("tfds:imdb_reviews", "not an image-classification dataset"),
    ("tfds:no_such_dataset_here", "has no dataset 'no_such_dataset_here'"),
    ("tfds:emnist/no_such_config", "tfds:emnist/no_such_config: "),
    ("tfds:Bad Name", "not a tensorflow-datasets name"),
    ("tfds:mnist", "not prepared as array_record"),
])
def test_tfds_errors_are_one_line_and_write_nothing(tmp_path, name, words):
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(DataError, match=words) as err:
        load_centralised(name, str(tmp_path / "tfds_dir") if name == "tfds:mnist" else None,
                         str(cache))
    assert "\n" not in str(err.value)
    assert os.listdir(cache) == []


def test_a_missing_source_names_the_files_and_where_to_put_them(tmp_path):
    with pytest.raises(DataError) as err:
        prepare_dataset(DataConfig(dataset="fashion_mnist", data_dir=str(tmp_path)))
    line = str(err.value)
    assert "\n" not in line and "train-images-idx3-ubyte.gz" in line
    assert os.path.join(str(tmp_path), "raw", "fashion_mnist") in line and "--download" in line


# ----------------------------------------------------------------------------- the command


@pytest.mark.slow
def test_prepare_command_then_load(tmp_path):
    expected = mnist_arrays(4, 2)
    source = write_mnist(str(tmp_path / "src"), expected)
    cache = str(tmp_path / "cache")
    proc = run("data_prep.prepare", "--dataset=mnist", f"--source={source}", f"--data_dir={cache}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("prepared mnist in ")
    assert_arrays(load_centralised("mnist", None, cache), expected, channels=1)
    proc = run("data_prep.verify", "--dataset=mnist", f"--data_dir={cache}")
    assert proc.returncode == 0, proc.stderr
    assert "every file matches" in proc.stdout


def _bad_idx(tmp_path):
    source = write_mnist(str(tmp_path / "src"), mnist_arrays(2, 2), gz=False)
    path = os.path.join(source, "t10k-images-idx3-ubyte")
    with open(path, "r+b") as f:
        f.write(b"\x00\x00\x08\x09")  # 9 dimensions: not the published 0x00000803
    return source


def _truncated_archive(tmp_path):
    write_cifar(str(tmp_path / "src"), "cifar10")
    path = str(tmp_path / "src" / "cifar-10-python.tar.gz")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return str(tmp_path / "src")


@pytest.mark.parametrize("case", [
    "bad_idx_magic", "offline_download",
    pytest.param("truncated_archive", marks=pytest.mark.slow),
    pytest.param("not_images", marks=pytest.mark.slow),
    pytest.param("offline_tfds_download", marks=pytest.mark.slow)])
def test_prepare_errors_exit_2_with_one_line_and_write_nothing(tmp_path, case):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "keep.txt").write_text("a file of the user's")
    args = {"bad_idx_magic": lambda: ["--dataset=mnist", f"--source={_bad_idx(tmp_path)}"],
            "truncated_archive": lambda: ["--dataset=cifar10",
                                          f"--source={_truncated_archive(tmp_path)}"],
            "not_images": lambda: ["--dataset=tfds:imdb_reviews"],
            "offline_download": lambda: ["--dataset=cifar10", "--download"],
            "offline_tfds_download": lambda: ["--dataset=tfds:mnist", "--download"]}[case]()
    before = tree_snapshot(str(cache))
    proc = run("data_prep.prepare", *args, f"--data_dir={cache}", env=OFFLINE)
    assert_one_line_exit_2(proc)
    assert tree_snapshot(str(cache)) == before
    words = {"bad_idx_magic": "is not an IDX file of MNIST's format", "truncated_archive": "not a complete tar",
             "not_images": "not an image-classification dataset",
             "offline_download": "could not download", "offline_tfds_download": "tfds:mnist"}
    assert words[case] in proc.stderr


@pytest.mark.parametrize("damage", ["truncated_archive", "truncated_gzip", "swapped_files"])
def test_damaged_sources_are_one_line_and_cache_nothing(tmp_path, damage):
    if damage == "truncated_archive":
        name, source, words = "cifar10", _truncated_archive(tmp_path), "not a complete tar"
    else:
        name, words = "mnist", ("not a complete gzip" if damage == "truncated_gzip"
                                else "expected 0x00000803")
        source = write_mnist(str(tmp_path / "src"), mnist_arrays(2, 2))
        images = os.path.join(source, "train-images-idx3-ubyte.gz")
        labels = os.path.join(source, "train-labels-idx1-ubyte.gz")
        if damage == "truncated_gzip":
            with open(images, "r+b") as f:
                f.truncate(os.path.getsize(images) - 9)
        else:
            os.replace(labels, images)
            write_mnist(str(tmp_path / "other"), mnist_arrays(2, 2))
            os.replace(os.path.join(str(tmp_path / "other"), "train-labels-idx1-ubyte.gz"),
                       labels)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=words) as err:
        load_centralised(name, source, str(cache))
    assert "\n" not in str(err.value)
    assert not cache.exists()


def test_a_batch_pickled_again_by_python_3_is_read_too():
    images = RNG.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    for protocol in (2, 4, 5):  # bytes through _codecs.encode (2), numpy's newer reducers
        raw = pickle.dumps({b"data": cifar_rows(images), b"labels": [3, 7]}, protocol=protocol)
        batch = centralised.cifar_files.load_pickle(raw, "py3")
        x, y = centralised.cifar_files.batch_arrays(batch, "labels", 10, "py3")
        np.testing.assert_array_equal(x, images)
        np.testing.assert_array_equal(y, [3, 7])


@pytest.mark.slow   # a run or a figure end to end: CI's second step
def test_a_run_partitions_an_image_dataset_into_clients(tmp_path, capsys):
    """--dataset=mnist --partition=iid: the published files prepared, split into train and test
    clients by the partitioner, trained, and the partition written beside the outputs; without
    --partition, one line and exit 2."""
    from tests.conftest import run_runner
    src, out = tmp_path / "src", tmp_path / "out"
    rng = np.random.default_rng(0)
    arrays = {"train": (rng.integers(0, 256, (40, 28, 28), dtype=np.uint8),
                        np.arange(40, dtype=np.uint8) % 10),
              "test": (rng.integers(0, 256, (20, 28, 28), dtype=np.uint8),
                       np.arange(20, dtype=np.uint8) % 10)}
    write_mnist(src, arrays)
    common = ["--dataset=mnist", f"--data_path={src}", f"--data_dir={tmp_path / 'cache'}",
              "--model=linear", "--num_rounds=2", "--clients_per_round=2", "--thetas=0.5",
              "--seeds=1", "--eval_every=1", "--tensorboard=no"]
    code, err, _ = run_runner(common + [f"--output_dir={out}"], capsys)
    assert code == 2 and "--partition" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    code, err, _ = run_runner(common + ["--partition=iid", "--num_clients=4",
                                        f"--output_dir={out}"], capsys)
    assert code == 0, err
    with np.load(out / "partition.npz") as z:
        for split, n in (("train", 40), ("test", 20)):   # iid: every example once, 4 clients
            assert np.array_equal(np.sort(z[f"{split}_indices"]), np.arange(n))
            assert np.array_equal(np.diff(z[f"{split}_offsets"]), [n // 4] * 4)
    with np.load(out / "clients.npz") as z:
        assert z["train_error"].shape[-1] == 4
    assert (out / "summary.json").exists()
