"""Runs that span several processes (hosts) with ``jax.distributed``.

:func:`initialize` joins the run: on TPU pods and Slurm the coordinator, the process count and
this process's id are detected by JAX; elsewhere they are given explicitly. Every process then
builds the same mesh over all processes' devices, the same data and the same round plans from
the seeds (:func:`check_same_plan` verifies it at start-up), and runs the same rounds; only
process 0 writes outputs. Checkpoints are collective: every process saves and restores them in
process 0's ``<output_dir>/checkpoints`` (:func:`primary_output_dir`; a filesystem they all see),
and decides when to save, and whether to stop, as the others do (:func:`any_process`). A process that cannot reach the coordinator within the timeout, or a
peer that dies, ends the run with an error instead of a hang.
"""

from __future__ import annotations

import hashlib
import socket
import time
from typing import List, Optional, Sequence

import jax
import numpy as np

from deltafl_jax.errors import ConfigError


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """ConfigError unless a TCP connection to host:port succeeds within `timeout_s` (checked
    by the other processes before they register, so that an unreachable coordinator is one
    clear line rather than the distributed service aborting the process)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host or "localhost", int(port)), timeout=2):
                return
        except (OSError, ValueError) as e:
            if time.monotonic() >= deadline:
                raise ConfigError(f"cannot join the distributed run: no coordinator answers at "
                                  f"--coordinator_address={address} within {timeout_s:g} s "
                                  f"({e})") from None
            time.sleep(0.5)


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, timeout_s: int = 120) -> None:
    """jax.distributed.initialize with a timeout; ConfigError (one line) when it fails. A peer
    that dies later makes JAX's distributed service end every process (non-zero exit)."""
    if coordinator_address and process_id not in (None, 0):
        wait_for_coordinator(coordinator_address, timeout_s)
    try:
        jax.distributed.initialize(coordinator_address=coordinator_address,
                                   num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=int(timeout_s))
    except Exception as e:  # pylint: disable=broad-except
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot join the distributed run (--coordinator_address="
                          f"{coordinator_address}, --num_processes={num_processes}, "
                          f"--process_id={process_id}, timeout {timeout_s} s): {first}") from None


def plan_digest(exp, fingerprint) -> str:
    """sha256 of the settings, the data and the first round's plan (an asynchronous run's:
    its first server step's, drawn from the schedulers' initial state, to which the run's
    first step returns)."""
    h = hashlib.sha256(repr(sorted(fingerprint.items())).encode())
    plan = exp.round_plan(0) if exp.buffered is None else exp.clock.plan(0)[0]
    for a in plan:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def check_same_plan(exp, fingerprint) -> None:
    """ConfigError unless every process built the same settings, data and plan."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils
    digest = np.frombuffer(bytes.fromhex(plan_digest(exp, fingerprint)), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(digest))
    differ = [i for i in range(every.shape[0]) if not np.array_equal(every[i], every[0])]
    if differ:
        raise ConfigError(f"process(es) {differ} built other settings, data or round plans than "
                          f"process 0; run the same command and data on every process")


def primary_output_dir(output_dir: Optional[str]) -> Optional[str]:
    """Process 0's output dir, on every process (collective with several processes)."""
    if jax.process_count() == 1:
        return output_dir
    from jax.experimental import multihost_utils
    text = (output_dir or "").encode("utf-8")
    if len(text) > _PATH_BYTES:
        raise ConfigError(f"--output_dir is longer than {_PATH_BYTES} bytes")
    buffer = np.zeros(_PATH_BYTES + 1, np.uint8)
    buffer[:len(text)], buffer[-1] = np.frombuffer(text, np.uint8), len(text) > 0
    got = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return bytes(got[:-1]).rstrip(b"\0").decode("utf-8") if got[-1] else None


_PATH_BYTES = 4096


def any_process(flags: Sequence[bool]) -> List[bool]:
    """Each flag, true when it is true on any process (collective)."""
    if jax.process_count() == 1:
        return [bool(f) for f in flags]
    from jax.experimental import multihost_utils
    every = np.asarray(multihost_utils.process_allgather(np.asarray(flags, np.int32)))
    return [bool(f) for f in every.reshape(-1, len(flags)).any(axis=0)]


def barrier(name: str) -> None:
    """Wait until every process gets here (nothing to do with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
