"""Preemption: SIGTERM and SIGINT end a run cleanly after the current round.

    with Preemption() as preemption:
        result = run_rounds(..., callbacks=[preemption, recorder, checkpoints, ...])
    if preemption.signum is not None:
        print(preemption.resume_hint(command, checkpoint_directory), file=sys.stderr)
        sys.exit(preemption.exit_code)

While installed, the handlers only set ``run.stop_requested = True`` and ``run.stop_reason``
("SIGTERM" / "SIGINT") on the :class:`~deltafl_jax.run.callbacks.RunContext`, and write one line
on stderr. The loop finishes the round it is in, the checkpoint callback saves (and waits for
the write), and the caller prints how to resume and exits non-zero (128 + the signal number:
143 for SIGTERM, 130 for SIGINT). A second SIGINT while stopping raises KeyboardInterrupt (a
user who insists); a second SIGTERM is ignored. A signal that arrives before the run starts is
kept and applied at :meth:`on_run_start`. The previous handlers are restored on exit (and at
:meth:`on_run_end` when used only as a callback). Signal handlers can only be installed from the
main thread; elsewhere this does nothing.

``defer=True`` (runs of several processes, which must all stop after the same round): the
handler only records the signal, and :meth:`on_round_end` requests the stop, at a point of the
round where the checkpoint callback (after this one) makes every process agree on it.

The handler runs in the main thread between two bytecodes, possibly in the middle of a round's
host code; it touches nothing but two attributes and writes its line with ``os.write``, which
is safe there (``print`` could re-enter a stream that is being written).
"""

from __future__ import annotations

import os
import shlex
import signal
import threading
from typing import Optional, Sequence

from deltafl_jax.run.callbacks import Callback, RunContext

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption(Callback):
    """Turns SIGTERM/SIGINT into ``run.stop_requested``; a context manager and a Callback.

    Attributes:
      signum: the first signal received (None: none).
      run: the RunContext it stops (set by :meth:`on_run_start`, or given).
    """

    def __init__(self, run: Optional[RunContext] = None, signals: Sequence[int] = SIGNALS,
                 defer: bool = False):
        self.run = run
        self.signals = tuple(signals)
        self.defer = defer
        self.signum: Optional[int] = None
        self._previous = {}
        self._installed = False

    # -- installing

    def install(self) -> "Preemption":
        if self._installed or threading.current_thread() is not threading.main_thread():
            return self
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._installed = True
        return self

    def uninstall(self) -> None:
        if not self._installed:
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        self._installed = False

    def __enter__(self) -> "Preemption":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # -- the handler

    @property
    def reason(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """128 + the signal number (the shell's convention), 0 when no signal came."""
        return 128 + int(self.signum) if self.signum is not None else 0

    def _handle(self, signum, frame) -> None:
        del frame
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        if not self.defer:
            self._request(self.run)
        name = signal.Signals(signum).name
        more = " (Ctrl-C again to abort at once)" if signal.SIGINT in self.signals else ""
        line = (f"deltafl_jax: {name} received: finishing this round, saving a checkpoint, "
                f"then stopping{more}\n")
        try:
            os.write(2, line.encode("utf-8", "replace"))
        except OSError:
            pass

    def _request(self, run: Optional[RunContext]) -> None:
        if run is not None and self.signum is not None:
            run.stop_requested = True
            run.stop_reason = self.reason

    # -- the callback

    def on_run_start(self, run: RunContext) -> None:
        self.run = run
        self.install()
        self._request(run)

    def on_round_end(self, run: RunContext, round: int, metrics) -> None:
        self._request(run)

    def on_run_end(self, run: RunContext, result) -> None:
        self.uninstall()

    # -- what to tell the user

    def resume_hint(self, command: Sequence[str], checkpoint_directory: str,
                    round: Optional[int] = None) -> str:
        """One line: why the run stopped, where its checkpoint is, and the command to resume."""
        after = f" after round {round}" if round is not None else ""
        return (f"deltafl_jax: stopped by {self.reason or 'request'}{after}; checkpoint in "
                f"{checkpoint_directory}; resume with: {shlex.join(list(command))}")
