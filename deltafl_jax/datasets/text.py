"""Text with natural clients: ``--dataset=text:PATH`` for causal language models.

PATH is a ``.jsonl`` (one JSON object a line), ``.csv`` (a header row) or ``.parquet`` file
(read with pyarrow) with a text column (``--text_column``), or an instruction/response pair
(``--prompt_column``, ``--response_column``), and optionally a client column
(``--client_column=user_id``) naming each row's client: Aya, OpenAssistant, a user's own logs.

Tokens. The text is tokenised by the tokenizer of ``--base_model`` (its ``tokenizer.json``, read
with the ``tokenizers`` library), with the tokenizer's own special
tokens (a Llama tokenizer's BOS) and the base's EOS after each document. A document is one
sequence of ``--max_length`` tokens, truncated or padded; with ``--pack`` a client's documents
are joined and cut into sequences of ``--max_length`` (the last one padded). An instruction is
written with ``--prompt_template`` (``{prompt}`` replaced by it) and followed by the response;
the loss scores the response's tokens only (and its EOS), as supervised fine-tuning does.

Storage. A sequence is stored as int32 [max_length] with the scoring in the sign
(:func:`encode`): a token t whose prediction the loss scores is stored as t >= 0, any other
token (the prompt, the padding) as -t - 1 < 0. :func:`decode` gives back (ids, scored); the
next-token loss of position i scores ids[i + 1] when scored[i + 1]
(:func:`deltafl_jax.models.llm.masked_token_losses`). So one array per split carries the
tokens and the loss mask, and the engine's client data need nothing new.

Clients. With a client column, one client per value (sorted by value), clients split 50/50
into train and test at random with ``--data_seed`` (:func:`deltafl_jax.data.split_clients`, as
LEAF's datasets). Without one, ``--partition`` is required: the sequences are shuffled with
``--data_seed``, halved into a train and a test part, and each split into clients as for the
centralised images (:func:`deltafl_jax.datasets.npz.partition_arrays`).

Cache. The tokenised sequences are written once as a prepared dataset
(:mod:`deltafl_jax.datasets.prepared`, the crash-safe cache) named by a digest of the file's
bytes, the tokenizer, the base's config and these settings; a changed file or setting
prepares anew. Every check (the file, its columns, the tokenizer, the sequence length against
the base's positions) runs before anything is written.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.data import ClientData, DataError, FederatedDataset, split_clients
from deltafl_jax.datasets import prepared

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}
CORPUS = "corpus"     # the one record of a file without a client column


def encode(ids: np.ndarray, scored: np.ndarray) -> np.ndarray:
    """int32 [..., L]: token t where `scored`, -t - 1 elsewhere (the module docstring)."""
    ids = np.asarray(ids, np.int64)
    return np.where(scored, ids, -ids - 1).astype(np.int32)


def decode(x):
    """(ids, scored) of stored sequences x [..., L] (NumPy or JAX): ids >= 0 the tokens."""
    scored = x >= 0
    return (x * (2 * scored - 1) - (1 - scored)), scored


# ----------------------------------------------------------------------------- reading rows


def _path(config) -> str:
    path = config.dataset[len("text:"):]
    if not path:
        raise DataError("--dataset=text:PATH needs a file after text: (jsonl, csv or parquet)")
    if not os.path.isfile(path):
        raise DataError(f"--dataset=text:{path}: no such file")
    if os.path.splitext(path)[1].lower() not in FORMATS:
        raise DataError(f"--dataset=text:{path}: the file must end in "
                        f"{', '.join(sorted(FORMATS))}")
    return os.path.abspath(path)


def _read_jsonl(path: str) -> List[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not a JSON object ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: not a JSON object")
            rows.append(row)
    return rows


def _read_parquet(path: str) -> List[dict]:
    try:
        import pyarrow.parquet as pq   # optional: parquet files only
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or "
                        f"give the rows as jsonl or csv") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pylint: disable=broad-except  (pyarrow's errors vary)
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__})") from None


def read_rows(path: str) -> List[dict]:
    """The rows of a jsonl, csv or parquet file as dicts (DataError for an unreadable or
    empty file)."""
    kind = FORMATS[os.path.splitext(path)[1].lower()]
    if kind == "jsonl":
        rows = _read_jsonl(path)
    elif kind == "csv":
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        rows = _read_parquet(path)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def _columns(text) -> Tuple[str, ...]:
    """The columns the settings read (client column last, when given)."""
    if (text.prompt_column is None) != (text.response_column is None):
        raise DataError("--prompt_column and --response_column go together (an "
                        "instruction/response pair); give both, or neither and --text_column")
    cols = ((text.prompt_column, text.response_column) if text.prompt_column is not None
            else (text.text_column,))
    return cols + ((text.client_column,) if text.client_column else ())


def check_columns(rows: Sequence[dict], text, path: str) -> None:
    """DataError naming the first column that a row lacks (and the columns it has)."""
    for column in _columns(text):
        for number, row in enumerate(rows, 1):
            if column not in row or row[column] is None:
                flag = ("--client_column" if column == text.client_column else
                        "--text_column" if column == text.text_column else
                        "--prompt_column" if column == text.prompt_column else
                        "--response_column")
                raise DataError(f"{flag}={column}: {path} has no column {column!r} (row "
                                f"{number} has {', '.join(map(repr, sorted(row)))})")


# ----------------------------------------------------------------------------- tokens


def base_folder(spec: Optional[str], download: bool) -> str:
    """The local folder of ``--base_model``: a folder as it is; a hub id downloaded with
    huggingface_hub when `download` (DataError otherwise: nothing is fetched at run time)."""
    if not spec:
        raise DataError("--dataset=text:PATH is tokenised by the base's tokenizer: give "
                        "--base_model=FOLDER (or a hub id with --download_base_model)")
    if os.path.isdir(spec):
        return os.path.abspath(spec)
    if not download:
        raise DataError(f"--base_model={spec}: no such folder (a Hugging Face hub id is "
                        f"downloaded with --download_base_model only)")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(spec, allow_patterns=["*.json", "*.safetensors"])
    except Exception as e:  # pylint: disable=broad-except  (offline, unknown id, ...)
        raise DataError(f"--base_model={spec}: the download failed "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


class Tokens:
    """What tokenising needs of the base (``config.json``, ``tokenizer.json``): its
    tokenizer, EOS, padding, vocabulary and positions. DataError for a folder without
    config.json or tokenizer.json, and for ``--max_length`` beyond its positions."""

    def __init__(self, text):
        self.folder = base_folder(text.base_model, text.download_base_model)
        files = {name: os.path.join(self.folder, name)
                 for name in ("config.json", "tokenizer.json")}
        for name, file in files.items():
            if not os.path.isfile(file):
                raise DataError(f"--base_model={text.base_model}: {self.folder} has no {name} "
                                f"(a Hugging Face checkpoint folder has config.json, "
                                f"model.safetensors and tokenizer.json)")
        with open(files["config.json"], encoding="utf-8") as f:
            self.config_text = f.read()
        config = json.loads(self.config_text)
        from tokenizers import Tokenizer
        self.tokenizer = Tokenizer.from_file(files["tokenizer.json"])
        with open(files["tokenizer.json"], "rb") as f:
            self.tokenizer_sha = hashlib.sha256(f.read()).hexdigest()
        positions = int(config.get("max_position_embeddings", 0))
        if text.max_length > positions:
            raise DataError(f"--max_length={text.max_length}: sequences longer than the "
                            f"{positions} positions of --base_model={text.base_model} "
                            f"(max_position_embeddings)")
        self.vocab_size = int(config["vocab_size"])
        self.eos = first_id(config.get("eos_token_id"))
        pad = first_id(config.get("pad_token_id"))
        self.pad = pad if pad is not None else (self.eos if self.eos is not None else 0)

    def ids(self, text: str, special: bool = True) -> List[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def document(self, row: dict, settings) -> Tuple[List[int], List[bool]]:
        """(ids, scored) of one row: its text (every token scored), or its prompt (not scored)
        and response (scored), each ended by EOS."""
        end = [self.eos] if self.eos is not None else []
        if settings.prompt_column is None:
            ids = self.ids(str(row[settings.text_column])) + end
            return ids, [True] * len(ids)
        template = settings.prompt_template.replace("\\n", "\n")
        prompt = self.ids(template.replace("{prompt}", str(row[settings.prompt_column])))
        response = self.ids(str(row[settings.response_column]), special=False) + end
        return prompt + response, [False] * len(prompt) + [True] * len(response)


def first_id(value) -> Optional[int]:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return None if value is None else int(value)


def sequences(docs: Sequence[Tuple[List[int], List[bool]]], length: int, pad: int,
              pack: bool) -> np.ndarray:
    """int32 [n, length] encoded sequences of `docs` ((ids, scored) each): one per document,
    truncated and padded with unscored `pad` tokens, or (`pack`) the documents joined and cut
    into chunks of `length`, the last one padded. Documents of fewer than 2 tokens (nothing
    to predict) are dropped when not packed."""
    if pack:
        ids = [t for d in docs for t in d[0]]
        scored = [s for d in docs for s in d[1]]
        chunks = [(ids[i:i + length], scored[i:i + length]) for i in range(0, len(ids), length)]
    else:
        chunks = [(d[0][:length], d[1][:length]) for d in docs]
    chunks = [c for c in chunks if len(c[0]) >= 2 and any(c[1][1:])]
    out = np.full((len(chunks), length), -pad - 1, np.int32)   # padding: unscored pad
    for row, (ids_, scored_) in enumerate(chunks):
        out[row, :len(ids_)] = encode(np.asarray(ids_), np.asarray(scored_, bool))
    return out


# ----------------------------------------------------------------------------- prepare / load


def _digest(path: str, tokens: Tokens, text) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    settings = {k: getattr(text, k) for k in ("text_column", "prompt_column", "response_column",
                                                "prompt_template", "client_column",
                                                "max_length", "pack")}
    h.update(json.dumps([settings, tokens.tokenizer_sha, tokens.config_text],
                        sort_keys=True).encode())
    return h.hexdigest()[:16]


def _records(rows: Sequence[dict], tokens: Tokens, text, path: str) -> List[dict]:
    """One record per client ({"client_id", "x"}), or one CORPUS record without a client
    column; clients without a whole sequence are dropped."""
    groups: Dict[str, List[dict]] = {}
    for row in rows:
        key = str(row[text.client_column]) if text.client_column else CORPUS
        groups.setdefault(key, []).append(row)
    records = []
    for key in sorted(groups):
        docs = [tokens.document(row, text) for row in groups[key]]
        x = sequences(docs, text.max_length, tokens.pad, text.pack)
        if len(x):
            records.append({"client_id": key, "x": x})
    if not records:
        raise DataError(f"{path}: no sequence with a token to predict")
    return records


def _check_partition(config, path: str) -> None:
    method = config.partitioner.method
    if config.text.client_column and method != "none":
        raise DataError(f"--partition={method}: {path} has its own clients "
                        f"(--client_column={config.text.client_column}); drop one of them")
    if not config.text.client_column and method == "none":
        raise DataError(f"{path}: without --client_column the rows have no clients: pass "
                        f"--client_column=COLUMN, or --partition=iid|size|... to split them")


def load(config) -> FederatedDataset:
    """``--dataset=text:PATH``: read, check and tokenise the file (once, then from the
    cache), and split it into train and test clients (the module docstring)."""
    text = config.text
    path = _path(config)
    _check_partition(config, path)
    tokens = Tokens(text)
    name = f"text_{_digest(path, tokens, text)}"
    k = prepared.min_client_examples(config, 1)

    def prepare():
        rows = read_rows(path)
        check_columns(rows, text, path)
        return prepared.write(
            config.resolved_data_dir, name, prepared.config_name(1),
            spec={"x": ((None, text.max_length), np.int32)},
            clients=_records(rows, tokens, text, path), metadata={"source": path},
            description=f"{path} tokenised by {tokens.folder}")

    info = prepared.open_or_prepare(config.resolved_data_dir, name, 1, prepare, path)
    keep = np.flatnonzero(info.sizes >= k)
    records = prepared.read(info, name, keep)
    xs = [np.asarray(r["x"], np.int32) for r in records]
    part = None
    if text.client_column:
        if len(xs) < 2:
            raise DataError(f"{path}: {len(xs)} client(s) of >= {k} sequences; train and test "
                            f"clients need at least 2")
        data = ClientData.from_clients(xs, None, [r["client_id"] for r in records])
        train, test = split_clients(data, config.data_seed)
    else:
        train, test, part = _partitioned(np.concatenate(xs), config)
    meta = {"source": path, "prepared": info.path, "task": "causal_lm",
            "base_model": tokens.folder, "input_vocab_size": tokens.vocab_size,
            "max_length": int(text.max_length), "pad_id": int(tokens.pad),
            "eos_id": -1 if tokens.eos is None else int(tokens.eos),
            "encoding": "signed: t >= 0 scored, -t - 1 not scored"}
    return FederatedDataset(name=config.dataset, train=train, test=test,
                            num_classes=tokens.vocab_size, x_scale=None,
                            metadata=meta, partition=part)


def _partitioned(x: np.ndarray, config):
    """(train, test, Partition): the sequences shuffled with ``--data_seed``, halved, each half
    split into clients by ``--partition``."""
    from deltafl_jax.datasets.npz import partition_arrays   # local: npz reads the partitioner
    if len(x) < 2:
        raise DataError(f"--dataset={config.dataset}: {len(x)} sequence(s); a train and a test "
                        f"half need at least 2")
    order = np.random.default_rng(config.data_seed).permutation(len(x))
    half = len(x) // 2
    return partition_arrays((x[order[:half]], x[order[half:]]), (None, None), config)
