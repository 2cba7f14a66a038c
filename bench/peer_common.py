"""What the peer scripts (``peer_fedjax.py``, ``peer_drjax.py``, ``peer_pfl_worker.py``,
``peer_pfl_llm_worker.py``) share, and the driver's end of their protocol (:class:`Side`). They
run as files in their own venvs, where this package is not installed, so this module uses the
standard library only and is imported as their sibling."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


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


class Side:
    """The driver's end of :func:`serve`: one side's process (`cmd`, run in `cwd` with `env`),
    one round per request; `info` is its READY entries and `rounds` its DONE records."""

    def __init__(self, cmd, env=None, cwd=None):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1, env=env, cwd=cwd)
        self.info = json.loads(self._expect("READY"))
        self.rounds = []

    def _expect(self, word: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(word + " "):
                return line[len(word) + 1:]
        raise RuntimeError(f"{self.proc.args[:3]} exited (code {self.proc.wait()}) "
                           f"before {word}")

    def round(self, t: int) -> float:
        self.proc.stdin.write(f"round {t}\n")
        done = json.loads(self._expect("DONE"))
        self.rounds.append(done)
        return float(done["seconds"])

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        finally:
            self.proc.wait(timeout=120)


def alternate(sides: dict, warmup: int, rounds: int) -> tuple:
    """Every side's `warmup` + `rounds` rounds, interleaved: in round t each side runs its
    round t, in an order that rotates every round; returns (the timed seconds per side, a
    record per round and side with ``os.getloadavg()``'s 1-minute load before and after)."""
    names = list(sides)
    times = {k: [] for k in names}
    loads = []
    for t in range(warmup + rounds):
        for name in names[t % len(names):] + names[:t % len(names)]:
            before = os.getloadavg()[0]
            dt = sides[name].round(t)
            if t >= warmup:
                times[name].append(dt)
            loads.append({"round": t, "side": name, "seconds": dt, "load1_before": before,
                          "load1_after": os.getloadavg()[0]})
        print(f"# round {t}: " + ", ".join(f"{k} {sides[k].rounds[-1]['seconds']:.2f}s"
                                           for k in names), file=sys.stderr, flush=True)
    return times, loads


def pfl_round_callback(counter, commands, first_round: int, wait=None):
    """A pfl ``TrainingProcessCallback`` (pfl imported here: only the pfl workers call this)
    that reports each round (``DONE`` with its seconds, CPU seconds and ``counter.examples``,
    the examples its local steps computed, which it resets) after `wait()` (the device's
    queued work), then waits for the next command: ``round T`` goes on, anything else stops
    pfl's run. A round's time runs from the previous round's report to the end of this round's
    ``after_central_iteration``: pfl's whole round, sampling and aggregation included."""
    from pfl.callback.base import TrainingProcessCallback
    from pfl.metrics import Metrics

    class Rounds(TrainingProcessCallback):
        def __init__(self):
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            self.round = first_round

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            if wait is not None:
                wait()
            dt = time.perf_counter() - self.t0
            print("DONE " + json.dumps({"round": self.round, "seconds": dt,
                                        "cpu_s": time.process_time() - self.c0,
                                        "real_examples": counter.examples,
                                        "padded_examples": counter.examples}), flush=True)
            counter.examples = 0
            cmd = next(commands, None)
            if cmd is None or cmd[0] != "round":
                return True, Metrics()
            self.round = cmd[1]
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            return False, Metrics()

    return Rounds()


def arguments() -> argparse.ArgumentParser:
    """The arguments every peer takes from bench/peers.py."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", choices=["cnn", "linear"], required=True)
    ap.add_argument("--batch_size", type=int, required=True)
    ap.add_argument("--learning_rate", type=float, default=0.05)
    ap.add_argument("--num_classes", type=int, default=62)
    return ap
