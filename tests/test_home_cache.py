"""The tests never touch the user's home or caches (tests/conftest.py): every cache a test or a
command it starts may fill is in the run's temporary home, and a run that changes the user's
caches fails."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SANDBOX = os.environ.get("DELTAFL_TESTS_SANDBOX", "")
REAL_HOME = os.environ.get("DELTAFL_TESTS_REAL_HOME", os.path.expanduser("~"))
# The variables tests/conftest.py sets; a nested run without them builds its own sandbox.
SANDBOX_VARIABLES = ("DELTAFL_TESTS_SANDBOX", "DELTAFL_TESTS_REAL_HOME",
                     "DELTAFL_TESTS_USER_PEERS", "DELTAFL_DATA", "DELTAFL_PEERS_CACHE",
                     "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "MPLCONFIGDIR",
                     "TFDS_DATA_DIR")

CACHES = """
import os
from deltafl_jax.datasets import DataConfig, default_data_dir
print(os.path.expanduser("~"))
print(default_data_dir())
print(DataConfig("sent140").resolved_data_dir)
print(os.environ.get("DELTAFL_PEERS_CACHE")   # bench.peers.cache_dir() without --cache_dir
      or os.path.join(os.path.expanduser("~"), ".cache", "deltafl_jax", "peers"))
from tensorflow_datasets.core import constants
print(constants.DATA_DIR)
import matplotlib
print(matplotlib.get_cachedir())
print(matplotlib.get_configdir())
"""


def inside(path, folder):
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(folder)]) == \
        os.path.realpath(folder)


def test_every_cache_is_in_the_temporary_home():
    """In the tests' process and in a command it starts: the home, the prepared-data cache
    (the default of --data_dir), the peers' venvs, tfds' data_dir and matplotlib's folders."""
    here = []
    exec(CACHES, {"print": here.append})
    child = subprocess.run([sys.executable, "-c", CACHES], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split("\n")[:-1]
    for paths in (here, child):
        assert len(paths) == 7
        for path in paths:
            assert SANDBOX and inside(path, SANDBOX), path
            assert not inside(path, REAL_HOME), path


INNER = '''
import os
from deltafl_jax.datasets import default_data_dir

def test_writes_into_the_data_cache():
    os.makedirs(default_data_dir(), exist_ok=True)
    with open(os.path.join(default_data_dir(), "prepared.json"), "w") as f:
        f.write("{}")

def test_writes_into_the_users_cache_by_its_path():
    folder = os.path.join(os.environ["DELTAFL_TESTS_REAL_HOME"], ".cache", "deltafl_jax", "raw")
    os.makedirs(folder)
    with open(os.path.join(folder, "all_data_0.json"), "w") as f:
        f.write("{}")
'''


def test_a_run_that_changes_the_users_cache_fails(tmp_path):
    """A run of two tests under a stand-in home: the one writing into the default data cache
    lands in the run's sandbox; the one writing into the home's cache by its path makes the
    run fail (exit code 1) with a line per path it added, and the sandbox is removed."""
    home = tmp_path / "home"
    (home / ".cache" / "deltafl_jax").mkdir(parents=True)
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {k: v for k, v in os.environ.items() if k not in SANDBOX_VARIABLES}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests"), REPO]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-p", "conftest", str(tmp_path / "test_inner.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "2 passed" in out, out
    cache = home / ".cache" / "deltafl_jax"
    lines = [line.strip() for line in out.splitlines()]
    report = lines.index(next(x for x in lines if x.startswith("error: the tests changed")))
    assert lines[report + 1:report + 4] == [f"changed {cache}", f"added {cache / 'raw'}",
                                            f"added {cache / 'raw' / 'all_data_0.json'}"]
    assert sorted(os.listdir(cache)) == ["raw"]   # the data cache's write went to the sandbox
    sandbox = lines[report].split("under ", 1)[1].rstrip("):")
    assert os.path.basename(sandbox).startswith("deltafl_tests_home_")
    assert not os.path.exists(sandbox)


def test_the_fast_tests_compile_without_expensive_optimizations(request):
    """tests/conftest.py: the README's command (-m 'not slow') compiles with XLA's most expensive
    optimizations off, here and in the commands the tests start; a run that selects the slow
    tests (the goldens) compiles at XLA's defaults."""
    import jax
    fast = request.config.getoption("markexpr") == "not slow"
    assert jax.config.read("jax_disable_most_optimizations") is fast
    child = subprocess.run([sys.executable, "-c", "import jax; print(jax.config.read("
                            "'jax_disable_most_optimizations'))"],
                           capture_output=True, text=True, check=True, cwd=REPO)
    assert child.stdout.strip() == str(fast)


def test_the_fast_tests_compile_with_the_older_fused_kernel_emitters(request):
    """tests/conftest.py: where XLA accepts it, the fast tests (and the commands they start)
    compile with --xla_cpu_use_fusion_emitters=false; the slow tests without it."""
    from conftest import FAST_SUITE_XLA_FLAG
    fast = request.config.getoption("markexpr") == "not slow"
    assert (FAST_SUITE_XLA_FLAG in os.environ.get("XLA_FLAGS", "")) is fast
