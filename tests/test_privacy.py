"""Client-level differential privacy (deltafl_jax.privacy.dp): the per-job clip, the server's
noise against a chi-square bound, the accounting against dp-accounting called here and
against a published figure, z = 0 against the non-private runs bit for bit, private Delta-FL,
the calibration, and the refusals."""

import dataclasses
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from scipy import stats

from conftest import run_rounds_history as run_rounds
from conftest import run_runner, tiny_config
from deltafl_jax import build_experiment, engine, rounds
from deltafl_jax.algorithms import ClientFeedback
from deltafl_jax.privacy import dp as privacy

M = 4   # clients per round: 1/4 sums to 1 exactly in float32 (FedAvg's fixed denominator)


def same(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_zero_noise_and_a_loose_clip_is_the_non_private_run_bit_for_bit(tiny_synthetic):
    """FedAvg (uniform weights, m = 4) with --dp_clip above every update's norm and z = 0:
    the clip scales by exactly 1, the noise adds exact zeros, and the fixed denominator 1 is
    the weight sum 4 x 1/4."""
    kw = dict(algorithm="fedavg", thetas=(), seeds=(1, 2), weighting="unweighted",
              clients_per_round=M, l2_reg=1e-3)
    plain, _ = run_rounds(build_experiment(tiny_config(**kw), tiny_synthetic), 3)
    private, hist = run_rounds(build_experiment(tiny_config(dp_clip=1e6, **kw),
                                                tiny_synthetic), 3)
    assert same(plain.params, private.params)
    assert all(np.all(h["dp_clipped"] == 0) for h in hist)


def job_norms(exp, clip, rounds_=2):
    """The per-job update norms that entered the sum in each round (the engine's job_sqnorm,
    passed through the server update's metrics)."""
    base = exp.algorithm

    def server_update(state, params, feedback, hyper):
        delta, state, metrics = base.server_update(state, params, feedback, hyper)
        return delta, state, {**metrics, "norm": jnp.sqrt(feedback.job_sqnorm),
                              "trained": feedback.job_trained}

    alg = base._replace(server_update=server_update)
    local = engine.LocalSGDConfig(batch_size=exp.config.batch_size, lanes=exp.lanes, clip=clip)
    round_fn = jax.jit(rounds.build_round_fn(exp.model, alg, exp.replicas, local,
                                             exp.eval_chunk, 1, exp.num_sampled))
    state, out = exp.initial_state(), []
    for t in range(rounds_):
        state, met = round_fn(state, exp.round_data(t), exp.keys())
        met = jax.device_get(met)
        out.append((met["norm"][met["trained"]], met.get("dp_clipped")))
    return out


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_every_clipped_update_has_norm_at_most_the_clip(tiny_synthetic):
    exp = build_experiment(tiny_config(algorithm="fedavg", thetas=(), weighting="unweighted",
                                       dp_clip=0.05, learning_rate=0.2), tiny_synthetic)
    loose = job_norms(exp, None)
    clipped = job_norms(exp, 0.05)
    assert max(float(n.max()) for n, _ in loose[:1]) > 0.05      # the clip is active
    for (norms, count), (raw, _) in zip(clipped, loose):
        assert np.all(norms <= 0.05), norms
        assert int(count.sum()) == int(np.sum(raw > 0.05))


def test_one_client_round_moves_the_model_by_its_clipped_update(tiny_synthetic):
    """m = 1, z = 0: the private round's step w_{t+1} - w_t is the plain round's step Delta
    scaled by min(1, C / ||Delta||), computed here in NumPy."""
    kw = dict(algorithm="fedavg", thetas=(), seeds=(1,), weighting="unweighted",
              clients_per_round=1, learning_rate=0.2, l2_reg=1e-3)
    plain = build_experiment(tiny_config(**kw), tiny_synthetic)
    private = build_experiment(tiny_config(dp_clip=0.05, **kw), tiny_synthetic)
    w0 = [np.asarray(x, np.float64) for x in jax.tree.leaves(plain.initial_state().params)]
    a, _ = run_rounds(plain, 1)
    b, _ = run_rounds(private, 1)
    step = [np.asarray(x, np.float64) - w for x, w in zip(jax.tree.leaves(a.params), w0)]
    norm = math.sqrt(sum(float(np.sum(d * d)) for d in step))
    assert norm > 0.05
    for got, w, d in zip(jax.tree.leaves(b.params), w0, step):
        np.testing.assert_allclose(np.asarray(got, np.float64) - w, d * 0.05 / norm,
                                   rtol=1e-4, atol=1e-7)


def test_the_server_noise_has_the_stated_standard_deviation():
    """(z C a_max)^2 per coordinate: over 200 keys x 500 coordinates the sum of squares,
    divided by the variance, lies inside chi-square's 99.9% interval (and z = 0 adds
    nothing)."""
    fedavg = __import__("deltafl_jax.algorithms.fedavg", fromlist=["x"])
    private = fedavg.private_fedavg("unweighted")
    m, clip, z, d = 8, 0.3, 1.7, 500
    fb = ClientFeedback(losses=np.zeros(m, np.float32), sizes=np.ones(m, np.int32),
                        weights=np.full(m, 1 / m, np.float32),
                        delta_sum={"w": np.zeros((d,), np.float32)},
                        weight_sum=np.float32(1.0), job_sqnorm=np.zeros(m, np.float32),
                        job_finite=np.ones(m, bool), job_trained=np.ones(m, bool),
                        learning_rate=np.float32(0.1), clients=np.arange(m, dtype=np.int32))
    keys = jax.random.split(jax.random.key(0), 200)
    privatize = jax.jit(lambda k, z: rounds._privatize(private, clip, m, fb, None, k, z))
    noisy = jax.jit(jax.vmap(privatize, in_axes=(0, None)))(keys, z)   # one program
    draws = np.asarray(noisy.delta_sum["w"], np.float64).ravel()
    sigma = z * clip / m
    n = draws.size
    statistic = float(np.sum(draws ** 2) / sigma ** 2)
    assert stats.chi2.ppf(0.0005, n) < statistic < stats.chi2.ppf(0.9995, n)
    assert np.all(np.asarray(noisy.weight_sum) == 1.0)          # the fixed denominator
    zero = privatize(keys[0], 0.0)
    assert np.all(np.asarray(zero.delta_sum["w"]) == 0.0)


def independent_epsilon(population, m, zs, rounds_, delta):
    """dp-accounting, called here: the composition of Gaussians with noise multipliers zs
    on m of `population` sampled without replacement, replace-one neighbours."""
    inner = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z) for z in zs])
    acc = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.SampledWithoutReplacementDpEvent(population, m, inner), rounds_)
    return acc.get_epsilon(delta)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_the_runs_epsilon_is_dp_accountings(tiny_synthetic, tmp_path):
    from deltafl_jax import run_experiment
    cfg = tiny_config(algorithm="fedavg", thetas=(), seeds=(1,), weighting="unweighted",
                      dp_clip=0.5, dp_noise_multiplier=(1.1, 2.0), num_rounds=4, eval_every=2,
                      clients_per_round=M)
    result = run_experiment(cfg, tiny_synthetic, log=lambda s: None)
    N = tiny_synthetic.train.num_clients
    delta = N ** -1.1
    for key, z in (("theta=1_dp_noise_multiplier=1.1_seed=1", 1.1),
                   ("theta=1_dp_noise_multiplier=2_seed=1", 2.0)):
        applied = np.float32(z)          # the round's z: float32, rounded up
        if float(applied) < z:
            applied = np.nextafter(applied, np.float32(np.inf))
        # The update's sum moves by up to 2 C / m when one client is replaced: z / 2.
        want = independent_epsilon(N, M, [float(applied) / 2], 4, delta)
        assert result.final[key]["dp_epsilon"] == pytest.approx(want, rel=1e-12)
    halfway = [r["dp_epsilon"] for r in result.history if r["round"] == 2]
    assert all(0 < e < result.final[k]["dp_epsilon"] for e, k in zip(halfway, result.final))


def classic_epsilon(event, delta):
    """epsilon = min over orders of RDP(order) + log(1/delta) / (order - 1): the conversion
    of the moments accountant (Abadi et al. 2016) and of TensorFlow Privacy's tutorials, from
    dp-accounting's RDP of each order (recovered from its single-order epsilon)."""
    orders = [1 + x / 10 for x in range(1, 100)] + list(range(12, 64))
    best = math.inf
    for a in orders:
        if a <= 1.01:
            continue
        acc = RdpAccountant([a])
        acc.compose(event)
        e = acc.get_epsilon(delta)
        if e > 0:
            rdp = e - math.log1p(-1 / a) + math.log(delta * a) / (a - 1)
            best = min(best, rdp - math.log(delta) / (a - 1))
    return best


@pytest.mark.parametrize("z,epochs,published,tighter", [(1.12, 60, 2.92, 2.52),
                                                         (1.2, 10, 1.20, 0.93)])
def test_a_published_figure(z, epochs, published, tighter):
    """TensorFlow Privacy's MNIST DP-SGD tutorial (tutorials/README.md, 'Select Parameters'):
    60,000 examples, batches of 256 sampled at q = 256/60000, noise multiplier z: epsilon at
    delta = 1e-5 after 60 epochs with z = 1.12 is 2.92, after 10 epochs with z = 1.2 is 1.20
    (RDP accountant, with the conversion of Abadi et al.'s moments accountant; the table's
    third row, z = 0.6 for 30 epochs, 9.74, comes out 9.76 here and is left out). One step
    is the sampled Gaussian mechanism of privacy.poisson_event. dp-accounting's own,
    tighter conversion (Canonne et al. 2020) gives 2.52 and 0.93."""
    steps = epochs * 60000 // 256
    event = dp_accounting.SelfComposedDpEvent(privacy.poisson_event(256 / 60000, z, (1.0,)),
                                              steps)
    assert round(classic_epsilon(event, 1e-5), 2) == published
    acc = RdpAccountant()
    acc.compose(event)
    assert round(acc.get_epsilon(1e-5), 2) == tighter


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_calibration_meets_the_target_epsilon():
    ledger = privacy.Ledger(population=1000, m=50, releases=(0.5,), rounds=300, delta=1e-5)
    for target in (8.0, 2.0, 0.5):
        z = privacy.calibrate(target, ledger)
        assert 0.99 * target < privacy.epsilon(ledger, z) <= target
    assert privacy.calibrate(math.inf, ledger) == 0.0
    # Private Delta-FL's round releases more: it needs more noise for the same epsilon.
    more = dataclasses.replace(ledger, releases=(0.5,) + (1.0,) * 5)
    assert privacy.calibrate(2.0, more) > privacy.calibrate(2.0, ledger)


def private_deltafl_config(**kw):
    return tiny_config(algorithm="deltafl", thetas=(1.0, 0.5), seeds=(1, 2),
                       weighting="unweighted", quantile="secagg_mm", mm_iters=5,
                       l2_reg=1e-3, **kw)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_private_deltafl_at_zero_noise_is_secagg_mm_bit_for_bit(tiny_synthetic):
    """z = 0 for the update and the quantile's sums, xi = 0, B and C above every loss and
    update: the noised secure sums and the kept weight are the plain ones."""
    plain, ph = run_rounds(build_experiment(private_deltafl_config(), tiny_synthetic), 3)
    private, qh = run_rounds(build_experiment(private_deltafl_config(
        dp_clip=1e6, dp_loss_bound=1e6, dp_mm_floor=0.0), tiny_synthetic), 3)
    assert same(plain.params, private.params)
    assert [h["num_selected"].tolist() for h in ph] == [h["num_selected"].tolist() for h in qh]


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_private_deltafl_accounts_its_quantiles_releases(tiny_synthetic):
    """One round of private Delta-FL releases the update, the kept weight and the mm_iters + 1
    secure sums of the quantile (noise ratio r): the run's epsilon composes them all."""
    exp = build_experiment(private_deltafl_config(dp_clip=0.5, dp_noise_multiplier=(3.0,),
                                                  dp_quantile_noise_ratio=2.0,
                                                  dp_loss_bound=4.0), tiny_synthetic)
    N = tiny_synthetic.train.num_clients
    # Replace-one multipliers: the update z/2 (sensitivity 2C), the kept weight z, the first
    # quantile sum z_q sqrt(B^2 + 1) / B (only F_k changes), the 5 MM steps z_q.
    want = independent_epsilon(N, exp.num_sampled,
                               [1.5, 3.0, 6.0 * math.sqrt(17) / 4] + [6.0] * 5, 10, N ** -1.1)
    assert exp.accounting.epsilons(10) == pytest.approx([want] * 4, rel=1e-12)
    _, hist = run_rounds(exp, 2)
    assert "eta" not in hist[0]        # the server never sees eta


def test_the_quantile_sums_and_the_kept_weight_get_their_stated_noise():
    """Over 4000 keys: each noised secure sum's two entries have std z_q x its sensitivity
    (the third, a count, is untouched), and private Delta-FL's kept weight has std z."""
    from deltafl_jax.privacy import secagg
    from deltafl_jax.algorithms.deltafl import DeltaFLHyper, DeltaFLOptions, private_deltafl
    keys = jax.random.split(jax.random.key(1), 4000)
    noise = secagg.SumNoise(keys[0], jnp.float32(1.5), 4.0, 0.5)
    sens = math.sqrt(17) / 0.5
    draws = np.asarray(jax.jit(jax.vmap(lambda k: secagg._noised(   # one program
        jnp.zeros(3), noise._replace(key=k), 3, sens)))(keys), np.float64)
    assert np.all(draws[:, 2] == 0)
    for col in (0, 1):
        stat = float(np.sum(draws[:, col] ** 2) / (1.5 * sens) ** 2)
        assert stats.chi2.ppf(0.0005, 4000) < stat < stats.chi2.ppf(0.9995, 4000)
    opts = DeltaFLOptions(weighting="unweighted", quantile="secagg_mm")
    private = private_deltafl(opts, privacy.Privacy(clip=1.0, noise_multipliers=(2.0,)))
    m = 8
    fb = ClientFeedback(losses=np.zeros(m, np.float32), sizes=np.ones(m, np.int32),
                        weights=np.ones(m, np.float32), delta_sum={"w": np.zeros((2,), np.float32)},
                        weight_sum=np.float32(1000.0), job_sqnorm=np.zeros(m, np.float32),
                        job_finite=np.ones(m, bool), job_trained=np.ones(m, bool),
                        learning_rate=np.float32(0.1), clients=np.arange(m, dtype=np.int32))
    out = jax.jit(jax.vmap(lambda k: rounds._privatize(private, 1.0, m, fb, DeltaFLHyper(0.5),
                                                       k, 2.0)))(keys)
    kept = np.asarray(out.weight_sum, np.float64) - 1000.0       # the floor 2 never binds
    stat = float(np.sum(kept ** 2) / 2.0 ** 2)
    assert stats.chi2.ppf(0.0005, 4000) < stat < stats.chi2.ppf(0.9995, 4000)


@pytest.mark.parametrize("flags,needle", [
    (["--algorithm=qffl", "--dp_clip=1"], "--algorithm=qffl has no private version"),
    (["--algorithm=fedavg", "--dp_clip=1"],
     "has a private version only with --weighting=unweighted"),
    (["--algorithm=deltafl", "--dp_clip=1", "--weighting=unweighted"],
     "only with --quantile=secagg_mm --weighting=unweighted"),
    (["--dp_target_epsilon=2"], "--dp_target_epsilon needs --dp_clip"),
    (["--algorithm=fedavg", "--weighting=unweighted", "--dp_clip=1",
      "--dp_noise_multiplier=1", "--dp_target_epsilon=2"], "not both"),
    (["--algorithm=fedavg", "--weighting=unweighted", "--dp_clip=0"], "--dp_clip must be"),
    (["--algorithm=deltafl", "--weighting=unweighted", "--quantile=secagg_mm", "--dp_clip=1",
      "--dp_noise_multiplier=1", "--dp_mm_floor=0"], "--dp_mm_floor must be > 0"),
    (["--algorithm=deltafl", "--weighting=unweighted", "--quantile=secagg_mm", "--dp_clip=1",
      "--dp_noise_multiplier=1", "--dp_quantile_noise_ratio=0"],
     "--dp_quantile_noise_ratio must be > 0"),
    (["--dp_loss_bound=3"], "--dp_loss_bound needs --dp_clip"),
])
def test_bad_privacy_flags_exit_2_with_one_line(tmp_path, capsys, flags, needle):
    out = tmp_path / "o"
    code, err, _ = run_runner(["--dataset=synthetic", "--synthetic_num_clients=20",
                               "--synthetic_max_examples=60", "--clients_per_round=4",
                               f"--output_dir={out}", *flags], capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not out.exists()
