"""LEAF json: the source format of LEAF's federated datasets (FEMNIST, Sent140, ...).

LEAF (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018) ships each dataset as
json files, each holding some of its users:

    {"users": [user, ...], "num_samples": [n, ...],
     "user_data": {user: {"x": [example, ...], "y": [label, ...]}, ...}}

(possibly with "hierarchies"). An example's form is the dataset's own: FEMNIST's x is a list of
784 floats, Sent140's is ``[id, date, query, user, text]``. LEAF's data directory holds the
complete data in ``all_data/`` and derived copies (its own sampling and splits) in
``sampled_data/``, ``rem_user_data/``, ``train/`` and ``test/``.

This module finds and parses those files; the datasets that use them
(:mod:`deltafl_jax.datasets.femnist`, :mod:`deltafl_jax.datasets.sent140`) apply the papers'
rules and package the result as a prepared dataset (:mod:`deltafl_jax.datasets.prepared`).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Dict, List, Sequence

from deltafl_jax.data import DataError


def json_files(path: str) -> List[str]:
    """The LEAF json files to read from `path` (a file, or a directory searched recursively).

    The complete files (``all_data/``) are read when present (the papers' rules are applied
    here, not by LEAF's sampling); otherwise the train files, then the test files, whose
    per-user examples are concatenated in that order. Derived copies in ``sampled_data/`` and
    ``rem_user_data/`` are never read.
    """
    if os.path.isfile(path):
        return [path]
    groups: Dict[str, List[str]] = {"all": [], "train": [], "test": []}
    for file in sorted(glob.glob(os.path.join(path, "**", "*.json"), recursive=True)):
        parent = os.path.basename(os.path.dirname(file))
        base = os.path.basename(file)
        if parent in ("sampled_data", "rem_user_data"):
            continue
        if parent == "train" or "_train_" in base or base.startswith("train"):
            groups["train"].append(file)
        elif parent == "test" or "_test_" in base or base.startswith("test"):
            groups["test"].append(file)
        else:
            groups["all"].append(file)
    return groups["all"] or groups["train"] + groups["test"]


def read_users(files: Sequence[str]):
    """Yield (user, x rows, y values) for every user of every LEAF json file, in file order.

    A user may appear in several files (train and test). A file that is not json, or not in
    LEAF's form, or a user with unequal numbers of x and y, is a :class:`DataError` naming the file.
    """
    for file in files:
        with open(file, encoding="utf-8") as f:
            try:
                blob = json.load(f)
            except json.JSONDecodeError as err:
                raise DataError(f"{file} is not valid json: {err}") from None
        if not isinstance(blob, dict) or "user_data" not in blob:
            raise DataError(f"{file} is not a LEAF json file (no 'user_data' key)")
        users = blob.get("users") or list(blob["user_data"])
        for user in users:
            data = blob["user_data"][user]
            if len(data["x"]) != len(data["y"]):
                raise DataError(f"{file}: user {user} has {len(data['x'])} x and "
                                f"{len(data['y'])} y")
            yield str(user), data["x"], data["y"]
