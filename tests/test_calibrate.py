"""The calibration's fitting rules, on synthetic timings (no clock involved)."""

import pytest

from tree_attention_edu.core.names import MERGE_NAMES
from tree_attention_edu.perf import benchmark, calibrate, costmodel


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


def test_fit_link_ignores_large_messages_no_slower_than_alpha():
    """Noise can time a large message at or under α: it must not set β to n / 1e-12."""
    link = calibrate.fit_link([(1024, 1e-4), (16384, 1e-4), (65536, 5e-5), (2**20, 3e-4)])
    assert link.beta_Bps == 2**20 / (3e-4 - 1e-4)
    unresolved = calibrate.fit_link([(1024, 1e-4), (65536, 5e-5), (2**20, 9e-5)])
    assert unresolved.beta_Bps == float("inf")


def test_fit_link_needs_both_regimes():
    with pytest.raises(ValueError, match="needs messages both"):
        calibrate.fit_link([(1024, 1e-4), (2048, 1e-4)])


def test_predict_uses_the_problem():
    topo = costmodel.Topology(
        1,
        8,
        costmodel.Link(1e-4, 1e9),
        costmodel.Link(1e-4, 1e9),
        mem_Bps=1e9,
        flops=float("inf"),
        overlap=False,
    )
    from tree_attention_edu.perf.benchmark import Problem

    prob = Problem(seq_len=8192, q_heads=4, kv_heads=4, head_dim=32)
    tree = calibrate.predict("tree", 8192, topo, prob)
    assert tree.compute_s == pytest.approx(1024 * 4 * 64 * 4 / 1e9)
    ring = calibrate.predict("ring", 8192, topo, prob)
    assert ring.compute_s == pytest.approx(8 * tree.compute_s)


def _measured_topology():
    ppermute, measured = costmodel.Link(1e-4, 1e9), costmodel.Link(2e-4, 5e8)
    return costmodel.Topology(
        1,
        8,
        ppermute,
        ppermute,
        mem_Bps=1e9,
        flops=float("inf"),
        overhead_s=1e-3,
        overlap=False,
        measured=tuple((k, measured) for k in calibrate.COLLECTIVE_KIND.values()),
    )


def test_predict_covers_every_pattern_and_ring():
    from tree_attention_edu.perf.benchmark import Problem

    topo, prob = _measured_topology(), Problem(seq_len=8192, q_heads=4, kv_heads=4, head_dim=32)
    assert benchmark.PATTERNS == (*MERGE_NAMES, "ring", "ring_pass_q")
    shape = dict(batch=1, q_heads=4, kv_heads=4, head_dim=32, itemsize=4, q_len=1)
    for m in MERGE_NAMES:
        assert calibrate.predict(m, 8192, topo, prob) == costmodel.predict_merge(
            m, 8192, topo, **shape, stat_itemsize=4
        )
    assert calibrate.predict("tree", 8192, topo, prob) == calibrate.predict(
        "allreduce", 8192, topo, prob
    )
    assert calibrate.predict("ring_pass_q", 8192, topo, prob) == costmodel.predict_pass_q_ring(
        8192, topo, **shape
    )
    # A measured collective is priced as measured: one all-gather is alpha + n/beta.
    ag = calibrate.predict("allgather", 8192, topo, prob)
    nbytes = 8 * 4 * 34 * 4
    assert ag.comm_s == pytest.approx(2e-4 + nbytes / 5e8)
    with pytest.raises(ValueError, match="`method` must be one of"):
        calibrate.predict("pass_kv", 8192, topo, prob)


def test_micro_benchmarks_span_the_pattern_messages():
    from tree_attention_edu.perf.benchmark import Problem

    prob = Problem(q_heads=16, kv_heads=16, head_dim=128)
    sizes = calibrate._pattern_payloads(prob, 8, [8192, 32768])
    assert 16 * 130 * 4 * 8 in sizes  # the all-gather of the packed states, received
    assert 4096 * 16 * 128 * 4 in sizes  # the ring's K block at Tk = 32768
    probe = calibrate.message_sizes(sizes)
    assert min(probe) <= calibrate.SMALL_MESSAGE and max(probe) >= max(sizes)  # alpha, beta
    assert set(calibrate.COLLECTIVE_FNS) == set(calibrate.COLLECTIVE_KIND)
    assert set(calibrate.COLLECTIVE_KIND.values()) < set(costmodel.COLLECTIVE_KINDS)


def test_patterns_table():
    cal = calibrate.Calibration(
        1e-3,
        costmodel.Link(1e-4, 1e9),
        costmodel.Link(1e-4, 1e9),
        1e9,
        _measured_topology(),
        {},
        {"all-gather": costmodel.Link(2e-4, 5e8)},
    )
    rows = [
        dict(
            name="allgather", devices=8, seq_len=8192, median_s=0.1, predicted_s=0.12, rel_err=0.2
        ),
        dict(name="ring", devices=8, seq_len=8192, median_s=0.5, predicted_s=0.35, rel_err=-0.3),
    ]
    text = calibrate.patterns_table(cal, rows)
    assert "all-gather alpha 200 us, beta 0.50 GB/s" in text
    assert "worst |rel err| 30% (ring, Tk=8192" in text
