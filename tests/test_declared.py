"""The configuration declared once (issue 32): every setting of ExperimentConfig's groups is a
field that carries its flag, the command line's flags are generated from them, and the flat
view (flag name -> value) that outputs and resumes store round-trips. The resolve step
(deltafl_jax.run.resolve) turns a configuration and its data into a validated run without
compiling anything."""

import dataclasses
import functools
import json
import math
import os

import pytest

from conftest import tiny_config
from deltafl_jax import DataConfig, ExperimentConfig, declared
from deltafl_jax.errors import ConfigError
from deltafl_jax.optimizers.client import ClientOptimizer
from deltafl_jax.optimizers.server import ServerOptimizer
from deltafl_jax.privacy.dp import Privacy
from deltafl_jax.run.config import GROUPS
from deltafl_jax.run.resolve import resolve

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Flags of the command line that are no setting of a group: the --algorithm entries, the
# algorithms' sweeps and options (their specs declare them), the process's own.
NOT_SETTINGS = {"algorithm", "model_module", "distributed", "coordinator_address",
                "num_processes", "process_id", "distributed_timeout_s", "deterministic",
                "estimate", "estimate_rounds"}


@functools.lru_cache(maxsize=1)
def _before():
    """experiments.run's flags: as recorded before the configuration was declared once
    (tests/fixtures/flags_before_32.json), and the flags added since (and the helps brought
    up to date since, and --algorithm's, which lists the methods) as the command line declares
    them now (tests/test_flags_unchanged.py keeps the recorded ones unchanged)."""
    import subprocess
    import sys
    with open(os.path.join(REPO, "tests", "fixtures", "flags_before_32.json")) as f:
        flags = {f["name"]: f for f in json.load(f)["experiments.run"]}
    proc = subprocess.run([sys.executable, "-m", "docs.gen_flags",
                           "--collect=experiments.run"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    now = {f["name"]: f for f in json.loads(proc.stdout)["flags"]}
    from test_flags_unchanged import HELP_UPDATED   # helps brought up to date since
    flags.update({name: f for name, f in now.items()
                  if name not in flags or name in HELP_UPDATED or name == "algorithm"})
    return flags


def test_every_setting_is_a_flag_of_the_command_line_and_back():
    from deltafl_jax.algorithms import registry
    flags = _before()
    settings = set(declared.flat_paths(DataConfig))
    for _, cls in GROUPS:
        settings |= set(declared.flat_paths(cls))
    algorithm_flags = {s.flag for s in registry.sweeps()} | {n for n, _ in registry.options()}
    assert settings <= set(flags)
    assert set(flags) - settings == NOT_SETTINGS | algorithm_flags


@pytest.mark.parametrize("cls", [DataConfig, ServerOptimizer, ClientOptimizer, Privacy]
                         + [cls for _, cls in GROUPS])
def test_each_settings_default_is_its_flags(cls):
    """The flag's default (as absl holds it) is the field's, written once on the field."""
    flags = _before()
    for f in declared.fields_of(cls):
        flag = declared.flag_of(f)
        want = flags[flag.name]["default"]
        got = declared.flag_default(f)
        got = ",".join(got) if isinstance(got, list) else got
        assert got == want, flag.name
        choices = flags[flag.name]["choices"]
        prefix = f"<{'|'.join(choices)}>: " if choices else ""   # absl's, before an enum's help
        assert flags[flag.name]["help"] == prefix + flag.help, flag.name


def test_the_server_optimizers_settings_are_declared_on_its_fields():
    """The server optimizer's hyper-parameters are ServerOptimizer's fields, nowhere else."""
    names = {flag.name: name for name, flag in declared.declared(ServerOptimizer)}
    assert names == {"server_optimizer": "name", "server_lr": "learning_rates",
                     "server_momentum": "momentum", "server_beta1": "beta1",
                     "server_beta2": "beta2", "server_eps": "eps"}
    cli = open(os.path.join(REPO, "experiments", "cli.py")).read()
    config = open(os.path.join(REPO, "deltafl_jax", "run", "config.py")).read()
    for flag in ("server_momentum", "server_beta1", "server_beta2", "server_eps"):
        assert flag not in cli and flag not in config, flag


def test_flat_settings_round_trip():
    c = tiny_config(server_optimizer="adam", server_lr=(0.1, 0.3), dp_clip="adaptive",
                    dp_clip_init=0.5, client_sampling="poisson", dp_noise_multiplier=(1.0,),
                    finetune_steps=(0, 2), client_holdout=0.2, l2_reg=(0.0, 0.01))
    assert c.server == ServerOptimizer(name="adam", learning_rates=(0.1, 0.3))
    assert c.privacy.adaptive and c.privacy.initial_clip == 0.5 and c.dp_clip == "adaptive"
    assert c.server_lr == (0.1, 0.3) and c.client_sampling == "poisson"
    flat = c.flat()
    d = ExperimentConfig(DataConfig(**flat.pop("data")), **flat)
    assert d == c
    assert dataclasses.replace(c, num_rounds=9).training.num_rounds == 9
    assert dataclasses.replace(c, num_rounds=9).server == c.server
    with pytest.raises(TypeError, match="unknown setting 'server_lrs'"):
        tiny_config(server_lrs=(1.0,))
    with pytest.raises(AttributeError):
        c.no_such_setting


def test_resolve_builds_the_grid_and_the_accounting_once(tiny_synthetic):
    c = tiny_config(algorithm="fedavg", thetas=(), weighting="unweighted", dp_clip=1.0,
                    dp_noise_multiplier=(0.5, 2.0), client_sampling="poisson", seeds=(1, 2))
    run = resolve(c, tiny_synthetic)
    assert run.replicas.size == 4
    assert run.accounting.noise == tuple(float(z) for z in run.replicas.dp_noise)
    assert run.poisson is not None and run.accounting.cap == run.poisson.cap
    assert run.num_sampled == run.poisson.cap and run.expected == c.clients_per_round


def test_a_private_run_is_refused_by_one_function(tiny_synthetic):
    """check_private_version: with the spec alone when the configuration is made (no private
    version at all), with the built algorithm in the resolve step (its options leave it
    none)."""
    with pytest.raises(ConfigError, match="--algorithm=qffl has no private version"):
        tiny_config(algorithm="qffl", thetas=(), dp_clip=1.0)
    c = tiny_config(algorithm="fedavg", thetas=(), dp_clip=1.0)   # weighted: none
    with pytest.raises(ConfigError, match="has a private version only with --weighting"):
        resolve(c, tiny_synthetic)


@pytest.mark.parametrize("value, low, high, low_open, high_open, ok", [
    (0.0, 0.0, math.inf, False, False, True),      # a closed bound holds its end
    (0.0, 0.0, math.inf, True, False, False),      # an open one does not
    (1, 0.0, 1.0, False, True, False),
    (0.999, 0.0, 1.0, False, True, True),
    (5, -math.inf, math.inf, False, False, True),  # an int is a number
    (True, -math.inf, math.inf, False, False, False),   # a bool is not
    ("1", -math.inf, math.inf, False, False, False),
    (None, -math.inf, math.inf, False, False, False),
    (math.nan, -math.inf, math.inf, False, False, False),
    (math.inf, 0.0, math.inf, False, False, False),
    (-math.inf, -math.inf, math.inf, False, False, False),
])
def test_finite_in_is_a_finite_number_within_its_bounds(value, low, high, low_open, high_open,
                                                        ok):
    assert declared.finite_in(value, low, high, low_open=low_open, high_open=high_open) is ok


def test_check_finite_names_the_flag_and_the_range_in_one_line():
    declared.check_finite("server_beta1", 0.0, 0.0, 1.0, high_open=True)
    with pytest.raises(ConfigError, match=r"^--server_beta1 must be a finite number >= 0 and "
                                          r"< 1, got 1\.0$"):
        declared.check_finite("server_beta1", 1.0, 0.0, 1.0, high_open=True)
    with pytest.raises(ConfigError, match=r"^--dp_clip must be a finite number > 0, got nan$"):
        declared.check_finite("dp_clip", math.nan, 0.0, low_open=True)
    with pytest.raises(ConfigError, match=r"^--learning_rate must be a finite number, got "
                                          r"'x'$"):
        declared.check_finite("learning_rate", "x")


# ---------------------------------------------------------------- one declaration mechanism


def test_an_algorithm_option_and_a_group_setting_go_through_one_declaration():
    """Every option of every spec is a field that carries a declared.Flag, as every setting of
    a group is; experiments/cli.py defines both by one loop, with the field's default, help
    and choices, and has no other flag definition."""
    import re
    from absl import flags as absl_flags
    from deltafl_jax.algorithms import registry
    from deltafl_jax.run.config import Training
    from experiments import cli
    cli.define_experiment_flags()
    FLAGS = absl_flags.FLAGS
    fields = [(spec.name, f) for spec in registry.SPECS.values()
              for f in dataclasses.fields(spec.options_type)]
    fields += [("Training", f) for f in dataclasses.fields(Training)
               if declared.flag_of(f) is not None]
    assert {f.name for owner, f in fields if owner == "propfair"} >= {"propfair_epsilon"}
    for owner, f in fields:
        flag = declared.flag_of(f)
        assert isinstance(flag, declared.Flag), (owner, f.name)
        absl = FLAGS[flag.name]
        want = declared.flag_default(f)
        assert absl.default == want, (owner, flag.name)
        choices = list(flag.choices)
        assert list(getattr(absl.parser, "enum_values", None) or []) == choices, flag.name
        prefix = f"<{'|'.join(choices)}>: " if choices else ""
        assert absl.help == prefix + flag.help, (owner, flag.name)
    assert cli.SECTION["propfair_epsilon"] == cli.OPTIONS_TITLE
    assert cli.SECTION["learning_rate"].startswith("Training")
    assert cli.SECTION["thetas"] == cli.SWEEPS_TITLE
    assert cli.SECTION["deterministic"].startswith("Where the process runs")
    source = open(os.path.join(REPO, "experiments", "cli.py")).read()
    assert len(re.findall(r"_KINDS\[[^\]]+\]\(", source)) == 1      # the one loop's call
    assert source.count("flags.DEFINE_") == len(cli._KINDS)         # only in its table


def test_two_different_declarations_of_one_flag_are_refused_with_a_clear_type_error():
    a = declared.Flag(name="eps", help="the margin", kind="float", flag_default=0.2)
    b = dataclasses.replace(a, flag_default=0.3)
    with pytest.raises(TypeError, match=r"^--eps is declared differently by FooOptions and by "
                                        r"BarOptions \(flag_default 0\.2 against 0\.3\); "
                                        r"declare it once and share that declaration$"):
        declared.unique([("FooOptions", a), ("BarOptions", b)])
    # One declaration that several groups hold (an option several specs read) is kept once.
    assert declared.unique([("FooOptions", a), ("BarOptions", dataclasses.replace(a))]) == \
        (("FooOptions", a),)
    # Within one configuration each flag has one field.
    with pytest.raises(TypeError, match=r"^--eps is declared twice, by A and by B$"):
        declared.unique([("A", a), ("B", a)], shared=False)

    @dataclasses.dataclass(frozen=True)
    class One:
        eps: float = declared.setting(0.2, "the margin")

    @dataclasses.dataclass(frozen=True)
    class Two:
        margin: float = declared.setting(0.3, "the margin", flag="eps")

    @dataclasses.dataclass(frozen=True)
    class Both:
        one: One = declared.group(One)
        two: Two = declared.group(Two)

    with pytest.raises(TypeError, match=r"--eps is declared differently by Both.one.eps and by "
                                        r"Both.two.margin"):
        declared.flat_paths(Both)


def test_a_number_option_checks_its_declared_bounds_in_one_line():
    from deltafl_jax.algorithms.deltafl import DeltaFLOptions
    from deltafl_jax.algorithms.options import build_options
    from deltafl_jax.algorithms.propfair import PropFairOptions
    cases = [(DeltaFLOptions, {"mm_iters": 0}, r"^--mm_iters must be an integer >= 1, got 0$"),
             (DeltaFLOptions, {"mm_iters": 2.0}, r"^--mm_iters must be an integer >= 1, got 2\.0$"),
             (DeltaFLOptions, {"fedau_cap": True}, r"^--fedau_cap must be an integer >= 0, got "
                                                   r"True$"),
             (DeltaFLOptions, {"smoothing": -0.1}, r"^--smoothing must be a finite number >= 0, "
                                                   r"got -0\.1$"),
             (PropFairOptions, {"propfair_epsilon": 0.0}, r"^--propfair_epsilon must be a finite "
                                                          r"number > 0, got 0\.0$"),
             (DeltaFLOptions, {"quantile": "median"}, r"^unknown --quantile='median'; choose one "
                                                      r"of sort, secagg_mm$")]
    for cls, given, message in cases:
        with pytest.raises(ConfigError, match=message):
            build_options(cls, given)
    assert build_options(DeltaFLOptions, {"mm_iters": 3, "filter": "reference",
                                          "qffl_q": 1.0}).mm_iters == 3


def test_stored_options_are_read_back_from_either_place_a_run_kept_them():
    """summary.json's config holds the options in ``options``; runs written before held them
    at the top level: both read back through declared.from_flat, defaults for the rest."""
    from deltafl_jax.algorithms import registry
    from deltafl_jax.algorithms.deltafl import DeltaFLOptions
    spec = registry.get("deltafl")
    now = {"learning_rate": 0.1, "options": {"filter": "reference", "mm_iters": 3}}
    before = {"learning_rate": 0.1, "filter": "reference", "mm_iters": 3}
    want = DeltaFLOptions(filter="reference", mm_iters=3)
    assert spec.stored_options(now) == spec.stored_options(before) == want
    assert spec.stored_options(None) == DeltaFLOptions()
    assert registry.get("propfair").stored_options(
        {"options": {"propfair_epsilon": 0.5}}).propfair_epsilon == 0.5


def test_a_nested_group_is_declared_built_and_restored_through_its_parent():
    """A group of groups (DataConfig's subgroups, say): its flags are declared in place, and
    it is built from the flags and read back from a stored run as one."""
    @dataclasses.dataclass(frozen=True)
    class Inner:
        eps: float = declared.setting(0.2, "the margin", bounds=declared.Bounds(0.0))

    @dataclasses.dataclass(frozen=True)
    class Outer:
        mode: str = declared.setting("a", "the mode", choices=("a", "b"))
        inner: Inner = declared.group(Inner)

    assert [f.name for f in declared.declarations(Outer)] == ["mode", "eps"]
    assert declared.flat_paths(Outer) == {"mode": ("mode",), "eps": ("inner", "eps")}
    given = {"mode": "b", "eps": 0.5}
    assert declared.from_flags(Outer, given.__getitem__) == Outer("b", Inner(0.5))
    assert declared.from_flat(Outer, {"eps": 0.7}) == Outer("a", Inner(0.7))
    assert declared.flat_values(Outer("b", Inner(0.5))) == given


def test_algorithms_read_their_options_typed_never_from_the_stored_mapping():
    """config.options (flag -> value) is the storage format; an algorithm reads its options
    through its spec's typed group (the factory's `options`, ``spec.options_for(config)``)."""
    import re
    folder = os.path.join(REPO, "deltafl_jax", "algorithms")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            source = open(os.path.join(folder, name)).read()
            assert not re.search(r"config\.options\s*(\.get\(|\[)", source), name
