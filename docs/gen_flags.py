r"""The flag reference (docs/reference/flags.md), generated from the code.

    python -m docs.gen_flags            # print the page
    python -m docs.gen_flags --write    # write docs/reference/flags.md
    python -m docs.gen_flags --check    # exit 1, naming the first difference, if the page is stale

Each command of COMMANDS is imported in a fresh process (absl's flags are process-global, and
two commands may declare a flag of the same name): one interpreter imports the libraries every
command uses but that declare no flag (jax, flax, optax, NumPy, absl), then forks one child
per command, which imports it (so the libraries' import, most of a command's start-up, is paid
once, not once per command), with absl's ``DEFINE_*`` functions wrapped so that the order in
which the flags are declared is recorded. A flag's default, help and choices are absl's. The
page groups the flags by what declares them: a command's own flags; the experiment flags of
``experiments.cli``, one group per section of its one declaring loop
(``experiments.cli.SECTION``: the group of settings that declares the flag); and the
algorithms' swept flags and options, one group per algorithm spec of the registry that
declares them.
``tests/test_docs.py`` checks that the committed page is this output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO, "docs", "reference", "flags.md")

# The documented commands, in the page's order: `python -m NAME`.
COMMANDS = ("experiments.run", "experiments.tune", "experiments.leaderboard",
            "experiments.report", "experiments.readme_tables", "data_prep.prepare",
            "data_prep.stats", "data_prep.verify", "experiments.pretrain",
            "experiments.lora_base_row")

# --------------------------------------------------------------------------------------------
# In the fresh interpreter: import one command, record its flags.


def _collect(module: str) -> Dict[str, Any]:
    """Every flag that importing `module` declares, with its declarer, in declaration order."""
    from absl import flags

    order: List[str] = []

    def wrap(define):
        def _record(*args, **kwargs):
            name = kwargs.get("name", args[0] if args else None)
            if name not in order:
                order.append(name)
            return define(*args, **kwargs)
        return _record

    flags.disclaim_key_flags()      # absl then attributes a flag to the wrapper's caller
    for attr in dir(flags):
        if attr.startswith("DEFINE"):
            setattr(flags, attr, wrap(getattr(flags, attr)))
    __import__(module)
    cli = sys.modules.get("experiments.cli")
    sections = dict(getattr(cli, "SECTION", {}))
    out = []
    for name in order:
        if name not in flags.FLAGS:
            continue
        defined_in = flags.FLAGS.find_module_defining_flag(name)
        if defined_in.startswith("absl"):        # absl's own flags (logging, app)
            continue
        flag = flags.FLAGS[name]
        default = flag.default
        if isinstance(default, (list, tuple)):
            default = ",".join(str(v) for v in default)
        choices = list(getattr(flag.parser, "enum_values", None) or [])
        out.append({"name": name, "default": default, "help": flag.help or "",
                    "type": flag.flag_type(), "choices": choices,
                    "boolean": bool(flag.boolean), "module": defined_in,
                    "section": sections.get(name, "") if defined_in == "experiments.cli" else ""})
    algorithms = []
    if "deltafl_jax.algorithms.registry" in sys.modules:
        from deltafl_jax.algorithms import registry
        for spec in registry.SPECS.values():
            fields = list(spec.option_flags())
            algorithms.append({"name": spec.name, "display": spec.display_name,
                               "sweeps": [s.flag for s in spec.sweeps()], "options": fields})
    return {"module": module, "flags": out, "algorithms": algorithms}


# --------------------------------------------------------------------------------------------
# In the calling interpreter.


# Imported once before the fork: what the commands import that declares no absl flag and does not
# import the package (whose registry _collect reads only when the command imported it).
SHARED_IMPORTS = ("numpy", "jax", "jax.numpy", "flax.linen", "optax", "absl.flags")


def _collect_forked(modules) -> List[Dict[str, Any]]:
    """_collect(module) for each of `modules`, each in a child forked from this interpreter
    after SHARED_IMPORTS (in order; a child that fails raises, with its error)."""
    import importlib
    import tempfile
    import traceback
    for name in SHARED_IMPORTS:
        importlib.import_module(name)
    found = []
    for module in modules:
        with tempfile.TemporaryFile("w+") as out:
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    json.dump(_collect(module), out)
                except BaseException:
                    out.write("\n" + traceback.format_exc())
                    code = 1
                out.flush()
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            out.seek(0)
            text = out.read()
            if os.waitstatus_to_exitcode(status) != 0:
                raise RuntimeError(f"collecting the flags of {module} failed:{text}")
            found.append(json.loads(text))
    return found


def collect(modules=COMMANDS) -> Dict[str, Dict[str, Any]]:
    """The flags of every command of `modules` (by default every documented command), each
    command imported in its own process (forked from one interpreter that imports the shared
    libraries once)."""
    proc = subprocess.run([sys.executable, "-m", "docs.gen_flags",
                           "--collect-all=" + ",".join(modules)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"collecting the flags failed:\n{proc.stderr}")
    return {c["module"]: c for c in json.loads(proc.stdout)}


def _cell(text: Any) -> str:
    """Text for a table cell: one line, pipes escaped."""
    text = re.sub(r"\s+", " ", str(text)).strip()
    return text.replace("|", "\\|")


def _default(flag) -> str:
    d = flag["default"]
    if d is None or d == "":
        return "unset"
    if flag["boolean"]:
        return "true" if d else "false"
    return f"`{_cell(d)}`"


def _table(flags: List[Dict[str, Any]], also=None) -> List[str]:
    """A table of `flags`; with `also` (flag -> other algorithms that read it), a column of
    them."""
    rows = ["| flag | default | help |", "|---|---|---|"]
    if also is not None:
        rows = ["| flag | default | help | also read by |", "|---|---|---|---|"]
    for f in flags:
        help_text = f["help"]     # an enum's help starts with its choices, <a|b>: (absl's)
        name = f"`--{f['name']}`" + (f" (`--no{f['name']}`)" if f["boolean"] else "")
        row = f"| {name} | {_default(f)} | {_cell(help_text)} |"
        if also is not None:
            row += " " + (", ".join(f"`{a}`" for a in also[f["name"]]) or "—") + " |"
        rows.append(row)
    return rows + [""]


def _own(command: Dict[str, Any], shared: set) -> List[Dict[str, Any]]:
    return [f for f in command["flags"] if f["module"] == command["module"]
            and f["name"] not in shared]


def _anchor(text: str) -> str:
    return re.sub(r"[^a-z0-9_ -]", "", text.lower()).strip().replace(" ", "-")


def render(commands: Dict[str, Dict[str, Any]]) -> str:
    """The page."""
    run = commands["experiments.run"]
    cli = [f for f in run["flags"] if f["module"] == "experiments.cli"]
    cli_names = {f["name"] for f in cli}
    data_names = {f["name"] for f in commands["data_prep.prepare"]["flags"]
                  if f["module"] == "experiments.cli"}
    lines = [
        "# Flag reference",
        "",
        "<!-- Generated by `python -m docs.gen_flags --write` from the code; do not edit by hand "
        "(tests/test_docs.py fails while this page differs from the code). -->",
        "",
        "Every flag of every command: its default and its help, as `python -m COMMAND --help` "
        "prints them, grouped by what declares it. The flags by task, with what each means in "
        "the papers' terms, are in [Configure a run](../guides/configure.md). `--flagfile=FILE` "
        "reads flags from a file, one `--flag=value` a line; flags after it on the command line "
        "override the file's. A boolean flag is turned off by its name with `no` before it "
        "(`--nosave_models`). absl's own flags "
        "(logging, `--helpfull`) are left out.",
        "",
        "## Commands",
        "",
        "| command | its own flags | and |",
        "|---|---|---|",
    ]
    for name in COMMANDS:
        c = commands[name]
        own = _own(c, set())
        names = {f["name"] for f in c["flags"]}
        shared = []
        if cli_names <= names:
            shared.append("[the experiment flags](#the-experiment-flags-experimentscli)")
        elif data_names and data_names <= names:
            shared.append("[the data flags](#data)")
        others = sorted({f["module"] for f in c["flags"]} - {name, "experiments.cli"})
        shared += [f"[{m}](#{_anchor('python -m ' + m)})'s" for m in others
                   if not m.startswith("absl")]
        own_cell = ", ".join(f"`--{f['name']}`" for f in own) or "—"
        link = f"[`python -m {name}`](#{_anchor('python -m ' + name)})" if own else \
            f"`python -m {name}`"
        lines.append(f"| {link} | {own_cell} | {', '.join(shared) or '—'} |")
    lines.append("")
    for name in COMMANDS:
        own = _own(commands[name], set())
        if not own:
            continue
        lines += [f"## python -m {name}", ""] + _table(own)

    lines += ["## The experiment flags (experiments.cli)", "",
              "`experiments.run`, `experiments.tune` and `experiments.leaderboard` take all of "
              "them; the data_prep commands the [data flags](#data).", ""]
    readers: Dict[str, List[str]] = {}
    for spec in run["algorithms"]:
        for flag in spec["sweeps"] + spec["options"]:
            readers.setdefault(flag, []).append(spec["name"])
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for f in cli:
        if f["name"] not in readers:
            groups.setdefault(f["section"], []).append(f)
    for title, flags in groups.items():
        lines += [f"### {title}", ""] + _table(flags)

    # The algorithms' flags: one group per spec that declares them (a flag several specs read
    # is listed under the first, with the others named).
    by_name = {f["name"]: f for f in cli if f["name"] in readers}
    lines += ["## The algorithms' flags", "",
              "Declared by the algorithms' specs (`deltafl_jax/algorithms/`), one group per "
              "algorithm: its swept hyper-parameters (several values train as replicas of one "
              "program) and its options.", ""]
    listed = set()
    for spec in run["algorithms"]:
        mine = [by_name[f] for f in spec["sweeps"] + spec["options"]
                if f in by_name and f not in listed]
        if not mine:
            continue
        listed.update(f["name"] for f in mine)
        lines += [f"### --algorithm={spec['name']} ({spec['display']})", ""]
        also = {f["name"]: [r for r in readers[f["name"]] if r != spec["name"]] for f in mine}
        lines += _table(mine, also)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: List[str]) -> int:
    for arg in argv:
        if arg.startswith("--collect="):
            print(json.dumps(_collect(arg.split("=", 1)[1])))
            return 0
        if arg == "--collect-all" or arg.startswith("--collect-all="):
            modules = arg.split("=", 1)[1].split(",") if "=" in arg else COMMANDS
            print(json.dumps(_collect_forked(modules)))
            return 0
    page = render(collect())
    if "--write" in argv:
        with open(PAGE, "w") as f:
            f.write(page)
        print(f"wrote {os.path.relpath(PAGE, REPO)}")
        return 0
    if "--check" in argv:
        with open(PAGE) as f:
            old = f.read()
        if old != page:
            diff = next(i for i, (a, b) in enumerate(zip(old.splitlines() + [""],
                                                          page.splitlines() + [""])) if a != b)
            print(f"{os.path.relpath(PAGE, REPO)} is stale (first difference at line "
                  f"{diff + 1}); run python -m docs.gen_flags --write")
            return 1
        print(f"{os.path.relpath(PAGE, REPO)} is up to date")
        return 0
    sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
