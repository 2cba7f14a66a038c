"""What the peer scripts (``peer_fedjax.py``, ``peer_drjax.py``, ``peer_pfl_worker.py``) share. They run as files in
their own venvs, where this package is not installed, so this module uses the standard library
only and is imported as their sibling."""

from __future__ import annotations

import argparse
import sys


def versions(packages) -> dict:
    """The Python version and each package's installed version (None when absent)."""
    import importlib.metadata as md
    out = {"python": sys.version.split()[0]}
    for pkg in packages:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def serve(packages, extra=None):
    """Say READY with the versions of `packages` (and the entries of `extra`), then yield each
    command the bench script sends on stdin, one per line, as (verb, round, the other words),
    until "quit" or the end."""
    import json
    print("READY " + json.dumps({**versions(packages), **(extra or {})}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            return
        yield cmd[0], int(cmd[1]), cmd[2:]


def arguments() -> argparse.ArgumentParser:
    """The arguments every peer takes from bench/peers.py."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", choices=["cnn", "linear"], required=True)
    ap.add_argument("--batch_size", type=int, required=True)
    ap.add_argument("--learning_rate", type=float, default=0.05)
    ap.add_argument("--num_classes", type=int, default=62)
    return ap
