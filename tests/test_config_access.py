"""Settings are read through their groups: the package reads ``config.training.learning_rate``,
never ``config.learning_rate``; the flat names stay a shorthand of the public API
(``ExperimentConfig(data, num_rounds=5)``, ``config.server_lr``), a flat read warning with a
DeprecationWarning that names the nested path, and ``flat()`` stays the stored format."""

import ast
import dataclasses
import glob
import os
import pickle
import warnings

import pytest

from deltafl_jax import DataConfig, ExperimentConfig
from deltafl_jax import datasets
from deltafl_jax.run.config import FLAT, GROUPS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Modules of the package not yet converted (they would still read settings by their flat
# names): none. pyproject.toml's filterwarnings makes a flat read inside the package an error
# under pytest.
NOT_YET_CONVERTED: set = set()

GROUP_NAMES = {name for name, _ in GROUPS}
# A flat name is a setting's flag name that is not also a group's name.
FLAT_NAMES = set(FLAT) - GROUP_NAMES
# The flat names of DataConfig's grouped settings (--max_train_clients: limits.max_train_clients).
DATA_FLAT_NAMES = set(datasets.FLAT)


def _last_name(node):
    """The name an expression ends with; an item of a list of configurations
    (``configs[0]``) ends with ``config``."""
    if isinstance(node, ast.Subscript):
        name = _last_name(node.value)
        return name[:-1] if name.endswith("configs") else ""
    return node.id if isinstance(node, ast.Name) else \
        node.attr if isinstance(node, ast.Attribute) else ""


def _config_params(function, cls="ExperimentConfig"):
    """Names of `function`'s parameters annotated as a `cls`."""
    a = function.args
    return {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs
            if p.annotation is not None and ast.unparse(p.annotation).strip("'\"")
            .endswith(cls)}


def _is_config(node, params):
    """An expression that holds an ExperimentConfig: a name or attribute ending in ``config``
    (``config``, ``self.config``, ``exp.config``, ``grid_config``), ``getattr(x, "config",
    ...)``, or a parameter annotated as one."""
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and \
            len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
        return str(node.args[1].value).endswith("config")   # getattr(facts, "config", None)
    return _last_name(node).endswith("config") or (isinstance(node, ast.Name)
                                                   and node.id in params)


def _is_data_config(node, params):
    """An expression that holds a DataConfig: one that holds a configuration (a DataConfig
    named ``config`` in a loader), its ``.data``, or a parameter annotated as a DataConfig."""
    return _is_config(node, params) or isinstance(node, ast.Attribute) and \
        node.attr == "data" and _is_config(node.value, params)


def _uses(source: str, names, holds, cls: str, constructed):
    """(line, text) of every use in `source` of a flat name in `names` on an expression that
    `holds(node, params)` says holds a `cls`: a read ``<expr>.<name>``, ``getattr(<expr>,
    "<name>")``, and a construction by flag name (`constructed(func, args, params)`)."""
    tree = ast.parse(source)
    scopes = [(tree, set())] + [(f, _config_params(f, cls)) for f in ast.walk(tree)
                                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found = set()
    for scope, params in scopes:
        for node in ast.walk(scope):
            if isinstance(node, ast.Attribute) and node.attr in names \
                    and holds(node.value, params):
                found.add((node.lineno, ast.unparse(node)))
            if not isinstance(node, ast.Call):
                continue
            func, args = ast.unparse(node.func), node.args
            flat_kw = [k.arg for k in node.keywords if k.arg in names]
            if flat_kw and constructed(func, args, params):
                found.add((node.lineno, f"{func}(..., {', '.join(flat_kw)}=...)"))
            if func == "getattr" and len(args) >= 2 and holds(args[0], params) and \
                    isinstance(args[1], ast.Constant) and args[1].value in names:
                found.add((node.lineno, ast.unparse(node)))
    return sorted(found)


def data_flat_uses(source: str):
    """(line, text) of every use of a flat name of DataConfig's grouped settings: a read
    ``config.data.<flag>`` / ``config.<flag>`` of a loader's DataConfig, ``getattr(config,
    "<flag>")``, and a construction by flag name (``DataConfig(name, <flag>=...)``,
    ``dataclasses.replace(config.data, <flag>=...)``)."""
    return _uses(source, DATA_FLAT_NAMES, _is_data_config, "DataConfig",
                 lambda func, args, params: func.endswith("DataConfig") or (
                     func.endswith("replace") and bool(args)
                     and _is_data_config(args[0], params)))


def flat_uses(source: str):
    """(line, text) of every use of a flat name on a configuration in `source`: a read
    ``config.<flag>``, ``getattr(config, "<flag>")``, and a construction by flag name
    (``ExperimentConfig(data, <flag>=...)``, ``dataclasses.replace(config, <flag>=...)``)."""
    return _uses(source, FLAT_NAMES, _is_config, "ExperimentConfig",
                 lambda func, args, params: func.endswith("ExperimentConfig") or (
                     func.endswith("replace") and bool(args) and _is_config(args[0], params)))


def flat_reads(source: str):
    """(line, text) of every flat read of a setting in `source` (what warns: a construction
    by flag name does not)."""
    never = lambda func, args, params: False   # noqa: E731
    return sorted(set(_uses(source, FLAT_NAMES, _is_config, "ExperimentConfig", never))
                  | set(_uses(source, DATA_FLAT_NAMES, _is_data_config, "DataConfig", never)))


def _package_files():
    return sorted(os.path.relpath(p, REPO).replace(os.sep, "/") for p in
                  glob.glob(os.path.join(REPO, "deltafl_jax", "**", "*.py"), recursive=True))


def test_the_package_reads_settings_through_their_groups():
    offences = []
    for rel in _package_files():
        if rel in NOT_YET_CONVERTED:
            continue
        with open(os.path.join(REPO, rel), encoding="utf-8") as f:
            source = f.read()
        offences += [f"{rel}:{line}: {text}" for line, text in
                     sorted(set(flat_uses(source)) | set(data_flat_uses(source)))]
    assert not offences, ("flat settings read inside deltafl_jax/ (read config.<group>.<field>; "
                          "FLAT maps each flag to its group and field):\n" + "\n".join(offences))


def test_the_commands_read_settings_through_their_groups():
    """experiments/ (the commands) reads no setting by its flat name either: a run of several
    algorithms printed a DeprecationWarning from ``configs[0].verbose`` (issue 51)."""
    offences = []
    for path in sorted(glob.glob(os.path.join(REPO, "experiments", "**", "*.py"),
                                 recursive=True)):
        with open(path, encoding="utf-8") as f:
            offences += [f"{os.path.relpath(path, REPO)}:{line}: {text}"
                         for line, text in flat_reads(f.read())]
    assert not offences, "flat settings read in experiments/:\n" + "\n".join(offences)


def test_the_not_yet_converted_modules_exist():
    """An entry of the allow-list names a module of the package (a moved or converted module
    leaves the list)."""
    files = set(_package_files())
    assert NOT_YET_CONVERTED <= files, sorted(NOT_YET_CONVERTED - files)


def test_the_scan_finds_every_kind_of_flat_use():
    source = (
        "import dataclasses\n"
        "def f(config, c: 'ExperimentConfig', run, cfg):\n"
        "    a = config.server_lr\n"                       # 3
        "    b = run.config.num_rounds\n"                  # 4
        "    d = c.dp_clip\n"                              # 5
        "    e = getattr(config, 'seeds')\n"               # 6
        "    g = dataclasses.replace(config, output_dir=None)\n"   # 7
        "    h = ExperimentConfig(data, num_rounds=5)\n"   # 8
        "    i = getattr(getattr(run, 'config', None), 'eval_every', None)\n"   # 9
        "    j = configs[0].verbose\n"                    # 10
        "    ok = (config.training.learning_rate, config.privacy.clip, config.options,\n"
        "          dataclasses.replace(config.output, output_dir=None), cfg.batch_size,\n"
        "          run.seeds, config.algorithm, config.thetas,\n"
        "          ExperimentConfig(data, training=config.training))\n")
    assert [line for line, _ in flat_uses(source)] == [3, 4, 5, 6, 7, 8, 9, 10]
    assert [line for line, _ in flat_reads(source)] == [3, 4, 5, 6, 9, 10]


# The nested path of a few flags, written out by hand (the table FLAT is built from the
# fields' declarations).
BY_HAND = {
    "num_rounds": ("training", "num_rounds"),
    "learning_rate": ("training", "learning_rate"),
    "server_lr": ("server", "learning_rates"),
    "client_optimizer": ("client", "name"),
    "client_sampling": ("sampling", "sampler"),
    "availability": ("online", "model"),
    "dp_clip": ("privacy", "clip"),
    "dp_target_epsilon": ("privacy", "target_epsilons"),
    "eval_every": ("evaluation", "eval_every"),
    "output_dir": ("output", "output_dir"),
    "verbose": ("output", "verbose"),
}


def _documented_field(flag):
    """The field of `flag` by the renaming rule of docs/reference/api/run.md."""
    special = {"server_optimizer": "name", "server_lr": "learning_rates",
               "client_optimizer": "name", "client_sampling": "sampler",
               "availability": "model", "availability_probs": "probabilities",
               "dp_noise_multiplier": "noise_multipliers",
               "dp_target_epsilon": "target_epsilons"}
    if flag in special:
        return special[flag]
    if flag in ("client_momentum", "client_beta1", "client_beta2", "client_eps"):
        return flag[len("client_"):]
    for prefix in ("server_", "availability_", "dp_"):
        if flag.startswith(prefix):
            return flag[len(prefix):]
    return flag


def test_the_documented_renaming_rule_names_every_field():
    wrong = {flag: (field, _documented_field(flag)) for flag, (_, field) in FLAT.items()
             if field != _documented_field(flag)}
    assert not wrong, wrong


def _config():
    return ExperimentConfig(DataConfig("synthetic"), algorithm="fedavg", thetas=(),
                            num_rounds=7, learning_rate=0.05, server_lr=(0.5,),
                            client_sampling="poisson", eval_every=3, output_dir=None,
                            save_models=False, verbose=False)


def test_flat_keywords_set_the_nested_fields_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = _config()
        assert (config.training.num_rounds, config.training.learning_rate,
                config.server.learning_rates, config.sampling.sampler,
                config.evaluation.eval_every, config.output.verbose) == \
            (7, 0.05, (0.5,), "poisson", 3, False)
        flat = config.flat()
        replaced = dataclasses.replace(config, num_rounds=9)
        assert replaced.training.num_rounds == 9
        assert pickle.loads(pickle.dumps(config)) == config
    assert (flat["num_rounds"], flat["server_lr"], flat["client_sampling"]) == \
        (7, (0.5,), "poisson")


@pytest.mark.parametrize("flag", sorted(BY_HAND))
def test_a_flat_read_warns_and_names_the_nested_path(flag):
    config = _config()
    group, field = BY_HAND[flag]
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(config, flag)
    assert value == getattr(getattr(config, group), field)
    assert len(caught) == 1
    assert f"config.{flag} is config.{group}.{field}" in str(caught[0].message)
    assert caught[0].filename == __file__   # the warning points at the caller's line


def test_every_flat_name_reads_its_field():
    config = _config()
    for flag in sorted(FLAT_NAMES):
        group, field = FLAT[flag]
        with pytest.warns(DeprecationWarning, match=rf"config\.{group}\.{field}\b"):
            assert getattr(config, flag) is getattr(getattr(config, group), field)


def test_unknown_and_private_names_raise_without_a_warning():
    config = _config()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("no_such_setting", "_private", "__deepcopy_extra__"):
            with pytest.raises(AttributeError):
                getattr(config, name)


# --------------------------------------------------------------------------------------------
# DataConfig: the settings that choose the data, and the rest in groups.

# The group and field of a few data flags, written out by hand.
DATA_BY_HAND = {
    "max_train_clients": ("limits", "max_train_clients"),
    "min_client_examples": ("limits", "min_client_examples"),
    "synthetic_alpha": ("synthetic", "alpha"),
    "synthetic_num_clients": ("synthetic", "num_clients"),
    "synthetic_on_demand": ("synthetic", "on_demand"),
    "toy_means": ("toy", "means"),
    "partition": ("partitioner", "method"),
    "dirichlet_alpha": ("partitioner", "dirichlet_alpha"),
    "partition_seed": ("partitioner", "seed"),
}
FIXTURE = os.path.join(REPO, "tests", "fixtures", "resume_before_32", "summary.json")


def test_no_settings_class_has_more_than_twenty_fields():
    """DataConfig keeps the fields that choose the data (at most 12); its groups and every
    group of ExperimentConfig hold at most 20."""
    from deltafl_jax import declared
    assert len(dataclasses.fields(DataConfig)) <= 12
    classes = [DataConfig] + [cls for _, cls in declared.groups(DataConfig)] + \
        [cls for _, cls in GROUPS]
    assert {cls.__name__: len(dataclasses.fields(cls)) for cls in classes
            if len(dataclasses.fields(cls)) > 20} == {}


def test_the_scan_finds_every_kind_of_flat_data_use():
    source = (
        "import dataclasses\n"
        "def f(config, d: 'DataConfig', run, exp):\n"
        "    a = config.data.dirichlet_alpha\n"                # 3
        "    b = config.max_train_clients\n"                   # 4
        "    c = d.synthetic_alpha\n"                          # 5
        "    e = getattr(config, 'toy_means')\n"               # 6
        "    g = DataConfig('npz', partition='iid')\n"         # 7
        "    h = dataclasses.replace(run.config.data, num_clients=5)\n"   # 8
        "    ok = (config.data.partitioner.method, exp.data.partition, d.dataset,\n"
        "          run.data.train.num_clients, config.data.limits.max_train_clients,\n"
        "          dataclasses.replace(config.data, data_seed=3), DataConfig('npz'))\n")
    assert [line for line, _ in data_flat_uses(source)] == [3, 4, 5, 6, 7, 8]


def test_flat_data_keywords_set_the_group_fields_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = DataConfig("npz", max_train_clients=5, synthetic_num_clients=10, toy_means=(
            (0.0, 0.0), (1.0, 1.0)), partition="dirichlet", partition_seed=4, data_seed=2)
        assert (data.limits.max_train_clients, data.synthetic.num_clients, data.toy.means,
                data.partitioner.method, data.partitioner.seed, data.data_seed) == \
            (5, 10, ((0.0, 0.0), (1.0, 1.0)), "dirichlet", 4, 2)
        assert data.synthetic.alpha == 1.0 and data.partitioner.num_clients == 100
        replaced = dataclasses.replace(data, dirichlet_alpha=0.1, dataset="synthetic")
        assert replaced.partitioner.dirichlet_alpha == 0.1 and replaced.dataset == "synthetic"
        assert replaced.partitioner.method == "dirichlet" and replaced.limits == data.limits
        assert pickle.loads(pickle.dumps(data)) == data and hash(data) == hash(
            DataConfig("npz", max_train_clients=5, synthetic_num_clients=10, toy_means=(
                (0.0, 0.0), (1.0, 1.0)), partition="dirichlet", partition_seed=4, data_seed=2))
    with pytest.raises(TypeError, match="unknown setting 'max_clients'"):
        DataConfig("synthetic", max_clients=10)
    with pytest.raises(TypeError):
        DataConfig()   # the dataset is required, as it was


@pytest.mark.parametrize("flag", sorted(DATA_BY_HAND))
def test_a_flat_data_read_warns_and_names_the_nested_path(flag):
    data = DataConfig("synthetic", partition_seed=3)
    group, field = DATA_BY_HAND[flag]
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(data, flag)
    assert value == getattr(getattr(data, group), field)
    assert len(caught) == 1
    assert f"config.{flag} is config.{group}.{field}" in str(caught[0].message)
    assert caught[0].filename == __file__


def test_every_flat_data_name_reads_its_field_and_others_raise():
    data = DataConfig("synthetic")
    for flag, (group, field) in sorted(datasets.FLAT.items()):
        with pytest.warns(DeprecationWarning, match=rf"config\.{group}\.{field}\b"):
            assert getattr(data, flag) is getattr(getattr(data, group), field)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("no_such_setting", "_private", "limits_max"):
            with pytest.raises(AttributeError):
                getattr(data, name)


def test_the_data_settings_are_stored_as_before():
    """summary.json's ``config["data"]`` stays flag -> value in the order written before the
    groups (the fixture, a run of that code), and a stored block builds the same DataConfig
    by flag name (``declared.from_flat``) as by keywords."""
    import json
    from deltafl_jax import declared
    with open(FIXTURE) as f:
        stored = json.load(f)["config"]["data"]
    data = declared.from_flat(DataConfig, stored)
    assert data.synthetic.num_clients == 12 and data.synthetic.shared == 0.8
    assert data.toy.means == ((0.0, 0.0), (4.0, 0.0), (1.0, 1.0))
    config = ExperimentConfig(data, algorithm="fedavg", thetas=(), output_dir=None,
                              save_models=False)
    flat = config.flat()["data"]
    assert [k for k in flat if k in stored] == list(stored)   # the same keys, in order
    assert json.loads(json.dumps({k: flat[k] for k in stored})) == stored
    assert set(flat) - set(stored) == (set(declared.flat_paths(type(data.partitioner)))
                                       | set(declared.flat_paths(type(data.text))))
    assert DataConfig(**flat) == data
