"""The calibration's fitting rules, on synthetic timings (no clock involved)."""

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tree_attention_edu.core import merges
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
    sizes = calibrate.pattern_payloads(prob, 8, [8192, 32768])
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


# --- the fixed part of a kernel call, and the model check's bookkeeping ----------------------


def test_fit_local_recovers_slope_and_intercept():
    """Times on the line `overhead + fixed + bytes / bw` give back bw and fixed exactly."""
    from tree_attention_edu.perf import microbench

    bw, fixed, overhead = 2.5e9, 300e-6, 100e-6
    sizes = (2**20, 2**24)
    times = tuple(overhead + fixed + n / bw for n in sizes)
    mem, got = microbench.fit_local(sizes, times, overhead)
    assert mem == pytest.approx(bw, rel=1e-12) and got == pytest.approx(fixed, rel=1e-9)
    # Noise that makes the longer shard no slower: no slope, so no fixed part is claimed.
    mem, got = microbench.fit_local(sizes, (2e-3, 1.9e-3), overhead)
    assert got == 0.0 and mem == pytest.approx(2**24 / (1.9e-3 - overhead))
    with pytest.raises(ValueError, match="`shard_bytes` must increase"):
        microbench.fit_local((2**24, 2**20), times, overhead)


def test_kernel_fixed_part_is_paid_once_by_a_tree_and_per_block_by_rings():
    """Closed forms: with `kernel_fixed_s = c`, a merge pattern's compute grows by c, the
    pass-KV ring's by p·c (one kernel call per block) and the pass-Q ring's by p·c."""
    from dataclasses import replace

    from tree_attention_edu.perf import links, predict

    link = links.Link(100e-6, 1e9)
    base = links.Topology(1, 8, link, link, mem_Bps=2e9, flops=float("inf"))
    c = 250e-6
    fixed = replace(base, kernel_fixed_s=c)
    shape = dict(batch=1, q_heads=8, kv_heads=8, head_dim=64, itemsize=4)
    for m in MERGE_NAMES:
        a, b = (predict.predict_merge(m, 4096, t, **shape) for t in (base, fixed))
        assert b.compute_s - a.compute_s == pytest.approx(c, rel=1e-12), m
        assert (b.comm_s, b.merge_s) == (a.comm_s, a.merge_s), m
    for fn in (predict.predict_ring, predict.predict_pass_q_ring):
        a, b = (fn(4096, t, **shape) for t in (base, fixed))
        assert b.compute_s - a.compute_s == pytest.approx(8 * c, rel=1e-12), fn.__name__
    with pytest.raises(ValueError, match="kernel_fixed_s"):
        replace(base, kernel_fixed_s=-1.0)


def test_regret_pairs_the_rounds():
    """A slow spell that falls on some rounds of one pattern and not of another (it began
    between them) moves their medians apart; the ratios in the same round do not move.
    Closed form: picked is 1/1.1 of all_to_all in 4 of 5 rounds, so it is not slower, where
    the medians (3.0 against 1.1) would say +173%. Against a pattern 4% faster in every
    round, the regret is 4%."""
    from tree_attention_edu.perf import modelcheck

    among = ("allgather", "all_to_all")
    rounds = {"allgather": [1.0, 1.0, 3.0, 3.0, 3.0], "all_to_all": [1.1, 1.1, 1.1, 3.3, 3.3]}
    assert modelcheck.regret(rounds, "allgather", among) == ("allgather", 0.0)
    assert modelcheck.regret(rounds, "all_to_all", among) == ("allgather", pytest.approx(0.1))
    faster = {"allgather": [1.04, 2.08, 1.04], "all_to_all": [1.0, 2.0, 1.0]}
    assert modelcheck.regret(faster, "allgather", among) == ("all_to_all", pytest.approx(0.04))
    for bad, match in (
        ({"allgather": [1.0]}, "lacks"),
        ({"allgather": [1.0, 2.0], "all_to_all": [1.0]}, "same number"),
        ({"allgather": [], "all_to_all": []}, "at least one"),
    ):
        with pytest.raises(ValueError, match=match):
            modelcheck.regret(bad, "allgather", among)
    with pytest.raises(ValueError, match="`picked`"):
        modelcheck.regret(rounds, "allreduce", among)


def test_interleaved_times_draw_each_rounds_order_from_a_fixed_seed():
    """Every call once per round (an untimed call, then the timed one), in an order drawn
    afresh each round: a call does not follow the same neighbour in every round, as under a
    rotation, and a second run draws the same orders."""
    log: list[str] = []
    calls = {n: (lambda n=n: log.append(n), ()) for n in "abcd"}

    def orders():
        log.clear()
        times = benchmark.interleaved_times(calls, repeats=12)
        assert all(len(t) == 12 for t in times.values())
        timed = log[1::2]
        assert log[::2] == timed  # each timed call right after its own untimed one
        return [timed[i : i + 4] for i in range(0, 48, 4)]

    first = orders()
    assert all(sorted(r) == list("abcd") for r in first)
    before_b = {r[r.index("b") - 1] for r in first if r.index("b")}
    assert len(before_b) >= 2  # a rotation of abcd puts "a" before "b" in every such round
    assert orders() == first


def test_interleaved_times_run_the_warmup_rounds_first_and_keep_none_of_them(monkeypatch):
    """`warmup` rounds go first, each like a timed round (an untimed call, then the timed
    one, in its own drawn order); only the `repeats` rounds after them are kept, in the
    orders that follow the warm-up's draws. A call slow only in the warm-up leaves no trace
    (on a clock that each call moves: 1 s, or 100 s for the warm-up's timed call)."""
    log: list[str] = []
    now = [0.0]
    monkeypatch.setattr(benchmark, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def call(n: str) -> None:
        now[0] += 100.0 if log.count(n) == 1 else 1.0  # the 2nd call: the warm-up's timed one
        log.append(n)

    calls = {n: (lambda n=n: call(n), ()) for n in "abc"}
    times = benchmark.interleaved_times(calls, repeats=3, warmup=1)
    assert times == {n: [1.0, 1.0, 1.0] for n in "abc"}
    assert len(log) == 2 * 3 * 4 and log[::2] == log[1::2]
    rng = random.Random(0)  # the same seed and draws as `interleaved_times`
    drawn = [rng.sample(list("abc"), 3) for _ in range(4)]
    assert [log[1::2][i : i + 3] for i in range(0, 12, 3)] == drawn
    for bad, err in ((-1, ValueError), (True, TypeError), (1.0, TypeError)):
        with pytest.raises(err, match="`warmup`"):
            benchmark.interleaved_times(calls, repeats=3, warmup=bad)


def test_model_check_run_takes_the_regret_from_autos_own_rounds(monkeypatch):
    """`run`'s wiring, with the calibration, the cells and the clock replaced: `auto`'s rows
    come from `AUTO_REPEATS`-style rounds of the four patterns (`benchmark.pattern_calls`'
    names), at every length for the cells' problem and at the shortest for each of
    `auto_problems`, each regret the paired one (`regret`) and each median recorded. A slow
    spell on some rounds leaves the regret alone."""
    from tree_attention_edu.perf import links, modelcheck

    link = links.Link(1e-4, 1e9)
    topo = links.Topology(1, 8, link, link, mem_Bps=1e9, flops=float("inf"))
    cal = calibrate.Calibration(1e-4, link, link, 1e9, topo, {})
    monkeypatch.setattr(calibrate, "pattern_calibration", lambda *a, **k: cal)
    monkeypatch.setattr(calibrate, "validate_patterns", lambda *a, **k: (cal, []))
    monkeypatch.setattr(modelcheck, "pick", lambda topology, problem, n: "allgather")
    factor = {"allreduce": 1.2, "allgather": 1.05, "reduce_scatter": 1.1, "all_to_all": 1.0}
    spell = [1.0, 1.0, 1.6, 1.6, 1.0]  # rounds 2 and 3 slow for every pattern
    seen = []

    def rounds(calls, repeats):
        seen.append((sorted(calls), repeats))
        return {
            k: [1e-3 * factor[k.split("@")[0]] * s * int(k.split("@")[1]) for s in spell]
            for k in calls
        }

    monkeypatch.setattr(benchmark, "interleaved_times", rounds)
    prob = benchmark.Problem(seq_len=64, q_heads=8, kv_heads=8, head_dim=16)
    extra = replace(prob, batch=2)
    report = modelcheck.run(
        ["8"], [128, 64], problem=prob, auto_problems=(extra,), repeats=1, auto_repeats=5
    )
    autos = merges.AUTO_MERGES
    assert seen == [
        (sorted(f"{m}@{n}" for m in autos for n in (128, 64)), 5),
        (sorted(f"{m}@64" for m in autos), 5),
    ]
    assert [(a.seq_len, a.batch) for a in report.auto] == [(64, 1), (128, 1), (64, 2)]
    for a in report.auto:
        assert (a.picked, a.best) == ("allgather", "all_to_all")
        assert a.regret == pytest.approx(0.05, rel=1e-9)
        assert a.medians_s["allgather"] == pytest.approx(1.05e-3 * a.seq_len)


def test_model_check_regret_and_failures():
    from tree_attention_edu.perf import modelcheck

    measured = {
        "allreduce": [2.0],
        "allgather": [1.0],
        "reduce_scatter": [1.05],
        "all_to_all": [3.0],
    }
    assert modelcheck.regret(measured, "reduce_scatter") == ("allgather", pytest.approx(0.05))
    assert modelcheck.regret(measured, "allgather") == ("allgather", 0.0)
    cells = [
        modelcheck.Cell("ring", "8", 4096, 1.3, 1.0, 0.3),
        modelcheck.Cell("allreduce", "2x4", 65536, 0.5, 1.0, -0.5),
        modelcheck.Cell("one_pass", "8", 4096, 1.0, float("nan"), float("nan")),
    ]
    auto = [
        modelcheck.AutoRow("8", 4096, 1, 8, 8, "allreduce", "allreduce", 0.0),
        modelcheck.AutoRow("8", 4096, 8, 32, 8, "allgather", "allreduce", 0.25),
    ]
    report = modelcheck.Report(cells, auto, {})
    # +30% is on the band's edge (in); -50% and an unmeasured cell are out; regret 25% is out.
    assert [f.split(":")[0] for f in report.failures] == [
        "allreduce on 2x4 at Tk=65536",
        "one_pass on 8 at Tk=4096",
        "auto on 8 at Tk=4096, batch 8, heads 32/8",
    ]
    js = report.as_json()
    assert set(js) >= {"cells", "auto", "failures"}
    assert set(js["cells"][0]) == {
        "method",
        "mesh",
        "seq_len",
        "predicted_s",
        "measured_s",
        "rel_err",
    }
    assert set(js["auto"][0]) == {
        "mesh",
        "seq_len",
        "batch",
        "q_heads",
        "kv_heads",
        "picked",
        "best",
        "regret",
        "medians_s",
    }


@pytest.mark.parametrize("bad", ["", "2x", "x4", "2x2x2", "0", "-8", "8.0"])
def test_mesh_names_are_checked(bad):
    from tree_attention_edu.perf import modelcheck

    with pytest.raises(ValueError, match="`mesh` must be"):
        modelcheck.parse_mesh(bad)


def test_a_time_within_the_overhead_gives_no_absurd_rate():
    """A copy timed no slower than a bare call (a notebook 9 run printed 4,194,304 GB/s from
    a 1 ns floor): its rate is over the whole time, a lower bound, and flagged unresolved."""
    from tree_attention_edu.perf import microbench

    prob = benchmark.Problem(seq_len=4096, q_heads=8, kv_heads=8, head_dim=64)
    shard = prob.kv_bytes / 4
    overhead = 1e-3
    for copy_s in (overhead, 0.99 * overhead, 1.05 * overhead):  # at, below, within noise
        assert microbench.work_time(copy_s, overhead) == (copy_s, False)
        mem, copy = calibrate.local_rates(prob, 4, 5e-3, copy_s, overhead)
        assert copy == pytest.approx(shard / copy_s) and copy < 1e11  # not PB/s
        assert mem == pytest.approx(shard / 4e-3)  # the kernel's time is resolved
    assert microbench.work_time(3e-3, overhead) == (pytest.approx(2e-3), True)
    assert microbench.work_time(1e-6) == (1e-6, True)  # no overhead: the time itself
    # fit_local's fallback (no slope) uses the same rule.
    mem, fixed = microbench.fit_local((2**20, 2**24), (2e-3, 1.9e-3), 1.9e-3)
    assert fixed == 0.0 and mem == pytest.approx(2**24 / 1.9e-3)


def test_a_link_with_points_reads_its_curve():
    """Closed forms: between two measured sizes the time is the straight line through them;
    below the smallest, the smallest's time; above the largest, its time plus the rest at β.
    Without points, Hockney's α + n/β. A bug that read the nearest point, or fell back to
    α + n/β inside the range, gives other numbers."""
    from tree_attention_edu.perf import links

    curve = ((1000.0, 1e-4), (3000.0, 5e-4), (7000.0, 6e-4))
    link = links.Link(50e-6, 1e7, points=curve)
    assert link.send(2000) == pytest.approx(3e-4, rel=1e-12)  # halfway: (1e-4 + 5e-4) / 2
    assert link.send(6000) == pytest.approx(5e-4 + 0.75 * 1e-4, rel=1e-12)
    assert link.send(3000) == pytest.approx(5e-4, rel=1e-12)  # on a point: its time
    assert link.send(10) == 1e-4 and link.send(0) == 1e-4
    assert link.send(9000) == pytest.approx(6e-4 + 2000 / 1e7, rel=1e-12)
    assert links.Link(50e-6, 1e7).send(2000) == pytest.approx(50e-6 + 2000 / 1e7, rel=1e-12)
    # The curve changes nothing the step formulas read.
    assert links.ring_allreduce_time(8000, 4, link) == links.ring_allreduce_time(
        8000, 4, links.Link(50e-6, 1e7)
    )


@pytest.mark.parametrize(
    ("points", "error", "match"),
    [
        (((1000.0, 1e-4),), TypeError, "at least two"),
        ([(1000.0, 1e-4), (2000.0, 2e-4)], TypeError, "a tuple"),
        (((2000.0, 1e-4), (1000.0, 2e-4)), ValueError, "sizes must increase"),
        (((1000.0, 1e-4), (1000.0, 2e-4)), ValueError, "sizes must increase"),
        (((1000.0, -1e-4), (2000.0, 2e-4)), ValueError, r"points\[0\]\[1\]"),
        (((1000.0, 1e-4), (2000.0,)), TypeError, r"points\[1\]"),
    ],
)
def test_a_link_refuses_a_bad_curve(points, error, match):
    from tree_attention_edu.perf import links

    with pytest.raises(error, match=match):
        links.Link(1e-4, 1e9, points=points)


def test_a_curve_is_read_at_numbers_only():
    import sympy

    from tree_attention_edu.perf import links

    link = links.Link(1e-4, 1e9, points=((1000.0, 1e-4), (2000.0, 2e-4)))
    with pytest.raises(TypeError, match=r"`nbytes` is a sympy"):
        link.send(sympy.Symbol("n"))


def test_fit_link_keeps_one_time_per_size_when_asked():
    """The curve is α at `SMALL_MESSAGE` (the median of the small sizes, not one size's
    time), then the larger sizes in order, a size timed twice kept at its median; α and β
    are the same as without the curve."""
    pts = [(2**20, 4e-4), (1024, 1e-4), (16384, 1.2e-4), (2**20, 2e-4), (2**20, 3e-4)]
    plain, kept = calibrate.fit_link(pts), calibrate.fit_link(pts, keep_points=True)
    assert plain.points == () and (kept.alpha_s, kept.beta_Bps) == (plain.alpha_s, plain.beta_Bps)
    assert kept.points == ((16384, pytest.approx(1.1e-4)), (2**20, 3e-4))
    assert kept.send(100) == kept.send(16384) == pytest.approx(1.1e-4)  # every small one: α
    with pytest.raises(TypeError, match="keep_points"):
        calibrate.fit_link(pts, keep_points=1)


def test_rings_fold_off_the_measured_in_loop_curve():
    """Closed forms with `fold_points`: the pass-KV ring's p folds are read off the curve at a
    block's K+V bytes (a block just received), the pass-Q ring's p steps cost the curve's
    time at no bytes plus the window's bytes at `mem_Bps` (a window of a shard read from
    memory); a merge pattern's one kernel call is not a fold and is priced as before."""
    from dataclasses import replace

    from tree_attention_edu.perf import links, predict

    link = links.Link(100e-6, 1e9)
    base = links.Topology(1, 8, link, link, mem_Bps=2e9, flops=float("inf"), overlap=False)
    # Block of 4096/8 keys, 8 heads, 64 + 64 dims, float32: 2,097,152 bytes.
    curve = ((2048.0, 30e-6), (1_000_000.0, 400e-6), (3_000_000.0, 1e-3))
    folded = replace(base, fold_points=curve)
    shape = dict(batch=1, q_heads=8, kv_heads=8, head_dim=64, itemsize=4)
    block = 2_097_152
    on_curve = 400e-6 + (block - 1_000_000) / 2_000_000 * 600e-6
    assert predict.fold_time(1, 512, 8, 64, 64, 8, folded, 4) == pytest.approx(on_curve)
    assert predict.fold_time(1, 512, 8, 64, 64, 8, base, 4) == pytest.approx(block / 2e9)
    ring = predict.predict_ring(4096, folded, **shape)
    assert ring.compute_s == pytest.approx(8 * on_curve, rel=1e-12)
    assert ring.comm_s == predict.predict_ring(4096, base, **shape).comm_s
    # Pass-Q: each step reads one kv head of the block, 2,097,152 / 8 bytes, from memory.
    window = block // 8
    step = predict.fold_time(1, 512, 1, 64, 64, 1, folded, 4, resident=False)
    assert step == pytest.approx(30e-6 + window / 2e9, rel=1e-12)
    pass_q = predict.predict_pass_q_ring(4096, folded, **shape)
    assert pass_q.compute_s == pytest.approx(8 * step, rel=1e-12)
    for m in MERGE_NAMES:
        assert predict.predict_merge(m, 4096, folded, **shape) == predict.predict_merge(
            m, 4096, base, **shape
        )
    # With a window curve (measured with the step's query-block permute), the pass-Q ring's
    # steps are read off it and its p - 1 permutes are not priced again.
    windowed = replace(folded, window_points=((0.0, 10e-6), (500_000.0, 110e-6)))
    step = 10e-6 + 100e-6 * (window / 500_000)
    assert predict.fold_time(1, 512, 1, 64, 64, 1, windowed, 4, resident=False) == pytest.approx(
        step, rel=1e-12
    )
    w = predict.predict_pass_q_ring(4096, windowed, **shape)
    assert w.compute_s == pytest.approx(8 * step, rel=1e-12)
    after = predict.collectives_time(
        predict.pass_q_collectives(
            batch=1, q_len=1, q_heads=8, kv_heads=8, head_dim=64, v_dim=64, p=8, itemsize=4,
            stat_itemsize=4,
        )[1:],
        windowed,
    )  # fmt: skip
    assert w.comm_s == pytest.approx(after, rel=1e-12) and pass_q.comm_s > after
    # Past the largest block: its time plus the rest at mem_Bps.
    big = predict.fold_time(1, 4096, 8, 64, 64, 8, folded, 4)
    assert big == pytest.approx(1e-3 + (8 * block - 3_000_000) / 2e9, rel=1e-12)
    with pytest.raises(ValueError, match="fold_points"):
        replace(base, fold_points=((2.0, 1.0), (1.0, 2.0)))
    # A window curve alone would drop the permutes and price steps as kernel calls.
    with pytest.raises(ValueError, match="`window_points` without `fold_points`"):
        replace(base, window_points=((0.0, 1e-5), (1e5, 2e-5)))
    # Curves measured with 8 devices sharing the host say nothing about 4.
    four = windowed.with_devices(4)
    assert (four.fold_points, four.window_points) == ((), ())
    assert windowed.with_devices(8) == windowed
    assert predict.predict_pass_q_ring(4096, four, **shape) == predict.predict_pass_q_ring(
        4096, base.with_devices(4), **shape
    )
    with pytest.raises(TypeError, match="resident"):
        predict.fold_time(1, 512, 8, 64, 64, 8, folded, 4, resident="yes")


def test_fold_problems_are_a_tiny_block_and_three_quarters_of_each_length():
    prob = benchmark.Problem(seq_len=4096, q_heads=8, kv_heads=8, head_dim=64)
    got = calibrate.fold_problems(prob, 8, (4096, 16384, 65536))
    assert [p.seq_len for p in got] == [64, 3072, 12288, 49152]
    assert all(p.q_heads == 8 and p.head_dim == 64 for p in got)
    # Lengths that round to the same multiple of p are timed once.
    assert [p.seq_len for p in calibrate.fold_problems(prob, 8, (4096, 4100))] == [64, 3072]
    # A predicted length is never a calibration length: 3/4 of 4096 is predicted here.
    assert [p.seq_len for p in calibrate.fold_problems(prob, 8, (3072, 4096))] == [64, 2304]
    # Fewer than two lengths left, or one device: no curve (the folds are kernel calls).
    assert calibrate.fold_problems(prob, 8, (88,)) == []  # 3/4 of 88 rounds to 64
    assert calibrate.fold_problems(prob, 1, (4096,)) == []
    with pytest.raises(ValueError, match="`p`"):
        calibrate.fold_problems(prob, 0, (4096,))
    with pytest.raises(TypeError, match="`problem`"):
        calibrate.fold_problems("4096", 8, (4096,))
    with pytest.raises(TypeError, match="`seq_lens`"):
        calibrate.fold_problems(prob, 8, "4096")


def test_fold_problems_are_checked_before_anything_is_timed(mesh8):
    from dataclasses import replace

    from tree_attention_edu.perf import microbench

    prob = benchmark.Problem(seq_len=4096, q_heads=8, kv_heads=8, head_dim=64)
    for bad, error, match in (
        ([prob], ValueError, "at least two shards"),
        ([prob, prob], ValueError, "at least two shards"),
        ([prob, replace(prob, seq_len=4100)], ValueError, r"`problems\[1\].seq_len` = 4100"),
        (prob, TypeError, "sequence of benchmark.Problem"),
        ([prob, "x"], TypeError, r"`problems\[1\]`"),
    ):
        with pytest.raises(error, match=match):
            microbench.check_fold_problems(bad, 8)
        with pytest.raises(error, match=match):  # raised at once: no collective is timed
            calibrate.measure_topology(mesh8, fold_problems=bad, sizes=())


def test_fold_loop_times_one_fold_per_shard_on_every_device(mesh8):
    """On the 8 simulated devices: one (shard bytes, seconds) pair per problem, the shard a
    device's K+V bytes; the time is a difference of two loops, never negative."""
    from tree_attention_edu.core.devices import make_mesh
    from tree_attention_edu.perf import microbench

    probs = [benchmark.Problem(seq_len=n, q_heads=2, kv_heads=2, head_dim=16) for n in (64, 256)]
    got = microbench.fold_loop_times(mesh8, probs, repeats=1)
    assert [n for n, _ in got] == [p.kv_bytes // 8 for p in probs]
    assert all(t >= 0.0 for _, t in got)
    # A window is ceil(2/8) = 1 of the 2 kv heads: half a shard.
    got = microbench.fold_loop_times(mesh8, probs, repeats=1, windows=True)
    assert [n for n, _ in got] == [p.kv_bytes // 16 for p in probs]
    with pytest.raises(ValueError, match="at least 2 devices"):
        microbench.fold_loop_times(make_mesh(1, "x"), probs, repeats=1)


@pytest.mark.parametrize("windows", [False, True])
def test_a_fold_loop_keeps_its_permute_in_both_programs(mesh8, windows):
    """With windows, the one-step program keeps its collective-permute too (the block it
    receives is an output, so the permute is not dead code): else the difference of the
    two programs would charge each step a permute and a half. Without windows, no program
    has one. (Each step scales the queries by its index, so no fold can be hoisted.)"""
    from tree_attention_edu.perf import microbench

    prob = benchmark.Problem(seq_len=64, q_heads=2, kv_heads=2, head_dim=16)
    _, args = microbench.local_calls(mesh8, prob)["kernel"]
    for steps in (1, 8):
        hlo = microbench._fold_loop(mesh8, steps, 2, windows).lower(*args).compile().as_text()
        assert ("collective-permute" in hlo) == windows, steps


def test_a_chain_latency_is_the_slope_in_the_number_of_collectives():
    """Closed form: `(chain_s − one_s)/(chain − 1)`, and 0 when the longer program was not
    slower (noise must not give a negative latency)."""
    from tree_attention_edu.perf import microbench

    assert microbench.chain_latency(1e-3, 4e-3, chain=4) == pytest.approx(1e-3, rel=1e-12)
    assert microbench.chain_latency(2e-4, 5e-4, chain=2) == pytest.approx(3e-4, rel=1e-12)
    assert microbench.chain_latency(5e-4, 4e-4, chain=4) == 0.0


@pytest.mark.parametrize("mesh_name", ["mesh8", "mesh2x4"])
@pytest.mark.parametrize("kind", ["psum", "all_gather", "psum_scatter", "all_to_all"])
def test_a_chain_runs_one_collective_per_step(request, mesh_name, kind):
    """Each chain program compiles to exactly `count` collectives of its kind (XLA folded
    none into another and reused none), and computes them: on ones, each step of a sum
    multiplies by p = 8 (the scattered share tiled back), an all-gather of a 1/p slice and
    an all-to-all by 1, and every step by its scale 1.0001."""
    import numpy as np

    from tree_attention_edu.perf import microbench
    from tree_attention_edu.perf.introspect import collective_stats

    mesh8 = request.getfixturevalue(mesh_name)  # both meshes the check calibrates
    hlo_kind = microbench.COLLECTIVE_KIND[kind]
    x = microbench.sharded_ones(mesh8, 4 * 8 * 4)  # 32 words per device
    factor = 8.0 if kind in ("psum", "psum_scatter") else 1.0
    for count in (1, microbench.CHAIN):
        fn = microbench._chain_program(mesh8, kind, count)
        kinds = [c.kind for c in collective_stats(fn, x).collectives]
        assert kinds == [hlo_kind] * count, (count, kinds)
        np.testing.assert_allclose(np.asarray(fn(x)), (factor * 1.0001) ** count, rtol=1e-6)


def test_collective_chain_times_times_every_program_in_one_call(mesh8):
    """A no-op's time, and each kind's one- and chain-collective programs' times, all
    positive; bad arguments are named before anything is timed."""
    from tree_attention_edu.perf import microbench

    noop, chains = microbench.collective_chain_times(mesh8, kinds=("psum",), repeats=1)
    assert noop > 0 and list(chains) == ["psum"]
    assert all(t > 0 for t in chains["psum"]) and len(chains["psum"]) == 2
    with pytest.raises(ValueError, match="kinds"):
        microbench.collective_chain_times(mesh8, kinds=("broadcast",), repeats=1)
    with pytest.raises(ValueError, match="chain"):
        microbench.collective_chain_times(mesh8, chain=1, repeats=1)
    with pytest.raises(ValueError, match="nbytes"):
        microbench.collective_chain_times(mesh8, nbytes=0, repeats=1)


@pytest.mark.parametrize("heads", [8, 6])  # 6: p = 8 does not divide the heads
def test_operands_apart_prices_each_operand_of_an_all_reduce_as_one_collective(heads):
    """Closed forms, with a measured all-reduce link (α, β): the allreduce merge's sum of
    numerator and denominator costs one α more when its operands run apart (the bytes are the
    same), one_pass's sum of three operands two α more; the other patterns hold no
    multi-operand all-reduce and are priced the same. `ring_only` implies it."""
    from dataclasses import replace

    from tree_attention_edu.perf import links, predict

    alpha = 150e-6
    link = links.Link(alpha, 1e9)
    base = links.Topology(
        1, 8, link, link, mem_Bps=2e9, flops=float("inf"), measured=(("all-reduce", link),)
    )
    apart = replace(base, operands_apart=True)
    shape = dict(batch=1, q_heads=heads, kv_heads=heads, head_dim=64, itemsize=4)
    extra = {"allreduce": alpha, "one_pass": 2 * alpha}
    for m in MERGE_NAMES:
        a, b = (predict.predict_merge(m, 4096, t, **shape) for t in (base, apart))
        assert b.comm_s - a.comm_s == pytest.approx(extra.get(m, 0.0), rel=1e-9, abs=1e-15), m
        assert (b.compute_s, b.merge_s) == (a.compute_s, a.merge_s), m
    with pytest.raises(TypeError, match="operands_apart"):
        replace(base, operands_apart=1)


def _local_seconds(kernel, folds, p, *, overhead, bw, fixed, copy_bw, fold_s, window_s):
    """Synthetic medians of `localfit.local_round_calls`' programs: the kernel on the line
    `overhead + fixed + shard / bw`, the copy at `copy_bw`, and the i-th fold loop taking
    `a + steps · fold_s[i]` (`window_s[i]` with windows)."""
    shard = [k.kv_bytes / p for k in kernel]
    first = 2 - len(kernel)  # "kernel0" is the shorter of two; one problem is "kernel1"
    out = {f"local kernel{first + i}": overhead + fixed + b / bw for i, b in enumerate(shard)}
    out["local copy1"] = overhead + shard[-1] / copy_bw
    for tag, per in (("fold", fold_s), ("window", window_s)):
        for i in range(len(folds)):
            out[f"local {tag} {i} x1"] = 1e-3 + per[i]
            out[f"local {tag} {i} xp"] = 1e-3 + p * per[i]
    return out


def _curved_topology(mem_Bps, curve):
    """8 devices on one node, links of 100 µs and 1 GB/s, 100 µs per call, and `curve` as
    both fold curves: the topology the local refit tests start from."""
    from tree_attention_edu.perf import links

    link = links.Link(1e-4, 1e9)
    return links.Topology(
        1,
        8,
        link,
        link,
        mem_Bps=mem_Bps,
        flops=float("inf"),
        overhead_s=1e-4,
        fold_points=curve,
        window_points=curve,
    )


def test_refit_local_fits_the_rounds_times_as_measure_topology_does():
    """Closed forms, no clock: the kernel's two times on a line give back its rate and
    fixed part, the copy its rate, each fold loop pair `(t_p − t_1)/(p − 1)`; names that are
    not the local programs' are ignored, and every other field of the topology is kept. With
    one kernel problem, no fixed part; without folds, the curves are left as they were."""
    from tree_attention_edu.perf import localfit

    prob = benchmark.Problem(seq_len=4096, q_heads=8, kv_heads=8, head_dim=64)
    lens = (4096, 16384, 65536)
    kernel = localfit.kernel_problems(prob, 8, lens)
    folds = tuple(localfit.fold_problems(prob, 8, lens))
    assert [k.seq_len for k in kernel] == [3072, 49152]
    old_curve = ((1e3, 1e-5), (1e6, 1e-3))
    topo = _curved_topology(1.0, old_curve)
    fold_s, window_s = (2e-5, 7e-4, 4e-3, 2e-2), (1e-5, 2e-4, 9e-4, 3e-3)
    seconds = _local_seconds(
        kernel,
        folds,
        8,
        overhead=1e-4,
        bw=1.1e9,
        fixed=4e-4,
        copy_bw=3e9,
        fold_s=fold_s,
        window_s=window_s,
    )
    got = localfit.refit_local(topo, kernel, folds, {**seconds, "allreduce@4096": 1.0})
    assert got.mem_Bps == pytest.approx(1.1e9, rel=1e-9)
    assert got.kernel_fixed_s == pytest.approx(4e-4, rel=1e-6)
    assert got.copy_Bps == pytest.approx(3e9, rel=1e-9)
    shard = [f.kv_bytes // 8 for f in folds]
    assert [n for n, _ in got.fold_points] == shard
    assert [t for _, t in got.fold_points] == pytest.approx(fold_s, rel=1e-9)
    # A window is ceil(8/8) = 1 of the 8 kv heads.
    assert [n for n, _ in got.window_points] == [n // 8 for n in shard]
    assert [t for _, t in got.window_points] == pytest.approx(window_s, rel=1e-9)
    assert (got.overhead_s, got.intra, got.devices) == (topo.overhead_s, topo.intra, 8)
    one = localfit.kernel_problems(prob, 8, (4096,))
    seconds = _local_seconds(
        one, (), 8, overhead=1e-4, bw=1.1e9, fixed=4e-4, copy_bw=3e9, fold_s=(), window_s=()
    )
    got = localfit.refit_local(topo, one, (), seconds)
    assert got.kernel_fixed_s == 0.0 and got.fold_points == old_curve
    assert got.mem_Bps == pytest.approx(one[0].kv_bytes / 8 / (4e-4 + one[0].kv_bytes / 8 / 1.1e9))


def test_ring_pass_calls_name_their_message_and_points_read_them(mesh8):
    """Each program is named by the bytes one message moves (whole keys, at least one: a
    key is 8 heads x 16 x 4 bytes = 512 here) and holds K = V of p times its keys;
    `ring_pass_points` reads only those names, each time over 2(p − 1) = 14 messages."""
    from tree_attention_edu.perf import ringlink

    prob = benchmark.Problem(seq_len=64, q_heads=8, kv_heads=8, head_dim=16)
    calls = ringlink.ring_pass_calls(mesh8, prob, [100, 1024, 5000])
    assert list(calls) == ["ring pass 512", "ring pass 1024", "ring pass 4608"]
    assert [c[1][0].shape for c in calls.values()] == [(1, 8 * k, 8, 16) for k in (1, 2, 9)]
    times = {"ring pass 1024": 1.4e-3, "ring pass 512": 2.8e-4, "tree": 9.0, "ring": 9.0}
    assert ringlink.ring_pass_points(8, times) == [
        (512, pytest.approx(2e-5)),
        (1024, pytest.approx(1e-4)),
    ]


def test_kernel_problems_are_three_quarters_of_each_end():
    from tree_attention_edu.perf import localfit

    prob = benchmark.Problem(seq_len=4096, q_heads=8, kv_heads=8, head_dim=64)
    assert [k.seq_len for k in localfit.kernel_problems(prob, 8, (65536, 4096, 16384))] == [
        3072,
        49152,
    ]
    assert [k.seq_len for k in localfit.kernel_problems(prob, 8, (4096, 4100))] == [3072]
    assert [k.seq_len for k in localfit.kernel_problems(prob, 8, (8,))] == [8]  # one per device
    with pytest.raises(ValueError, match="`p`"):
        localfit.kernel_problems(prob, 0, (4096,))
    with pytest.raises(TypeError, match="`seq_lens`"):
        localfit.kernel_problems(prob, 8, "4096")


@pytest.mark.parametrize("local", [False, True])
def test_validate_patterns_times_the_local_programs_in_the_cells_rounds(mesh8, monkeypatch, local):
    """With `local`, the kernel, copy and fold programs run in the same rounds as the cells,
    and the cells are predicted with the calibration refitted from them (which is returned);
    without, the calibration given is used as it is. The clock is replaced by synthetic
    times, so this checks the wiring, not a measurement."""
    from tree_attention_edu.perf import localfit

    prob = benchmark.Problem(seq_len=64, q_heads=8, kv_heads=8, head_dim=16)
    lens = [512, 1024]
    kernel = localfit.kernel_problems(prob, 8, lens)
    folds = tuple(localfit.fold_problems(prob, 8, lens))
    topo = _curved_topology(5e8, ((1e3, 1e-5), (1e5, 1e-4)))
    link = topo.intra
    cal = calibrate.Calibration(1e-4, link, link, 5e8, topo, {})
    local_s = _local_seconds(
        kernel,
        folds,
        8,
        overhead=1e-4,
        bw=1.1e9,
        fixed=4e-4,
        copy_bw=3e9,
        fold_s=(1e-5, 2e-5, 4e-5),
        window_s=(1e-5, 1e-5, 2e-5),
    )
    seen = {}
    alpha, beta = 3e-5, 2e9  # the ring-pass programs: 2(p - 1) messages and one overhead

    def fake(calls, repeats=5):
        seen.update(calls)
        sizes = {k: int(k.removeprefix("ring pass ")) for k in calls if k.startswith("ring pass ")}
        # Latency alone up to SMALL_MESSAGE, then α + n/β: fit_link's closed form.
        per = {
            k: alpha + (n / beta if n > calibrate.SMALL_MESSAGE else 0) for k, n in sizes.items()
        }
        ring = {k: 14 * t + 1e-4 for k, t in per.items()}
        return {name: ring.get(name, local_s.get(name, 2e-3)) for name in calls}

    monkeypatch.setattr(benchmark, "median_times", fake)
    got, rows = calibrate.validate_patterns(
        mesh8, lens, problem=prob, methods=("allreduce", "ring"), calibration=cal, local=local
    )
    local_names = {n for n in seen if n.startswith("local ")}
    assert local_names == (set(local_s) if local else set())
    ring_names = {n for n in seen if n.startswith("ring pass ")}
    sizes = calibrate.pattern_message_sizes(prob, 8, lens)
    assert len(ring_names) == (len(sizes) if local else 0)
    assert {n for n in seen if not n.startswith(("local ", "ring pass "))} == {
        f"{m}@{n}" for m in ("allreduce", "ring") for n in lens
    }
    if local:
        assert got.mem_Bps == got.topology.mem_Bps == pytest.approx(1.1e9, rel=1e-9)
        assert len(got.topology.fold_points) == len(folds)
        # The ring's link refitted from its programs' rounds, less the overhead's share.
        assert got.ppermute.alpha_s == pytest.approx(alpha, rel=1e-9)
        assert got.ppermute.beta_Bps == pytest.approx(beta, rel=1e-9)
        assert got.topology.intra == got.topology.inter == got.ppermute
        assert got.links["collective-permute"] == got.ppermute
    else:
        assert got is cal
    for r in rows:
        n = r["seq_len"]
        want = calibrate.predict(r["name"], n, got.topology, replace(prob, seq_len=n))
        assert r["predicted_s"] == want.total_s and r["median_s"] == 2e-3


def test_links_take_alpha_from_the_chain_and_the_overhead_from_its_no_op(mesh8, monkeypatch):
    """`measure_topology`'s assembly, the clock replaced by synthetic times: the overhead is
    the chains' no-op, each kind's α its chain slope (the point at `SMALL_MESSAGE`), each
    larger point its time less the overhead but never under α, the chains are recorded
    beside the sizes, and the topology prices an all-reduce's operands apart."""
    from tree_attention_edu.perf import microbench

    noop, one, four = 100e-6, 260e-6, 740e-6  # slope (740 - 260) / 3 = 160 µs
    monkeypatch.setattr(
        calibrate,
        "collective_chain_times",
        lambda mesh, kinds, chain, repeats: (noop, {k: (one, four) for k in kinds}),
    )
    big = {2**20: noop + 1e-3, 2**17: noop + 50e-6}  # the second under α: floored to α
    monkeypatch.setattr(
        calibrate,
        "collective_times",
        lambda mesh, sizes, repeats, kinds: {
            "noop": [(n, noop) for n in sizes],
            **{k: [(n, big[n]) for n in sizes] for k in kinds},
        },
    )
    monkeypatch.setattr(
        calibrate,
        "ring_pass_times",
        lambda mesh, prob, sizes, repeats: [(n, 1e-4 + n / 1e9) for n in sizes],
    )
    monkeypatch.setattr(calibrate, "measure_local", lambda *a, **k: (1e9, 3e9))
    cal = calibrate.measure_topology(
        mesh8, sizes=(1024, 2**17, 2**20), repeats=1, kinds=tuple(microbench.COLLECTIVE_FNS)
    )
    assert cal.overhead_s == noop and cal.topology.operands_apart
    alpha = (four - one) / 3
    for kind, link in cal.links.items():
        if kind == "collective-permute":
            continue
        assert link.alpha_s == pytest.approx(alpha, rel=1e-12), kind
        assert link.points == (
            (microbench.SMALL_MESSAGE, pytest.approx(alpha)),
            (2**17, pytest.approx(alpha)),
            (2**20, pytest.approx(1e-3)),
        ), kind
    assert cal.collective_points["psum chain"] == [(1, one), (microbench.CHAIN, four)]
    from tree_attention_edu.perf import modelcheck

    recorded = modelcheck.Report([], [], {"8": cal}).as_json()["calibrations"]["8"]
    assert recorded["chains"]["psum chain"] == [(1, one), (microbench.CHAIN, four)]


def _mesh8():
    from tree_attention_edu.core.devices import make_mesh

    return make_mesh(8, "x")


def _bad_local_inputs():
    """(call, error, match) for the new public local-calibration functions."""
    from tree_attention_edu.perf import links, localfit, microbench, ringlink

    prob = benchmark.Problem(seq_len=64, q_heads=8, kv_heads=8, head_dim=16)
    two = (replace(prob, seq_len=768), replace(prob, seq_len=3072))
    link = links.Link(1e-4, 1e9)
    topo4 = links.Topology(1, 4, link, link, mem_Bps=1e9, flops=float("inf"))
    topo8 = links.Topology(1, 8, link, link, mem_Bps=1e9, flops=float("inf"))
    topo2x4 = links.Topology(2, 4, link, link, mem_Bps=1e9, flops=float("inf"))
    return [
        (lambda: microbench.chain_latency(1e-3, 2e-3, chain=1), ValueError, "chain"),
        (lambda: microbench.chain_latency(1e-3, 2e-3, chain=True), TypeError, "chain"),
        (lambda: microbench.chain_latency(float("nan"), 2e-3, chain=4), ValueError, "one_s"),
        (lambda: microbench.chain_latency(1e-3, -2e-3, chain=4), ValueError, "chain_s"),
        (lambda: microbench.collective_chain_times(_mesh8(), kinds="psum"), TypeError, "kinds"),
        (lambda: microbench.collective_chain_times(_mesh8(), chain=65), ValueError, "chain"),
        (lambda: microbench.collective_chain_times("mesh"), TypeError, "mesh"),
        (lambda: microbench.fold_loop_points(two, 1, {}), ValueError, "at least 2 devices"),
        (lambda: microbench.fold_loop_points(two, 8, {}), ValueError, "lacks"),
        (lambda: microbench.fold_loop_points(two, 8, {}, windows="no"), TypeError, "windows"),
        (lambda: microbench.fold_loop_points(two, 8, []), TypeError, "times"),
        (lambda: microbench.fit_local_affine(two[::-1], 8, {}), ValueError, "shorter cache"),
        (lambda: microbench.fit_local_affine(two, 0, {}), ValueError, "devices"),
        (lambda: microbench.fit_local_affine(two[:1], 8, {}), TypeError, "pair"),
        (
            lambda: microbench.fit_local_affine(
                two, 8, {"kernel0": 1e-3, "kernel1": float("inf"), "copy1": 1e-3}
            ),
            ValueError,
            "kernel1",
        ),
        (lambda: localfit.refit_local(topo8, (), (), {}), TypeError, "kernel"),
        (lambda: localfit.refit_local(topo8, two + two[:1], (), {}), TypeError, "kernel"),
        (lambda: localfit.refit_local(topo8, two, (), {}), ValueError, "lacks"),
        (lambda: localfit.refit_local("topo", two, (), {}), TypeError, "topology"),
        (
            lambda: localfit.refit_local(topo4, (replace(prob, seq_len=66),), (), {}),
            ValueError,
            "multiple of the 4 devices",
        ),
        (lambda: localfit.local_round_calls(_mesh8(), two, two[:1]), ValueError, "two shards"),
        (lambda: localfit.kernel_problems(prob, 8, 4096), TypeError, "seq_lens"),
        (lambda: ringlink.refit_ring_link(topo8, []), TypeError, "times"),
        (lambda: ringlink.refit_ring_link(topo8, {"local copy1": 1.0}), ValueError, "ring pass"),
        (lambda: ringlink.refit_ring_link(topo8, {"ring pass 64": -1.0}), ValueError, "64"),
        (lambda: ringlink.refit_ring_link("topo", {}), TypeError, "topology"),
        (lambda: ringlink.refit_ring_link(topo2x4, {"ring pass 64": 1.0}), ValueError, "nodes"),
        (lambda: ringlink.ring_pass_points(0, {}), ValueError, "`p`"),
        (lambda: ringlink.ring_pass_points(8, {"ring pass 1e3": 1.0}), ValueError, "1e3"),
        (lambda: ringlink.ring_pass_points(8, {"ring pass ²": 1.0}), ValueError, "positive int"),
        (lambda: ringlink.ring_pass_points(8, {"ring pass 064": 1.0}), ValueError, "064"),
        (lambda: ringlink.ring_pass_points(8, None), TypeError, "times"),
        (lambda: ringlink.ring_link("ab", 1e-4, 8), TypeError, "points"),
        (lambda: ringlink.ring_link([(1024, 1e-4)], float("nan"), 8), ValueError, "overhead_s"),
        (lambda: ringlink.ring_link([(1024, 1e-4)], 1e-4, 0), ValueError, "`p`"),
        (lambda: ringlink.ring_pass_calls(_mesh8(), prob, [0]), ValueError, r"sizes\[0\]"),
        (lambda: ringlink.ring_pass_calls(_mesh8(), None, [64]), TypeError, "problem"),
        (lambda: ringlink.ring_pass_calls("mesh", prob, [64]), TypeError, "mesh"),
        (lambda: benchmark.pattern_calls(_mesh8(), prob, [64], ["tree"]), ValueError, "methods"),
        (lambda: benchmark.pattern_calls(_mesh8(), None, [64], ["ring"]), TypeError, "base"),
        (lambda: benchmark.pattern_calls(_mesh8(), prob, "64", ["ring"]), TypeError, "seq_lens"),
        (lambda: benchmark.pattern_calls("mesh", prob, [64], ["ring"]), TypeError, "mesh"),
        (lambda: calibrate.pattern_payloads(prob, 8, []), ValueError, "seq_lens"),
        (lambda: calibrate.pattern_payloads({}, 8, [64]), TypeError, "problem"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_local_inputs())))
def test_local_calibration_functions_name_their_bad_arguments(mesh8, index):
    call, error, match = _bad_local_inputs()[index]
    with pytest.raises(error, match=match):
        call()


def test_validate_patterns_refuses_another_meshs_calibration(mesh8):
    from tree_attention_edu.perf import links

    link = links.Link(1e-4, 1e9)
    topo4 = links.Topology(1, 4, link, link, mem_Bps=1e9, flops=float("inf"))
    cal = calibrate.Calibration(1e-4, link, link, 1e9, topo4, {})
    with pytest.raises(ValueError, match="measured on 4 devices"):
        calibrate.validate_patterns(mesh8, [64], calibration=cal)
    with pytest.raises(TypeError, match="calibration"):
        calibrate.validate_patterns(mesh8, [64], calibration="cal")
    with pytest.raises(TypeError, match="repeats"):
        calibrate.validate_patterns(mesh8, [64], calibration=cal, repeats=2.5)


def test_kernel_problems_leave_out_a_predicted_length():
    from tree_attention_edu.perf import localfit

    prob = benchmark.Problem(seq_len=64, q_heads=8, kv_heads=8, head_dim=16)
    # 3/4 of 16384 is 12288, a predicted length: only 3/4 of the shortest is left.
    got = localfit.kernel_problems(prob, 8, (12288, 16384))
    assert [k.seq_len for k in got] == [9216]
