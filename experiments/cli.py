"""What every command of ``experiments`` shares: one-line errors with exit code 2."""

from __future__ import annotations

import sys

from absl import flags


def fail(message: str) -> None:
    """One line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_flags_or_fail(argv):
    """absl's flag parsing, with a bad flag reported by :func:`fail`."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0] if str(e) else "bad flags")
