"""Host data: the npz format, Synthetic(alpha, beta), the client limits, and round plans."""

import numpy as np
import pytest

from deltafl_jax import ClientData, DataConfig, DataError, load_dataset
from deltafl_jax.datasets.synthetic import synthetic_clients
from deltafl_jax.sampling.plan import (LocalWork, capacities, client_permutations,
                                       make_round_plan, make_split_plan, sample_clients)


def test_npz_groups_examples_by_client_id(tmp_path):
    rng = np.random.default_rng(0)
    client = np.array([7, 3, 7, 3, 3, 9, 7])       # interleaved, unsorted ids
    x = rng.normal(size=(7, 2)).astype(np.float32)
    y = np.array([0, 1, 2, 0, 1, 2, 0])
    path = tmp_path / "d.npz"
    np.savez(path, train_x=x, train_y=y, train_client=client, test_x=x[:3], test_y=y[:3],
             test_client=np.array([1, 1, 2]), x_scale=np.float32(0.5))
    data = load_dataset(DataConfig("npz", data_path=str(path)))
    assert list(data.train.client_ids) == [3, 7, 9]
    for k, cid in enumerate([3, 7, 9]):
        xk, yk = data.train.client(k)
        np.testing.assert_array_equal(xk, x[client == cid])   # order kept within a client
        np.testing.assert_array_equal(yk, y[client == cid])
    assert data.num_classes == 3 and data.x_scale == 0.5
    assert list(data.test.sizes) == [2, 1]


def test_npz_without_labels_for_mean_estimation(tmp_path):
    path = tmp_path / "m.npz"
    np.savez(path, train_x=np.ones((4, 2), np.float32), train_client=np.array([0, 0, 1, 1]),
             test_x=np.zeros((2, 2), np.float32), test_client=np.array([5, 6]))
    data = load_dataset(DataConfig("npz", data_path=str(path)))
    assert data.train.y is None and data.num_classes == 0
    path2 = tmp_path / "half.npz"
    np.savez(path2, train_x=np.ones((4, 2)), train_client=np.arange(4), train_y=np.zeros(4, int),
             test_x=np.ones((2, 2)), test_client=np.arange(2))
    with pytest.raises(DataError, match="both train_y and test_y"):
        load_dataset(DataConfig("npz", data_path=str(path2)))


def test_synthetic_is_seeded_and_half_train_half_test():
    a = load_dataset(DataConfig("synthetic", synthetic_num_clients=30, data_seed=4))
    b = load_dataset(DataConfig("synthetic", synthetic_num_clients=30, data_seed=4))
    c = load_dataset(DataConfig("synthetic", synthetic_num_clients=30, data_seed=5))
    np.testing.assert_array_equal(a.train.x, b.train.x)
    assert a.train.x.shape != c.train.x.shape or not np.array_equal(a.train.x, c.train.x)
    assert a.train.num_clients == 15 and a.test.num_clients == 15
    assert a.feature_shape == (60,) and a.num_classes == 10
    sizes = np.concatenate([a.train.sizes, a.test.sizes])
    assert sizes.min() >= 50 and sizes.max() <= 1000


def test_synthetic_power_law_sizes_and_feature_covariance():
    data = synthetic_clients(0.0, 0.0, 400, seed=0, max_examples=10 ** 6)
    sizes = data.sizes
    # lognormal(4, 2) + 50: median e^4 + 50 ~ 104.6, heavy right tail.
    assert 90 < np.median(sizes) < 120
    assert np.percentile(sizes, 99) > 10 * np.median(sizes)
    # Within a client, x ~ N(v_k, diag(j^-1.2)): per-feature variance j^-1.2.
    big = int(np.argmax(sizes))
    xk, _ = data.client(big)
    j = np.arange(1, 61)
    np.testing.assert_allclose(xk.var(axis=0), j ** -1.2, rtol=0.25)


def test_synthetic_labels_follow_a_softmax_model_per_client():
    # With a shared labelling model (rho near 1) one linear classifier fits every client.
    data = synthetic_clients(0.0, 1.0, 20, seed=1, max_examples=300, shared=0.999)
    x, y = data.x.astype(np.float64), data.y
    onehot = np.eye(10)[y]
    # Least-squares scores are a crude fit; argmax agreement far above chance (10%).
    A = np.c_[x, np.ones(len(x))]
    coef, *_ = np.linalg.lstsq(A, onehot, rcond=None)
    assert np.mean((A @ coef).argmax(1) == y) > 0.6
    with pytest.raises(DataError, match="synthetic_shared"):
        synthetic_clients(1, 1, 10, seed=0, shared=1.0)


def test_client_limits():
    cfg = DataConfig("synthetic", synthetic_num_clients=40, max_examples_per_client=60,
                     max_train_clients=7, max_test_clients=5)
    data = load_dataset(cfg)
    full = load_dataset(DataConfig("synthetic", synthetic_num_clients=40))
    assert data.train.num_clients == 7 and data.test.num_clients == 5
    assert data.train.sizes.max() <= 60
    k = 0
    cid = data.train.client_ids[k]
    kf = list(full.train.client_ids).index(cid)
    np.testing.assert_array_equal(data.train.client(k)[0], full.train.client(kf)[0][:60])
    with pytest.raises(DataError, match="max_train_clients"):
        load_dataset(DataConfig("synthetic", max_train_clients=0))


def test_sampling_is_a_pure_function_of_seed_and_round_without_replacement():
    s = sample_clients(3, 10, 50, 20)
    assert len(set(s.tolist())) == 20 and s.min() >= 0 and s.max() < 50
    np.testing.assert_array_equal(s, sample_clients(3, 10, 50, 20))
    assert not np.array_equal(s, sample_clients(3, 11, 50, 20))
    assert not np.array_equal(s, sample_clients(4, 10, 50, 20))
    # Uniform: over many rounds each client is drawn m/N of the time.
    counts = np.bincount(np.concatenate([sample_clients(0, t, 10, 3) for t in range(3000)]),
                         minlength=10)
    np.testing.assert_allclose(counts / 3000, 0.3, atol=0.03)
    p = client_permutations(1, 2, 5, 7, 3)
    assert p.size == 21 and all(sorted(p[i * 7:(i + 1) * 7]) == list(range(7)) for i in range(3))


def test_round_plan_streams():
    sizes = np.array([5, 9, 3, 12, 7, 4])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    work = LocalWork(batch_size=4, local_epochs=2)
    caps = capacities(sizes, 3, work, eval_chunk=8)
    assert caps.eval_len == 32 and caps.eval_len >= 12 + 9 + 7
    for t in range(20):
        plan = make_round_plan([1, 2], t, offsets, 3, work, caps)
        for g, seed in enumerate([1, 2]):
            chosen = sample_clients(seed, t, 6, 3)
            np.testing.assert_array_equal(plan.clients[g], chosen)
            n = sizes[chosen]
            L = int(plan.eval_len[g])
            assert L == n.sum()
            expect = np.concatenate([np.arange(offsets[k], offsets[k + 1]) for k in chosen])
            np.testing.assert_array_equal(plan.eval_idx[g, :L], expect)
            np.testing.assert_array_equal(plan.eval_seg[g, :L], np.repeat(np.arange(3), n))
            assert np.all(plan.eval_seg[g, L:] == 3)
            for i, k in enumerate(chosen):
                start = plan.train_start[g, i]
                for e in range(2):
                    rows = plan.train_idx[g, start + e * n[i]:start + (e + 1) * n[i]]
                    assert sorted(rows) == list(range(offsets[k], offsets[k + 1]))
                assert plan.steps[g, i] == 2 * -(-n[i] // 4)
    split = make_split_plan(offsets, eval_chunk=8)
    assert split.eval_idx.shape[1] % 8 == 0
    np.testing.assert_array_equal(split.eval_seg[0, :40], np.repeat(np.arange(6), sizes))


def test_client_data_validation():
    with pytest.raises(DataError, match="has no examples"):
        ClientData(x=np.zeros((3, 1)), y=None, offsets=np.array([0, 3, 3]),
                   client_ids=np.array([0, 1]))
    with pytest.raises(DataError, match="offsets must run"):
        ClientData(x=np.zeros((3, 1)), y=None, offsets=np.array([0, 2]),
                   client_ids=np.array([0]))
