"""Poisson client sampling (deltafl_jax.sampling.plan, --client_sampling=poisson), its add-or-remove
accounting (PLD or RDP, deltafl_jax.privacy.dp), adaptive clipping (--dp_clip=adaptive), and
DP-FTRL with a banded matrix factorisation (--client_sampling=cyclic --dp_mechanism=bandmf).

The references: scipy's binomial law and chi-square tests for the sampler, the round under
Poisson against the fixed-sampling round on the same cohort, dp-accounting called here with
the events written out from the paper's multipliers, NumPy for the clip's geometric step,
and for BandMF a dense NumPy solve of C W = Z and a brute-force sensitivity of the dense
strategy matrix."""

import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from scipy import stats

from conftest import run_rounds_history as run_rounds
from conftest import run_runner, tiny_config
from deltafl_jax import FederatedDataset, build_experiment
from deltafl_jax.data import split_clients
from deltafl_jax.datasets.synthetic import synthetic_clients
from deltafl_jax.privacy import dp as privacy
from deltafl_jax.sampling import plan
from deltafl_jax.sampling import PoissonSampler, samplers

ADD_OR_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


# ------------------------------------------------------------------------------ the sampler

def binomial_gof_pvalue(sizes, n, q):
    """chi-square goodness of fit of `sizes` to Binomial(n, q), cells merged until each
    expects at least 5."""
    sizes = np.asarray(sizes)
    pmf = stats.binom.pmf(np.arange(n + 1), n, q)
    observed = np.bincount(sizes, minlength=n + 1).astype(float)
    cells_o, cells_e, acc_o, acc_e = [], [], 0.0, 0.0
    for o, e in zip(observed, pmf * sizes.size):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= 5:
            cells_o.append(acc_o)
            cells_e.append(acc_e)
            acc_o = acc_e = 0.0
    cells_o[-1] += acc_o
    cells_e[-1] += acc_e
    return stats.chisquare(cells_o, cells_e).pvalue


def test_cohort_sizes_are_binomial():
    """3000 rounds of N = 40 clients at q = 0.25: the cohort sizes fit Binomial(40, 0.25);
    the fixed sampler's sizes (always m) do not (the test can fail)."""
    N, q, T = 40, 0.25, 3000
    sizes = [plan.poisson_cohort(7, t, N, q).size for t in range(T)]
    assert binomial_gof_pvalue(sizes, N, q) > 1e-3
    fixed = [plan.sample_clients(7, t, N, 10).size for t in range(T)]
    assert binomial_gof_pvalue(fixed, N, q) < 1e-12


def test_each_client_joins_independently_of_the_others():
    """Every client joins with probability q (binomial test), and for several pairs the 2 x 2
    table of (i joined, j joined) over 3000 rounds passes a chi-square test of independence;
    the fixed sampler at m = N / 2 fails it (given i, j joins less often)."""
    N, q, T = 12, 0.5, 3000
    joined = np.zeros((T, N), bool)
    for t in range(T):
        joined[t, plan.poisson_cohort(3, t, N, q)] = True
    for k in range(N):
        assert stats.binomtest(int(joined[:, k].sum()), T, q).pvalue > 1e-4
    for i, j in ((0, 1), (2, 9), (5, 6), (10, 11)):
        table = [[np.sum(joined[:, i] & joined[:, j]), np.sum(joined[:, i] & ~joined[:, j])],
                 [np.sum(~joined[:, i] & joined[:, j]), np.sum(~joined[:, i] & ~joined[:, j])]]
        assert stats.chi2_contingency(table, correction=False).pvalue > 1e-3
    fixed = np.zeros((T, N), bool)
    for t in range(T):
        fixed[t, plan.sample_clients(3, t, N, N // 2)] = True
    table = [[np.sum(fixed[:, 0] & fixed[:, 1]), np.sum(fixed[:, 0] & ~fixed[:, 1])],
             [np.sum(~fixed[:, 0] & fixed[:, 1]), np.sum(~fixed[:, 0] & ~fixed[:, 1])]]
    assert stats.chi2_contingency(table, correction=False).pvalue < 1e-3


def test_overflow_probability_and_the_cap():
    for n, q, cap in ((201, 0.1, 30), (10001, 0.01, 150), (50, 0.3, 49), (30, 0.5, 10)):
        assert plan.overflow_probability(n, q, cap) == pytest.approx(
            stats.binom.sf(cap, n, q), rel=1e-9)
    cap = plan.poisson_cap(200, 0.1, 20, 1e-12)
    assert 20 * stats.binom.sf(cap, 201, 0.1) <= 1e-12 < 20 * stats.binom.sf(cap - 1, 201, 0.1)
    # A cohort above the cap keeps `cap` of its clients, drawn from the same cohort.
    full = plan.poisson_cohort(1, 4, 100, 0.5)
    capped = plan.poisson_cohort(1, 4, 100, 0.5, cap=20)
    assert capped.size == 20 and set(capped) <= set(full)


def test_the_poisson_plan_holds_the_cohort_and_empty_slots():
    offsets = np.concatenate([[0], np.cumsum(np.arange(5, 25))])      # 20 clients
    work = plan.LocalWork(batch_size=4, local_epochs=2)
    sampling = PoissonSampler(num_clients=20, q=0.3, slots=12)
    caps = plan.capacities(np.diff(offsets), 12, work, 8)
    p = plan.make_round_plan([5, 6], 3, offsets, 12, work, caps,
                             cohorts=plan.draw_cohorts(sampling, [5, 6], 3))
    for g, seed in enumerate((5, 6)):
        cohort = plan.poisson_cohort(seed, 3, 20, 0.3, 12)
        k = cohort.size
        np.testing.assert_array_equal(p.clients[g, :k], cohort)
        np.testing.assert_array_equal(p.sizes[g, :k], np.diff(offsets)[cohort])
        assert np.all(p.sizes[g, k:] == 0) and np.all(p.steps[g, k:] == 0)
        assert p.eval_len[g] == np.diff(offsets)[cohort].sum()
        assert np.all(p.eval_seg[g, :p.eval_len[g]] < k)


# ------------------------------------------------------------------------------ the round

def same_cohort_runs(tiny_synthetic, monkeypatch, rounds_, **kw):
    """(the Poisson run, the fixed run drawing that run's cohort each round, cohort sizes)."""
    poisson = build_experiment(tiny_config(client_sampling="poisson", **kw), tiny_synthetic)
    cohorts = {}
    for t in range(rounds_):
        pl = poisson.round_plan(t)
        cohorts[t] = np.asarray(pl.clients[0][pl.sizes[0] > 0])
    a, ha = run_rounds(poisson, rounds_)
    outs = []
    for t in range(rounds_):
        kw2 = {k: v for k, v in kw.items() if k != "clients_per_round"}
        monkeypatch.setattr(samplers, "sample_clients",
                            lambda seed, r, n, m, t=t: cohorts[t])
        fixed = build_experiment(tiny_config(clients_per_round=cohorts[t].size, **kw2),
                                 tiny_synthetic)
        state = fixed.initial_state() if t == 0 else state
        state = state.replace(round=jnp.int32(t))
        state, _ = fixed.round_fn(state, fixed.round_data(t), fixed.keys())
        outs.append(state)
    return a, ha, outs[-1], [c.size for c in cohorts.values()], poisson


@pytest.mark.parametrize("algorithm,extra", [
    ("fedavg", dict(thetas=(), weighting="unweighted")),
    ("deltafl", dict(thetas=(0.5,))),
])
@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_an_empty_slot_changes_nothing(tiny_synthetic, monkeypatch, algorithm, extra):
    """Two rounds under Poisson sampling give the models of the fixed-sampling rounds that
    draw the same cohorts (m = the cohort's size each round)."""
    a, hist, b, sizes, exp = same_cohort_runs(tiny_synthetic, monkeypatch, 2,
                                              algorithm=algorithm, clients_per_round=4,
                                              l2_reg=1e-3, seeds=(2,), **extra)
    assert exp.num_sampled > 4 and min(sizes) < exp.num_sampled    # some slots are empty
    assert [int(h["cohort_size"][0]) for h in hist] == sizes
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-7)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_dp_fedavg_under_poisson_divides_by_the_expected_weight(tiny_synthetic, monkeypatch):
    """z = 0 and a clip above every update: one private round moves the model by the sum of
    the cohort's updates over q N = m (McMahan et al. 2018), not over the cohort's size."""
    kw = dict(algorithm="fedavg", thetas=(), weighting="unweighted", clients_per_round=4,
              l2_reg=1e-3, seeds=(2,))
    plain, _, _, sizes, _ = same_cohort_runs(tiny_synthetic, monkeypatch, 1, **kw)
    private = build_experiment(tiny_config(client_sampling="poisson", dp_clip=1e6, **kw),
                               tiny_synthetic)
    w0 = private.initial_state().params
    b, _ = run_rounds(private, 1)
    for w, x, y in zip(jax.tree.leaves(w0), jax.tree.leaves(plain.params),
                       jax.tree.leaves(b.params)):
        step_plain = np.asarray(x, np.float64) - np.asarray(w, np.float64)
        np.testing.assert_allclose(np.asarray(y, np.float64) - np.asarray(w, np.float64),
                                   step_plain * sizes[0] / 4, rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------------------ accounting

def pld_epsilon(q, z_eff, rounds_, delta):
    acc = PLDAccountant(neighboring_relation=ADD_OR_REMOVE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z_eff)),
                rounds_)
    return acc.get_epsilon(delta)


def rdp_epsilon(q, multipliers, rounds_, delta):
    """RDP, with the releases as a ComposedDpEvent (dp-accounting reduces it itself)."""
    inner = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(s)
                                           for s in multipliers])
    acc = RdpAccountant(neighboring_relation=ADD_OR_REMOVE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, inner), rounds_)
    return acc.get_epsilon(delta)


def applied(z):
    """The round's z: float32, rounded up."""
    f = np.float32(z)
    return float(f if float(f) >= z else np.nextafter(f, np.float32(np.inf)))


@pytest.fixture(scope="module")
def two_hundred():
    """200 training clients (and 200 test) of a few examples."""
    clients = synthetic_clients(1.0, 1.0, 400, seed=5, max_examples=50, shared=0.5)
    train, test = split_clients(clients, seed=5)
    return FederatedDataset("synthetic", train, test, num_classes=10)


def test_the_measured_example_poisson_pld_reports_at_most_3(two_hundred):
    """N = 200, m = 20, z = 1.1, 20 rounds, delta = 1e-5: Poisson + PLD gives 2.98 (<= 3.0),
    Poisson + RDP 3.50, and the fixed sampler's replace-one RDP 18.8; each equals
    dp-accounting called here."""
    kw = dict(algorithm="fedavg", thetas=(), weighting="unweighted", clients_per_round=20,
              dp_clip=1.0, dp_noise_multiplier=(1.1,), dp_delta=1e-5, num_rounds=20)
    assert two_hundred.train.num_clients == 200
    z = applied(1.1)
    pld = build_experiment(tiny_config(client_sampling="poisson", **kw), two_hundred)
    eps = float(pld.accounting.epsilons(20)[0])
    assert eps == pytest.approx(pld_epsilon(0.1, z, 20, 1e-5), rel=1e-9)
    assert eps <= 3.0 and round(eps, 2) == 2.98
    rdp = build_experiment(tiny_config(client_sampling="poisson", dp_accountant="rdp", **kw),
                           two_hundred)
    e_rdp = float(rdp.accounting.epsilons(20)[0])
    assert e_rdp == pytest.approx(rdp_epsilon(0.1, [z], 20, 1e-5), rel=1e-9)
    assert round(e_rdp, 2) == 3.50
    fixed = build_experiment(tiny_config(**kw), two_hundred)
    assert round(float(fixed.accounting.epsilons(20)[0]), 1) == 18.8
    # The cap's overflow term is negligible and recorded.
    info = pld.accounting.describe(pld.replicas.labels)
    assert info["sampler"] == "poisson" and info["cap"] == pld.num_sampled
    (over,) = info["overflow_delta"].values()
    assert 0 < over <= 1e-5 / privacy.OVERFLOW_SHARE
    assert over == pytest.approx((1 + math.exp(eps)) * 20 * stats.binom.sf(
        pld.num_sampled, 201, 0.1), rel=1e-6)


def private_deltafl(**kw):
    return tiny_config(algorithm="deltafl", thetas=(1.0, 0.5), seeds=(1,),
                       weighting="unweighted", quantile="secagg_mm", mm_iters=3,
                       client_sampling="poisson", dp_clip=0.5, dp_quantile_noise_ratio=2.0,
                       dp_loss_bound=4.0, **kw)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_private_deltafl_under_poisson_accounts_each_release(tiny_synthetic, accountant):
    """Add-or-remove multipliers: the update z, the kept weight z, the first quantile sum and
    the 3 MM sums z_q = 2 z; with --dp_kept_weight=expected the kept weight is not
    released."""
    N = tiny_synthetic.train.num_clients
    q, delta, z = 6 / N, N ** -1.1, applied(3.0)
    for kept, mults in (("noised", [z, z] + [2 * z] * 4), ("expected", [z] + [2 * z] * 4)):
        exp = build_experiment(private_deltafl(dp_noise_multiplier=(3.0,), dp_kept_weight=kept,
                                               dp_accountant=accountant), tiny_synthetic)
        got = exp.accounting.epsilons(10)
        if accountant == "pld":
            want = pld_epsilon(q, 1 / math.sqrt(sum(1 / s ** 2 for s in mults)), 10, delta)
        else:
            want = rdp_epsilon(q, mults, 10, delta)
        assert got == pytest.approx([want] * 2, rel=1e-9)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_calibration_under_poisson_meets_the_target(tiny_synthetic):
    """--dp_target_epsilon under Poisson + PLD: the applied z's epsilon is within 1% below
    the target, for FedAvg and for private Delta-FL (which needs more noise)."""
    N = tiny_synthetic.train.num_clients
    fed = build_experiment(tiny_config(algorithm="fedavg", thetas=(), weighting="unweighted",
                                       client_sampling="poisson", dp_clip=0.5,
                                       dp_target_epsilon=(2.0,), num_rounds=30),
                           tiny_synthetic)
    dfl = build_experiment(private_deltafl(dp_target_epsilon=(2.0,), num_rounds=30),
                           tiny_synthetic)
    for exp in (fed, dfl):
        e = float(exp.accounting.epsilons(30)[0])
        assert 0.99 * 2.0 < e <= 2.0
    assert dfl.accounting.noise[0] > fed.accounting.noise[0]
    z = fed.accounting.noise[0]
    assert float(fed.accounting.epsilons(30)[0]) == pytest.approx(
        pld_epsilon(6 / N, z, 30, N ** -1.1), rel=1e-9)


# ------------------------------------------------------------------------------ adaptive clip

def adaptive_config(**kw):
    base = dict(algorithm="fedavg", thetas=(), weighting="unweighted", seeds=(1, 2),
                clients_per_round=6, dp_clip="adaptive", dp_clip_init=0.02,
                dp_clip_quantile=0.5, dp_clip_lr=0.3, learning_rate=0.2)
    base.update(kw)
    return tiny_config(**base)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_the_adaptive_clip_follows_the_geometric_step(tiny_synthetic):
    """z = 0: C_{t+1} = C_t exp(-eta_C (b_t / m - gamma)) with b_t the trained clients whose
    update was not clipped (m - dp_clipped), computed here in NumPy from the run's counts;
    the clip starts below every update and grows."""
    exp = build_experiment(adaptive_config(), tiny_synthetic)
    state, hist = run_rounds(exp, 4)
    clip = np.full(2, 0.02, np.float64)
    for h in hist:
        np.testing.assert_allclose(h["dp_clip_norm"], clip, rtol=1e-5)
        unclipped = 6 - np.asarray(h["dp_clipped"], np.float64)
        clip = clip * np.exp(-0.3 * (unclipped / 6 - 0.5))
    np.testing.assert_allclose(np.asarray(state.dp["clip"]), clip, rtol=1e-5)
    assert np.all(clip > 0.02)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_the_adaptive_clip_under_poisson_noises_its_count(tiny_synthetic):
    """The count's noise has std r z (chi-square over 4000 keys), and the run's epsilon
    composes it with the update (add-or-remove multipliers z and r z) under both
    samplers."""
    keys = jax.random.split(jax.random.key(4), 4000)
    p = privacy.Privacy(clip="adaptive", clip_init=1.0, clip_count_noise=3.0, clip_lr=0.2)
    _, frac = jax.vmap(lambda k: privacy.adaptive_clip(jnp.float32(1.0), jnp.int32(5), k,
                                                       jnp.float32(1.5), p, 10.0))(keys)
    noise = (np.asarray(frac, np.float64) * 10.0 - 5.0)
    stat = float(np.sum(noise ** 2) / (3.0 * 1.5) ** 2)
    assert stats.chi2.ppf(0.0005, 4000) < stat < stats.chi2.ppf(0.9995, 4000)
    N = tiny_synthetic.train.num_clients
    z = applied(1.5)
    exp = build_experiment(adaptive_config(client_sampling="poisson", dp_noise_multiplier=(1.5,),
                                           dp_clip_count_noise=3.0), tiny_synthetic)
    want = pld_epsilon(6 / N, 1 / math.sqrt(1 / z ** 2 + 1 / (3 * z) ** 2), 7, N ** -1.1)
    assert exp.accounting.epsilons(7) == pytest.approx([want] * 2, rel=1e-9)
    fixed = build_experiment(adaptive_config(dp_noise_multiplier=(1.5,),
                                             dp_clip_count_noise=3.0), tiny_synthetic)
    inner = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z / 2),
                                           dp_accounting.GaussianDpEvent(3 * z)])
    acc = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.SampledWithoutReplacementDpEvent(N, 6, inner), 7)
    assert fixed.accounting.epsilons(7) == pytest.approx([acc.get_epsilon(N ** -1.1)] * 2,
                                                         rel=1e-9)
    _, hist = run_rounds(exp, 2)
    assert "cohort_size" in hist[0] and "dp_clip_norm" in hist[0]


# ------------------------------------------------------------------------------ refusals

BASE = ["--dataset=synthetic", "--synthetic_num_clients=20", "--synthetic_max_examples=60",
        "--clients_per_round=4"]


@pytest.mark.parametrize("flags,needle", [
    (["--algorithm=scaffold", "--thetas=1", "--client_sampling=poisson"],
     "--algorithm=scaffold needs a fixed cohort"),
    (["--algorithm=fedavg", "--weighting=unweighted", "--dp_clip=1", "--dp_accountant=pld"],
     "--dp_accountant=pld needs --client_sampling=poisson"),
    (["--algorithm=fedavg", "--weighting=unweighted", "--dp_clip=big"],
     "--dp_clip must be a number C > 0 or 'adaptive'"),
    (["--algorithm=fedavg", "--weighting=unweighted", "--dp_clip=1", "--dp_clip_quantile=0.3"],
     "--dp_clip_quantile needs --dp_clip=adaptive"),
    (["--algorithm=fedavg", "--weighting=unweighted", "--dp_clip=1", "--dp_clip_init=0.3"],
     "--dp_clip_init needs --dp_clip=adaptive"),
    (["--algorithm=fedavg", "--weighting=unweighted", "--dp_clip=adaptive",
      "--dp_clip_quantile=1.5"], "--dp_clip_quantile must lie in (0, 1)"),
    (["--algorithm=deltafl", "--weighting=unweighted", "--quantile=secagg_mm",
      "--dp_clip=adaptive"], "needs a fixed denominator"),
    (["--dp_accountant=rdp"], "--dp_accountant needs --dp_clip"),
    (["--client_sampling=sometimes"], "--client_sampling"),
])
def test_bad_sampling_flags_exit_2_with_one_line(tmp_path, capsys, flags, needle):
    out = tmp_path / "o"
    code, err, _ = run_runner([*BASE, f"--output_dir={out}", *flags], capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not out.exists()


# ------------------------------------------------------------------------------ DP-FTRL

def test_cyclic_groups_take_part_every_g_rounds():
    """N = 23, m = 5: G = 4 disjoint groups of 5 (3 clients never take part); each client's
    rounds are exactly G apart."""
    N, m, T = 23, 5, 16
    seen = {}
    for t in range(T):
        cohort = plan.cyclic_cohort(9, t, N, m)
        assert cohort.size == m and len(set(cohort)) == m
        for k in cohort:
            seen.setdefault(int(k), []).append(t)
    assert len(seen) == 20
    for rounds_ in seen.values():
        assert np.all(np.diff(rounds_) == 4) and len(rounds_) == 4


def dense_toeplitz(coef, n):
    C = np.zeros((n, n))
    for j, c in enumerate(coef):
        C += c * np.eye(n, k=-j)
    return C


def test_bandmf_noise_is_c_inverse_of_gaussians():
    """T rounds of privacy.bandmf_privatize: the noise added each round, W = C^-1 Z, solved
    here with NumPy from the dense banded Toeplitz C, with Z the independent draws (the
    same keys with one band: W = Z)."""
    from deltafl_jax.algorithms.fedavg import private_fedavg
    from deltafl_jax.algorithms import ClientFeedback
    private = private_fedavg("unweighted")
    coef, T, m, d, clip, z, scale = (0.8, 0.5, 0.3), 9, 4, 7, 0.5, 1.3, 1.7
    fb = ClientFeedback(losses=jnp.zeros(m), sizes=jnp.ones(m, jnp.int32),
                        weights=jnp.full(m, 1 / m), delta_sum={"w": jnp.zeros((d,))},
                        weight_sum=jnp.float32(1.0), job_sqnorm=jnp.zeros(m),
                        job_finite=jnp.ones(m, bool), job_trained=jnp.ones(m, bool),
                        learning_rate=jnp.float32(0.1), clients=jnp.arange(m))
    history = {"w": jnp.zeros((2, d))}
    W, Z = [], []
    for t in range(T):
        key = jax.random.fold_in(jax.random.key(3), t)
        out, history = privacy.bandmf_privatize(private, clip, m, coef, scale, fb, None, key,
                                                jnp.float32(z), history)
        W.append(np.asarray(out.delta_sum["w"], np.float64))
        fresh, _ = privacy.bandmf_privatize(private, clip, m, (1.0,), scale, fb, None, key,
                                            jnp.float32(z), fb.delta_sum)
        Z.append(np.asarray(fresh.delta_sum["w"], np.float64))
        assert float(out.weight_sum) == 1.0
    want = np.linalg.solve(dense_toeplitz(coef, T), np.stack(Z))
    np.testing.assert_allclose(np.stack(W), want, rtol=1e-4, atol=1e-6)
    sigma = z * clip / m * scale                      # Z's std: z C a_max s_T
    stat = float(np.sum(np.stack(Z) ** 2) / sigma ** 2)
    assert stats.chi2.ppf(0.0005, T * d) < stat < stats.chi2.ppf(0.9995, T * d)


def brute_sensitivity(coef, groups, T, t=None):
    """max over the cyclic groups of ||sum of C's columns at the group's rounds < t||, C the
    dense T x T banded Toeplitz (NumPy)."""
    t = T if t is None else t
    C = dense_toeplitz(coef, T)[:t, :t]
    return max(np.linalg.norm(C[:, g::groups].sum(axis=1)) for g in range(groups))


@pytest.mark.parametrize("mechanism,bands", [("bandmf", 3), ("bandmf", None),
                                             ("gaussian", None)])
@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_dp_ftrl_epsilon_is_one_gaussian_over_the_factorisation(tiny_synthetic, mechanism,
                                                                  bands):
    """N = 12, m = 3: G = 4 groups; epsilon after t of T = 10 rounds is dp-accounting's (PLD,
    add-or-remove) for one Gaussian mechanism of multiplier z s_T / s_t, with the
    sensitivities s brute-forced here from the dense strategy matrix."""
    kw = dict(algorithm="fedavg", thetas=(), weighting="unweighted", clients_per_round=3,
              client_sampling="cyclic", dp_clip=0.5, dp_noise_multiplier=(2.0,),
              num_rounds=10, dp_mechanism=mechanism)
    if bands:
        kw["dp_bands"] = bands
    exp = build_experiment(tiny_config(**kw), tiny_synthetic)
    coef = exp.accounting.correlated.coef
    assert len(coef) == {("bandmf", 3): 3, ("bandmf", None): 4, ("gaussian", None): 1}[
        (mechanism, bands)]
    assert math.sqrt(sum(c * c for c in coef)) == pytest.approx(1.0, rel=1e-6)
    N, z = tiny_synthetic.train.num_clients, applied(2.0)
    s_T = brute_sensitivity(coef, 4, 10)
    for t in (4, 10):
        acc = PLDAccountant(neighboring_relation=ADD_OR_REMOVE)
        acc.compose(dp_accounting.GaussianDpEvent(z * s_T / brute_sensitivity(coef, 4, 10, t)))
        assert float(exp.accounting.epsilons(t)[0]) == pytest.approx(
            acc.get_epsilon(N ** -1.1), rel=1e-9)
    state, hist = run_rounds(exp, 3)
    if len(coef) > 1:
        assert jax.tree.leaves(state.dp["noise"])[0].shape[1] == len(coef) - 1


@pytest.mark.parametrize("flags,needle", [
    (["--algorithm=fedavg", "--weighting=unweighted", "--dp_clip=1", "--dp_mechanism=bandmf"],
     "--dp_mechanism=bandmf needs --client_sampling=cyclic"),
    (["--algorithm=fedavg", "--weighting=unweighted", "--dp_clip=1", "--dp_bands=3",
      "--client_sampling=cyclic"], "--dp_bands needs --dp_mechanism=bandmf"),
    (["--algorithm=deltafl", "--weighting=unweighted", "--quantile=secagg_mm", "--dp_clip=1",
      "--client_sampling=cyclic"], "releases more than its update"),
    (["--algorithm=fedavg", "--weighting=unweighted", "--dp_clip=adaptive",
      "--client_sampling=cyclic"], "not cyclic"),
])
def test_bad_dp_ftrl_flags_exit_2_with_one_line(tmp_path, capsys, flags, needle):
    out = tmp_path / "o"
    code, err, _ = run_runner([*BASE, f"--output_dir={out}", *flags], capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not out.exists()
