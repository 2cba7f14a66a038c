"""The errors that the library raises for bad input, in one leaf module.

Each carries a one-line message that names what is wrong; the commands of ``experiments``
print it as it is and exit with code 2 (see ``experiments/cli.py``). Every one derives from
:class:`DeltaFLError` (a ValueError), so ``except DeltaFLError`` catches them all. The modules
that raise them re-export them under the names they had there (``outputs.RunFormatError``,
``report.RunError``, ``tuning.TuningError``, ``experiments.cli.UsageError``,
``prepared.DamagedDataset``, ``checkpoint.CheckpointError`` and ``CheckpointMismatch``).
"""


class DeltaFLError(ValueError):
    """Base class of the library's input errors (one-line message)."""


class ConfigError(DeltaFLError):
    """A bad setting; the message is one line naming the flag."""


class DataError(DeltaFLError):
    """Federated data that cannot be used: wrong shapes, NaN, empty clients, bad files."""


class UsageError(ConfigError):
    """A malformed flag value; the message is one line naming the flag."""


class TuningError(ConfigError):
    """Bad tuning input (grids, the tuned method); the message is one line."""


class RunFormatError(DeltaFLError):
    """An output directory whose files are missing, unreadable or of a newer format.

    ``output_dir`` and ``reason`` are kept apart; the message is "OUTPUT_DIR: reason".
    """

    def __init__(self, output_dir: str, reason: str):
        self.output_dir = output_dir
        self.reason = reason
        super().__init__(f"{output_dir}: {reason}")


class RunError(DeltaFLError):
    """A run directory that cannot be reported; the message is one line."""


class DamagedDataset(DataError):
    """A prepared dataset whose files do not match its checksums: truncated, corrupted, missing
    a file, or written before checksums existed. `path` is its directory, `reason` a few words."""

    def __init__(self, name: str, path: str, reason: str):
        super().__init__(f"{name}: the prepared dataset at {path} is damaged ({reason}); run "
                         f"python -m data_prep.prepare --dataset={name} again")
        self.path = path
        self.reason = reason


class CheckpointError(DeltaFLError):
    """A checkpoint that cannot be read (damaged); restore falls back to an older one."""


class CheckpointMismatch(DeltaFLError):
    """A readable checkpoint that this run cannot use: its state has other leaves, shapes or
    dtypes (another configuration), or it has another format. The message names which."""


class HFCheckpointError(CheckpointError):
    """A Hugging Face model folder or peft adapter that cannot be used (no config.json, an
    architecture that is not supported, no tokenizer.json, a tensor missing, a LoRA target that
    matches no layer), or a hub id that cannot be fetched. The message is one line naming it."""
