"""Replayed availability: a schedule array, and device traces of FedScale and FLASH.

A schedule is an ``.npz`` holding ``available``, bool [rounds, N] over the training clients in
id order (:func:`load_schedule`), read with ``allow_pickle=False``.

A device trace gives, per device, the closed intervals of time (seconds) in which it can
train, read at the times t_r = start + r x round_seconds of the rounds:

- FedScale's ``client_behave_trace`` (SymbioticLab/FedScale, commit 27d7cd3d,
  fedscale/cloud/internal/client_metadata.py ``ClientMetadata.is_active``): a pickle
  ``{client_id: {'active': [a_0, a_1, ...], 'inactive': [e_0, e_1, ...], 'finish_time': F,
  ...}}``; device k is active at time t iff a_j <= t mod F <= e_j for some j (the trace
  repeats every F seconds). FedScale gives client c the trace of the key at position c mod K
  of the dict's keys (``user_trace_keys``).
- FLASH's traces (PKU-Chengxu/FLASH, commit 70e47eb2, models/timer.py ``Timer`` and
  models/client.py), a JSON object with one entry per device, in either of FLASH's two forms:
  its ready times (the Timer's ``cached_timers.json``): ``{guid: {"isSuccess": bool,
  "trace_start": s, "trace_end": e, "ready_time": [[s_0, e_0], ...]}}``; or its state trace
  (``data/state_traces.json``): ``{uid: {"guid": ..., "model": ..., "messages":
  "YYYY-mm-dd HH:MM:SS\tstate\n..."}}``, from which the ready times are derived as the Timer
  does (:func:`flash_ready_times`). A device whose isSuccess is false, or whose trace lasts
  under a second, is never ready; otherwise it is ready at t iff s_j <= now <= e_j for some
  j, now = trace_start + (int(t - trace_start) mod int(trace_end - trace_start)) (int
  truncating toward 0, the mod of Python: in [0, length)). Times are seconds since
  2020-01-02 00:00:00 (FLASH's reference time).

A pickle can run code when it is loaded. :func:`load_fedscale` reads it with an unpickler
that builds only dicts, lists, tuples, strings and numbers (and NumPy scalars): a pickle that
names any other class or function is refused with a DataError before anything is built from
it. Only load trace files you trust even so.

:class:`TraceSet` asks all the traces at once: the intervals of trace k are shifted by
k x span (span: wider than every trace's times), sorted, and a running maximum of their ends
kept, so "is trace k active at time t" is one ``searchsorted`` over every trace (O(K log M)
for K traces of M intervals in all; exact for times that are whole seconds up to 2^53 /
(K span)).
"""

from __future__ import annotations

import datetime
import io
import json
import pickle
import zipfile
from typing import List, NamedTuple, Sequence

import numpy as np

from deltafl_jax.errors import ConfigError, DataError

FORMATS = ("fedscale", "flash")

# The only classes a FedScale trace pickle may name: NumPy scalars and their dtypes.
_ALLOWED = {("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
            ("numpy", "dtype")}


def load_schedule(path: str, num_clients: int, num_rounds: int) -> np.ndarray:
    """The array ``available`` [R, N] bool of the schedule at `path` (R >= num_rounds)."""
    try:
        with open(path, "rb") as head:
            magic = head.read(6)
        npz_or_npy = magic.startswith((b"PK\x03\x04", b"\x93NUMPY"))   # a zip, or an .npy
        f = np.load(path, allow_pickle=False) if npz_or_npy else None
        names = f.files if isinstance(f, np.lib.npyio.NpzFile) else None
        available = f["available"] if names is not None and "available" in names else None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"--availability_schedule={path}: not a readable .npz "
                        f"({type(e).__name__}: {e})".replace("\n", " ")) from None
    if not npz_or_npy:   # np.load would call it "pickled (object) data"
        raise DataError(f"--availability_schedule={path}: not a readable .npz (it starts with "
                        f"{magic!r}, not as a zip does); expected an .npz holding 'available', "
                        f"bool [rounds, clients], as numpy.savez(path, available=...) writes")
    if names is None:
        raise DataError(f"--availability_schedule={path}: a single .npy array, not an .npz "
                        f"holding 'available'")
    f.close()
    if available is None:
        raise DataError(f"--availability_schedule={path}: no array 'available' in it (it "
                        f"holds {', '.join(names) or 'nothing'})")
    if available.dtype != np.bool_:
        raise DataError(f"--availability_schedule={path}: 'available' must be bool, got "
                        f"{available.dtype}")
    if available.ndim != 2 or available.shape[1] != num_clients:
        raise DataError(f"--availability_schedule={path}: 'available' must be [rounds, "
                        f"{num_clients}] (the training clients), got {list(available.shape)}")
    if available.shape[0] < num_rounds:
        raise DataError(f"--availability_schedule={path}: it covers {available.shape[0]} "
                        f"rounds, the run has {num_rounds}")
    return available


class RawTraces(NamedTuple):
    """The traces of a file, in its order: keys, per trace the origin o_k and length L_k of
    its repeating time (t -> o_k + (d mod L_k), d = t - o_k, truncated toward 0 when
    `truncate`), whether it can be active, and its intervals' starts and ends."""

    keys: list
    origin: np.ndarray
    length: np.ndarray
    valid: np.ndarray
    truncate: bool
    starts: List[np.ndarray]
    ends: List[np.ndarray]


class DataOnlyUnpickler(pickle.Unpickler):
    """An unpickler that builds only Python's plain data types and NumPy scalars."""

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a trace never needs")


def read_pickle(path: str, flag: str, what: str, error: type = DataError):
    """The object of the pickle at `path`, read by :class:`DataOnlyUnpickler` (module
    docstring); `error` in one line, ``--flag=path: ...``, when the file cannot be read or
    does not unpickle (`what` names what it should have been: a damaged pickle, or one that
    names a class)."""
    try:
        with open(path, "rb") as f:
            return DataOnlyUnpickler(io.BytesIO(f.read())).load()
    except OSError as e:
        raise error(f"--{flag}={path}: cannot read it ({e.strerror})") from None
    except Exception as e:   # a damaged pickle raises anything; none is trusted
        raise error(f"--{flag}={path}: not {what} ({type(e).__name__}: {e})".replace(
            "\n", " ")) from None


def _numbers(values, what: str) -> np.ndarray:
    try:
        out = np.asarray(values, np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise DataError(f"{what} must be a list of numbers") from None
    if not np.all(np.isfinite(out)):
        raise DataError(f"{what} holds a value that is not a finite number")
    return out


def _fedscale_entry(path: str, key, entry):
    where = f"--availability_trace={path}: client {key!r}"
    if not isinstance(entry, dict) or not {"active", "inactive", "finish_time"} <= set(entry):
        raise DataError(f"{where}: not a dict with 'active', 'inactive' and 'finish_time'")
    starts = _numbers(entry["active"], f"{where}: 'active'")
    ends = _numbers(entry["inactive"], f"{where}: 'inactive'")
    if starts.size != ends.size:
        raise DataError(f"{where}: {starts.size} 'active' times for {ends.size} 'inactive'")
    finish = _numbers([entry["finish_time"]], f"{where}: 'finish_time'")[0]
    if not finish > 0:
        raise DataError(f"{where}: 'finish_time' must be > 0, got {finish:g}")
    return starts, ends, finish


def load_fedscale(path: str) -> RawTraces:
    """FedScale's client_behave_trace pickle, read by the restricted unpickler (module
    docstring)."""
    data = read_pickle(path, "availability_trace", "a FedScale client_behave_trace pickle")
    if not isinstance(data, dict) or not data:
        raise DataError(f"--availability_trace={path}: a FedScale trace is a non-empty dict "
                        f"{{client_id: {{'active': ..., 'inactive': ..., 'finish_time': ...}}}}")
    starts, ends, length = [], [], []
    for key, entry in data.items():
        s, e, finish = _fedscale_entry(path, key, entry)
        starts.append(s)
        ends.append(e)
        length.append(finish)
    k = len(data)
    return RawTraces(keys=list(data), origin=np.zeros(k), length=np.asarray(length),
                     valid=np.ones(k, bool), truncate=False, starts=starts, ends=ends)


FLASH_REFERENCE = datetime.datetime(2020, 1, 2)   # FLASH's refer_time, 2020-01-02 00:00:00
# FLASH's states: what each sets (charged, wifi, locked); a battery level "NN%" sets nothing.
_FLASH_STATES = {"battery_charged_on": ("charged", True), "battery_charged_off": ("charged", False),
                 "wifi": ("wifi", True), "unknown": ("wifi", False), "2g": ("wifi", False),
                 "3g": ("wifi", False), "4g": ("wifi", False), "5g": ("wifi", False),
                 "screen_on": ("screen_off", False), "screen_off": ("screen_off", True),
                 "screen_lock": ("locked", True), "screen_unlock": ("locked", False)}


def _flash_seconds(stamp: str) -> float:
    moment = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S")
    return (moment - FLASH_REFERENCE).total_seconds()


def flash_ready_times(where: str, messages: str):
    """(ready [[start, end], ...], trace_start, trace_end) of one device's FLASH messages, or
    None where FLASH's Timer finds the trace invalid (never ready). Ready: screen locked, on
    WiFi and charging; an interval still open at the trace's end is dropped, as there. Times
    are differences of wall-clock stamps (FLASH's ``time.mktime`` differences in a time zone
    without daylight saving)."""
    status = {"charged": False, "wifi": False, "locked": False, "screen_off": False}
    ready, opened, times = [], None, []
    try:
        for line in messages.split("\n"):
            if not line.strip():
                continue
            stamp, state = line.strip().split("\t")
            t, state = _flash_seconds(stamp.strip()), state.strip().lower()
            if state in _FLASH_STATES:
                status[_FLASH_STATES[state][0]] = _FLASH_STATES[state][1]
            elif state.endswith("%"):
                float(state[:-1])
            else:
                raise DataError(f"{where}: unknown state {state!r} (FLASH's Timer stops on it)")
            on = status["locked"] and status["wifi"] and status["charged"]
            if on and opened is None:
                opened = t
            elif opened is not None and not on:
                ready.append([opened, t])
                opened = None
            times.append(t)
    except DataError:
        raise
    except ValueError:     # a line FLASH cannot split or parse: its Timer drops the trace
        return None
    if not ready:
        return None
    start = next((t for t in times if t), times[-1])   # FLASH keeps the first nonzero time
    if int(times[-1] - start) == 0:
        return None
    return ready, start, times[-1]


def _flash_entry(path: str, key, entry):
    where = f"--availability_trace={path}: device {key!r}"
    if isinstance(entry, dict) and isinstance(entry.get("messages"), str):
        derived = flash_ready_times(where, entry["messages"])
        if derived is None:
            return np.zeros(0), np.zeros(0), 0.0, 0.0
        entry = {"isSuccess": True, "ready_time": derived[0], "trace_start": derived[1],
                 "trace_end": derived[2]}
    if not isinstance(entry, dict) or "isSuccess" not in entry:
        raise DataError(f"{where}: not a dict with 'messages' (a state trace) or "
                        f"'isSuccess', 'trace_start', 'trace_end' and 'ready_time'")
    if not entry["isSuccess"]:
        return np.zeros(0), np.zeros(0), 0.0, 0.0
    if not {"trace_start", "trace_end", "ready_time"} <= set(entry):
        raise DataError(f"{where}: a successful trace needs 'trace_start', 'trace_end' and "
                        f"'ready_time'")
    ready = _numbers(entry["ready_time"], f"{where}: 'ready_time'")
    if ready.size % 2 or np.ndim(entry["ready_time"]) not in (1, 2):
        raise DataError(f"{where}: 'ready_time' must be a list of [start, end] pairs")
    ready = ready.reshape(-1, 2)
    start, end = _numbers([entry["trace_start"], entry["trace_end"]],
                          f"{where}: 'trace_start' and 'trace_end'")
    return ready[:, 0], ready[:, 1], float(start), float(np.trunc(end - start))


def load_flash(path: str) -> RawTraces:
    """FLASH's JSON: ready times (cached_timers.json) or state traces (state_traces.json),
    entry by entry."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except OSError as e:
        raise DataError(f"--availability_trace={path}: cannot read it ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"--availability_trace={path}: not FLASH's JSON "
                        f"({type(e).__name__}: {e})".replace("\n", " ")) from None
    if not isinstance(data, dict) or not data:
        raise DataError(f"--availability_trace={path}: a FLASH trace is a non-empty JSON "
                        f"object with one entry per device")
    starts, ends, origin, length = [], [], [], []
    for key, entry in data.items():
        s, e, o, n = _flash_entry(path, key, entry)
        starts.append(s)
        ends.append(e)
        origin.append(o)
        length.append(n)
    length = np.asarray(length)
    return RawTraces(keys=list(data), origin=np.asarray(origin), length=length,
                     valid=length >= 1, truncate=True, starts=starts, ends=ends)


def load_traces(path: str, fmt: str = "auto") -> RawTraces:
    """The traces at `path`: fmt fedscale | flash | auto (flash for a .json file)."""
    if fmt == "auto":
        fmt = "flash" if str(path).lower().endswith(".json") else "fedscale"
    if fmt not in FORMATS:
        raise ConfigError(f"--availability_trace_format={fmt}: one of auto, "
                          f"{', '.join(FORMATS)}")
    return load_flash(path) if fmt == "flash" else load_fedscale(path)


class TraceSet:
    """Some traces of a file (`keep`: their indices in it), asked who is active at a time
    (module docstring)."""

    def __init__(self, raw: RawTraces, keep: Sequence[int]):
        keep = np.asarray(keep, np.int64)
        self.keys = [raw.keys[k] for k in keep]
        self.origin = raw.origin[keep]
        self.length = np.where(raw.valid[keep], raw.length[keep], 1.0)
        self.valid = raw.valid[keep]
        self.truncate = raw.truncate
        counts = np.asarray([raw.starts[k].size for k in keep], np.int64)
        owner = np.repeat(np.arange(keep.size), counts)
        starts = np.concatenate([raw.starts[k] for k in keep] + [np.zeros(0)])
        ends = np.concatenate([raw.ends[k] for k in keep] + [np.zeros(0)])
        values = np.concatenate([starts, ends, self.origin, self.origin + self.length])
        self.low = float(values.min()) if values.size else 0.0
        self.span = float(values.max()) - self.low + 1.0 if values.size else 1.0
        base = owner * self.span - self.low
        order = np.lexsort((starts, owner))
        self.starts = (starts + base)[order]
        self.ends = np.maximum.accumulate((ends + base)[order]) if order.size else ends

    def __len__(self) -> int:
        return len(self.keys)

    def local_time(self, t: float) -> np.ndarray:
        """[K] each trace's own time at run time t (its repeating window)."""
        d = t - self.origin
        if self.truncate:
            d = np.trunc(d)
        return self.origin + np.mod(d, self.length)

    def active(self, t: float) -> np.ndarray:
        """[K] bool: whether each trace is active at time t."""
        q = self.local_time(float(t)) + np.arange(len(self)) * self.span - self.low
        idx = np.searchsorted(self.starts, q, side="right") - 1
        hit = np.zeros(len(self), bool)
        ok = idx >= 0
        hit[ok] = self.ends[idx[ok]] >= q[ok]
        return hit & self.valid
