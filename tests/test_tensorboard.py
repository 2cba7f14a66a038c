"""TensorBoard event files hold the p90 test error and the tail metrics of every replica, read
back with a TFRecord parser written here from the format (length, crc, Event proto, crc), not
with tensorboardX."""

import glob
import json
import os
import struct

import pytest

from conftest import tiny_config

pytest.importorskip("tensorboardX")
from tensorboardX.proto import event_pb2  # noqa: E402


def read_events(path):
    """Every (tag, step, value) scalar of one event file."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos + 12 <= len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
        pos += 12 + n + 4
        for v in event.summary.value:
            out.append((v.tag, event.step, v.simple_value))
    return out


def test_event_files_hold_every_replicas_p90(tiny_synthetic, tmp_path):
    from deltafl_jax import run_experiment
    out = tmp_path / "run"
    cfg = tiny_config(thetas=(1.0, 0.5), seeds=(1, 2), output_dir=str(out), tensorboard=True,
                      num_rounds=4, eval_every=2)
    run_experiment(cfg, tiny_synthetic)
    records = [json.loads(l) for l in open(out / "metrics.jsonl")]
    keys = {f"theta={r['theta']:g}_seed={r['seed']}" for r in records}
    assert sorted(os.listdir(out / "tb")) == sorted(keys)
    for key in keys:
        (path,) = glob.glob(str(out / "tb" / key / "events.out.tfevents.*"))
        scalars = read_events(path)
        for metric in ("test_error_p90", "test_error_worst10", "test_error_std",
                       "test_share_below_target"):   # the tail metrics too
            got = {step: v for tag, step, v in scalars if tag == f"eval/{metric}"}
            want = {r["round"]: r[metric] for r in records
                    if f"theta={r['theta']:g}_seed={r['seed']}" == key}
            assert set(got) == set(want) == {2, 4}
            for step in want:
                assert got[step] == pytest.approx(want[step], rel=1e-6)
