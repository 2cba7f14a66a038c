r"""The engine's round at two commits of this project, interleaved round by round on one machine.

    python -m bench.before_after --before=../deltafl_jax_36a2d9c [--make_before] \
        [--after=.] [--models=cnn,linear] [--algorithms=fedavg,deltafl] [--rounds=5] \
        [--out=bench/results/before_after_cpu.json]
    python -m bench.before_after --before=../deltafl_jax_ddd4c01 --before_commit=ddd4c01 \
        --models=pfl_cnn --algorithms=fedavg --devices=2 --rounds=8

A change of the round (the server step as an optax transformation applied by the round, the
engine's optional per-client hooks) is accepted when FedAvg and Delta-FL cost the same per
round before and after it. This script times both source trees on the workloads of
``bench/compare.py`` and ``bench/peers.py`` (``engine_runner``): m = ``--clients`` of
``--num_clients`` FEMNIST-like clients (``bench.common.femnist_like_dataset``, seed 0), one
local epoch, lr 0.05, seed 1, the ConvNet (batch 16) or softmax regression (batch 10), FedAvg
(``--algorithm=fedavg``, theta = 1) and Delta-FL at theta = 0.5. ``--models=pfl_cnn`` is
pfl-research's CIFAR-10 benchmark instead (``bench/peer_pfl.py``'s engine side): its CNN with
the model's defaults, 1000 clients of 50 random CIFAR-shaped images
(``bench.common.cifar_like_dataset``), m = 50, batch 10, lr 0.1, one local epoch; ``--clients``
and ``--num_clients`` are FEMNIST's and do not apply to it. Both workers build these images
with this script's tree's ``bench/common.py`` (loaded by path), so the two trees train the
same data even where the older tree lacks the generator.

One worker process per (tree, workload) runs this file with ``cwd`` and ``PYTHONPATH`` set to
its tree, so it imports that tree's ``deltafl_jax`` (it checks ``deltafl_jax.__file__`` and
reports the tree's ``git rev-parse HEAD``). It builds the experiment once, prints ``READY
{json}``, then answers each ``round t`` line with ``DONE {json}``: the seconds of
``exp.round_fn(state, exp.round_data(t), keys)`` until its metrics are on the host, and the
process's CPU seconds over the same span (every thread's; on a machine shared with other
work the CPU time moves less with the load than the wall time does; the host-side
``round_data`` is timed apart), the round's ``num_selected`` and
``train_real_examples``, the sampled clients and a digest of the new models. The worker uses
only API that both trees have: ``ExperimentConfig``, ``build_experiment``, ``initial_state``,
``keys``, ``round_data``, ``round_fn``, ``state.params``.

Per workload the driver starts the two workers one after the other, then runs round t on one
and then the other, never two at once; the order swaps every round (before/after, then
after/before, ...) so neither always runs right after the other. The first ``--warmup`` rounds
(compilation) are discarded; each figure is the median of ``--rounds`` rounds. The clients
sampled, the clients kept and the examples trained must be the same in both trees in every
round, or the script fails (exit 2) after writing its JSON. Writes JSON to ``--out`` and prints
a markdown table. Errors are one line on stderr with exit code 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

BEFORE_COMMIT = "36a2d9c"

flags.DEFINE_string("before", None, "a checkout of the older commit (e.g. a git worktree)")
flags.DEFINE_bool("make_before", False, "create --before with `git worktree add --detach "
                  "PATH --before_commit` if it does not exist")
flags.DEFINE_string("before_commit", BEFORE_COMMIT, "the commit --before must be at")
flags.DEFINE_string("after", None, "the newer tree (default: the tree holding this script)")
flags.DEFINE_list("models", ["cnn", "linear"], "models to time (cnn, linear)")
flags.DEFINE_list("algorithms", ["fedavg", "deltafl"],
                  "fedavg (theta = 1) and/or deltafl (theta = 0.5)")
flags.DEFINE_list("devices", ["1"], "engine device counts (on a CPU, D > 1 splits the host "
                  "into D devices, as bench/peers.py's --engine_devices)")
flags.DEFINE_integer("rounds", 5, "timed rounds per workload (median reported)")
flags.DEFINE_integer("warmup", 1, "untimed rounds first (compilation)")
flags.DEFINE_integer("clients", 100, "m, sampled clients per round")
flags.DEFINE_integer("num_clients", 865, "clients in the population (fewer: a smoke run)")
flags.DEFINE_string("out", None, "write the JSON here (default the git-ignored "
                    "bench/out/before_after_<backend>.json)")
flags.DEFINE_string("worker", None, "(internal) run as a worker with this JSON spec")
FLAGS = flags.FLAGS

# The configuration of bench/peers.py's engine_runner; pfl_cnn's is bench/peer_pfl.py's.
SEED = 1
BATCH = {"cnn": 16, "linear": 10, "pfl_cnn": 10}
LEARNING_RATE = {"cnn": 0.05, "linear": 0.05, "pfl_cnn": 0.1}
PFL_CLIENTS, PFL_POPULATION = 50, 1000    # pfl-research's cohort and its users
THETA = {"fedavg": 1.0, "deltafl": 0.5}
HERE = os.path.dirname(os.path.abspath(__file__))
THIS_FILE = os.path.abspath(__file__)


class Fail(Exception):
    """A one-line error: printed on stderr, exit code 2."""


# ----------------------------------------------------------------------------- worker


def _digest(*arrays) -> str:
    import numpy as np
    h = hashlib.sha1()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def _git(tree: str, *args: str) -> str:
    return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def _say(word: str, obj) -> None:
    sys.stdout.write(f"{word} {json.dumps(obj)}\n")
    sys.stdout.flush()


def _import_tree(spec: dict) -> str:
    """Import deltafl_jax (the tree on PYTHONPATH) and check where it came from."""
    from absl import logging
    logging.set_verbosity(logging.WARNING)   # no INFO lines from jax's backend probing
    tree = os.path.realpath(spec["tree"])
    if spec["devices"] > 1:   # before JAX starts its backend
        from deltafl_jax.engine.mesh import host_device_flags
        os.environ["XLA_FLAGS"] = host_device_flags(os.environ.get("XLA_FLAGS", ""),
                                                    spec["devices"])
    import deltafl_jax
    pkg = os.path.realpath(deltafl_jax.__file__)
    if not pkg.startswith(tree + os.sep):
        raise Fail(f"the worker for {tree} imported deltafl_jax from {pkg}")
    return pkg


def _versions() -> dict:
    import jax
    import numpy as np
    out = {"python": sys.version.split()[0], "jax": jax.__version__, "numpy": np.__version__}
    for name in ("jaxlib", "optax", "flax"):
        try:
            out[name] = __import__(name).__version__
        except Exception:   # noqa: BLE001 - a version is informative only
            pass
    return out


def _this_trees_common():
    """bench/common.py of the tree holding this script, loaded by path (the worker's own tree
    is on PYTHONPATH and may be older)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("before_after_common",
                                                  os.path.join(HERE, "common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(spec: dict, timer):
    """bench/peers.py's engine_runner configuration, or bench/peer_pfl.py's engine side for
    pfl_cnn; (experiment, state, keys, READY info)."""
    import jax

    from deltafl_jax import DataConfig, ExperimentConfig, build_experiment

    model, algorithm = spec["model"], spec["algorithm"]
    t0 = time.perf_counter()
    if model == "pfl_cnn":
        data = _this_trees_common().cifar_like_dataset(PFL_POPULATION)
    else:
        from bench.common import femnist_like_dataset
        data = femnist_like_dataset(spec["num_clients"], seed=0)
    data_s = time.perf_counter() - t0
    cfg = ExperimentConfig(
        data=DataConfig(data.name), model=model, algorithm=algorithm,
        thetas=(THETA[algorithm],), seeds=(SEED,), num_rounds=spec["num_rounds"],
        clients_per_round=spec["clients"], batch_size=BATCH[model],
        learning_rate=LEARNING_RATE[model], output_dir=None, save_models=False, verbose=False,
        devices=spec["devices"])
    t0 = time.perf_counter()
    with timer:
        exp = build_experiment(cfg, data)
        state, keys = exp.initial_state(), exp.keys()
        jax.block_until_ready((state, keys))
    dev = jax.devices()[0]
    info = {"data_s": data_s, "build_s": time.perf_counter() - t0,
            "build_compile_s": timer.seconds, "backend": jax.default_backend(),
            "device": str(getattr(dev, "device_kind", dev)),
            "data_digest": _digest(data.train.x, data.train.y, data.train.offsets),
            "placement": {k: v for k, v in vars(exp.placement).items()
                          if isinstance(v, (int, float, str, bool, type(None)))}}
    return exp, state, keys, info


def _serve(exp, state, keys, timer) -> None:
    """Answer `round t` lines until `quit` or the end of stdin."""
    import jax
    import numpy as np

    def ints(x):
        return np.asarray(x).astype(np.int64).ravel().tolist()

    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        t = int(words[1])
        t0 = time.perf_counter()
        rd = exp.round_data(t)
        jax.block_until_ready(rd)
        round_data_s = time.perf_counter() - t0
        timer.seconds = 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        with timer:
            state, met = exp.round_fn(state, rd, keys)
            met = jax.device_get(met)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        _say("DONE", {
            "round": t, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "round_data_s": round_data_s,
            "compile_s": timer.seconds, "num_selected": ints(met["num_selected"]),
            "train_real_examples": ints(met["train_real_examples"]),
            "clients": ints(jax.device_get(rd.plan.clients)),
            "params_digest": _digest(*jax.tree.leaves(jax.device_get(state.params)))})


def worker(spec: dict) -> None:
    """Build one experiment from the tree on PYTHONPATH, then serve rounds on stdin."""
    pkg = _import_tree(spec)
    from bench.common import CompileTimer

    timer = CompileTimer()
    exp, state, keys, info = _build(spec, timer)
    tree = os.path.realpath(spec["tree"])
    _say("READY", {"tree": tree, "deltafl_jax_file": pkg,
                   "commit": _git(tree, "rev-parse", "HEAD"), "pid": os.getpid(),
                   "versions": _versions(), **info})
    _serve(exp, state, keys, timer)


# ----------------------------------------------------------------------------- driver


class Worker:
    """One tree's worker process for one workload (the pattern of bench/peers.py's Peer)."""

    def __init__(self, label: str, tree: str, spec: dict):
        self.label = label
        env = dict(os.environ, PYTHONPATH=tree)
        env.pop("PYTHONSAFEPATH", None)
        cmd = [sys.executable, THIS_FILE, f"--worker={json.dumps(dict(spec, tree=tree))}"]
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.info = self._expect("READY")

    def _expect(self, word: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(word + " "):
                return json.loads(line[len(word) + 1:])
        raise Fail(f"the {self.label} worker exited (code {self.proc.wait()}) before {word}; "
                   f"its stderr is above")

    def round(self, t: int) -> dict:
        self.proc.stdin.write(f"round {t}\n")
        self.proc.stdin.flush()
        return self._expect("DONE")

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def tree_info(tree: str) -> dict:
    try:
        head = _git(tree, "rev-parse", "HEAD")
        changed = _git(tree, "status", "--porcelain", "--untracked-files=no").splitlines()
    except (OSError, subprocess.CalledProcessError) as e:
        raise Fail(f"{tree} is not a git checkout ({e})")
    return {"path": tree, "commit": head, "short": head[:7], "dirty": bool(changed),
            "changed_files": len(changed)}


def resolve_trees() -> tuple:
    after = os.path.realpath(FLAGS.after or os.path.dirname(HERE))
    if not os.path.isdir(os.path.join(after, "deltafl_jax")):
        raise Fail(f"--after={after} holds no deltafl_jax package")
    try:
        want = _git(after, "rev-parse", "--verify", "--quiet", FLAGS.before_commit + "^{commit}")
    except (OSError, subprocess.CalledProcessError):
        raise Fail(f"commit {FLAGS.before_commit} is not in the repository of {after} (a "
                   f"shallow clone? `git fetch --unshallow`)")
    how = (f"create it with `git -C {after} worktree add --detach PATH {FLAGS.before_commit}` "
           f"or pass --make_before")
    if not FLAGS.before:
        raise Fail(f"--before=PATH (a checkout of {FLAGS.before_commit}) is required; "
                   f"--make_before creates it (a git worktree) if PATH does not exist")
    before = os.path.realpath(FLAGS.before)
    if not os.path.exists(before):
        if not FLAGS.make_before:
            raise Fail(f"--before={before} does not exist; {how}")
        proc = subprocess.run(["git", "-C", after, "worktree", "add", "--detach", before, want],
                              capture_output=True, text=True)
        if proc.returncode:
            raise Fail(f"git worktree add {before} failed: "
                       f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        print(f"# created {before} at {want[:7]} (git worktree)", file=sys.stderr, flush=True)
    if not os.path.isdir(os.path.join(before, "deltafl_jax")):
        raise Fail(f"--before={before} holds no deltafl_jax package")
    info = {"before": tree_info(before), "after": tree_info(after)}
    if info["before"]["commit"] != want:
        raise Fail(f"--before={before} is at {info['before']['short']}, not "
                   f"{FLAGS.before_commit} (pass --before_commit to compare another commit)")
    if info["before"]["dirty"]:
        print(f"# warning: {before} has uncommitted changes", file=sys.stderr, flush=True)
    return info


def check_flags() -> list:
    for name, allowed in (("models", BATCH), ("algorithms", THETA)):
        values = getattr(FLAGS, name)
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise Fail(f"--{name} must be a list of {', '.join(allowed)}; got "
                       f"{','.join(values) or 'nothing'}")
    try:
        devices = [int(d) for d in FLAGS.devices]
    except ValueError:
        devices = []
    if not devices or min(devices) < 1:
        raise Fail(f"--devices must be integers >= 1, got {','.join(FLAGS.devices)}")
    if FLAGS.rounds < 1 or FLAGS.warmup < 0:
        raise Fail(f"--rounds must be >= 1 and --warmup >= 0 (got {FLAGS.rounds}, "
                   f"{FLAGS.warmup})")
    if not 1 <= FLAGS.clients <= FLAGS.num_clients:
        raise Fail(f"--clients must be in [1, --num_clients={FLAGS.num_clients}], got "
                   f"{FLAGS.clients}")
    return [(model, alg, d) for model in FLAGS.models for alg in FLAGS.algorithms
            for d in devices]


def quantiles(values) -> dict:
    vs = sorted(values)
    q = statistics.quantiles(vs, n=4, method="inclusive") if len(vs) > 1 else [vs[0]] * 3
    return {"median": statistics.median(vs), "min": vs[0], "max": vs[-1], "q1": q[0],
            "q3": q[2], "values": list(values)}


def interleave(name: str, spec: dict, trees: dict) -> tuple:
    """Start both trees' workers, then one round of each in turn; (infos, rounds, load)."""
    workers = {}
    try:
        for side in ("before", "after"):
            print(f"# {name}: starting the {side} worker ({trees[side]['short']})",
                  file=sys.stderr, flush=True)
            workers[side] = Worker(f"{side} ({name})", trees[side]["path"], spec)
            got = workers[side].info["commit"]
            if got != trees[side]["commit"]:
                raise Fail(f"the {side} worker reports commit {got[:7]}, expected "
                           f"{trees[side]['short']}")
        rounds, load = {"before": [], "after": []}, []
        for t in range(spec["num_rounds"]):
            order = ("before", "after") if t % 2 == 0 else ("after", "before")
            for side in order:
                l0 = os.getloadavg()[0]
                rounds[side].append(workers[side].round(t))
                load.append({"round": t, "tree": side, "load1_before": l0,
                             "load1_after": os.getloadavg()[0]})
            print(f"# {name} round {t}{' (warm-up)' if t < FLAGS.warmup else ''}: before "
                  f"{rounds['before'][-1]['seconds']:.3f}s, after "
                  f"{rounds['after'][-1]['seconds']:.3f}s", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    return {side: w.info for side, w in workers.items()}, rounds, load


def compare_rounds(rounds: dict) -> tuple:
    """Per round: what both trees did, and whether it matches; (rows, mismatched rounds)."""
    rows, mismatches = [], []
    for b, a in zip(rounds["before"], rounds["after"]):
        same = {k: b[k] == a[k] for k in ("clients", "num_selected", "train_real_examples")}
        row = {"round": b["round"], "warmup": b["round"] < FLAGS.warmup,
               "num_selected": b["num_selected"],
               "train_real_examples": b["train_real_examples"],
               "clients_digest": _digest_list(b["clients"]),
               **{f"same_{k}": v for k, v in same.items()},
               "same_params": b["params_digest"] == a["params_digest"],
               "seconds": {"before": b["seconds"], "after": a["seconds"]},
               "round_data_s": {"before": b["round_data_s"], "after": a["round_data_s"]}}
        if not all(same.values()):
            mismatches.append(b["round"])
            row["after_num_selected"] = a["num_selected"]
            row["after_train_real_examples"] = a["train_real_examples"]
            row["after_clients_digest"] = _digest_list(a["clients"])
        rows.append(row)
    return rows, mismatches


def side_summary(info: dict, rounds: list) -> dict:
    w = FLAGS.warmup
    timed = [r["seconds"] for r in rounds[w:]]
    cpu = [r["cpu_seconds"] for r in rounds[w:]]
    keep = ("commit", "deltafl_jax_file", "versions", "backend", "device", "placement",
            "data_s", "build_s", "build_compile_s")
    return {**{k: info[k] for k in keep},
            "warmup_round_s": [r["seconds"] for r in rounds[:w]],
            "warmup_compile_s": sum(r["compile_s"] for r in rounds[:w]),
            "timed_compile_s": sum(r["compile_s"] for r in rounds[w:]),
            "round_s": timed, "median_s_per_round": statistics.median(timed),
            "round_cpu_s": cpu, "median_cpu_s_per_round": statistics.median(cpu),
            "median_round_data_s": statistics.median(r["round_data_s"] for r in rounds[w:])}


def time_workload(model: str, algorithm: str, devices: int, trees: dict) -> dict:
    """Both trees' workers for one workload, alternating round by round."""
    pfl = model == "pfl_cnn"
    spec = {"model": model, "algorithm": algorithm, "devices": devices,
            "clients": PFL_CLIENTS if pfl else FLAGS.clients,
            "num_clients": PFL_POPULATION if pfl else FLAGS.num_clients,
            "num_rounds": FLAGS.warmup + FLAGS.rounds}
    name = f"{model} {algorithm}" + ("" if devices == 1 else f" {devices}dev")
    infos, rounds, load = interleave(name, spec, trees)
    rows, mismatches = compare_rounds(rounds)
    out = {"workload": name, "model": model, "algorithm": algorithm, "theta": THETA[algorithm],
           "devices": devices, "batch_size": BATCH[model],
           "learning_rate": LEARNING_RATE[model], "local_epochs": 1, "m": spec["clients"],
           "num_clients": spec["num_clients"],
           "rounds_timed": FLAGS.rounds, "warmup": FLAGS.warmup,
           "before": side_summary(infos["before"], rounds["before"]),
           "after": side_summary(infos["after"], rounds["after"])}
    b, a = out["before"]["round_s"], out["after"]["round_s"]
    out["ratio_after_over_before"] = (out["after"]["median_s_per_round"]
                                      / out["before"]["median_s_per_round"])
    out["per_round_ratio"] = quantiles([y / x for x, y in zip(b, a)])
    out["cpu_ratio_after_over_before"] = (out["after"]["median_cpu_s_per_round"]
                                          / out["before"]["median_cpu_s_per_round"])
    out["per_round_cpu_ratio"] = quantiles(
        [y / x for x, y in zip(out["before"]["round_cpu_s"], out["after"]["round_cpu_s"])])
    out["same_data"] = infos["before"]["data_digest"] == infos["after"]["data_digest"]
    out["same_clients_and_examples"] = not mismatches and out["same_data"]
    out["same_params_every_round"] = all(r["same_params"] for r in rows)
    out.update(mismatched_rounds=mismatches, rounds=rows, load=load)
    return out


def _digest_list(values) -> str:
    return hashlib.sha1(json.dumps(values).encode()).hexdigest()[:16]


def _warm(side: dict) -> str:
    return f"{sum(side['warmup_round_s']):.1f}" if side["warmup_round_s"] else "-"


def markdown(result: dict) -> str:
    rows = ["| model | algorithm | devices | before s/round | after s/round | after / before "
            "| per-round ratios: median [min, max] | CPU s after / before | build s before / "
            "after | warm-up round s before / after | kept clients, examples / round | same "
            "clients & examples |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["workloads"]:
        b, a, pr = r["before"], r["after"], r["per_round_ratio"]
        timed = [x for x in r["rounds"] if not x["warmup"]]
        kept = statistics.mean(sum(x["num_selected"]) for x in timed)
        ex = statistics.mean(sum(x["train_real_examples"]) for x in timed)
        rows.append(
            f"| {r['model']} | {r['algorithm']} (θ = {r['theta']:g}) | {r['devices']} | "
            f"{b['median_s_per_round']:.4g} | {a['median_s_per_round']:.4g} | "
            f"**{r['ratio_after_over_before']:.3f}** | {pr['median']:.3f} [{pr['min']:.3f}, "
            f"{pr['max']:.3f}] | {r['cpu_ratio_after_over_before']:.3f} | "
            f"{b['build_s']:.1f} / {a['build_s']:.1f} | "
            f"{_warm(b)} / {_warm(a)} | {kept:.1f}, {ex:.0f} | "
            f"{'yes' if r['same_clients_and_examples'] else '**NO**'} |")
    t = result["trees"]
    head = (f"before {t['before']['short']} ({t['before']['path']}), after "
            f"{t['after']['short']}{' + uncommitted changes' if t['after']['dirty'] else ''} "
            f"({t['after']['path']}); jax {result['versions'].get('jax')}, Python "
            f"{result['versions'].get('python')}, {result['machine']['cpu_count']} CPUs; load "
            f"average {result['loadavg_start'][0]:.1f} at start, {result['loadavg_end'][0]:.1f} "
            f"at end; median of {FLAGS.rounds} rounds after {FLAGS.warmup} warm-up")
    return head + "\n\n" + "\n".join(rows)


def drive() -> int:
    import platform

    workloads = check_flags()
    trees = resolve_trees()
    result = {"benchmark": "before_after", "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "python": sys.version.split()[0]},
              "trees": trees, "worker_script": THIS_FILE,
              "order": "per workload, one round of each tree in turn, never two at once; "
                       "the first of each round alternates (before, after / after, before)",
              "settings": {"rounds": FLAGS.rounds, "warmup": FLAGS.warmup,
                           "clients": FLAGS.clients, "num_clients": FLAGS.num_clients,
                           "learning_rate": LEARNING_RATE, "seed": SEED, "batch_size": BATCH},
              "loadavg_start": list(os.getloadavg()), "workloads": []}
    t0 = time.perf_counter()
    for model, algorithm, devices in workloads:
        result["workloads"].append(time_workload(model, algorithm, devices, trees))
    result["wall_s"] = time.perf_counter() - t0
    result["loadavg_end"] = list(os.getloadavg())
    first = result["workloads"][0]
    result["versions"] = first["after"]["versions"]
    result["versions_before"] = first["before"]["versions"]
    result["backend"] = first["after"]["backend"]
    result["device"] = first["after"]["device"]
    result["summary"] = {r["workload"]: r["ratio_after_over_before"]
                         for r in result["workloads"]}
    result["same_clients_and_examples"] = all(r["same_clients_and_examples"]
                                              for r in result["workloads"])
    from bench.paths import default_out
    out = FLAGS.out or default_out(f"before_after_{result['backend']}")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(json.dumps(result, indent=1) + "\n")
    print(markdown(result) + f"\nwrote {out}", flush=True)
    bad = [r["workload"] + (" (data)" if not r["same_data"] else
                            f" (rounds {r['mismatched_rounds']})")
           for r in result["workloads"] if not r["same_clients_and_examples"]]
    if bad:
        raise Fail("the trees sampled, kept or trained different clients or examples in: "
                   + "; ".join(bad) + f" (see {out})")
    return 0


def main(argv):
    if len(argv) > 1:
        raise Fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.worker:
        worker(json.loads(FLAGS.worker))
        return 0
    return drive()


def parse_flags(argv):
    try:
        return FLAGS(argv)
    except flags.Error as e:
        print(f"before_after: error: {e}", file=sys.stderr)
        sys.exit(2)


def run(argv=None):
    def wrapped(argv):
        try:
            return main(argv)
        except Fail as e:
            print(f"before_after: error: {e}", file=sys.stderr)
            sys.exit(2)

    app.run(wrapped, argv=argv, flags_parser=parse_flags)


if __name__ == "__main__":
    if sys.path and os.path.realpath(sys.path[0] or ".") == HERE:
        # Run as a file (a worker): its folder must not shadow the tree on PYTHONPATH.
        sys.path.pop(0)
    run()
