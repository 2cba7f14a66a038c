"""The prepared-dataset cache stays whole: a broken build is never read as a dataset.

- Two concurrent ``python -m data_prep.prepare --dataset=shakespeare`` into one empty data dir
  both succeed, leave one whole dataset and no temporary directory, and the dataset loads.
- A damaged cache (a truncated or missing file, a missing checksums file) is detected on open by
  the recorded sizes and rebuilt on the next load with one warning line; the rebuilt data equal
  the original.
- Opening costs O(metadata): open and read hash no file of the cache (a load hashes its source's
  files, to tell whether they still hold what was prepared). A file altered in place
  (same size) is caught by ``python -m data_prep.verify`` (exit 2, one line; 0 when whole), and
  when it breaks a read, by the full check that then runs (DamagedDataset: prepare again).
- A second preparation of the same content keeps the installed copy; other content replaces it.
- The temporary directory of a killed preparation on this host is removed by the next one.
- A prepared copy is keyed by what its source files hold: a rewritten source file (the same size
  and modification time included) is prepared again, saying so in one line; settings that no data
  can meet are refused before any cache is written; tfds leaves no temporary folder.
"""

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from deltafl_jax.datasets import (DataConfig, cache, centralised, load_centralised,
                                  load_dataset, prepared)
from deltafl_jax.errors import DataError
from test_image_datasets import tree_snapshot, write_mnist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Four roles of 60..120 characters: with min_client_examples=10 all are kept, so a preparation
# takes about a second (tfds' own overhead).
TINY_PLAY = """# Tiny

## ACT I

**ALPHA**
Now is the winter of our discontent made glorious summer by this sun of York.

**BETA**
And all the clouds that loured upon our house in the deep bosom of the ocean buried.

**GAMMA**
Now are our brows bound with victorious wreaths, our bruised arms hung up for monuments.

**DELTA**
Our stern alarums changed to merry meetings, our dreadful marches to delightful measures.
"""


def _config(data_dir, source, k=10):
    return DataConfig(dataset="shakespeare", data_path=source, data_dir=str(data_dir),
                      min_client_examples=k)


@pytest.fixture
def tiny_source(tmp_path):
    folder = tmp_path / "plays"
    folder.mkdir()
    (folder / "tiny.md").write_text(TINY_PLAY)
    return str(folder)


def _leftovers(data_dir):
    root = os.path.join(str(data_dir), "deltafl_shakespeare")
    return [e for e in os.listdir(root) if e.startswith((".incomplete-", ".trash-"))]


def _dataset_dir(data_dir, k=10):
    return prepared.dataset_path(str(data_dir), "shakespeare", prepared.config_name(k))


def _records_file(path):
    (name,) = [e for e in os.listdir(path) if ".array_record-" in e]
    return os.path.join(path, name)


@contextlib.contextmanager
def count_hashing(monkeypatch):
    """The files that the cache's sha256 function hashes inside the block (a list)."""
    hashed = []
    real = cache._file_sha256

    def counting(path):
        hashed.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(cache, "_file_sha256", counting)
    yield hashed
    monkeypatch.setattr(cache, "_file_sha256", real)


def _flip_byte(file, offset):
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _verify(data_dir, *flags):
    return subprocess.run([sys.executable, "-m", "data_prep.verify", "--dataset=shakespeare",
                           f"--data_dir={data_dir}", *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def _assert_same(a, b):
    for split in ("train", "test"):
        sa, sb = getattr(a, split), getattr(b, split)
        np.testing.assert_array_equal(sa.x, sb.x)
        np.testing.assert_array_equal(sa.y, sb.y)
        np.testing.assert_array_equal(sa.offsets, sb.offsets)
        assert list(sa.client_ids) == list(sb.client_ids)


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_concurrent_preparations_both_succeed(tmp_path):
    # 369 roles: a preparation takes a few seconds, long enough for the two to overlap (before
    # the fix, the second one failed renaming onto the first one's finished directory).
    data_dir = tmp_path / "data"
    command = [sys.executable, "-m", "data_prep.prepare", "--dataset=shakespeare",
               f"--data_dir={data_dir}", "--min_client_examples=3000"]
    start = time.perf_counter()
    procs = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err
        assert "prepared shakespeare in" in out
    elapsed = time.perf_counter() - start
    path = _dataset_dir(data_dir, 3000)
    assert cache.damage(path) is None
    assert _leftovers(data_dir) == []
    data = load_dataset(DataConfig(dataset="shakespeare", data_dir=str(data_dir),
                                   min_client_examples=3000))
    assert data.train.num_clients + data.test.num_clients == 369
    print(f"two concurrent preparations: {elapsed:.1f} s")


@pytest.mark.parametrize("damage", ["truncate", "drop_records", "drop_checksums", "drop_info"])
def test_damaged_cache_is_rebuilt_with_one_warning(tmp_path, tiny_source, capsys, monkeypatch,
                                                   damage):
    data_dir = tmp_path / "data"
    original = load_dataset(_config(data_dir, tiny_source))
    path = _dataset_dir(data_dir)
    assert cache.damage(path) is None
    capsys.readouterr()

    records = _records_file(path)
    size = os.path.getsize(records)
    if damage == "truncate":
        with open(records, "r+b") as f:
            f.truncate(os.path.getsize(records) // 2)
    elif damage == "drop_records":
        os.remove(records)
    elif damage == "drop_checksums":
        os.remove(os.path.join(path, cache.CHECKSUMS_FILE))
    else:
        os.remove(os.path.join(path, "dataset_info.json"))
        # the config is then no longer listed as prepared: it is simply prepared again
    assert cache.damage(path) is not None
    expected = prepared.DataError if damage == "drop_info" else prepared.DamagedDataset
    with count_hashing(monkeypatch) as hashed, pytest.raises(expected) as caught:
        prepared.open_prepared(str(data_dir), "shakespeare", prepared.config_name(10))
    assert hashed == []  # caught by presence and size alone
    if damage == "truncate":
        assert f"{os.path.basename(records)} has {size // 2} bytes, not {size}" in str(caught.value)

    rebuilt = load_dataset(_config(data_dir, tiny_source))
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    if damage == "drop_info":
        assert warnings == []
    else:
        assert len(warnings) == 1, err
        assert "damaged" in warnings[0] and "rebuilding" in warnings[0] and path in warnings[0]
    _assert_same(original, rebuilt)
    assert cache.damage(path) is None
    assert _leftovers(data_dir) == []

    # and the next load is quiet
    load_dataset(_config(data_dir, tiny_source))
    assert "warning" not in capsys.readouterr().err


def test_same_content_keeps_the_installed_copy_other_content_replaces_it(tmp_path):
    data_dir = str(tmp_path)
    spec = {"text": ((None,), np.uint8)}
    clients = [{"client_id": f"c{i}", "text": np.arange(30 + i, dtype=np.uint8)}
               for i in range(3)]
    path = prepared.write(data_dir, "shakespeare", "min1", spec, clients, {"source": "a"})
    first = os.stat(_records_file(path)).st_ino
    prepared.write(data_dir, "shakespeare", "min1", spec, clients, {"source": "a"})
    assert os.stat(_records_file(path)).st_ino == first  # the installed copy was kept

    prepared.write(data_dir, "shakespeare", "min1", spec, clients[:2], {"source": "b"})
    info = prepared.open_prepared(data_dir, "shakespeare", "min1")
    assert info.metadata["source"] == "b" and info.num_records == 2
    assert _leftovers(data_dir) == []


def test_leftovers_of_dead_preparations_are_removed(tmp_path, tiny_source):
    root = tmp_path / "deltafl_shakespeare"
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = root / f".incomplete-min10-0123abcd-{host}-{dead_pid}"
    live = root / f".incomplete-min10-0123abcd-{host}-{os.getpid()}"
    elsewhere = root / f".trash-min10-0123abcd-other-host-{dead_pid}"
    for folder in (stale, live, elsewhere):
        (folder / "x").mkdir(parents=True)
    load_dataset(_config(tmp_path, tiny_source))
    assert not stale.exists()
    assert live.exists() and elsewhere.exists()


def test_open_and_read_hash_nothing_verify_hashes_every_file(tmp_path, tiny_source, monkeypatch):
    data_dir = str(tmp_path / "data")
    original = load_dataset(_config(data_dir, tiny_source))
    path = _dataset_dir(data_dir)
    listed = sorted(cache.read_checksums(path)["files"])
    assert listed == sorted(e for e in os.listdir(path) if e != cache.CHECKSUMS_FILE)
    with count_hashing(monkeypatch) as hashed:
        again = load_dataset(_config(data_dir, tiny_source))  # open_or_prepare, open, read
        info = prepared.open_prepared(data_dir, "shakespeare", prepared.config_name(10))
        prepared.read(info, "shakespeare")
    assert hashed == ["tiny.md"]   # the source's play (is it what was prepared?), no cache file
    _assert_same(original, again)
    with count_hashing(monkeypatch) as hashed:
        assert cache.damage(path) is None  # the full check: each listed file once
    assert sorted(hashed) == listed


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_same_size_corruption_is_caught_by_verify_and_by_a_failed_read(tmp_path, tiny_source,
                                                                      monkeypatch):
    data_dir = str(tmp_path / "data")
    original = load_dataset(_config(data_dir, tiny_source))
    path = _dataset_dir(data_dir)
    records = _records_file(path)
    ok = _verify(data_dir)
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert len(lines) == 5 and all(line.startswith("ok ") for line in lines[:4])
    assert f"({os.path.getsize(records)} bytes)" in ok.stdout
    assert "every file matches" in lines[-1] and ok.stderr == ""

    # The last byte of the records file (array_record's padding): the data still read back
    # whole, so only the full check sees it.
    _flip_byte(records, os.path.getsize(records) - 1)
    with count_hashing(monkeypatch) as hashed:
        _assert_same(original, load_dataset(_config(data_dir, tiny_source)))
    assert hashed == ["tiny.md"]   # the source's play only: no cache file, so the flip goes unseen
    bad = _verify(data_dir)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "damaged" in bad.stderr and "fails its sha256 check" in bad.stderr
    assert "python -m data_prep.prepare --dataset=shakespeare" in bad.stderr
    assert f"DAMAGED  min10/{prepared.VERSION}/{os.path.basename(records)}" in bad.stdout
    _flip_byte(records, os.path.getsize(records) - 1)  # undo

    # Byte 100 lies in the first chunk's records: the read fails, the full check runs and
    # names the file and the command that prepares it again.
    _flip_byte(records, 100)
    info = prepared.open_prepared(data_dir, "shakespeare", prepared.config_name(10))
    with count_hashing(monkeypatch) as hashed, pytest.raises(prepared.DamagedDataset) as caught:
        prepared.read(info, "shakespeare")
    assert len(hashed) == len(cache.read_checksums(path)["files"])
    message = str(caught.value)
    assert "fails its sha256 check" in message and os.path.basename(records) in message
    assert "run python -m data_prep.prepare --dataset=shakespeare again" in message
    assert "\n" not in message
    with pytest.raises(prepared.DamagedDataset):
        load_dataset(_config(data_dir, tiny_source))

    # preparing again replaces the damaged copy (same content, but not whole)
    prepared_again = subprocess.run(
        [sys.executable, "-m", "data_prep.prepare", "--dataset=shakespeare",
         f"--source={tiny_source}", f"--data_dir={data_dir}", "--min_client_examples=10"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert prepared_again.returncode == 0, prepared_again.stderr
    assert _verify(data_dir).returncode == 0
    _assert_same(original, load_dataset(_config(data_dir, tiny_source)))


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_verify_missing_truncated_and_bad_flags(tmp_path, tiny_source):
    data_dir = str(tmp_path / "data")
    nothing = _verify(data_dir)
    assert nothing.returncode == 2 and nothing.stdout == ""
    assert nothing.stderr.strip().splitlines() == [
        f"error: shakespeare: nothing prepared under {data_dir}; run python -m data_prep.prepare "
        f"--dataset=shakespeare"]
    load_dataset(_config(data_dir, tiny_source))
    assert _verify(data_dir, "--min_client_examples=10").returncode == 0
    assert _verify(data_dir, "--min_client_examples=11").returncode == 2  # not prepared
    records = _records_file(_dataset_dir(data_dir))
    size = os.path.getsize(records)
    with open(records, "r+b") as f:
        f.truncate(size - 1)
    bad = _verify(data_dir)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert f"{os.path.basename(records)} has {size - 1} bytes, not {size}" in bad.stderr
    os.remove(os.path.join(_dataset_dir(data_dir), "features.json"))
    missing = _verify(data_dir)
    assert missing.returncode == 2
    assert f"DAMAGED  min10/{prepared.VERSION}/features.json: is missing" in missing.stdout
    wrong = subprocess.run([sys.executable, "-m", "data_prep.verify", "--dataset=synthetic"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 2 and "--dataset must be one of" in wrong.stderr


# --------------------------------------------------------------------------------------------
# The cache is keyed by what its source files hold (centralised image data, issue 51)


def _mnist(seed, n_train=6, n_test=3):
    """MNIST-shaped arrays of `seed`: every seed gives IDX files of the same sizes."""
    rng = np.random.default_rng(seed)
    return {"train": (rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
                      rng.integers(0, 10, n_train, dtype=np.uint8)),
            "test": (rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
                     rng.integers(0, 10, n_test, dtype=np.uint8))}


def _same_images(got, arrays):
    np.testing.assert_array_equal(got.train_x[..., 0], arrays["train"][0])
    np.testing.assert_array_equal(got.train_y, arrays["train"][1])
    np.testing.assert_array_equal(got.test_x[..., 0], arrays["test"][0])
    np.testing.assert_array_equal(got.test_y, arrays["test"][1])


def _regenerate(source, arrays):
    """Write `arrays` over the IDX files of `source`, keeping each file's modification time
    (as an archive extracted again does): only the bytes tell."""
    times = {f: os.stat(os.path.join(source, f)).st_mtime_ns for f in os.listdir(source)}
    write_mnist(source, arrays, gz=False)
    for f, ns in times.items():
        os.utime(os.path.join(source, f), ns=(ns, ns))
    assert {f: os.path.getsize(os.path.join(source, f)) for f in times} == sizes(source)


def sizes(source):
    return {f: os.path.getsize(os.path.join(source, f)) for f in os.listdir(source)}


def test_regenerated_idx_files_are_prepared_again(tmp_path, capsys, monkeypatch):
    """The IDX files of a folder written anew (same sizes, same modification times): the next
    load, with --data_path or without it, sees the new data and says why in one line; the same
    bytes touched again are no change (the copy is read, nothing parsed, nothing said)."""
    source, data_dir = str(tmp_path / "src"), str(tmp_path / "cache")
    first, second = _mnist(1), _mnist(2)
    write_mnist(source, first, gz=False)
    before = sizes(source)
    _same_images(load_centralised("mnist", source, data_dir), first)
    capsys.readouterr()
    _regenerate(source, second)
    assert sizes(source) == before
    _same_images(load_centralised("mnist", source, data_dir), second)
    changed = [l for l in capsys.readouterr().err.splitlines() if "changed" in l]
    assert changed == [f"deltafl_jax: the source of the prepared mnist changed since it was "
                       f"prepared ({source}/t10k-images-idx3-ubyte holds other bytes: the same "
                       f"size, another sha256); preparing it again"]
    _same_images(load_centralised("mnist", None, data_dir), second)   # the new copy, kept
    assert capsys.readouterr().err == ""
    _regenerate(source, first)    # back to the first data, without --data_path
    _same_images(load_centralised("mnist", None, data_dir), first)
    err = capsys.readouterr().err
    assert f"the source of the prepared mnist changed since it was prepared ({source}/" in err
    for f in os.listdir(source):  # the same bytes, a new modification time: no change
        os.utime(os.path.join(source, f))
    monkeypatch.setattr(centralised, "read_files",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("parsed again")))
    _same_images(load_centralised("mnist", source, data_dir), first)
    assert capsys.readouterr().err == ""


def test_a_copy_prepared_before_sources_were_recorded(tmp_path, capsys):
    """A cached copy without a record of its source files (as this package wrote it before; the
    loaders read ``source_files`` with .get, so null stands for absent): kept while its source
    holds the same images (nothing prepared), prepared again once it does not."""
    source, data_dir = str(tmp_path / "src"), str(tmp_path / "cache")
    first = _mnist(3)
    write_mnist(source, first)
    arrays, metadata = centralised.read_source("mnist", source, data_dir)
    metadata["source_files"] = None
    path = centralised.write_cache("mnist", data_dir, arrays, metadata)
    records = _records_file(path)
    stamp = os.stat(records).st_mtime_ns
    capsys.readouterr()
    _same_images(load_centralised("mnist", source, data_dir), first)
    assert capsys.readouterr().err == "" and os.stat(records).st_mtime_ns == stamp
    second = _mnist(4)
    write_mnist(source, second)
    _same_images(load_centralised("mnist", None, data_dir), second)
    err = capsys.readouterr().err
    assert f"changed since it was prepared ({source} holds other images or labels)" in err
    assert "source_files" in load_centralised("mnist", source, data_dir).metadata


def test_preparing_images_leaves_no_temporary_folder_and_names_what_it_prepares(
        tmp_path, capsys, monkeypatch):
    """A preparation (load_centralised, as a run's first load and data_prep.prepare do): tfds'
    temporary folders (one empty tmp*tfds per preparation before) are removed; the line names
    the images, not the records as clients that a centralised dataset does not have."""
    source, temp = str(tmp_path / "src"), tmp_path / "tmp"
    temp.mkdir()
    write_mnist(source, _mnist(5, 40, 20))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    load_centralised("mnist", source, str(tmp_path / "cache"))
    assert os.listdir(temp) == []
    (line,) = [l for l in capsys.readouterr().err.splitlines() if "preparing" in l]
    assert line.startswith("deltafl_jax: preparing mnist (40 train and 20 test images, "
                           "centralised: --partition splits them into clients) in "), line
    assert "2 clients" not in line


BAD_PARTITIONS = [
    (["--partition=dirichlet", "--dirichlet_alpha=0"], "--dirichlet_alpha must be > 0, got 0"),
    (["--partition=iid", "--num_clients=0"], "--num_clients must be at least 1, got 0"),
    (["--partition=iid", "--num_clients=4", "--max_train_clients=0"],
     "--max_train_clients must be at least 1, got 0"),
    (["--partition=dirichlet", "--min_partition_size=-1"],
     "--min_partition_size must be >= 0, got -1"),
]


def _data_config(source, data_dir, flags):
    settings = {"data_path": source, "data_dir": str(data_dir)}
    for flag in flags:
        name, value = flag[2:].split("=")
        settings[name] = value if name == "partition" else float(value) \
            if name == "dirichlet_alpha" else int(value)
    return DataConfig("mnist", **settings)


@pytest.mark.parametrize("flags, words", BAD_PARTITIONS)
def test_bad_partition_settings_are_refused_before_the_cache(tmp_path, flags, words):
    """load_dataset checks the settings before the loader prepares anything: the refusal names
    the flag and --data_dir is not made."""
    source = str(tmp_path / "src")
    write_mnist(source, _mnist(6, 40, 20))
    data_dir = tmp_path / "cache"
    with pytest.raises(DataError, match=f"^{words}$"):
        load_dataset(_data_config(source, data_dir, flags))
    assert not data_dir.exists()


@pytest.mark.slow   # a start-up of experiments.run (JAX) each; the fast test above, in-process
@pytest.mark.parametrize("flags, words", BAD_PARTITIONS[:1])
def test_bad_partition_settings_write_no_cache(tmp_path, flags, words):
    """Refused with one line and exit 2 before anything is written: no dataset cache in
    --data_dir, no output folder (the cache was written first before)."""
    source = str(tmp_path / "src")
    write_mnist(source, _mnist(6, 40, 20))
    before = tree_snapshot(source)
    data_dir, out = tmp_path / "cache", tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "--dataset=mnist",
                           f"--data_path={source}", f"--data_dir={data_dir}", "--model=linear",
                           "--num_rounds=1", f"--output_dir={out}", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert words in lines[0]
    assert not data_dir.exists() and not out.exists()
    assert tree_snapshot(source) == before


def test_source_change_of_a_large_source_hashes_only_files_whose_time_changed(tmp_path):
    """cache.source_change without always_hash (a source above prepared.HASH_EVERY_LOAD): a file
    of the recorded size and modification time is taken as it was (not read); another time
    sends it to its sha256; another size is a change without reading it."""
    path = tmp_path / "big.bin"
    path.write_bytes(b"a" * 64)
    recorded = cache.file_facts([str(path)])
    ns = os.stat(path).st_mtime_ns
    path.write_bytes(b"b" * 64)
    os.utime(path, ns=(ns, ns))
    assert cache.source_change(recorded, [str(path)], always_hash=False) is None
    assert "another sha256" in cache.source_change(recorded, [str(path)], always_hash=True)
    os.utime(path, ns=(ns + 10 ** 9, ns + 10 ** 9))
    assert "another sha256" in cache.source_change(recorded, [str(path)], always_hash=False)
    path.write_bytes(b"a" * 64)   # the recorded bytes again, a new time: no change
    assert cache.source_change(recorded, [str(path)], always_hash=False) is None
    path.write_bytes(b"a" * 65)
    assert cache.source_change(recorded, [str(path)]) == f"{path} has 65 bytes, not 64"
    assert cache.source_change(recorded, []) == f"{path} is no longer read"
    assert cache.source_change({}, [str(path)]) == f"{path} is new"
