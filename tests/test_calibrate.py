"""The calibration's fitting rules, on synthetic timings (no clock involved)."""

import pytest

from tree_attention_edu import calibrate, costmodel


def test_fit_link_recovers_hockney_parameters():
    alpha, beta = 150e-6, 2e9
    sizes = calibrate.message_sizes([2**20, 2**23])
    link = calibrate.fit_link([(n, alpha + n / beta) for n in sizes])
    # Small messages carry n/β too (≤ 16 KB / 2 GB/s = 8 us): α is read to within that.
    assert link.alpha_s == pytest.approx(alpha, rel=0.06)
    assert link.beta_Bps == pytest.approx(beta, rel=0.01)


def test_message_sizes_span_the_transfers():
    sizes = calibrate.message_sizes([3_000_000, 40_000_000])
    assert sizes[:3] == (1024, 4096, calibrate.SMALL_MESSAGE)
    big = sizes[3:]
    assert min(big) <= 1_500_000 and max(big) >= 80_000_000 - 4
    assert list(big) == sorted(big)


def test_fit_link_needs_both_regimes():
    with pytest.raises(ValueError, match="needs messages both"):
        calibrate.fit_link([(1024, 1e-4), (2048, 1e-4)])


def test_predict_uses_the_problem():
    topo = costmodel.Topology(1, 8, costmodel.Link(1e-4, 1e9), costmodel.Link(1e-4, 1e9),
                              mem_Bps=1e9, flops=float("inf"), overlap=False)
    from tree_attention_edu.benchmark import Problem

    prob = Problem(seq_len=8192, q_heads=4, kv_heads=4, head_dim=32)
    tree = calibrate.predict("tree", 8192, topo, prob)
    assert tree.compute_s == pytest.approx(1024 * 4 * 64 * 4 / 1e9)
    ring = calibrate.predict("ring", 8192, topo, prob)
    assert ring.compute_s == pytest.approx(8 * tree.compute_s)
