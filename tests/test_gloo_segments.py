"""gloo's ring all-reduce skips the segments of its buffer that hold no bytes: the cost
model's count of them (`costmodel.gloo_segments`), its price of such a ring
(`costmodel.gloo_ring_time`), and the cluster's fit of the part of a call that such a ring
pays whole (`cluster.levels.fit_few`)."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import sympy

from tree_attention_edu.perf import costmodel as cm

GLOO = cm.Topology(
    nodes=2,
    devices_per_node=4,
    intra=cm.Link(1e-3, 400e6, call_s=0.6e-3),
    inter=cm.Link(2e-3, 100e6, call_s=0.5e-3),
    mem_Bps=1e9,
    flops=float("inf"),
    overlap=False,
    ring_only=True,
    uplinks=1,
)


def _held_as_gloo_computes_it(nbytes: int, p: int, itemsize: int = 4) -> int:
    """The segments of `nbytes` over `p` ranks that gloo's ring sends, from its own
    offsets (`gloo/allreduce.cc`, `ring()`, below the maximum segment size): 2p segments
    of `roundUp(ceil(n / 2p), itemsize)` bytes; segment i is sent where
    `min(segmentBytes, n − i·segmentBytes) > 0`."""
    segments = 2 * p
    seg_bytes = math.ceil(math.ceil(nbytes / segments) / itemsize) * itemsize
    return sum(min(seg_bytes, nbytes - i * seg_bytes) > 0 for i in range(segments))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_gloo_segments_follow_gloo_s_offsets(p):
    """Every operand size from 1 to 5p elements: the count matches gloo's offsets, an
    operand of at least 2p elements fills all but the last few segments' rounding, and
    fewer than 2p elements hold one segment each (`one_pass`'s flag: one)."""
    for elements in range(1, 5 * p + 1):
        held, total = cm.gloo_segments(4 * elements, p)
        assert total == 2 * p
        assert held == _held_as_gloo_computes_it(4 * elements, p), elements
        if elements <= 2 * p:
            assert held == elements
    assert cm.gloo_segments(0, p) == (0, 2 * p)
    # 9 elements over 8 segments: segments of 2 elements, five of them holding bytes
    assert cm.gloo_segments(36, 4) == (5, 8)
    assert cm.gloo_segments(2048, p) == (2 * p, 2 * p)


def test_a_ring_of_few_elements_pays_its_call_and_the_share_of_its_steps_that_send():
    """`gloo_ring_time` in closed form: c + (2(p−1)α − c)·h/2p + 2(p−1)/p·n/β, c capped at
    2(p−1)α; a full operand, or a link without `call_s`, costs `ring_allreduce_time`."""
    link, p = cm.Link(1e-3, 400e6, call_s=0.6e-3), 4
    steps = 2 * 3 * 1e-3
    for nbytes, held in ((4, 1), (8, 2), (32, 8), (2048, 8)):
        want = 0.6e-3 + (steps - 0.6e-3) * held / 8 + 2 * 3 / 4 * nbytes / 400e6
        assert cm.gloo_ring_time(nbytes, p, link) == pytest.approx(want, rel=1e-12)
    full = cm.ring_allreduce_time(2048, p, link)
    assert cm.gloo_ring_time(2048, p, link) == pytest.approx(full, rel=1e-12)
    assert cm.gloo_ring_time(4, p, cm.Link(1e-3, 400e6)) == cm.ring_allreduce_time(
        4, p, cm.Link(1e-3, 400e6)
    )
    # a call above the whole ring's α (noise in its fit) prices a few elements as a full ring
    big = cm.Link(1e-3, 400e6, call_s=1.0)
    assert cm.gloo_ring_time(4, p, big) == pytest.approx(cm.ring_allreduce_time(4, p, big))
    assert cm.gloo_ring_time(4, 1, link) == 0.0
    assert cm.gloo_ring_time(0, p, link) == 0.0  # no element: gloo returns before its ring
    with pytest.raises(ValueError, match="call_s"):
        cm.Link(1e-3, 400e6, call_s=-1e-3)
    alpha = sympy.Symbol("alpha", positive=True)
    symbolic = cm.Link(alpha, 400e6)
    assert cm.gloo_ring_time(4, p, symbolic) == cm.ring_allreduce_time(4, p, symbolic)
    with pytest.raises(TypeError, match="gloo_ring_time"):
        cm.gloo_ring_time(4, p, cm.Link(alpha, 400e6, call_s=1e-3))


def test_gloo_topologies_price_each_level_s_ring_by_its_held_segments():
    """A `ring_only` topology runs each level's ring through `gloo_ring_time`: the one-element
    flag of `one_pass` over a 4-device level holds 1 of 8 segments, over the 2 nodes 1 of
    4 (on the node's shared uplink, which keeps `call_s`); the 8-element denominator fills
    both. `with_devices` keeps `call_s` for the same layout only."""
    shared = cm.Link(2e-3, 100e6 / 4, call_s=0.5e-3)
    assert GLOO.shared_inter == shared
    for nbytes in (4, 32, 2048):
        want = cm.gloo_ring_time(nbytes, 4, GLOO.intra) + cm.gloo_ring_time(nbytes, 2, shared)
        assert cm.hierarchical_allreduce_time(nbytes, GLOO) == pytest.approx(want, rel=1e-12)
    flag = cm.hierarchical_allreduce_time(4, GLOO)
    assert flag == pytest.approx(
        0.6e-3 + 5.4e-3 / 8 + 1.5 * 4 / 400e6 + 0.5e-3 + 3.5e-3 / 4 + 4 / 25e6,
        rel=1e-12,
    )
    older = dataclasses.replace(
        GLOO, intra=cm.Link(1e-3, 400e6), inter=cm.Link(2e-3, 100e6)
    )  # no call_s: every step at α
    assert cm.hierarchical_allreduce_time(32, older) == pytest.approx(
        cm.hierarchical_allreduce_time(32, GLOO), rel=1e-12
    )  # 8 elements fill both levels' segments
    assert cm.hierarchical_allreduce_time(4, older) > 2 * flag
    # call_s stays with a ring of its measured size only
    assert GLOO.with_devices(8) == GLOO
    assert GLOO.with_devices(4).intra.call_s == 0.6e-3  # one node of 4: the same "gpu" ring
    assert GLOO.with_devices(4).inter.call_s is None
    assert GLOO.with_devices(16).intra.call_s == 0.6e-3  # four nodes of 4
    assert GLOO.with_devices(16).inter.call_s is None
    assert GLOO.with_devices(2).intra.call_s is None
    # The flat ring over all 8 devices: the flag holds 1 of 16 segments
    ring = dataclasses.replace(GLOO, flat_ring=cm.Link(3e-3, 50e6, call_s=1e-3))
    want = 1e-3 + (2 * 7 * 3e-3 - 1e-3) / 16 + 2 * 7 / 8 * 4 / 50e6
    assert cm.collective_time("all-reduce", 4, ring) == pytest.approx(want, rel=1e-12)


def test_one_pass_and_the_2_level_tree_part_on_gloo_by_their_small_operands():
    """Both merges run six rings over two levels; `one_pass`'s flag is one element where
    the tree's maxima are 8, so with `call_s` the model prices `one_pass` cheaper by the
    flag's empty segments; without it (before) they differ only by the maxima's 28 bytes
    more than the flag's."""
    prob = dict(batch=1, q_heads=8, head_dim=64, itemsize=4, stat_itemsize=4)
    tree, fast = (cm.predict_merge(m, 8192, GLOO, **prob) for m in ("allreduce", "one_pass"))
    saved = sum(
        cm.gloo_ring_time(32, g, link) - cm.gloo_ring_time(4, g, link)
        for g, link in ((4, GLOO.intra), (2, GLOO.shared_inter))
    )
    assert tree.comm_s - fast.comm_s == pytest.approx(saved, rel=1e-9)
    assert saved > 4e-3
    older = dataclasses.replace(GLOO, intra=cm.Link(1e-3, 400e6), inter=cm.Link(2e-3, 100e6))
    with pytest.raises(ValueError, match="stat_itemsize"):
        cm.predict_merge("one_pass", 8192, GLOO, **(prob | dict(stat_itemsize=8)))
    tree, fast = (cm.predict_merge(m, 8192, older, **prob) for m in ("allreduce", "one_pass"))
    # the maxima's 28 more bytes, on both levels' rings
    assert tree.comm_s - fast.comm_s == pytest.approx(28 * (1.5 / 400e6 + 1 / 25e6), rel=1e-9)


def test_the_cluster_fits_call_s_from_an_all_reduce_of_two_elements():
    """`levels.fit_few`: times built from c and α by the model's rule give c back, on each
    ring of a 2×2×2 cluster (2 of 4 segments held over "node", 2 of 8 over "gpu", 2 of
    16 over all 8 devices); clamped at 0 and at 2(g−1)α; None on a one-device level.
    `pooled` keeps each process's rounds in order."""
    from tree_attention_edu.cluster import levels

    ctx = SimpleNamespace(
        two=SimpleNamespace(shape={"node": 2, "gpu": 4}), flat=SimpleNamespace(size=8)
    )
    overhead, alpha, call = 3e-4, 0.7e-3, 0.9e-3
    for axis, g in (("node", 2), ("gpu", 4), ("flat", 8)):
        share = 2 / (2 * g)
        steps = 2 * (g - 1) * alpha
        # skewed about the model's time (mean 0, median −1e-4): the mean is read
        rounds = [overhead + call + (steps - call) * share + j for j in (-1e-4, -1e-4, 2e-4)]
        times = {f"few {axis} {levels.FEW_BYTES}": rounds}
        assert levels.fit_few(ctx, axis, times, overhead, alpha) == pytest.approx(call)
        assert levels.fit_few(ctx, axis, {}, overhead, alpha) is None  # a record from before
        low = {k: [overhead + steps * share / 2] * 3 for k in times}
        assert levels.fit_few(ctx, axis, low, overhead, alpha) == 0.0
        high = {k: [overhead + 2 * steps] * 3 for k in times}
        assert levels.fit_few(ctx, axis, high, overhead, alpha) == pytest.approx(steps)
    one = SimpleNamespace(two=SimpleNamespace(shape={"node": 2, "gpu": 1}), flat=ctx.flat)
    assert levels.fit_few(one, "gpu", {}, overhead, alpha) is None
    everyone = {"a": [[1.0, 2.0], [3.0, 4.0]], "b": [[5.0, 6.0], [7.0, 8.0]]}
    assert levels.pooled(everyone) == {"a": [1.0, 2.0, 3.0, 4.0], "b": [5.0, 6.0, 7.0, 8.0]}


def test_the_cluster_s_links_carry_call_s_fitted_at_the_lone_alpha():
    """`levels.fit_links` on every call a run times (synthetic, in closed form): each ring's
    `call_s` from its few call at that ring's lone α, the flat ring's too, though the flat
    ring is then priced at the chain's step; `methods.topologies` hands each to its link
    (the flat tree's ring included), and a record without them prices as before."""
    from tree_attention_edu.cluster import levels, methods
    from tree_attention_edu.perf import calibrate

    ctx = SimpleNamespace(
        two=SimpleNamespace(shape={"node": 2, "gpu": 4}, size=8),
        flat=SimpleNamespace(size=8),
        say=lambda *_: None,
    )
    overhead, lone, chained, call = 2e-4, 0.9e-3, 0.6e-3, 0.8e-3
    alpha = {"node": 1.5e-3, "gpu": 0.7e-3, "flat": lone}
    times: dict[str, list[float]] = {}
    for n in levels.LEVEL_SIZES:
        times[f"noop {n}"] = [overhead] * 3
    for axis, g in (("node", 2), ("gpu", 4), ("flat", 8)):
        for n in levels.sizes(ctx, axis):
            wire = n * 1e-9 if n > calibrate.SMALL_MESSAGE else 0.0  # β from the large only
            times[f"{axis} {n}"] = [overhead + 2 * (g - 1) * alpha[axis] + wire] * 3
        steps = 2 * (g - 1) * alpha[axis]
        times[f"few {axis} {levels.FEW_BYTES}"] = [
            overhead + call + (steps - call) * 2 / (2 * g)
        ] * 3
    for n in levels.sizes(ctx, "flat"):
        if n <= calibrate.SMALL_MESSAGE:
            lone_t = times[f"flat {n}"][0]
            times[f"chain {n}"] = [lone_t + (levels.CHAIN - 1) * 14 * chained] * 3
    for name in levels.KINDS:
        for n in levels.kind_sizes(8):
            times[f"{name} {n}"] = [overhead + 1e-3 + n * 1e-8] * 3
    links = levels.fit_links(ctx, times, 1e9)
    assert links["flat"]["alpha_s"] == pytest.approx(chained)  # the chain's step, priced
    for key in ("inter", "intra", "flat"):
        assert links[key]["call_s"] == pytest.approx(call, rel=1e-6)
    s = SimpleNamespace(nodes=2, processes_per_node=2, devices_per_process=2, devices=8)
    local = {"mem_Bps": 1e9, "sync_s": 0.0, "copy_Bps": 1e9}
    two, flat = methods.topologies(SimpleNamespace(s=s), links, local)
    assert two.intra.call_s == links["intra"]["call_s"]
    assert two.inter.call_s == links["inter"]["call_s"]
    assert two.flat_ring.call_s == flat.intra.call_s == links["flat"]["call_s"]
    older = {
        k: {f: v for f, v in links[k].items() if f != "call_s"} for k in ("inter", "intra", "flat")
    }
    two_old, flat_old = methods.topologies(SimpleNamespace(s=s), links | older, local)
    assert two_old.intra.call_s is None and flat_old.intra.call_s is None
    flag = cm.hierarchical_allreduce_time(4, two)
    assert flag < cm.hierarchical_allreduce_time(4, two_old)
    assert cm.hierarchical_allreduce_time(2048, two) == cm.hierarchical_allreduce_time(
        2048, two_old
    )
