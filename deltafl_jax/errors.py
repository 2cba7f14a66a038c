"""The errors that the library raises for bad input, in one leaf module.

Each carries a one-line message that names what is wrong; the commands of ``experiments``
print it as it is and exit with code 2 (see ``experiments/cli.py``).
"""


class DeltaFLError(ValueError):
    """Base class of the library's input errors (one-line message)."""


class ConfigError(DeltaFLError):
    """A bad setting; the message is one line naming the flag."""


class DataError(DeltaFLError):
    """Federated data that cannot be used: wrong shapes, NaN, empty clients, bad files."""
