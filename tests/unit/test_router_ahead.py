import numpy as np

from pyspecter.router_ahead import RANK_PROB, Routers, maps, norm_ratio, rank_table


def test_rank_table_sums_to_k_and_follows_the_measured_curve() -> None:
    for E, k in ((128, 8), (32, 4), (16, 2)):
        t = rank_table(E, k)
        assert abs(float(t.sum()) - k) < 1e-4
        assert np.all(np.diff(t) <= 1e-7)  # a lower rank is never more likely
    assert np.isclose(rank_table(32, 4)[0], RANK_PROB[0])


def test_maps_fold_the_norm_ratio_into_the_next_router() -> None:
    rng = np.random.default_rng(0)
    d, E = 8, 4
    G = [rng.standard_normal((E, d)).astype(np.float32) for _ in range(2)]
    n0, n1 = rng.uniform(0.5, 2, d).astype(np.float32), rng.uniform(0.5, 2, d).astype(np.float32)
    r = Routers(G, [None, None], [None, None], 1, 2, ["a", "b"], [n0, n1])
    x_res = rng.standard_normal(d).astype(np.float32)
    W, b = maps(r, 0, 1)
    # layer 0's router input x_res * n0 through the map equals layer 1's router on x_res * n1
    assert np.allclose((x_res * n0) @ W + b, G[1] @ (x_res * n1), atol=1e-5)
    assert np.allclose(norm_ratio(np.array([0.0, 2.0]), np.array([3.0, 1.0])), [1.0, 0.5])
