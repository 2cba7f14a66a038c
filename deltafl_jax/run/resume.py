"""Resuming a run: what must match, and picking up from the newest checkpoint.

Rerunning the command of a run whose ``<output_dir>/checkpoints/`` holds a checkpoint of the
same configuration continues it from there; the sampling and the shuffles are pure functions of
(seed, round, client) and the PRNG keys are re-derived from the seeds, so the resumed run ends
with the same outputs, bit for bit, as one that was never interrupted. A configuration that
differs is refused, naming the flags that differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Dict, Optional

import jax

from deltafl_jax.algorithms import registry
from deltafl_jax.errors import ConfigError
from deltafl_jax.run import checkpoint as ckpt

# Settings that may change between the run and its resume (they change no result).
FREE_FIELDS = ("output_dir", "overwrite", "verbose", "tensorboard", "checkpoint_every",
               "checkpoint_every_s", "save_models", "devices", "client_data")


def data_digest(data) -> str:
    """sha256 of every array of the dataset's two splits."""
    h = hashlib.sha256()
    for split in (data.train, data.test):
        split.digest(h)
    return h.hexdigest()


def fingerprint(config, data) -> Dict[str, Any]:
    """The settings (flag name -> value) and the data that a resume must match. The data
    settings and the algorithm's options (with their defaults filled in) are flattened, so
    that a difference names the flag (``--filter``)."""
    out = {k: v for k, v in dataclasses.asdict(config).items() if k not in FREE_FIELDS}
    data_fields = out.pop("data")
    out.update({k: v for k, v in data_fields.items()})
    del out["options"]
    options = registry.get(config.algorithm).options_for(config)
    out.update(dataclasses.asdict(options))
    out["data_sha256"] = data_digest(data)
    out["jax_version"] = jax.__version__
    if config.dp_clip is not None:   # a calibrated z and the epsilon depend on the accountant
        from deltafl_jax.privacy import library_version
        out["dp_accounting_version"] = library_version()
    return out


@dataclasses.dataclass
class Resume:
    """The newest usable checkpoint: rounds done, the state and the recorder's histories."""

    round: int
    state: Any
    host: Dict[str, Any]


def check_config(checkpointer: "ckpt.Checkpointer", current: Dict[str, Any]) -> None:
    """ConfigError naming the flags that differ from the newest checkpoint's."""
    saved = checkpointer.read_fingerprint()
    if saved is None:
        return
    diff = ckpt.fingerprint_diff(saved[1], current)
    if diff:
        names = ", ".join(f"--{d}" for d in diff)
        raise ConfigError(f"the checkpoint in {checkpointer.directory} was made with other "
                          f"settings ({names} differ); rerun with those, or pass --overwrite "
                          f"to start afresh")


def restore(checkpointer: "ckpt.Checkpointer", template_state) -> Optional[Resume]:
    """The newest intact checkpoint (a damaged newest one falls back to the previous, with a
    warning), or None."""
    try:
        restored = checkpointer.restore(template_state)
    except ckpt.CheckpointMismatch as e:
        raise ConfigError(f"cannot resume from {checkpointer.directory}: {e}") from None
    if restored is None:
        return None
    return Resume(round=int(restored.round), state=restored.state, host=restored.host)
