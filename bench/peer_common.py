"""What the peer scripts (``peer_fedjax.py``, ``peer_drjax.py``) share. They run as files in
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


def arguments() -> argparse.ArgumentParser:
    """The arguments every peer takes from bench/peers.py."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", choices=["cnn", "linear"], required=True)
    ap.add_argument("--batch_size", type=int, required=True)
    ap.add_argument("--learning_rate", type=float, default=0.05)
    ap.add_argument("--num_classes", type=int, default=62)
    return ap
