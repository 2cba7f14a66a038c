"""The documentation cannot drift from the code: the flag reference (docs/reference/flags.md) is
the output of its generator, every `--flag` and every repository path that README.md, the
site's pages (docs/) and bench/README.md name exists, the README's two set-up commands are the
ones CI runs, and a table held by several pages is the same in each. (`mkdocs build --strict`
in .ci/run checks the site's links, anchors and API references.)"""

import glob
import itertools
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from docs import gen_flags  # noqa: E402  (docs/ is not an installed package)
from experiments import pages  # noqa: E402

PAGES = pages.markdown_pages() + [os.path.join(REPO, "bench", "README.md")]

# Flags of other programs that the pages name, each with where it belongs.
FOREIGN = {
    "xla_gpu_deterministic_ops": "an XLA flag (--deterministic sets it)",
    "xla_force_host_platform_device_count": "an XLA flag (bench.scaling's fake devices)",
    "xla_cpu_use_onednn": "an XLA:CPU flag (measured in the benchmarks)",
    "xla_cpu_multi_thread_eigen": "an XLA:CPU flag (measured in the benchmarks)",
    "xla_cpu_use_xnnpack": "an XLA:CPU flag (measured in the benchmarks)",
    "xla_cpu_prefer_vector_width": "an XLA:CPU flag (measured in the benchmarks)",
    "xla_cpu_use_fusion_emitters": "an XLA:CPU flag (the fast tests compile with it off)",
    "xla_cpu_copy_insertion_use_region_analysis": "an XLA:CPU flag (measured in the "
                                                  "benchmarks)",
    "xla_gpu_enable_triton_gemm": "an XLA:GPU flag (ResNet-18-GN's compile on jax 0.11.2)",
    "suite_cpu_out": "the pytest option of bench/suite_cpu.py, a plugin",
    "index": "pip's --index-url",
    "extra": "pip's --extra-index-url",
    "dist": "pytest-xdist's --dist",
    "strict": "mkdocs build --strict",
    "detach": "git worktree add --detach",
    "flagfile": "absl's --flagfile",
    "help": "absl's --help",
    "helpfull": "absl's --helpfull",
}
# The recipe's example algorithm (docs/guides/add-algorithm.md): names it invents.
EXAMPLE = "myalgo"
# The one-file models of the availability and device-speed guides: their flags and files.
GUIDE_EXAMPLES = ("every_k", "availability_every", "two_tier", "client_speed_slowdown")
# The usage line's `--flag=value`.
PLACEHOLDERS = {"flag"}

# A flag, or a family of them (`--dp_*`).
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_]*)(\*?)")
ROOTS = ("deltafl_jax", "experiments", "bench", "tests", "data_prep", "docs", "notebooks", ".ci")
PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(re.escape(r) for r in ROOTS)
                  + r")/[\w./{},<>*+-]*)")
# Paths inside the package, named from within it (`algorithms/spec.py`, `engine/train.py`).
SHORT = re.compile(r"(?<![\w/.-])((?:algorithms|engine|run|report|datasets)/\w+\.py)")


@pytest.fixture(scope="module")
def commands():
    return gen_flags.collect()


def known_flags(commands):
    names, booleans = set(), set()
    for command in commands.values():
        for flag in command["flags"]:
            names.add(flag["name"])
            if flag["boolean"]:
                booleans.add(flag["name"])
    for path in glob.glob(os.path.join(REPO, "bench", "*.py")):
        text = open(path).read()
        names.update(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", text))
        names.update(re.findall(r"add_argument\(\s*\"--(\w+)\"", text))
        booleans.update(re.findall(r"DEFINE_bool\(\s*\"(\w+)\"", text))
    return names, booleans


def unknown_flags(text, names, booleans):
    """The `--flags` of `text` that no command defines, with their lines."""
    bad = []
    for number, line in enumerate(text.splitlines(), 1):
        for name, family in FLAG.findall(line):
            if family and any(n.startswith(name) for n in names):
                continue
            if (name in names or name in FOREIGN or name in PLACEHOLDERS or EXAMPLE in name
                    or name in GUIDE_EXAMPLES
                    or (name.startswith("no") and name[2:] in booleans)):
                continue
            bad.append((number, name))
    return bad


def _expand(path):
    """`a_{x,y}.json` -> `a_x.json`, `a_y.json`."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def missing_paths(text, root=REPO):
    """The repository paths of `text` that do not exist, with their lines. Placeholders
    (`<name>`, `*`, `NAME`), the example algorithm's files and the outputs a command would write
    (`--out=...`, `bench/out/`) are not paths of the repository."""
    bad = []
    for number, line in enumerate(text.splitlines(), 1):
        found = [(m, False) for m in PATH.finditer(line)] + [(m, True) for m in
                                                              SHORT.finditer(line)]
        for match, short in found:
            path = match.group(1).rstrip(".,;:)")
            before = line[:match.start()]
            if (re.search(r"--(out|output_dir)=$", before) or "<" in path or "*" in path
                    or EXAMPLE in path or path.startswith("bench/out")
                    or any(e in path for e in GUIDE_EXAMPLES)
                    or any(re.fullmatch(r"[A-Z]+", seg) for seg in re.split(r"[/.]", path))):
                continue
            for one in _expand(path):
                where = os.path.join(root, "deltafl_jax", one) if short else os.path.join(
                    root, one)
                if not os.path.exists(where):
                    bad.append((number, one))
    return bad


def test_the_flag_reference_is_generated_from_the_code(commands):
    with open(gen_flags.PAGE) as f:
        committed = f.read()
    assert committed == gen_flags.render(commands), (
        "docs/reference/flags.md is stale: run python -m docs.gen_flags --write")
    # Every flag of every command is on the page, and experiments.run's are all there.
    run = {f["name"] for f in commands["experiments.run"]["flags"]}
    assert {"thetas", "dataset", "server_lr", "dp_clip", "estimate", "eval_clients"} <= run
    for command in commands.values():
        for flag in command["flags"]:
            assert f"`--{flag['name']}`" in committed, (command["module"], flag["name"])


def test_every_flag_the_pages_name_exists(commands):
    names, booleans = known_flags(commands)
    bad = {}
    for page in PAGES:
        found = unknown_flags(open(page).read(), names, booleans)
        if found:
            bad[os.path.relpath(page, REPO)] = found
    assert not bad, f"flags that no command defines: {bad}"


def test_every_repository_path_the_pages_name_exists():
    bad = {}
    for page in PAGES:
        found = missing_paths(open(page).read())
        if found:
            bad[os.path.relpath(page, REPO)] = found
    assert not bad, f"paths that do not exist: {bad}"


def test_the_checks_find_what_is_not_there(commands):
    """The scanners report a flag and a path that do not exist, and pass the ones that do."""
    names, booleans = known_flags(commands)
    text = ("`--thetas=1,0.5` `--nouse_bias` `--no_such_flag` `--nothetas` `--dp_*` `--zz_*`\n"
            "`deltafl_jax/rounds.py`, `deltafl_jax/no_such.py`, `engine/train.py`, "
            "`engine/nope.py`, `bench/results/compare_{cnn,nope}_cpu.json`, "
            "`--out=bench/results/new.json`, `experiments/NAME.flags`")
    assert unknown_flags(text, names, booleans) == [(1, "no_such_flag"), (1, "nothetas"),
                                                    (1, "zz_")]
    assert missing_paths(text) == [(2, "deltafl_jax/no_such.py"),
                                   (2, "bench/results/compare_nope_cpu.json"),
                                   (2, "engine/nope.py")]


def test_the_readmes_set_up_commands_are_the_ones_ci_runs():
    """The README's two commands, word for word, and .ci/run: the test extra with the docs
    extra, exactly the README's test command, the slow tests, the site's strict build."""
    readme = open(os.path.join(REPO, "README.md")).read()
    install = ("python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && "
               ".venv/bin/python -m experiments.run --flagfile=experiments/shakespeare_cpu.flags")
    test = ".venv/bin/python -m pytest -q tests"
    assert f"```bash\n{install}\n```" in readme
    assert f"```bash\n{test}\n```" in readme
    assert len(readme.splitlines()) <= 200
    ci = [line.strip() for line in open(os.path.join(REPO, ".ci", "run"))
          if line.strip() and not line.startswith("#")]
    assert "python -m pip install -q -e '.[test,docs]'" in ci
    assert ci.index(test) < ci.index(".venv/bin/python -m pytest -q -m slow tests")
    assert any(re.fullmatch(r"(\w+=\S+ )*(\S+/)?mkdocs build --strict.*", line) for line in ci)


def test_a_table_held_by_several_pages_is_the_same_in_each():
    from deltafl_jax.report import readme
    names = set()
    for page in pages.markdown_pages():
        names.update(re.findall(r"<!-- table: ([a-z0-9_]+) -->", open(page).read()))
    assert "synthetic" in names
    shared = 0
    for name in sorted(names):
        held = pages.pages_holding(f"<!-- table: {name} -->")
        blocks = {readme.current(open(p).read(), name) for p in held}
        assert len(blocks) == 1, (name, held)
        shared += len(held) > 1
    assert shared >= 1      # the README's headline table is also on the results page
