"""The command lines data_prep.prepare and data_prep.stats, run as
subprocesses the way a user runs them."""

import itertools
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Four roles; their texts (lines joined by a space) have these lengths, so 20-character windows
# give length - 20 examples each.
ROLES = {
    "DUKE": ["Now, fair Hippolyta, our nuptial hour", "Draws on apace; four happy days bring in"],
    "THESEUS": ["Go, Philostrate, stir up the Athenian youth to merriments."],
    "EGEUS": ["Full of vexation come I, with complaint", "Against my child, my daughter Hermia."],
    "LYSANDER": ["The course of true love never did run smooth."],
}


def write_play(root):
    lines = ["# A Dream", "", "## ACT I", "", "### SCENE I. Athens.", ""]
    for role, spoken in ROLES.items():
        lines += [f"**{role}**  "] + [s + "  " for s in spoken] + [""]
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "a-dream.md"), "w") as f:
        f.write("\n".join(lines))
    return {role: len(" ".join(spoken)) - 20 for role, spoken in ROLES.items()}


def run(*args, env=None):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, env=full_env, timeout=300)


def assert_one_line_exit_2(proc):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stdout == ""


def test_prepare_then_stats_json_of_a_tiny_play(tmp_path):
    sizes = write_play(str(tmp_path / "plays"))
    cache = str(tmp_path / "cache")
    proc = run("data_prep.prepare", "--dataset=shakespeare", f"--source={tmp_path / 'plays'}",
               f"--data_dir={cache}", "--min_client_examples=1")
    assert proc.returncode == 0, proc.stderr
    assert os.path.isdir(os.path.join(cache, "deltafl_shakespeare", "min1"))
    proc = run("data_prep.stats", "--dataset=shakespeare", f"--data_path={tmp_path / 'plays'}",
               f"--data_dir={cache}", "--min_client_examples=1", "--data_seed=2", "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert set(stats) == {"num_classes", "num_train_clients", "num_test_clients",
                          "median_examples", "min_examples", "max_examples"}
    assert stats["num_classes"] == 53
    assert stats["num_train_clients"] == stats["num_test_clients"] == 2
    # the train clients are two of the four roles: (min, median, max) of one pair of the
    # hand-computed sizes
    pairs = {(min(a, b), (a + b) / 2, max(a, b))
             for a, b in itertools.combinations(sizes.values(), 2)}
    assert (stats["min_examples"], stats["median_examples"], stats["max_examples"]) in pairs


def test_stats_prepares_on_first_use_and_keeps_stdout_clean(tmp_path):
    write_play(str(tmp_path / "plays"))
    proc = run("data_prep.stats", "--dataset=shakespeare", f"--data_path={tmp_path / 'plays'}",
               f"--data_dir={tmp_path / 'cache'}", "--min_client_examples=1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1
    json.loads(proc.stdout)


def test_missing_femnist_source_exits_2_with_one_line(tmp_path):
    for module in ("data_prep.prepare", "data_prep.stats"):
        proc = run(module, "--dataset=femnist", f"--data_dir={tmp_path}")
        assert_one_line_exit_2(proc)
        assert "emnist_all.sqlite" in proc.stderr and "--data_path=" in proc.stderr


def test_missing_sent140_source_exits_2_with_one_line(tmp_path):
    for module in ("data_prep.prepare", "data_prep.stats"):
        proc = run(module, "--dataset=sent140", f"--data_dir={tmp_path}")
        assert_one_line_exit_2(proc)
        assert os.path.join(str(tmp_path), "raw", "sent140") in proc.stderr


def test_femnist_download_without_network_exits_2_with_one_line(tmp_path):
    # Every request goes to a proxy on a closed loopback port: the download cannot succeed.
    proxy = "http://127.0.0.1:9"
    env = {"http_proxy": proxy, "https_proxy": proxy, "HTTP_PROXY": proxy, "HTTPS_PROXY": proxy,
           "no_proxy": "", "NO_PROXY": ""}
    proc = run("data_prep.prepare", "--dataset=femnist", "--download", f"--data_dir={tmp_path}",
               env=env)
    assert_one_line_exit_2(proc)
    assert "emnist_all.sqlite.lzma" in proc.stderr
    assert not any(name.endswith(".part") for _, _, files in os.walk(tmp_path) for name in files)


def test_download_is_refused_for_other_datasets(tmp_path):
    proc = run("data_prep.prepare", "--dataset=sent140", "--download", f"--data_dir={tmp_path}")
    assert_one_line_exit_2(proc)


def test_an_unknown_dataset_is_named_as_unknown(tmp_path):
    """A name prepare does not know is not 'needs no preparation'."""
    proc = run("data_prep.prepare", "--dataset=cifar", f"--data_dir={tmp_path}")
    assert_one_line_exit_2(proc)
    line = proc.stderr.strip()
    assert line.startswith("error: unknown dataset 'cifar'; choose one of ")
    assert "needs no preparation" not in line
    from deltafl_jax.datasets import DATASETS, PREPARABLE
    assert all(name in line for name in list(DATASETS) + list(PREPARABLE))
    # A known dataset that is generated, not prepared, says so.
    proc = run("data_prep.prepare", "--dataset=synthetic", f"--data_dir={tmp_path}")
    assert_one_line_exit_2(proc)
    assert "--dataset=synthetic needs no preparation" in proc.stderr
    assert os.listdir(tmp_path) == []
