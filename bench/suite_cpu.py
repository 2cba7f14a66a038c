"""A pytest plugin that measures where the test suite's CPU time goes, per test and per file.

Wall time on a shared machine says little; CPU seconds do not depend on the load. Load it with
``-p bench.suite_cpu --suite_cpu_out=PATH`` (from the repository root) on top of the README's
test command, xdist included::

    python -m pytest -q tests -p bench.suite_cpu --suite_cpu_out=bench/out/suite_cpu.json

For every test, each process (every xdist worker) records the CPU seconds its protocol took
(setup, call and teardown: a module- or session-scoped fixture is charged to the test that first
needs it, its teardown to the last), as the process's own time (``time.process_time``) plus the time of the
subprocesses it waited for (``resource.getrusage(RUSAGE_CHILDREN)``, user + system), and the
XLA compilations it ran in-process (jax's ``/jax/core/compile/backend_compile_duration``
events: their count and seconds; a program loaded from the persistent compilation cache counts
too, and ``cache_hits`` says how many were; ``fresh_compiles`` in the totals is the difference;
programs a subprocess compiles are in its CPU time, not in the count; the totals name the 30
jitted functions whose compiles took longest, summed over their shapes). Each worker writes ``PATH.<worker>.json``;
the process that started the run merges them into ``PATH``: the totals (every process's whole
CPU time, the controller's and the workers' imports and collection included, the workers'
subprocesses too; ``compile_s`` is the compiles' wall seconds; the sum over tests;
the compiles), then per file and per test, costliest first.

``python -m bench.suite_cpu compare BEFORE.json AFTER.json --out=PATH`` writes both runs' totals
and per-file CPU side by side.
"""
import argparse
import glob
import json
import os
import resource
import sys
import time

import pytest

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def pytest_addoption(parser):
    parser.addoption("--suite_cpu_out", default=None,
                     help="where bench.suite_cpu writes its JSON (per-worker parts beside it)")


def _cpu():
    """(own CPU seconds of this process, user + system seconds of its waited-for children)."""
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), ch.ru_utime + ch.ru_stime


class _Recorder:
    def __init__(self, out):
        self.out = out
        self.tests = {}
        self.programs = {}   # jitted function's name -> [compiles, seconds]
        self.compiles = self.compile_s = self.cache_hits = 0
        self.listening = False

    def listen(self):
        if self.listening:
            return
        import jax.monitoring as mon
        mon.register_event_duration_secs_listener(self._on_duration)
        mon.register_event_listener(self._on_event)
        self.listening = True

    def _on_duration(self, event, duration, fun_name="?", **_):
        if event == _COMPILE_EVENT:
            self.compiles += 1
            self.compile_s += duration
            tally = self.programs.setdefault(fun_name, [0, 0.0])
            tally[0] += 1
            tally[1] += duration

    def _on_event(self, event, **_):
        if event == _CACHE_HIT_EVENT:
            self.cache_hits += 1

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.listen()
        own0, ch0 = _cpu()
        c0, s0, h0 = self.compiles, self.compile_s, self.cache_hits
        yield
        own1, ch1 = _cpu()
        self.tests[item.nodeid] = {
            "cpu_s": round(own1 - own0 + ch1 - ch0, 3), "own_s": round(own1 - own0, 3),
            "children_s": round(ch1 - ch0, 3), "compiles": self.compiles - c0,
            "compile_s": round(self.compile_s - s0, 3), "cache_hits": self.cache_hits - h0}

    def write_part(self, name):
        own, ch = _cpu()
        part = {"own_cpu_s": own, "children_cpu_s": ch, "tests": self.tests,
                "programs": self.programs}
        with open(f"{self.out}.{name}.json", "w") as f:
            json.dump(part, f)


def pytest_configure(config):
    out = config.getoption("--suite_cpu_out")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        config.pluginmanager.register(_Recorder(os.path.abspath(out)), "suite_cpu_recorder")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    rec = session.config.pluginmanager.get_plugin("suite_cpu_recorder")
    if rec is None:
        return
    worker = getattr(session.config, "workerinput", None)
    if worker is not None:
        rec.write_part(worker["workerid"])
        return
    rec.write_part("controller")
    merge(rec.out)


def merge(out):
    """Reads ``out.*.json`` (the workers' and the controller's parts) into ``out``."""
    parts = {os.path.basename(p)[len(os.path.basename(out)) + 1:-5]: json.load(open(p))
             for p in sorted(glob.glob(glob.escape(out) + ".*.json"))}
    tests = {k: v for p in parts.values() for k, v in p["tests"].items()}
    files = {}
    for nodeid, t in tests.items():
        f = files.setdefault(nodeid.split("::")[0], {"cpu_s": 0.0, "children_s": 0.0,
                                                     "compiles": 0, "compile_s": 0.0,
                                                     "tests": 0})
        for k in ("cpu_s", "children_s", "compiles", "compile_s"):
            f[k] += t[k]
        f["tests"] += 1
    for f in files.values():
        for k in ("cpu_s", "children_s", "compile_s"):
            f[k] = round(f[k], 2)
    # The controller's children include the xdist workers, counted in their own parts.
    cpu = {k: p["own_cpu_s"] + (p["children_cpu_s"] if k != "controller" or len(parts) == 1
                                else 0.0) for k, p in parts.items()}
    total = sum(cpu.values())
    summary = {
        "total_cpu_s": round(total, 1),
        "per_process_cpu_s": {k: round(v, 1) for k, v in cpu.items()},
        "tests_cpu_s": round(sum(t["cpu_s"] for t in tests.values()), 1),
        "tests": len(tests),
        "compiles": sum(t["compiles"] for t in tests.values()),
        "fresh_compiles": sum(t["compiles"] - t["cache_hits"] for t in tests.values()),
        "compile_s": round(sum(t["compile_s"] for t in tests.values()), 1),
        "cache_hits": sum(t["cache_hits"] for t in tests.values()),
        "children_cpu_s": round(sum(t["children_s"] for t in tests.values()), 1),
        "quiet_wall_estimate_s": round(total / 2, 1),
    }
    programs = {}
    for p in parts.values():
        for name, (n, sec) in p.get("programs", {}).items():
            tally = programs.setdefault(name, [0, 0.0])
            tally[0] += n
            tally[1] += sec
    summary["programs_by_compile_s"] = {
        name: {"compiles": n, "compile_s": round(sec, 1)}
        for name, (n, sec) in sorted(programs.items(), key=lambda kv: -kv[1][1])[:30]}
    result = {"summary": summary,
              "files": dict(sorted(files.items(), key=lambda kv: -kv[1]["cpu_s"])),
              "tests": dict(sorted(tests.items(), key=lambda kv: -kv[1]["cpu_s"]))}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


def compare(before, after):
    """Both runs' summaries and per-file CPU seconds and compiles, side by side."""
    b, a = json.load(open(before)), json.load(open(after))
    names = sorted(set(b["files"]) | set(a["files"]),
                   key=lambda n: -b["files"].get(n, {}).get("cpu_s", 0.0))
    zero = {"cpu_s": 0.0, "compiles": 0, "tests": 0}
    return {"before": b["summary"], "after": a["summary"],
            "files": {n: {"before": {k: b["files"].get(n, zero)[k] for k in zero},
                          "after": {k: a["files"].get(n, zero)[k] for k in zero}}
                      for n in names}}


def main(argv):
    p = argparse.ArgumentParser(prog="python -m bench.suite_cpu")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    c.add_argument("--out", required=True)
    args = p.parse_args(argv)
    res = compare(args.before, args.after)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    for when in ("before", "after"):
        s = res[when]
        print(f"{when}: total CPU {s['total_cpu_s']} s, {s['tests']} tests, {s['compiles']} "
              f"compiles ({s['fresh_compiles']} not from the cache), quiet wall "
              f"~{s['quiet_wall_estimate_s']} s")


if __name__ == "__main__":
    main(sys.argv[1:])
