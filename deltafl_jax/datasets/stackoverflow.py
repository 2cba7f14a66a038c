"""StackOverflow next-word prediction: one client per user, read from TensorFlow Federated's files.

The large cross-device benchmark of Reddi et al. 2021 ("Adaptive Federated Optimization",
App. C), built from TFF's published ``stackoverflow`` dataset without TensorFlow.

Source files (TFF, ``tff.simulation.datasets.stackoverflow``):

- ``stackoverflow.sqlite`` (published as ``stackoverflow.sqlite.lzma``): a table
  ``examples(split_name TEXT, client_id TEXT, serialized_example_proto BLOB)`` with one row per
  sentence, ``split_name`` one of ``train``, ``heldout``, ``test``, and a table
  ``client_metadata(client_id TEXT, split_name TEXT, num_examples INTEGER)`` (used when present
  to list the clients without scanning the examples). Each blob is a serialized
  ``tf.train.Example`` with the features ``tokens`` (bytes: the sentence, lower-cased and
  tokenised by TFF, tokens separated by one space), ``title``, ``tags`` (``|``-separated),
  ``creation_date``, ``type`` (bytes) and ``score`` (int64). Only ``tokens`` is used. The protos
  are parsed by :func:`deltafl_jax.datasets.femnist.parse_example` (the wire format, no TF).
  TFF's splits: train = posts before 2018-01-01 (342,477 users, 135,818,730 sentences), test =
  posts from 2018 on (204,088 users, 16,586,035 sentences), heldout = users with id % 10 == 0.
- ``stackoverflow.word_count`` (in ``stackoverflow.word_count.tar.bz2``): one ``word count``
  line per word, the most frequent first.

Rules (TFF's ``word_prediction_preprocessing.build_to_ids_fn`` with ``vocab_size=10000``,
``sequence_length=20``, one OOV bucket; Reddi et al. App. C):

- vocabulary: the first ``VOCAB_SIZE = 10000`` words of the word-count file (fewer when the file
  is shorter); word i of the file (0-based) gets id i + 1;
- ids: ``PAD = 0``, words ``1..V``, ``OOV = V + 1``, ``BOS = V + 2``, ``EOS = V + 3``: V + 4 =
  10,004 ids in all;
- a sentence is split on single spaces exactly as ``tf.strings.split(s, sep=' ')`` (so two
  spaces give an empty word, an OOV), truncated to its first 20 words, each word mapped to its
  id (OOV when not in the vocabulary); EOS is appended only when the sentence had fewer than 20
  words (so it survived the truncation whole); BOS is prepended; the result (at most 21 ids) is
  padded with PAD to ``SEQUENCE_LENGTH = 21``;
- one example per sentence, x = those 21 ids (int32); there is no label (``y`` is None): the
  model reads x[:, :20] and predicts x[:, 1:] (:func:`deltafl_jax.models.text.lstm_nwp`);
- train clients = the users of TFF's ``train`` split, test clients = the users of its ``test``
  split, each client's sentences in the database's row order. TFF splits by date, not by user:
  a user may be a client of both splits, with different sentences (the ``heldout`` split is
  not used). This is the setting of Reddi et al. (train on ``train``, evaluate on ``test``),
  not the papers' disjoint 50/50 split by client;
- clients with >= ``min_client_examples`` sentences (default 1: every user) are kept.

Limits applied while reading. ``--max_train_clients`` / ``--max_test_clients`` pick clients by
:func:`deltafl_jax.datasets.limits.choose_clients` (the rule of the runner's limits) among the
eligible clients of each split in client-id order, and ``--max_examples_per_client`` keeps
each client's first sentences. A preparation with such limits reads (and stores) only those
sentences, as a cache config of its own (``min<k>-tr<A>-te<B>-ex<E>-seed<s>``); a complete
preparation (``min<k>``) serves any limits, applied before its records are read. Either way the
loaded dataset equals the complete one with the runner's limits applied afterwards.

The prepared records store the ids as uint16 (half the disk; V + 4 < 65536); they are loaded as
int32. The vocabulary is stored beside them (``vocab.npy``).

Download (only with ``python -m data_prep.prepare --dataset=stackoverflow --download``): the two
files below are fetched into ``<data_dir>/raw/stackoverflow/``, the SQLite file decompressed
with :mod:`lzma` and the word counts extracted with :mod:`tarfile`, with progress on stderr.
"""

from __future__ import annotations

import array
import glob
import os
import shutil
import sqlite3
import sys
import tarfile
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.data import ClientData, DataError, FederatedDataset
from deltafl_jax.datasets import archives, prepared
from deltafl_jax.datasets.femnist import parse_example
from deltafl_jax.datasets.limits import choose_clients

NAME = "stackoverflow"
VOCAB_SIZE = 10000
MAX_WORDS = 20
SEQUENCE_LENGTH = MAX_WORDS + 1
PAD_ID = 0
DEFAULT_MIN_CLIENT_EXAMPLES = 1
SPLITS = ("train", "test")
SQLITE_NAME = "stackoverflow.sqlite"
WORD_COUNT_NAME = "stackoverflow.word_count"
SQLITE_URL = "https://storage.googleapis.com/tff-datasets-public/stackoverflow.sqlite.lzma"
WORD_COUNT_URL = ("https://storage.googleapis.com/tff-datasets-public/"
                  "stackoverflow.word_count.tar.bz2")
RAW_SUBDIR = os.path.join("raw", "stackoverflow")
PROGRESS_ROWS = 1_000_000


# ----------------------------------------------------------------------------- vocabulary, ids


def special_ids(vocab_size: int) -> Dict[str, int]:
    """TFF's special ids for a vocabulary of `vocab_size` words and one OOV bucket."""
    v = int(vocab_size)
    return {"pad": PAD_ID, "oov": v + 1, "bos": v + 2, "eos": v + 3, "num_ids": v + 4}


def read_vocab(path: str, size: int = VOCAB_SIZE) -> List[str]:
    """The first `size` words of a ``word count`` file (most frequent first)."""
    words: List[str] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if len(words) >= size:
                break
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2 or not parts[1].isdigit():
                raise DataError(f"{path}:{number}: expected 'word count', got {line.strip()!r}")
            words.append(parts[0])
    if not words:
        raise DataError(f"{path}: no words in the word-count file")
    return words


def to_ids(sentence: str, lookup: Dict[str, int], vocab_size: int) -> np.ndarray:
    """The 21 ids of one sentence (module docstring, "Rules"); `lookup[word]` = its id 1..V."""
    ids = special_ids(vocab_size)
    words = sentence.split(" ")
    tokens = [lookup.get(w, ids["oov"]) for w in words[:MAX_WORDS]]
    if len(words) < MAX_WORDS:
        tokens.append(ids["eos"])
    out = np.zeros(SEQUENCE_LENGTH, np.int64)
    out[0] = ids["bos"]
    out[1:1 + len(tokens)] = tokens
    return out


def sentence_ids(blob: bytes, lookup: Dict[str, int], vocab_size: int) -> np.ndarray:
    """The ids of one serialized tf.train.Example row (its ``tokens`` feature)."""
    tokens = parse_example(blob).get("tokens")
    if not isinstance(tokens, list) or len(tokens) != 1:
        raise DataError("stackoverflow: a row has no single bytes feature 'tokens'")
    return to_ids(tokens[0].decode("utf-8"), lookup, vocab_size)


# ----------------------------------------------------------------------------- sources


def _first(path: str, *patterns: str) -> Optional[str]:
    for pattern in patterns:
        found = sorted(glob.glob(os.path.join(path, "**", pattern), recursive=True))
        if found:
            return found[0]
    return None


def find_source(path: str, data_dir: str) -> Tuple[str, str]:
    """(sqlite file, word-count file) of a source: a directory holding both (or their archives,
    unpacked here into <data_dir>/raw/stackoverflow), or the SQLite file with the word counts
    beside it."""
    if not os.path.exists(path):
        raise DataError(f"stackoverflow: --data_path={path} does not exist")
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    raw = os.path.join(data_dir, RAW_SUBDIR)
    db = path if os.path.isfile(path) else _first(folder, SQLITE_NAME, "*.sqlite")
    if db is None and _first(folder, "*.sqlite.lzma"):
        db = decompress(_first(folder, "*.sqlite.lzma"), raw)
    counts = _first(folder, WORD_COUNT_NAME, "*.word_count")
    if counts is None and _first(folder, "*.word_count.tar.bz2"):
        counts = extract_word_counts(_first(folder, "*.word_count.tar.bz2"), raw)
    if db is None or counts is None:
        missing = SQLITE_NAME if db is None else WORD_COUNT_NAME
        raise DataError(f"stackoverflow: no {missing} (or its published archive) in {folder}")
    return os.path.abspath(db), os.path.abspath(counts)


def _connect(file: str) -> sqlite3.Connection:
    connection = sqlite3.connect(f"file:{os.path.abspath(file)}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in connection.execute("SELECT name FROM sqlite_master")}
    except sqlite3.DatabaseError as err:
        connection.close()
        raise DataError(f"{file} is not a TFF SQLite database ({err})") from None
    if "examples" not in tables:
        connection.close()
        raise DataError(f"{file} is not a TFF SQLite database (no 'examples' table)")
    return connection


def client_sizes(connection: sqlite3.Connection, split: str) -> Dict[str, int]:
    """{client id: sentences} of one split, from client_metadata when present."""
    tables = {r[0] for r in connection.execute("SELECT name FROM sqlite_master")}
    if "client_metadata" in tables:
        rows = connection.execute("SELECT client_id, num_examples FROM client_metadata "
                                  "WHERE split_name = ?", (split,))
    else:
        rows = connection.execute("SELECT client_id, COUNT(*) FROM examples WHERE split_name = ? "
                                  "GROUP BY client_id", (split,))
    return {str(cid): int(n) for cid, n in rows}


def eligible_clients(sizes: Dict[str, int], k: int) -> List[str]:
    """The client ids with >= k sentences, sorted (TFF sorts its client ids too)."""
    return sorted(cid for cid, n in sizes.items() if n >= k)


def chosen_positions(num: int, max_clients: Optional[int], seed: int) -> np.ndarray:
    """Positions kept among `num` eligible clients (all without a limit)."""
    if max_clients is None:
        return np.arange(num)
    return choose_clients(num, int(max_clients), seed)


def read_clients(file: str, vocab: Sequence[str], selection: Dict[str, Sequence[str]],
                 max_examples: Optional[int] = None) -> Dict[str, Dict[str, np.ndarray]]:
    """{split: {client id: uint16 ids [n, 21]}} of the selected clients of each split, in one
    streaming pass over the examples table (row order); at most `max_examples` sentences per
    client, the first ones. Rows of other clients and splits are skipped without parsing."""
    lookup = {w: i + 1 for i, w in enumerate(vocab)}
    wanted = {split: set(ids) for split, ids in selection.items()}
    cap = None if max_examples is None else int(max_examples)
    rows: Dict[Tuple[str, str], array.array] = {}
    connection = _connect(file)
    seen = 0
    try:
        cursor = connection.execute("SELECT split_name, client_id, serialized_example_proto "
                                    "FROM examples")
        for split, cid, blob in cursor:
            seen += 1
            if seen % PROGRESS_ROWS == 0:
                print(f"deltafl_jax: stackoverflow: {seen:,} rows read", file=sys.stderr,
                      flush=True)
            cid = str(cid)
            if cid not in wanted.get(split, ()):
                continue
            buf = rows.setdefault((split, cid), array.array("H"))
            if cap is not None and len(buf) >= cap * SEQUENCE_LENGTH:
                continue
            buf.extend(sentence_ids(blob, lookup, len(vocab)).tolist())
    except sqlite3.DatabaseError as err:
        raise DataError(f"{file} is not a TFF SQLite database ({err})") from None
    finally:
        connection.close()
    out: Dict[str, Dict[str, np.ndarray]] = {split: {} for split in selection}
    for split, ids in selection.items():
        for cid in ids:
            buf = rows.get((split, cid))
            if buf is None:
                raise DataError(f"stackoverflow: client {cid} of split {split} has no rows")
            out[split][cid] = np.frombuffer(buf, np.uint16).reshape(-1, SEQUENCE_LENGTH)
    return out


# ----------------------------------------------------------------------------- archives, download


def decompress(file: str, out_dir: str) -> str:
    """Decompress a .sqlite.lzma into out_dir (once); returns the .sqlite path."""
    return archives.decompress_lzma(file, out_dir, "stackoverflow")


def extract_word_counts(file: str, out_dir: str) -> str:
    """Extract the ``*.word_count`` member of TFF's .tar.bz2 into out_dir (once)."""
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, WORD_COUNT_NAME)
    if not os.path.exists(out):
        try:
            with tarfile.open(file, "r:bz2") as tar:
                member = next((m for m in tar.getmembers()
                               if m.isfile() and m.name.endswith(".word_count")), None)
                if member is None:
                    raise DataError(f"stackoverflow: {file} holds no *.word_count file")
                with tar.extractfile(member) as src, open(out + ".part", "wb") as dst:
                    shutil.copyfileobj(src, dst)
        except (tarfile.TarError, EOFError, OSError) as err:
            raise DataError(f"stackoverflow: cannot read {file} ({err}); delete it and "
                            f"download it again") from None
        os.replace(out + ".part", out)
    return out


def fetch(url: str, out_dir: str, timeout: float = 60.0) -> str:
    """Download `url` into out_dir (once), with progress on stderr; returns the file."""
    return archives.fetch(url, out_dir, "stackoverflow", "--source=DIR holding it", timeout)


def download(data_dir: str) -> str:
    """Fetch TFF's stackoverflow.sqlite.lzma and word counts into <data_dir>/raw/stackoverflow,
    decompress and extract them; returns that directory."""
    out_dir = os.path.join(data_dir, RAW_SUBDIR)
    decompress(fetch(SQLITE_URL, out_dir), out_dir)
    extract_word_counts(fetch(WORD_COUNT_URL, out_dir), out_dir)
    return out_dir


# ----------------------------------------------------------------------------- prepare / load


def _limits(config) -> Optional[Dict[str, Optional[int]]]:
    """The limits a preparation can apply early, or None when there are none."""
    kept = config.limits
    limits = {"max_train_clients": kept.max_train_clients,
              "max_test_clients": kept.max_test_clients,
              "max_examples_per_client": kept.max_examples_per_client}
    for name, value in limits.items():
        if value is not None and value < 1:
            raise DataError(f"--{name} must be at least 1, got {value}")
    return limits if any(v is not None for v in limits.values()) else None


def config_name(k: int, limits: Optional[Dict[str, Optional[int]]], seed: int) -> str:
    """min<k>, or min<k>-tr<A>-te<B>-ex<E>-seed<s> for a preparation with early limits."""
    if limits is None:
        return prepared.config_name(k)
    part = lambda v: "all" if v is None else str(int(v))
    return (f"{prepared.config_name(k)}-tr{part(limits['max_train_clients'])}"
            f"-te{part(limits['max_test_clients'])}"
            f"-ex{part(limits['max_examples_per_client'])}-seed{int(seed)}")


def missing_source_message(data_dir: str) -> str:
    raw = os.path.join(data_dir, RAW_SUBDIR)
    return (f"stackoverflow: no prepared data and no source: pass --data_path=DIR holding "
            f"{SQLITE_NAME} and {WORD_COUNT_NAME} (TFF's files, or their .lzma / .tar.bz2) or "
            f"put them in {raw}/, or run python -m data_prep.prepare --dataset=stackoverflow "
            f"--download")


def _source(config) -> Optional[str]:
    if config.data_path:
        return os.path.abspath(config.data_path)
    raw = os.path.join(config.resolved_data_dir, RAW_SUBDIR)
    return raw if os.path.isdir(raw) else None


def _selection(file: str, k: int, limits, seed: int) -> Dict[str, List[str]]:
    """{split: client ids kept}: eligible (>= k sentences), sorted, then the early limits."""
    connection = _connect(file)
    try:
        sizes = {split: client_sizes(connection, split) for split in SPLITS}
    finally:
        connection.close()
    limits = limits or {}
    out = {}
    for offset, split in enumerate(SPLITS, 1):
        ids = eligible_clients(sizes[split], k)
        if not ids:
            raise DataError(f"stackoverflow: no client of split {split} in {file} has >= {k} "
                            f"sentences")
        keep = chosen_positions(len(ids), limits.get(f"max_{split}_clients"), seed + offset)
        out[split] = [ids[i] for i in keep]
    return out


def prepare(config, min_client_examples: Optional[int] = None,
            source: Optional[str] = None) -> str:
    """Read the source (with the early limits of `config`) and write the prepared dataset."""
    k = (prepared.min_client_examples(config, DEFAULT_MIN_CLIENT_EXAMPLES)
         if min_client_examples is None else int(min_client_examples))
    data_dir = config.resolved_data_dir
    source = os.path.abspath(source) if source else _source(config)
    if source is None:
        raise DataError(missing_source_message(data_dir))
    db, counts = find_source(source, data_dir)
    vocab = read_vocab(counts)
    if len(vocab) + 4 > np.iinfo(np.uint16).max:
        raise DataError(f"stackoverflow: {len(vocab)} words do not fit uint16 ids")
    limits = _limits(config)
    selection = _selection(db, k, limits, config.data_seed)
    data = read_clients(db, vocab, selection, (limits or {}).get("max_examples_per_client"))
    clients = [{"client_id": cid, "x": data[split][cid]}
               for split in SPLITS for cid in selection[split]]
    metadata = {
        "source": source, "min_client_examples": k, "vocab_size": len(vocab),
        "num_train_clients": len(selection["train"]), "limits": limits,
        "data_seed": int(config.data_seed) if limits else None,
        "rules": "TFF build_to_ids_fn: 10,000 words, 20 words + BOS/EOS, pad 0; "
                 "train = TFF train users, test = TFF test users",
    }
    return prepared.write(
        data_dir, NAME, config_name(k, limits, config.data_seed),
        spec={"x": ((None, SEQUENCE_LENGTH), np.uint16)}, clients=clients, metadata=metadata,
        arrays={"vocab": np.asarray(vocab)},
        description="StackOverflow (TFF) next-word prediction, one record per user and split.")


def _try_open(data_dir: str, config_names: Sequence[str], source: Optional[str]):
    for name in config_names:
        if not prepared.is_prepared(data_dir, NAME, name):
            continue
        try:
            info = prepared.open_prepared(data_dir, NAME, name)
        except prepared.DamagedDataset as err:
            print(f"deltafl_jax: warning: the prepared {NAME} at {err.path} is damaged "
                  f"({err.reason}); rebuilding it", file=sys.stderr, flush=True)
            continue
        if source is None or info.metadata.get("source") == source:
            return info
    return None


def open_dataset(config, k: int) -> prepared.Prepared:
    """A prepared dataset that serves `config`: a complete one (min<j>, j <= k), else one
    prepared with exactly these limits; prepares the latter (or the complete one when there
    are no limits) when there is none."""
    data_dir = config.resolved_data_dir
    source = os.path.abspath(config.data_path) if config.data_path else None
    limits = _limits(config)
    names = [n for n in (prepared.find_config(data_dir, NAME, k),
                         config_name(k, limits, config.data_seed) if limits else None) if n]
    info = _try_open(data_dir, names, source)
    if info is None:
        prepare(config, k)
        info = prepared.open_prepared(data_dir, NAME, config_name(k, limits, config.data_seed))
    return info


def _split(records: List[dict], cap: Optional[int]) -> ClientData:
    xs = [np.asarray(r["x"][:cap], dtype=np.int32) for r in records]
    return ClientData.from_clients(xs, None, client_ids=[r["client_id"] for r in records])


def load(config) -> FederatedDataset:
    """Load (preparing on first use when a source is at hand) the train and test users, with
    the client limits applied before the records are read."""
    k = prepared.min_client_examples(config, DEFAULT_MIN_CLIENT_EXAMPLES)
    info = open_dataset(config, k)
    sizes = info.sizes
    n_train = int(info.metadata["num_train_clients"])
    limits = _limits(config) or {}
    positions = {}
    for offset, (split, lo, hi) in enumerate((("train", 0, n_train),
                                              ("test", n_train, len(sizes))), 1):
        eligible = lo + np.flatnonzero(sizes[lo:hi] >= k)
        if eligible.size == 0:
            raise DataError(f"stackoverflow: no {split} client has >= {k} sentences")
        keep = chosen_positions(eligible.size, limits.get(f"max_{split}_clients"),
                                config.data_seed + offset)
        positions[split] = eligible[keep]
    cap = limits.get("max_examples_per_client")
    train = _split(prepared.read(info, NAME, positions["train"]), cap)
    test = _split(prepared.read(info, NAME, positions["test"]), cap)
    v = int(info.metadata["vocab_size"])
    ids = special_ids(v)
    return FederatedDataset(
        name=NAME, train=train, test=test, num_classes=ids["num_ids"], x_scale=None,
        metadata={"source": info.metadata.get("source"), "prepared": info.path,
                  "min_client_examples": k, "task": "next_word_prediction",
                  "input_vocab_size": ids["num_ids"], "vocab_size": v, "pad_id": ids["pad"],
                  "oov_id": ids["oov"], "bos_id": ids["bos"], "eos_id": ids["eos"],
                  "sequence_length": SEQUENCE_LENGTH})
