"""No flag a user relies on changes: every flag of ``experiments.run``, ``experiments.tune`` and
``data_prep.prepare`` recorded in ``tests/fixtures/flags_before_32.json`` (by the code before the
configuration was declared once) is still there with its default, its type, its choices and its
help. A flag may only gain help text (where it had none), have its help brought up to date
(HELP_UPDATED, with the reason and the new text), or lose a duplicate (listed in
DROPPED_DUPLICATES with the flag that stays); ``--algorithm``'s help lists the registered
methods, which may grow. New flags are allowed: they are listed, not refused."""

import json
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from docs import gen_flags  # noqa: E402  (docs/ is not an installed package)

FIXTURE = os.path.join(REPO, "tests", "fixtures", "flags_before_32.json")
KEYS = ("name", "default", "help", "type", "choices", "boolean")
DROPPED_DUPLICATES = {}   # flag -> the flag that stays
# flag -> the help it must have now (its name, default, type and choices unchanged)
HELP_UPDATED = {
    # the GPU default became im2col_wgrad (measured on an H100), im2col and winograd were
    # added, and every nn.Conv of a model of one's own takes the same path; a built-in
    # network's first layer keeps im2col_wgrad under winograd (its input needs no gradient);
    # Winograd's tiles grew from 2 x 2 to 4 x 4 and ResNet-18-GN took it on CPU
    # (docs/benchmarks/pfl-research.md, docs/benchmarks/resnet.md)
    "conv_impl": "convolutions (the built-in networks' and every nn.Conv): im2col_wgrad (CPU, "
                 "GPU) | winograd (3x3 at stride 1 by Winograd's F(4x4, 3x3), the rest as "
                 "im2col_wgrad and a built-in network's first layer as one im2col product; "
                 "pfl_cnn's and resnet18_gn's on CPU) | im2col | xla (TPU; the module as "
                 "written); unset: by backend and model",
    # the image models, and a pretrained language model (issue 52)
    "model": "linear | cnn | mlp | mean | gru | lstm | sent140_linear | lstm_nwp | fedavg_cnn | "
             "pfl_cnn | resnet18_gn | llama (a pretrained --base_model, with "
             "--dataset=text:PATH), or a model of your own registered by --model_module",
    # text with natural clients (issue 52)
    "dataset": "synthetic | gaussian_toy | npz | shakespeare | sent140 | femnist | stackoverflow "
               "| text:PATH (jsonl, csv or parquet, tokenised by --base_model's tokenizer)",
    # the centralised image datasets download too
    "download": "femnist / stackoverflow / the image datasets only: fetch the published files "
                "first (emnist_all.sqlite.lzma; stackoverflow.sqlite.lzma and "
                "stackoverflow.word_count.tar.bz2; MNIST's IDX files, CIFAR's python archives; "
                "tfds:NAME through tensorflow-datasets)",
}


def _without_methods(flag):
    """--algorithm's record with its list of registered methods elided."""
    return dict(flag, help=re.sub(r"one or more of [a-z_, ]+;", "one or more of ...;",
                                  flag["help"]))


with open(FIXTURE) as f:
    BEFORE = json.load(f)


@pytest.fixture(scope="module")
def flags_now():
    """Each recorded command's flags today, each command imported in a process of its own."""
    found = gen_flags.collect(sorted(BEFORE))
    return {m: [{k: f[k] for k in KEYS} for f in c["flags"]] for m, c in found.items()}


@pytest.mark.parametrize("module", sorted(BEFORE))
def test_the_flags_are_the_ones_recorded_before_the_change(module, flags_now):
    before = {f["name"]: f for f in BEFORE[module]}
    now = {f["name"]: f for f in flags_now[module]}
    gone = sorted(set(before) - set(now) - set(DROPPED_DUPLICATES))
    assert not gone, f"{module}: flags removed: {gone}"
    for name, old in before.items():
        if name not in now:
            continue
        new = now[name]
        if name == "algorithm":
            new, old = _without_methods(new), _without_methods(old)
        for key in ("default", "type", "choices", "boolean"):
            assert new[key] == old[key], f"{module} --{name}: {key} {old[key]!r} -> {new[key]!r}"
        if name in HELP_UPDATED:
            assert new["help"] == HELP_UPDATED[name], f"{module} --{name}: {new['help']!r}"
        elif old["help"]:
            assert new["help"] == old["help"], (
                f"{module} --{name}: help changed\n  before: {old['help']}\n  now:    "
                f"{new['help']}")
        else:
            assert new["help"], f"{module} --{name}: lost its help"


def test_the_check_sees_a_changed_default():
    before = {f["name"]: f for f in BEFORE["experiments.run"]}
    assert before["server_beta2"]["default"] == 0.99
    assert before["server_lr"]["default"] == "1"
    assert before["thetas"]["help"]
