"""The shell of a command (``experiments.run``, ``experiments.tune``, ``data_prep.prepare``,
...): absl's flag parsing with ``--help`` and its usage lines, one-line errors (exit code 2),
and the flags given on the command line itself."""

from __future__ import annotations

import os
import sys

from absl import flags

FLAGS = flags.FLAGS
HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def fail(message: str) -> None:
    """One line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


COMMAND_LINE: set = set()   # the flags given on the command line itself (not by a flagfile)


FLAGFILE_HELP = ("--flagfile=FILE reads flags from FILE, one --flag=value a line (# starts a "
                 "comment);\nflags after it on the command line override the file's.")


def usage(program: str) -> str:
    """The usage lines of ``python -m PACKAGE.NAME --help`` (``experiments.run``,
    ``data_prep.prepare``, ...): the command's own example line(s) from its module docstring
    when it is the running program, else a generic line, and how --flagfile works."""
    main = sys.modules.get("__main__")
    name = os.path.splitext(os.path.basename(program))[0]
    running = getattr(getattr(main, "__spec__", None), "name", None) or ""
    module = running if running.endswith("." + name) else f"experiments.{name}"
    doc = getattr(main, "__doc__", None) or ""
    lines = [line.strip() for line in doc.splitlines()
             if line.strip().startswith(f"python -m {module} ")]
    if not lines:
        lines = [f"python -m {module} [--flagfile=FILE] [--flag=value ...]"]
    return "\n".join(["usage: " + lines[0]] + ["       " + line for line in lines[1:]]
                     + ["", FLAGFILE_HELP])


def print_help(text: str) -> None:
    """`text` on stdout. A reader that stops early (``--help | head``) closes the pipe: the
    rest is not wanted, so it is dropped quietly instead of ending in a BrokenPipeError
    traceback (stdout is pointed at /dev/null, so the interpreter's last flush fails no
    more)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def parse_flags_or_fail(argv):
    """absl's flag parsing; --help prints the flags and exits 0, a bad flag or a missing
    flagfile, or one that is not text, is one line and exit code 2."""
    COMMAND_LINE.clear()
    COMMAND_LINE.update(a.lstrip("-").split("=", 1)[0] for a in argv[1:] if a.startswith("--"))
    if any(a in HELP_FLAGS for a in argv[1:]):
        modules = [m for m in FLAGS.flags_by_module_dict() if not m.startswith("absl")]
        print_help(usage(argv[0]) + "\n\n" + "\n\n".join(FLAGS.module_help(m)
                                                          for m in modules))
        sys.exit(0)
    try:
        return FLAGS(argv)
    except flags.Error as e:
        text = str(e).splitlines()[0] if str(e) else "bad flags"
        fail(text.replace("ERROR:: ", "").strip())
    except UnicodeDecodeError as e:   # a flagfile that is not text (absl reads it as text)
        path = undecodable_flagfile(argv[1:])
        where = f"--flagfile={path}" if path else "a --flagfile"
        fail(f"{where} is not a text file of flags (its byte {e.start} is not valid "
             f"{e.encoding}); a flagfile holds one --flag=value a line")


def _flagfiles(args) -> list:
    prefixes = ("--flagfile=", "-flagfile=")
    return [a.split("=", 1)[1] for a in args if a.startswith(prefixes)]


def undecodable_flagfile(args, seen=None):
    """The first flagfile named in `args` (or in a flagfile they name) that cannot be read as
    text, or None."""
    seen = set() if seen is None else seen
    for path in _flagfiles(args):
        if path in seen:
            continue
        seen.add(path)
        try:
            with open(path) as f:
                lines = [line.strip() for line in f]
        except UnicodeDecodeError:
            return path
        except OSError:
            continue
        inner = undecodable_flagfile(lines, seen)
        if inner:
            return inner
    return None
