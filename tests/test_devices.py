"""The round across a device mesh: D = 2, 4, 8 fake CPU devices give the same
clients kept and examples trained as D = 1, and the same metrics and parameters bit for bit
(each replica adds its jobs' slots in its own order, whatever the device count), SCAFFOLD's
control variates and a server optimizer's state included, Ditto's personal models and
its personalised evaluation (seen clients, unseen devices after adaptation) too;
the compiled program has no collective inside a while body and no all-gather, and the jobs'
updates cross the devices through collective permutes, not as a per-job all-reduce."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow   # subprocess runs: CI's second step (see .ci/run)

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module", params=["synthetic", "cnn", "scaffold", "ditto", "cnn_chunks"])
def runs(request):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "devices_script.py"),
                           request.param], capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    return {"case": request.param, **{r["devices"]: r for r in out}}


def test_same_clients_and_examples_on_every_device_count(runs):
    base = runs[1]["metrics"]
    for D in (2, 4, 8):
        for m1, mD in zip(base, runs[D]["metrics"]):
            assert mD["num_selected"] == m1["num_selected"]
            assert mD["train_real_examples"] == m1["train_real_examples"]
            assert mD["eval_real_examples"] == m1["eval_real_examples"]
            # The critical path shrinks with more devices.
            assert mD["train_trips"] <= m1["train_trips"]


def test_metrics_and_parameters_bit_for_bit(runs):
    for D in (2, 4, 8):
        for a, b in zip(runs[1]["params"], runs[D]["params"]):
            np.testing.assert_array_equal(b, a, err_msg=f"D={D}")
        for k, v in runs[1]["summary"].items():
            np.testing.assert_array_equal(runs[D]["summary"][k], v, err_msg=f"D={D} {k}")
        for m1, mD in zip(runs[1]["metrics"], runs[D]["metrics"]):
            for k in ("sampled_loss_mean", "control_variate_norm"):
                if k in m1:
                    np.testing.assert_array_equal(mD[k], m1[k], err_msg=f"D={D} {k}")


def while_bodies(hlo):
    """Names of the computations that are while-loop bodies (and what they call)."""
    bodies = set(re.findall(r"while\([^\n]*body=%?([\w.\-]+)", hlo))
    comps = dict(re.findall(r"\n(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S))
    todo, seen = list(bodies), set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += re.findall(r"(?:calls|to_apply|body|condition|branch_computations)="
                           r"\{?%?([\w.\-]+)", comps[name])
    return {n: comps[n] for n in seen if n in comps}


def test_the_hlo_checker_sees_a_collective_in_a_loop():
    hlo = ("\n%body.1 (p: f32[]) -> f32[] {\n  %a = f32[] all-reduce(f32[] %p), to_apply=%add\n}"
           "\nENTRY %main () -> f32[] {\n  %w = f32[] while(f32[] %x), condition=%c, "
           "body=%body.1\n}")
    bodies = while_bodies(hlo)
    assert list(bodies) == ["body.1"] and "all-reduce" in bodies["body.1"]


def test_no_collective_inside_a_loop_and_no_all_gather(runs):
    """No collective inside the lanes' loops (each device runs them to its own trip count).
    The one loop with collectives in it is the exchange of a big leaf in chunks, permutes
    only, outside the lanes' loops (no convolution in it), forced in the "cnn_chunks" case."""
    hlo = runs[4]["hlo"]
    bodies = while_bodies(hlo)
    assert bodies, "no while loop found"
    chunk_loops = []
    for name, text in bodies.items():
        if runs["case"] == "cnn_chunks" and "collective-permute" in text:
            assert not re.search(r"convolution\(|dot\(", text), name
            chunk_loops.append(name)
            text = text.replace("collective-permute", "")
        assert not re.search(r"all-reduce|all-gather|collective-permute|all-to-all", text), name
    assert bool(chunk_loops) == (runs["case"] == "cnn_chunks")
    assert "all-gather" not in hlo
    assert re.search(r"all-reduce", hlo), "the partial sums are reduced after the loops"


def all_reduced_floats(hlo):
    """Elements of the floating-point arrays that the program's all-reduces sum."""
    total = 0
    for line in hlo.splitlines():
        if re.search(r"= \(?[^=]*\ball-reduce(-start)?\(", line):
            for dims in re.findall(r"\b(?:f16|bf16|f32|f64)\[([\d,]*)\]", line.split("=")[1]
                                   .split("all-reduce")[0]):
                total += int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def test_the_all_reduce_checker_counts_floats():
    hlo = ("  %a = (f32[8,4,3]{2,1,0}, s32[4]{0}, f32[2]{0}) all-reduce(%x, %y, %z), to_apply=%s\n"
           "  %b = f32[64,60,10]{2,1,0} add(%p, %q)\n  %c = bf16[5]{0} all-reduce(%w)")
    assert all_reduced_floats(hlo) == 8 * 4 * 3 + 2 + 5


def test_the_updates_cross_devices_once_not_as_a_per_job_sum(runs):
    """XLA:CPU's all-reduce of a [jobs, |w|] buffer cost more than the rest of a softmax
    regression round on 2 host devices. The jobs' updates go through D - 1 collective
    permutes (each device gets its block of every job's update; no all-to-all, which
    XLA:CPU runs as three copies), and the all-reduces carry per-replica sums,
    the per-client states that the algorithm keeps, and per-job scalars: under half of one
    model per job besides the states."""
    out = runs[4]
    assert re.search(r"collective-permute", out["hlo"]) and "all-to-all" not in out["hlo"]
    J, w, state = out["jobs"], out["model_size"], out["client_state_size"]
    assert all_reduced_floats(out["hlo"]) < J * (state + w / 2)


def test_host_device_flags_hand_cases():
    from deltafl_jax.engine.mesh import host_device_flags
    assert host_device_flags("", None) == ""
    assert host_device_flags("", 1) == ""
    assert host_device_flags("", 3) == "--xla_force_host_platform_device_count=3"
    assert (host_device_flags("--xla_cpu_foo=1", 2)
            == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2")
    # A count the user chose is kept.
    chosen = "--xla_force_host_platform_device_count=8"
    assert host_device_flags(chosen, 2) == chosen


def _cli_run(tmp_path, name, devices):
    out = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "experiments.run",
                           f"--flagfile={os.path.join(HERE, 'tiny.flags')}",
                           f"--devices={devices}", f"--output_dir={out}"],
                          capture_output=True, text=True, timeout=600, env=env,
                          cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, np.load(out / "rounds.npz"), [
        json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def test_devices_flag_splits_a_cpu_host_without_xla_flags(tmp_path):
    """--devices=2 on a 1-device CPU asks XLA for 2 host devices; the run equals D = 1 bit
    for bit."""
    out1, r1, m1 = _cli_run(tmp_path, "d1", 1)
    out2, r2, m2 = _cli_run(tmp_path, "d2", 2)
    assert "placement: 2 cpu device(s)" in out2, out2
    assert "placement: 1 cpu device(s)" in out1, out1
    assert sorted(r1.files) == sorted(r2.files)
    for k in r1.files:
        if r1[k].dtype.kind in "USO":   # labels
            np.testing.assert_array_equal(r2[k], r1[k], err_msg=k)
        elif r1[k].dtype.kind in "biu":
            if k.startswith("device_"):
                continue   # per-device work: one entry per device
            if k.endswith("_trips"):   # the critical path: shorter on 2 devices
                assert np.all(r2[k] <= r1[k]) and np.any(r2[k] < r1[k]), k
                continue
            if k.endswith("padded_examples"):   # slots computed: depend on the lane layout
                continue
            np.testing.assert_array_equal(r2[k], r1[k], err_msg=k)
        else:
            np.testing.assert_array_equal(r2[k], r1[k], err_msg=k)
    assert len(m1) == len(m2)
    for a, b in zip(m1, m2):
        assert b["test_error_mean"] == a["test_error_mean"]


def test_tune_accepts_devices_on_a_cpu(tmp_path):
    """experiments.tune starts the backend like the runner: --devices=2 splits the host."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "experiments.tune",
                           f"--flagfile={os.path.join(HERE, 'tiny.flags')}", "--num_rounds=3",
                           "--lr_grid=0.02,0.3", "--devices=2",
                           f"--output_dir={tmp_path / 'tune'}"],
                          capture_output=True, text=True, timeout=600, env=env,
                          cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "tune" / "tuned.flags").exists()
