"""The prepared-dataset cache stays whole: a broken build is never read as a dataset.

- Two concurrent ``python -m data_prep.prepare --dataset=shakespeare`` into one empty data dir
  both succeed, leave one whole dataset and no temporary directory, and the dataset loads.
- A damaged cache (a truncated or altered file, a missing checksums file) is detected by its
  checksums and rebuilt on the next load with one warning line; the rebuilt data equal the
  original.
- A second preparation of the same content keeps the installed copy; other content replaces it.
- The temporary directory of a killed preparation on this host is removed by the next one.
"""

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from deltafl_jax.datasets import DataConfig, load_dataset, prepared

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


def _assert_same(a, b):
    for split in ("train", "test"):
        sa, sb = getattr(a, split), getattr(b, split)
        np.testing.assert_array_equal(sa.x, sb.x)
        np.testing.assert_array_equal(sa.y, sb.y)
        np.testing.assert_array_equal(sa.offsets, sb.offsets)
        assert list(sa.client_ids) == list(sb.client_ids)


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
    assert prepared.damage(path) is None
    assert _leftovers(data_dir) == []
    data = load_dataset(DataConfig(dataset="shakespeare", data_dir=str(data_dir),
                                   min_client_examples=3000))
    assert data.train.num_clients + data.test.num_clients == 369
    print(f"two concurrent preparations: {elapsed:.1f} s")


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "drop_checksums", "drop_info"])
def test_damaged_cache_is_rebuilt_with_one_warning(tmp_path, tiny_source, capsys, damage):
    data_dir = tmp_path / "data"
    original = load_dataset(_config(data_dir, tiny_source))
    path = _dataset_dir(data_dir)
    assert prepared.damage(path) is None
    capsys.readouterr()

    records = _records_file(path)
    if damage == "truncate":
        with open(records, "r+b") as f:
            f.truncate(os.path.getsize(records) // 2)
    elif damage == "flip_byte":
        with open(records, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "drop_checksums":
        os.remove(os.path.join(path, prepared.CHECKSUMS_FILE))
    else:
        os.remove(os.path.join(path, "dataset_info.json"))
        # the config is then no longer listed as prepared: it is simply prepared again
    assert prepared.damage(path) is not None
    expected = prepared.DataError if damage == "drop_info" else prepared.DamagedDataset
    with pytest.raises(expected):
        prepared.open_prepared(str(data_dir), "shakespeare", prepared.config_name(10))

    rebuilt = load_dataset(_config(data_dir, tiny_source))
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    if damage == "drop_info":
        assert warnings == []
    else:
        assert len(warnings) == 1, err
        assert "damaged" in warnings[0] and "rebuilding" in warnings[0] and path in warnings[0]
    _assert_same(original, rebuilt)
    assert prepared.damage(path) is None
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
