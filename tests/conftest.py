import os
import shutil
import stat
import subprocess
import sys
import tempfile

# Tests never read or write the user's home: for the whole run HOME, the XDG folders and every
# cache a command may fill (the prepared-data cache $DELTAFL_DATA, the peers' venvs
# $DELTAFL_PEERS_CACHE, matplotlib's, tfds' data_dir) point into one fresh temporary folder,
# set before anything is imported and inherited by the xdist workers and the commands the
# tests start; the process that made it removes it at the end. That process also lists the
# user's caches (WATCHED) when the run starts and fails the run if they differ at its end.
SANDBOX_VAR, REAL_HOME_VAR = "DELTAFL_TESTS_SANDBOX", "DELTAFL_TESTS_REAL_HOME"
_OWN_SANDBOX, _WATCHED = None, []
if SANDBOX_VAR not in os.environ:
    _OWN_SANDBOX = tempfile.mkdtemp(prefix="deltafl_tests_home_")
    _real_home = os.path.expanduser("~")
    _home = os.path.join(_OWN_SANDBOX, "home")
    _cache = os.path.join(_home, ".cache")
    # The user's data caches, as the code would find them without this sandbox.
    _WATCHED = sorted({os.environ.get("DELTAFL_DATA") or os.path.join(_real_home, ".cache",
                                                                      "deltafl_jax"),
                       os.path.join(_real_home, ".cache", "deltafl_jax"),
                       os.environ.get("TFDS_DATA_DIR") or os.path.join(_real_home,
                                                                       "tensorflow_datasets"),
                       os.path.join(_real_home, ".cache", "matplotlib"),
                       os.path.join(_real_home, ".config", "matplotlib")})
    os.makedirs(_cache)
    if os.path.isfile(os.path.join(_real_home, ".gitconfig")):   # git's safe.directory etc.
        shutil.copy(os.path.join(_real_home, ".gitconfig"), os.path.join(_home, ".gitconfig"))
    os.environ.update({
        SANDBOX_VAR: _OWN_SANDBOX, REAL_HOME_VAR: _real_home, "HOME": _home,
        # The user's peers' venvs, which tests/test_bench_smoke.py may run (never rebuild).
        "DELTAFL_TESTS_USER_PEERS": os.environ.get("DELTAFL_PEERS_CACHE") or os.path.join(
            _real_home, ".cache", "deltafl_jax", "peers"),
        "XDG_CACHE_HOME": _cache, "XDG_CONFIG_HOME": os.path.join(_home, ".config"),
        "XDG_DATA_HOME": os.path.join(_home, ".local", "share"),
        "DELTAFL_DATA": os.path.join(_cache, "deltafl_jax"),
        "DELTAFL_PEERS_CACHE": os.path.join(_cache, "deltafl_jax", "peers"),
        "MPLCONFIGDIR": os.path.join(_home, ".config", "matplotlib"),
        "TFDS_DATA_DIR": os.path.join(_home, "tensorflow_datasets")})


def snapshot(paths):
    """{path: (kind, size, mtime_ns)} of every entry under `paths` (symbolic links not followed;
    a missing path lists nothing)."""
    out = {}
    for root in paths:
        _add_entry(out, root)
        for top, dirs, files in os.walk(root):
            for name in dirs + files:
                _add_entry(out, os.path.join(top, name))
    return out


def _add_entry(out, path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:   # absent, or removed while listed
        return
    kind = "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "file"
    out[path] = kind, (0 if kind == "dir" else st.st_size), st.st_mtime_ns


def changes(before, after):
    """One line per path added, removed or changed between two snapshots."""
    verbs = {p: "added" for p in set(after) - set(before)}
    verbs.update({p: "removed" for p in set(before) - set(after)})
    verbs.update({p: "changed" for p in set(before) & set(after) if before[p] != after[p]})
    return [f"{verbs[p]} {p}" for p in sorted(verbs)]


_HOME_AT_START = snapshot(_WATCHED) if _OWN_SANDBOX else None

# Most of the suite's time is XLA compiling small programs, and many tests build the same
# program (the same tiny model, shapes and round) in separate experiments: one persistent
# compilation cache for the whole run, shared by the xdist workers and the commands the tests
# start (set before jax is imported; a fresh directory per run, so nothing is reused across
# runs or code versions).
_OWN_XLA_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_XLA_CACHE = tempfile.mkdtemp(prefix="deltafl_tests_xla_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_XLA_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# The commands split a CPU host into one device per core unless --devices or XLA_FLAGS choose;
# the tests run on one host device (the trip counts and layouts they check), and a test that
# wants more asks for them (its own XLA_FLAGS, last one wins, or --devices).
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=1").strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402


FAST_SUITE_MARKEXPR = "not slow"
# XLA:CPU's emitters of fused kernels spend a fixed ~8 ms setting up each kernel, so a round
# (about 200 kernels even for the linear model) compiles in half the time with the older
# emitters. Same results (the goldens match bit for bit with it), slower small kernels.
FAST_SUITE_XLA_FLAG = "--xla_cpu_use_fusion_emitters=false"
PROBED_VAR = "DELTAFL_TESTS_XLA_FLAG_PROBED"


def _xla_accepts(flag):
    """Whether this jaxlib's XLA knows `flag` (XLA aborts on an unknown one): a child process
    compiles one program with it."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flag).strip())
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0)"],
                           env=env, capture_output=True, timeout=300)
    return probe.returncode == 0


def pytest_configure(config):
    """The fast suite (the README's test command, ``-m 'not slow'``) compiles with XLA's most
    expensive optimizations off (``jax_disable_most_optimizations``: LLVM at -O0, no expensive
    passes), in this process, the xdist workers and the commands the tests start. Most of that
    suite's time is XLA compiling small programs it runs once. With it, where this jaxlib's XLA
    accepts it, :data:`FAST_SUITE_XLA_FLAG` (XLA:CPU's older emitters of fused kernels, which
    compile each kernel faster). The HLO the code builds, its ops and their order are the same;
    what changes is how the kernels are emitted, so floats can differ in the last bits from an
    optimized build, and every fast test compares within a tolerance or two programs compiled
    alike. Runs that select the slow tests (CI's second step: the goldens and the
    kill-and-resume recordings, compared bit for bit with files written at XLA's default
    level) compile as users do."""
    fast = config.getoption("markexpr") == FAST_SUITE_MARKEXPR
    if fast and "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ:
        os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    from jax._src import xla_bridge
    if (fast and "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]
            and PROBED_VAR not in os.environ and not xla_bridge.backends_are_initialized()):
        os.environ[PROBED_VAR] = "1"   # the workers inherit the flag, or that it was refused
        if _xla_accepts(FAST_SUITE_XLA_FLAG):
            os.environ["XLA_FLAGS"] += " " + FAST_SUITE_XLA_FLAG
    if os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1":
        import jax
        jax.config.update("jax_disable_most_optimizations", True)


def pytest_sessionfinish(session, exitstatus):
    """The process that made the sandbox (the xdist controller, after every worker is done)
    fails the run if the user's caches changed while it ran."""
    if _HOME_AT_START is None or hasattr(session.config, "workerinput"):
        return
    lines = changes(_HOME_AT_START, snapshot(_WATCHED))
    if lines:
        shown = lines[:20] + ([f"... {len(lines) - 20} more"] if len(lines) > 20 else [])
        text = (f"error: the tests changed the user's caches (they must write only under "
                f"{_OWN_SANDBOX}):\n" + "".join(f"  {x}\n" for x in shown))
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write("\n" + text, red=True, bold=True)
        else:
            sys.stderr.write(text)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config):
    """The process that made the sandbox and the compilation cache (not an xdist worker)
    removes them."""
    if hasattr(config, "workerinput"):
        return
    for path in (_OWN_XLA_CACHE, _OWN_SANDBOX):
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


sys.path.insert(0, os.path.dirname(__file__))

from deltafl_jax import DataConfig, ExperimentConfig, FederatedDataset  # noqa: E402
from deltafl_jax.data import split_clients  # noqa: E402
from deltafl_jax.datasets.synthetic import synthetic_clients  # noqa: E402


def run_command(command, argv, capsys=None):
    """Runs a command of experiments/ (``run``, ``report``, ``tune``, ``leaderboard``: its
    module) in-process as ``python -m`` does: the flags reset, parsed from `argv` by the
    module's own parser (experiments.cli's when it has none) and its ``main`` called; returns
    (exit code, stderr, stdout), read from `capsys`, or from the streams redirected here
    without it (a fixture wider than a test)."""
    import contextlib
    import io
    from experiments import cli
    parse = getattr(command, "parse_flags_or_fail", cli.parse_flags_or_fail)
    command.FLAGS.unparse_flags()
    code, err, out = 0, io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as streams:
        if capsys is None:
            streams.enter_context(contextlib.redirect_stderr(err))
            streams.enter_context(contextlib.redirect_stdout(out))
        try:
            command.main(parse([command.__name__.rsplit(".", 1)[-1]] + list(argv)))
        except SystemExit as e:
            code = e.code
    if capsys is None:
        return code, err.getvalue(), out.getvalue()
    captured = capsys.readouterr()
    return code, captured.err, captured.out


def run_runner(argv, capsys):
    """experiments.run in-process (:func:`run_command`): (exit code, stderr, stdout)."""
    from experiments import run as runner
    return run_command(runner, argv, capsys)


@pytest.fixture(scope="session")
def tiny_synthetic():
    """24 synthetic clients of 50..80 examples (12 train / 12 test), 60 features, 10 classes."""
    clients = synthetic_clients(1.0, 1.0, 24, seed=3, max_examples=80, shared=0.5)
    train, test = split_clients(clients, seed=3)
    return FederatedDataset("synthetic", train, test, num_classes=10)


def folder_bytes(path):
    """{relative path: bytes} of every file under `path`."""
    return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(path) for f in files}


def refused_over_a_finished_run(tmp_path, data, *flags, message):
    """A finished run in a folder, then a subprocess ``experiments.run`` on tests/tiny.flags
    with `flags` and ``--overwrite`` into it: asserts one stderr line holding `message`,
    exit 2, and the folder byte-identical."""
    import subprocess
    from deltafl_jax import run_experiment
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "run"
    run_experiment(tiny_config(num_rounds=1, eval_every=1, output_dir=str(out)), data)
    before = folder_bytes(str(out))
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run",
         f"--flagfile={os.path.join(repo, 'tests', 'tiny.flags')}", f"--output_dir={out}",
         *flags, "--overwrite"], cwd=repo, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert message in lines[0]
    assert folder_bytes(str(out)) == before


def tiny_config(**overrides):
    """A small configuration; a swept flag of a baseline (fedprox_mu=..., qffl_q=...) may be
    passed as a keyword and goes into ``sweeps``, an algorithm's option (filter=...,
    weighting=...) into ``options``."""
    from deltafl_jax.algorithms import registry
    base = dict(data=DataConfig("synthetic"), model="linear", thetas=(1.0, 0.5), seeds=(1,),
                num_rounds=3, clients_per_round=6, batch_size=8, learning_rate=0.05,
                eval_every=3, output_dir=None, save_models=False, verbose=False)
    flags = {s.flag for s in registry.sweeps()} - {"thetas"}
    sweeps = {k: tuple(overrides.pop(k)) for k in list(overrides) if k in flags}
    option_flags = {name for name, _ in registry.options()}
    options = {k: overrides.pop(k) for k in list(overrides) if k in option_flags}
    base.update(overrides)
    return ExperimentConfig(**base, sweeps=sweeps, options=options)


@pytest.fixture
def make_config():
    return tiny_config


def run_rounds_history(exp, rounds):
    """Run `rounds` rounds of a built experiment; (final state, per-round host metrics)."""
    import jax
    state, keys, hist = exp.initial_state(), exp.keys(), []
    for t in range(rounds):
        state, metrics = exp.round_fn(state, exp.round_data(t, state), keys)
        hist.append(jax.device_get(metrics))
    return state, hist


def linear_rows(params, r):
    """(W, b) in float64 of replica r of a softmax regression's params ({'Dense_0': ...})."""
    import jax
    p = jax.device_get(params)["Dense_0"]
    return np.asarray(p["kernel"][r], np.float64), np.asarray(p["bias"][r], np.float64)


def client_lists(split):
    """(xs, ys): each client's inputs (float64) and labels, for the NumPy references."""
    xs = [split.client(k)[0].astype(np.float64) for k in range(split.num_clients)]
    ys = [split.client(k)[1] for k in range(split.num_clients)]
    return xs, ys


def client_job(learning_rate, steps, l2=0.0):
    """The job a client update sees, with the default client optimizer (plain SGD)."""
    from deltafl_jax.optimizers.client import ClientOptimizer
    from deltafl_jax.engine import ClientJob
    return ClientJob(optimizer=ClientOptimizer().transformation(learning_rate, l2),
                     learning_rate=np.float32(learning_rate), l2=np.float32(l2),
                     steps=np.int32(steps))
