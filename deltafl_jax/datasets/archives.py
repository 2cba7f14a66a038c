"""Fetching and unpacking the published archives of the real datasets (TFF's
``*.sqlite.lzma`` files), only when the user asks for a download (``--download``).

Each step writes under a temporary ``.part`` name and renames when complete, so an interrupted
download or decompression is never taken for a finished one, and reports its progress on stderr
every 256 MiB. Failures are one-line :class:`deltafl_jax.errors.DataError` s that name the
dataset and say what to do.
"""

from __future__ import annotations

import lzma
import os
import sys
import urllib.error
import urllib.request
from typing import Optional

from deltafl_jax.errors import DataError

_STEP = 1 << 24
_REPORT = 1 << 28


def copy_with_progress(src, dst, what: str, total: Optional[int] = None) -> None:
    """Copy the file object `src` into `dst`, with a line on stderr every 256 MiB."""
    done, next_report = 0, _REPORT
    for chunk in iter(lambda: src.read(_STEP), b""):
        dst.write(chunk)
        done += len(chunk)
        if done >= next_report:
            of = f" of {total / 2**20:,.0f} MiB" if total else ""
            print(f"deltafl_jax: {what}: {done / 2**20:,.0f} MiB{of}", file=sys.stderr,
                  flush=True)
            next_report += _REPORT


def fetch(url: str, out_dir: str, dataset: str, source_hint: str,
          timeout: float = 60.0) -> str:
    """Download `url` into out_dir (once); returns the file. On failure, DataError naming the
    URL and `source_hint`, the flag that reads a copy fetched elsewhere."""
    file = os.path.join(out_dir, os.path.basename(url))
    if os.path.exists(file):
        return file
    os.makedirs(out_dir, exist_ok=True)
    tmp = file + ".part"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as out:
            # Said once connected: a download that cannot start is the error's one line.
            print(f"deltafl_jax: downloading {url}", file=sys.stderr, flush=True)
            length = response.headers.get("Content-Length") if response.headers else None
            copy_with_progress(response, out, os.path.basename(url),
                               int(length) if length else None)
    except (urllib.error.URLError, OSError) as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        reason = getattr(err, "reason", err)
        raise DataError(f"{dataset}: could not download {url} ({reason}); fetch it on a "
                        f"machine with a network and pass {source_hint}") from None
    os.replace(tmp, file)
    return file


def decompress_lzma(file: str, out_dir: str, dataset: str) -> str:
    """Decompress FILE.lzma into out_dir (once); returns the decompressed path."""
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, os.path.basename(file)[: -len(".lzma")])
    if not os.path.exists(out):
        tmp = out + ".part"
        try:
            with lzma.open(file, "rb") as src, open(tmp, "wb") as dst:
                copy_with_progress(src, dst, f"decompressing {os.path.basename(file)}")
        except (lzma.LZMAError, EOFError) as err:
            os.remove(tmp)
            raise DataError(f"{dataset}: {file} is not a complete .lzma file ({err}); "
                            f"delete it and download it again") from None
        os.replace(tmp, out)
    return out
