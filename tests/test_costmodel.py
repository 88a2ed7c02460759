"""Closed-form costs against the compiled program and the paper's formulas."""

import dataclasses
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tree_attention_edu as tae
from tree_attention_edu.core.names import MERGE_NAMES
from tree_attention_edu.perf import costmodel as cm


@pytest.mark.parametrize(
    ("n", "p", "b"),
    [(1, 1, 2), (1024, 1, 2), (1024, 8, 2), (1000, 7, 3), (5, 8, 2), (2**20, 128, 2)],
)
def test_reduction_steps(n, p, b):
    # Count sequential binary combines along the deepest path of the tree. A group of b
    # children takes b - 1 binary combines, so the count is (b - 1)·levels at most.
    depth = tae.tree_reduce([0] * min(p, n), b, op=lambda x, y: max(x, y) + 1)
    levels = cm.tree_depth(min(p, n), b)
    assert depth == levels if b == 2 else levels <= depth <= (b - 1) * levels
    assert cm.reduction_steps(n, p, b) == math.ceil(n / min(p, n)) - 1 + levels
    assert cm.reduction_steps(n, 1, b) == n - 1


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("tk", [4096, 12288])
def test_model_bytes_equal_compiled_bytes(p, tk):
    mesh = tae.make_mesh(p, "x")
    B, Tq, Hq, Hkv, D, Dv = 2, 1, 8, 4, 32, 16
    kv = NamedSharding(mesh, P(None, "x"))
    q = jax.ShapeDtypeStruct((B, Tq, Hq, D), jnp.float32, sharding=NamedSharding(mesh, P()))
    k = jax.ShapeDtypeStruct((B, tk, Hkv, D), jnp.float32, sharding=kv)
    v = jax.ShapeDtypeStruct((B, tk, Hkv, Dv), jnp.float32, sharding=kv)
    tree = tae.collective_stats(lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh), q, k, v)
    ring = tae.collective_stats(lambda q, k, v: tae.ring_decode(q, k, v, mesh=mesh), q, k, v)
    assert tree.total_bytes == cm.tree_payload_bytes(B, Tq, Hq, Dv)
    assert ring.by_kind()["collective-permute"] == cm.ring_payload_bytes(B, tk, Hkv, D, Dv, p)
    assert ring.total_bytes == cm.collective_bytes(
        cm.ring_collectives(
            batch=B, kv_len=tk, kv_heads=Hkv, head_dim=D, v_dim=Dv, p=p, q_len=Tq, q_heads=Hq
        )
    )


def test_paper_formulas():
    b, t, n_h, d_h, p = 1, 8192, 16, 128, 8
    d = n_h * d_h
    # Mem_ring - Mem_tree = 2btd - 2bn_h: tree saves the second K/V buffer.
    assert (
        cm.paper_memory_ring(b, t, n_h, d_h) - cm.paper_memory_tree(b, t, n_h, d_h)
        == 2 * b * t * d - 2 * b * n_h
    )
    # The tree payload (elements) is the paper's b·d + 2·b·n_h; the paper's volume multiplies
    # it by the ring-allreduce factor 2(p-1)/p.
    payload = cm.tree_payload_bytes(b, 1, n_h, d_h, itemsize=1)
    assert payload == b * d + 2 * b * n_h
    assert cm.paper_volume_tree(b, n_h, d_h, p) == pytest.approx(2 * (p - 1) / p * payload)
    # Ring: the paper's 2btd·p counts K and V over p steps; the compiled ring sends p-1 steps.
    ring = cm.ring_payload_bytes(b, t * p, n_h, d_h, d_h, p, itemsize=1)
    assert ring == cm.paper_volume_ring(b, t, n_h, d_h, p) * (p - 1) / p


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize(("shape", "axes"), [((8,), ("x",)), ((2, 4), ("node", "gpu"))])
def test_model_bytes_equal_compiled_bytes_meshes(shape, axes, layout):
    """Two-level meshes pay the tree payload once per level; a ragged Tk (4100 keys, padded
    once to 4104 by `pad_cache` and masked) sends blocks of ceil(Tk/p) keys."""
    mesh = tae.make_mesh(shape, axes)
    B, Tq, Hq, Hkv, D, Dv, tk = 1, 1, 4, 2, 16, 8, 4100
    padded = -(-tk // 8) * 8
    kv = NamedSharding(mesh, tae.core.decode.kv_spec(axes, layout))
    kshape = (B, padded, Hkv, D) if layout == "bthd" else (B, Hkv, padded, D)
    vshape = (*kshape[:3], Dv)
    q = jax.ShapeDtypeStruct((B, Tq, Hq, D), jnp.float32, sharding=NamedSharding(mesh, P()))
    k = jax.ShapeDtypeStruct(kshape, jnp.float32, sharding=kv)
    v = jax.ShapeDtypeStruct(vshape, jnp.float32, sharding=kv)
    n = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=NamedSharding(mesh, P()))
    kw = dict(mesh=mesh, layout=layout)
    tree = tae.collective_stats(
        lambda q, k, v, n: tae.tree_decode(q, k, v, kv_lengths=n, **kw), q, k, v, n
    )
    ring = tae.collective_stats(
        lambda q, k, v, n: tae.ring_decode(q, k, v, kv_lengths=n, **kw), q, k, v, n
    )
    assert tree.total_bytes == cm.tree_payload_bytes(B, Tq, Hq, Dv, levels=len(shape))
    assert ring.by_kind()["collective-permute"] == cm.ring_payload_bytes(B, tk, Hkv, D, Dv, 8)


def test_model_reduces_to_paper_formulas():
    """Symbolically: the model's memory is eqs. 8-9, and its ring-allreduce wire volume of the
    tree payload is eq. 14."""
    b, t, n_h, d_h = sympy.symbols("b t n_h d_h", positive=True, integer=True)
    d = n_h * d_h
    assert (
        sympy.simplify(
            cm.peak_memory_tree(b, t, n_h, d_h) - (2 * b * t * d + 2 * b * d + 2 * b * n_h)
        )
        == 0
    )
    assert sympy.simplify(cm.peak_memory_ring(b, t, n_h, d_h) - (4 * b * t * d + 2 * b * d)) == 0
    unit = cm.Link(alpha_s=0, beta_Bps=1)  # time = elements on the wire
    for p in (2, 8, 128):
        payload = cm.tree_payload_bytes(b, 1, n_h, d_h, itemsize=1)
        wire = cm.ring_allreduce_time(payload, p, unit)
        assert sympy.simplify(wire - cm.paper_volume_tree(b, n_h, d_h, p)) == 0


def test_allreduce_choice_and_hierarchy():
    link = cm.Link(alpha_s=10e-6, beta_Bps=10e9)
    # Latency-bound messages take the log-depth tree; bandwidth-bound ones the ring.
    assert cm.allreduce_time(1e3, 64, link)[1] == "recursive_doubling"
    assert cm.allreduce_time(1e9, 64, link)[1] == "ring"
    t, _ = cm.allreduce_time(1e3, 64, link)
    assert t == pytest.approx(6 * (10e-6 + 1e3 / 10e9))
    # Hierarchical: intra-node stage over 8 devices, inter-node stage over 16 nodes.
    topo = cm.DGX_H100
    want = cm.allreduce_time(4096, 8, topo.intra)[0] + cm.allreduce_time(4096, 16, topo.inter)[0]
    assert cm.hierarchical_allreduce_time(4096, topo) == pytest.approx(want)
    assert cm.hierarchical_allreduce_time(4096, topo.with_devices(8)) == pytest.approx(
        cm.allreduce_time(4096, 8, topo.intra)[0]
    )
    with pytest.raises(ValueError, match="whole number of 8-device nodes"):
        topo.with_devices(12)


def test_ring_and_tree_predictions():
    topo = cm.DGX_H100.with_devices(16)
    tree = cm.predict_tree(2**20, topo)
    ring = cm.predict_ring(2**20, topo)
    t = 2**20 // 16
    block_s = t * 16 * 256 * 2 / topo.mem_Bps
    assert tree.compute_s == pytest.approx(block_s)
    assert ring.compute_s == pytest.approx(16 * block_s)
    # Where the loop copies its block before each send (XLA:CPU), 15 blocks are read and
    # written once more at the copy rate.
    copying = cm.predict_ring(2**20, dataclasses.replace(topo, copy_Bps=topo.mem_Bps))
    assert copying.compute_s == pytest.approx((16 + 2 * 15) * block_s)
    send = 2 * topo.inter.send(t * 16 * 128 * 2)  # the ring crosses nodes: the slow link
    # ...and one all-reduce of the output [1, 1, 16, 128] broadcasts shard 0's answer.
    broadcast = cm.collectives_time([("all-reduce", 16 * 128 * 2, 1)], topo)
    assert ring.comm_s == pytest.approx(15 * (send - block_s) + broadcast)  # overlap: 1 block
    no_overlap = cm.predict_ring(2**20, topo, overlap=False)
    assert no_overlap.comm_s == pytest.approx(15 * send + broadcast)
    assert ring.total_s > tree.total_s


def test_bad_arguments():
    with pytest.raises(ValueError, match="`n` must be a positive int, got 0"):
        cm.reduction_steps(0, 1)
    with pytest.raises(ValueError, match="`p` must be a positive int, got 0"):
        cm.ring_payload_bytes(1, 1024, 2, 8, 8, p=0)  # was a ZeroDivisionError
    with pytest.raises(ValueError, match="`p` must be a positive int, got 0"):
        cm.ring_allreduce_time(1e3, 0, cm.DGX_H100.intra)  # was 0 seconds
    with pytest.raises(TypeError, match="`kv_len` must be an int, got float"):
        cm.ring_payload_bytes(1, 1024.5, 2, 8, 8, p=8)
    with pytest.raises(ValueError, match="`branching` must be an int >= 2, got 1"):
        cm.tree_depth(8, 1)
    with pytest.raises(ValueError, match="`nbytes` must be >= 0"):
        cm.DGX_H100.intra.send(-1)
    with pytest.raises(ValueError, match="`beta_Bps` must be > 0"):
        cm.Link(alpha_s=1e-6, beta_Bps=0)
    with pytest.raises(TypeError, match="`topo` must be a Topology"):
        cm.predict_tree(1024, cm.DGX_H100.intra)
    with pytest.raises(ValueError, match=r"`q_heads` \(16\) must be a multiple of `kv_heads`"):
        cm.predict_ring(1024, cm.DGX_H100, kv_heads=3)
    with pytest.raises(ValueError, match="`seq_len` must be a positive int, got 0"):
        cm.predict_tree(0, cm.DGX_H100)
    # Sizes may still be symbols (test_model_reduces_to_paper_formulas) and numpy ints.
    assert cm.tree_depth(np.int64(8)) == 3


def test_decode_intensity_closed_form():
    """I = decode_flops / kv_read_bytes = 2·G·Tq/itemsize, whatever the other sizes."""
    g, i, q = sympy.symbols("G itemsize q_len", positive=True, integer=True)
    assert sympy.simplify(cm.decode_intensity(g, i, q) - 2 * g * q / i) == 0
    b, t, h, d, dv = sympy.symbols("b t h d d_v", positive=True, integer=True)
    ratio = cm.decode_flops(b, t, g * h, d, dv, q) / cm.kv_read_bytes(b, t, h, d, dv, i)
    assert sympy.simplify(ratio - cm.decode_intensity(g, i, q)) == 0
    # float32 and bf16 multi-head attention, Llama 3.1-8B's bf16 GQA (32 / 8 heads).
    assert (cm.decode_intensity(1, 4), cm.decode_intensity(1, 2), cm.decode_intensity(4, 2)) == (
        0.5,
        1.0,
        4.0,
    )
    llama = cm.LLAMA_3_1_8B
    assert cm.decode_intensity(llama.q_heads // llama.kv_heads, llama.itemsize) == 4.0


@pytest.mark.parametrize(("group", "itemsize", "q_len"), [(1, 4, 1), (4, 2, 1), (8, 1, 3)])
def test_decode_intensity_is_the_roofline_ratio(group, itemsize, q_len):
    """With a device of 1 byte/s and 1 flop/s, local_decode_time is max(bytes, flops)."""
    unit = cm.Topology(1, 1, cm.Link(0, 1), cm.Link(0, 1), mem_Bps=1.0, flops=1.0)
    b, t, hkv, d = 2, 4096, 8, 128
    nbytes = b * t * hkv * 2 * d * itemsize  # K and V, read once
    flops = 2 * b * q_len * hkv * group * t * 2 * d  # q·k and p·v, two flops per multiply-add
    assert cm.kv_read_bytes(b, t, hkv, d, d, itemsize) == nbytes
    assert cm.decode_flops(b, t, hkv * group, d, d, q_len) == flops
    assert cm.local_decode_time(b, t, hkv, d, d, hkv * group, unit, itemsize, q_len) == max(
        nbytes, flops
    )
    assert cm.decode_intensity(group, itemsize, q_len) == flops / nbytes


def test_ridge_point():
    assert cm.DGX_H100.ridge_point == pytest.approx(989e12 / 3.35e12)
    # Decode of Llama 3.1-8B is memory-bound on an H100 up to 73 queries per step.
    assert cm.decode_intensity(4, 2, q_len=73) < cm.DGX_H100.ridge_point
    assert cm.decode_intensity(4, 2, q_len=74) > cm.DGX_H100.ridge_point


def test_model_shape_counts_the_weights_of_the_model():
    """`ModelShape.params` against the package's own model, and Llama 3.1-8B's 8.03B."""
    from tree_attention_edu.llama import model

    for cfg in (model.PRESETS["tiny"], model.Config(tie_embeddings=True, q_heads=8, kv_heads=1)):
        params = model.init_params(cfg, jax.random.key(0))
        shape = cm.ModelShape(
            cfg.layers,
            cfg.dim,
            cfg.q_heads,
            cfg.kv_heads,
            cfg.head_dim,
            cfg.hidden,
            cfg.vocab,
            cfg.tie_embeddings,
        )
        assert shape.params == sum(x.size for x in jax.tree.leaves(params))
    llama = cm.LLAMA_3_1_8B
    assert llama.params == 8_030_261_248  # "8.03B" on the model card
    assert llama.weight_bytes == 2 * llama.params
    assert llama.q_heads * llama.head_dim == llama.dim


def test_paper_microbenchmark_and_generation_time():
    pred = cm.paper_microbenchmark(1_280_000, 16)
    topo = cm.DGX_H100.with_devices(16)
    assert pred["tree"] == cm.predict_tree(1_280_000, topo, q_heads=16, head_dim=128, itemsize=2)
    assert pred["ring"] == cm.predict_ring(1_280_000, topo, q_heads=16, head_dim=128, itemsize=2)
    node = cm.DGX_H100.with_devices(8)
    llama = cm.LLAMA_3_1_8B
    got = cm.generation_time(65536, node, tokens=3)
    for method, fn in (("tree", cm.predict_tree), ("ring", cm.predict_ring)):
        step = fn(65536, node, q_heads=32, kv_heads=8, head_dim=128, itemsize=2).total_s
        assert got[method] == pytest.approx(3 * (32 * step + llama.weight_bytes / 3.35e12))
    assert got["ring"] > got["tree"]


def test_paper_llama_table_is_consistent():
    """The transcribed means reproduce the table's own rounded speedup column."""
    assert (
        PAPER_KEYS
        == set(cm.PAPER_LLAMA)
        == set(cm.PAPER_LLAMA_STDERR)
        == set(cm.PAPER_LLAMA_SPEEDUP)
    )
    for hw, rows in cm.PAPER_LLAMA.items():
        assert list(rows) == [32768, 65536, 131072, 262144]
        assert set(cm.PAPER_LLAMA_STDERR[hw]) == set(rows)
        for n, (tree, ring) in rows.items():
            assert round(ring / tree) == cm.PAPER_LLAMA_SPEEDUP[hw][n], (hw, n)


PAPER_KEYS = {"8x H100", "4x MI300X"}


def test_bad_arguments_of_the_paper_helpers():
    with pytest.raises(ValueError, match="whole number of 8-device nodes"):
        cm.paper_microbenchmark(80_000, 12)
    with pytest.raises(TypeError, match="`model` must be a ModelShape"):
        cm.generation_time(32768, cm.DGX_H100.with_devices(8), model="llama")
    with pytest.raises(ValueError, match=r"`q_heads` \(32\) must be a multiple of `kv_heads`"):
        cm.ModelShape(32, 4096, 32, 5, 128, 14336, 128256)
    with pytest.raises(ValueError, match="`group` must be a positive int, got 0"):
        cm.decode_intensity(0)


# --- merge patterns ---------------------------------------------------------------

SYM = sympy.symbols("B T_q H_q D_v p s", positive=True, integer=True)


def _by_kind(collectives):
    out = {}
    for kind, nbytes, count in collectives:
        out[kind] = out.get(kind, 0) + nbytes * count
    return out


def test_merge_collectives_closed_forms():
    """Each pattern's bytes as the issue writes them, symbolically (n = B·Tq·Hq rows)."""
    b, tq, hq, dv, p, s = SYM
    n = b * tq * hq
    kw = dict(batch=b, q_len=tq, q_heads=hq, v_dim=dv, p=p, stat_itemsize=s)
    want = {
        "allreduce": {"all-reduce": n * s + n * (dv + 1) * s},
        "allgather": {"all-gather": p * n * (dv + 2) * s},
        "one_pass": {"all-reduce": n * (dv + 1) * s + s},
    }
    for pattern, kinds in want.items():
        got = _by_kind(cm.merge_collectives(pattern, **kw))
        assert set(got) == set(kinds)
        assert all(sympy.simplify(got[k] - kinds[k]) == 0 for k in kinds), pattern
    # The allreduce pattern's bytes are the paper's tree payload (float32 statistics).
    assert (
        sympy.simplify(
            _by_kind(cm.merge_collectives("allreduce", **kw))["all-reduce"]
            - cm.tree_payload_bytes(b, tq, hq, dv, itemsize=s)
        )
        == 0
    )
    # one_pass's fallback adds the exact merge; two mesh levels pay the all-reduces twice.
    fb = _by_kind(cm.merge_collectives("one_pass", **kw, fallback=True))["all-reduce"]
    assert sympy.simplify(fb - (n * (dv + 1) * s + s + n * s + n * (dv + 1) * s)) == 0
    two = cm.collective_bytes(cm.merge_collectives("allreduce", **kw, levels=2))
    assert sympy.simplify(two - cm.tree_payload_bytes(b, tq, hq, dv, itemsize=s, levels=2)) == 0


@pytest.mark.parametrize(("hq", "p"), [(16, 8), (6, 4), (3, 8)])
def test_head_scattered_patterns_pad_the_heads(hq, p):
    b, tq, dv, s = 2, 3, 16, 4
    hq_pad = -(-hq // p) * p
    assert cm.padded_heads(hq, p) == hq_pad and hq_pad % p == 0 and hq_pad - hq < p
    kw = dict(batch=b, q_len=tq, q_heads=hq, v_dim=dv, p=p, stat_itemsize=s, out_itemsize=2)
    n, n_pad = b * tq * hq, b * tq * hq_pad
    # Heads that p does not divide are gathered at the end, in the output's dtype.
    gather = [("all-gather", n_pad * dv * 2, 1)] if hq % p else []
    assert cm.merge_collectives("reduce_scatter", **kw) == [
        ("all-gather", p * n_pad * 2 * s, 1),
        ("reduce-scatter", n_pad * dv * s, 1),
        *gather,
    ]
    assert cm.merge_collectives("all_to_all", **kw) == [
        ("all-to-all", n_pad * (dv + 2) * s, 1),
        *gather,
    ]
    del kw["out_itemsize"]
    assert cm.merge_read_bytes("allgather", **kw) == p * n * (dv + 2) * s


def test_ring_collectives_sum_to_the_ring_payload():
    got = cm.ring_collectives(
        batch=2, kv_len=4100, kv_heads=2, head_dim=16, v_dim=8, p=8, itemsize=4, q_len=3, q_heads=6
    )
    assert got == [
        ("collective-permute", 2 * 513 * 2 * 16 * 4, 7),
        ("collective-permute", 2 * 513 * 2 * 8 * 4, 7),
        ("all-reduce", 2 * 3 * 6 * 8 * 4, 1),
    ]  # shard 0's output, broadcast
    assert cm.collective_bytes(got[:2]) == cm.ring_payload_bytes(2, 4100, 2, 16, 8, 8)
    assert (
        cm.ring_collectives(batch=2, kv_len=4100, kv_heads=2, head_dim=16, v_dim=8, p=1)[2:] == []
    )  # one device: nothing to broadcast


@pytest.mark.parametrize(("hq", "hkv", "p"), [(16, 16, 8), (32, 8, 8), (8, 2, 4), (4, 4, 8)])
def test_pass_q_collectives(hq, hkv, p):
    b, tq, d, dv, item, s = 2, 1, 32, 16, 2, 4
    gs = -(-hkv // p) * (hq // hkv)
    assert cm.pass_q_heads(hq, hkv, p) == gs
    got = cm.pass_q_collectives(
        batch=b,
        q_len=tq,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        v_dim=dv,
        p=p,
        itemsize=item,
        stat_itemsize=s,
    )
    rows = b * tq * gs
    assert got == [
        ("collective-permute", rows * d * item, p - 1),
        ("all-to-all", p * rows * (dv + 2) * s, 1),
        ("all-gather", p * rows * dv * s, 1),
    ]
    # Queries travel, not the cache: far fewer bytes than pass-KV at any long context.
    ring = cm.ring_collectives(
        batch=b, kv_len=65536, kv_heads=hkv, head_dim=d, v_dim=dv, p=p, itemsize=item
    )
    assert cm.collective_bytes(got) < cm.collective_bytes(ring) / 100


def test_wire_bytes_closed_forms():
    """Each kind's payload priced as the bytes one device sends (ring algorithms, pairwise
    all-to-all): the paper's eq. 12 for the all-reduce, (p-1)/p of the payload once for the
    all-gather, reduce-scatter and all-to-all, the whole payload for a permute."""
    n, p = sympy.symbols("n p", positive=True, integer=True)
    assert sympy.simplify(cm.wire_bytes("all-reduce", n, p) - 2 * (p - 1) / p * n) == 0
    for kind in ("all-gather", "reduce-scatter", "all-to-all"):
        assert sympy.simplify(cm.wire_bytes(kind, n, p) - (p - 1) / p * n) == 0
    assert cm.wire_bytes("collective-permute", n, p) == n
    got = cm.sent_bytes([("all-reduce", 64, 2), ("all-gather", 128, 1), ("all-to-all", 16, 1)], 8)
    assert got == 2 * 2 * 7 * 64 / 8 + 7 * 128 / 8 + 7 * 16 / 8
    assert cm.sent_bytes([], 8) == 0
    with pytest.raises(ValueError, match="kind"):
        cm.wire_bytes("broadcast", 64, 8)
    with pytest.raises(ValueError, match="nbytes"):
        cm.wire_bytes("all-reduce", -1, 8)


@pytest.mark.parametrize(
    ("tk", "hq", "hkv", "p", "d", "dv", "item", "s"),
    [
        (65536, 32, 8, 8, 128, 128, 4, 4),  # notebook 8's shape
        (4096, 16, 16, 8, 64, 64, 2, 2),
        (4100, 12, 4, 8, 32, 16, 2, 4),  # p divides neither Tk nor Hkv
        (1000, 6, 3, 4, 16, 16, 4, 4),
    ],
)
def test_pass_q_crossover_closed_form(tk, hq, hkv, p, d, dv, item, s):
    """The first Tq where the pass-Q ring sends at least the pass-KV ring's bytes: the closed
    form, and the brute-force comparison of `sent_bytes` on either side of it."""
    b = 2
    shape = dict(batch=b, kv_heads=hkv, head_dim=d, v_dim=dv, p=p, itemsize=item)
    got = cm.pass_q_crossover(tk, q_heads=hq, stat_itemsize=s, **shape)
    t, gs = -(-tk // p), -(-hkv // p) * (hq // hkv)
    fixed = (p - 1) * t * hkv * (d + dv) * item  # the K/V blocks, per batch row
    per_q = (p - 1) * gs * (d * item + (2 * dv + 2) * s) - 2 * (p - 1) * hq * dv * item / p
    assert got == math.ceil(fixed / per_q)
    if tk % p == 0 and hkv % p == 0 and item == s:  # the docstring's form
        assert got == math.ceil(tk * hkv * (d + dv) / (hq * (d + 2)))

    def kv(tq):
        return cm.sent_bytes(cm.ring_collectives(**shape, kv_len=tk, q_len=tq, q_heads=hq), p)

    def q(tq):
        return cm.sent_bytes(
            cm.pass_q_collectives(**shape, q_len=tq, q_heads=hq, stat_itemsize=s), p
        )

    assert q(got - 1) < kv(got - 1) and q(got) >= kv(got)


def test_pass_q_crossover_without_a_crossing():
    """One device sends nothing in either ring: no crossover."""
    shape = dict(batch=1, q_heads=8, kv_heads=8, head_dim=16, v_dim=16)
    assert cm.pass_q_crossover(1024, p=1, **shape) is None
    with pytest.raises(TypeError, match="kv_len"):
        cm.pass_q_crossover(sympy.Symbol("N"), p=8, **shape)


def test_collective_times_one_level():
    link = cm.Link(alpha_s=10e-6, beta_Bps=10e9)
    a, beta = link.alpha_s, link.beta_Bps
    p, m = 8, 1000
    # All-gather: recursive doubling for small messages, ring never cheaper in alpha-beta
    # (same bandwidth term, more alphas), so the tuner always picks doubling at powers of 2.
    t, algo = cm.allgather_time(p * m, p, link)
    assert algo == "recursive_doubling" and t == pytest.approx(3 * a + (p - 1) * m / beta)
    assert cm.reduce_scatter_time(p * m, p, link) == pytest.approx(
        (p - 1) * a + (p - 1) / p * p * m / beta
    )
    assert cm.all_to_all_time(p * m, p, link) == pytest.approx((p - 1) * (a + m / beta))
    for f in (cm.reduce_scatter_time, cm.all_to_all_time):
        assert f(1e6, 1, link) == 0.0
    assert cm.allgather_time(1e6, 1, link) == (0.0, "ring")
    # On one node, collective_time is these formulas over `intra`.
    topo = cm.DGX_H100.with_devices(8)
    assert cm.collective_time("all-gather", 8000, topo) == cm.allgather_time(8000, 8, topo.intra)[0]
    assert cm.collective_time("collective-permute", 8000, topo) == topo.intra.send(8000)


def test_collective_times_across_nodes():
    topo = cm.DGX_H100.with_devices(32)  # 4 nodes of 8
    intra, inter, n = topo.intra, topo.inter, 64_000
    assert cm.collective_time("all-reduce", n, topo) == cm.hierarchical_allreduce_time(n, topo)
    assert cm.collective_time("all-gather", n, topo) == pytest.approx(
        cm.allgather_time(n / 4, 8, intra)[0] + cm.allgather_time(n, 4, inter)[0]
    )
    assert cm.collective_time("reduce-scatter", n, topo) == pytest.approx(
        cm.reduce_scatter_time(n, 8, intra) + cm.reduce_scatter_time(n / 8, 4, inter)
    )
    assert cm.collective_time("all-to-all", n, topo) == pytest.approx(
        7 * (intra.alpha_s + n / 32 / intra.beta_Bps)
        + 24 * (inter.alpha_s + n / 32 / inter.beta_Bps)
    )
    assert cm.collective_time("collective-permute", n, topo) == inter.send(n)
    # A measured kind replaces the formulas, on exactly the measured device count.
    link = cm.Link(1e-3, 1e6)
    measured = dataclasses.replace(topo, measured=(("all-to-all", link),))
    assert cm.collective_time("all-to-all", n, measured) == link.send(n)
    assert measured.with_devices(32).measured and not measured.with_devices(16).measured


def test_predict_merge_parts():
    topo = cm.DGX_H100.with_devices(16)
    kw = dict(batch=4, q_heads=32, kv_heads=8, head_dim=128, itemsize=2)
    assert cm.predict_tree(2**20, topo, **kw) == cm.predict_merge("allreduce", 2**20, topo, **kw)
    t = 2**20 // 16
    compute = cm.local_decode_time(4, t, 8, 128, 128, 32, topo, 2)
    shape = dict(batch=4, q_len=1, q_heads=32, v_dim=128, p=16, stat_itemsize=4)
    for pattern in MERGE_NAMES:
        pred = cm.predict_merge(pattern, 2**20, topo, **kw)
        assert pred.method == pattern and pred.compute_s == compute
        collectives = cm.merge_collectives(pattern, **shape)
        if pattern == "butterfly":  # 3 rounds inside a node of 8 (NVLink), 1 across
            nb = collectives[0][1]
            want = 3 * topo.intra.send(nb) + topo.inter.send(nb)
        else:
            want = sum(c * cm.collective_time(k, nb, topo) for k, nb, c in collectives)
        assert pred.comm_s == pytest.approx(want)
        assert pred.merge_s == pytest.approx(cm.merge_read_bytes(pattern, **shape) / topo.mem_Bps)
        assert pred.total_s == pytest.approx(pred.compute_s + pred.comm_s + pred.merge_s)
    fast = cm.predict_merge("one_pass", 2**20, topo, **kw)
    slow = cm.predict_merge("one_pass", 2**20, topo, **kw, fallback=True)
    exact = cm.predict_merge("allreduce", 2**20, topo, **kw)
    assert slow.comm_s == pytest.approx(fast.comm_s + exact.comm_s)
    assert fast.comm_s < exact.comm_s  # one all-reduce fewer
    everything = cm.predict_all(2**20, topo, **kw)
    assert list(everything) == [*MERGE_NAMES, *cm.RINGS]


def test_pass_q_ring_prediction():
    topo = cm.DGX_H100.with_devices(8)
    kw = dict(batch=1, q_heads=32, kv_heads=8, head_dim=128, itemsize=2)
    pq = cm.predict_pass_q_ring(2**20, topo, **kw)
    kv = cm.predict_ring(2**20, topo, **kw)
    tree = cm.predict_tree(2**20, topo, **kw)
    # Each step reads the shard's one kv head (of 8): p steps read the shard once.
    assert pq.compute_s == pytest.approx(tree.compute_s)
    assert kv.compute_s == pytest.approx(8 * tree.compute_s)
    assert pq.total_s < kv.total_s  # Tq·Hq = 32 ≪ Tk·Hkv
    no = cm.predict_pass_q_ring(2**20, topo, **kw, overlap=False)
    permute = cm.pass_q_collectives(
        batch=1, q_len=1, q_heads=32, kv_heads=8, head_dim=128, v_dim=128, p=8, itemsize=2
    )[0]
    assert no.comm_s - pq.comm_s == pytest.approx(
        7 * min(pq.compute_s / 8, cm.collective_time("collective-permute", permute[1], topo))
    )


NO_ONE_PASS = ("allreduce", "allgather", "reduce_scatter", "all_to_all")


def test_best_merge_follows_latency_and_bandwidth():
    """Latency-bound (tiny payloads, many devices): one collective beats two. Bandwidth-bound
    (huge batch × heads): the least bytes on the slow links win. Asserted on the model's own
    numbers, so a change of constants moves the winners with them."""
    topo = cm.DGX_H100.with_devices(64)

    def times(batch):
        return {m: cm.predict_merge(m, 2**16, topo, batch=batch).total_s for m in NO_ONE_PASS}

    small = times(1)
    best = cm.best_merge(2**16, topo, batch=1, patterns=NO_ONE_PASS)
    assert best == min(small, key=small.get)
    assert small["allgather"] < small["allreduce"]  # one α-bound collective instead of two
    assert best == "allgather"
    big = times(4096)
    best = cm.best_merge(2**16, topo, batch=4096, patterns=NO_ONE_PASS)
    assert best == min(big, key=big.get)
    assert best in ("allreduce", "reduce_scatter")
    assert big["allgather"] > big["allreduce"]  # p× the payload loses once bytes dominate
    # one_pass is priced by its fast path: never slower than allreduce.
    assert cm.best_merge(2**16, topo, batch=1) != "allreduce"


def test_best_merge_ties_go_to_allreduce():
    one = cm.DGX_H100.with_devices(1)  # no collective at all: every pattern costs the same
    assert cm.best_merge(4096, one, patterns=("allgather", "allreduce")) == "allreduce"
    free = cm.Topology(
        1,
        8,
        cm.Link(0, float("inf")),
        cm.Link(0, float("inf")),
        mem_Bps=float("inf"),
        flops=float("inf"),
    )
    assert cm.best_merge(4096, free) == "allreduce"


def test_crossover_map():
    ps, bhs = (8, 16, 64), (16, 256, 4096, 65536)
    got = cm.crossover_map(ps=ps, batch_heads=bhs)
    assert got["ps"] == list(ps) and got["batch_heads"] == list(bhs)
    assert len(got["winner"]) == len(bhs) and all(len(r) == len(ps) for r in got["winner"])
    for i, bh in enumerate(bhs):
        for j, p in enumerate(ps):
            secs = {m: got["seconds"][m][i][j] for m in MERGE_NAMES}
            assert got["winner"][i][j] == min(secs, key=secs.get)
            assert got["winner"][i][j] == cm.best_merge(
                2**20, cm.DGX_H100.with_devices(p), batch=bh // 16
            )
            assert got["speedup"][i][j] == pytest.approx(
                secs["allreduce"] / secs[got["winner"][i][j]]
            )
    assert "DGX H100" in got["topology"]


def test_bad_arguments_of_the_merge_model():
    with pytest.raises(ValueError, match="`pattern` must be one of"):
        cm.merge_collectives("ring", batch=1, q_len=1, q_heads=4, v_dim=8, p=2)
    with pytest.raises(TypeError, match="`pattern` must be a str"):
        cm.predict_merge(3, 1024, cm.DGX_H100)
    with pytest.raises(ValueError, match=r"`patterns\[1\]` must be one of"):
        cm.best_merge(1024, cm.DGX_H100, patterns=("allreduce", "psum"))
    with pytest.raises(ValueError, match="`patterns` is empty"):
        cm.best_merge(1024, cm.DGX_H100, patterns=())
    with pytest.raises(ValueError, match=r"`batch_heads\[0\]` holds 24, not a multiple"):
        cm.crossover_map(batch_heads=(24,))
    with pytest.raises(ValueError, match="`ps\\[0\\]` must be a positive int"):
        cm.crossover_map(ps=(0,))
    with pytest.raises(ValueError, match="`kind` must be one of"):
        cm.collective_time("broadcast", 8, cm.DGX_H100)
    with pytest.raises(TypeError, match=r"`measured\[0\]` must be a \(kind, Link\) pair"):
        dataclasses.replace(cm.DGX_H100, measured=(("all-gather", 1e-3),))
    with pytest.raises(ValueError, match="gives 'all-gather' twice"):
        link = cm.Link(1e-3, 1e9)
        dataclasses.replace(cm.DGX_H100, measured=(("all-gather", link), ("all-gather", link)))
    with pytest.raises(TypeError, match="`fallback` must be True or False"):
        cm.predict_merge("one_pass", 1024, cm.DGX_H100, fallback=1)


def test_ring_payload_bytes_symbolic():
    """(p−1) blocks of ceil(N/p) keys, K and V: for N = p·t exactly (p−1)·b·t·h·(d+dv)·s."""
    b, t, h, d, dv, p, s = sympy.symbols("b t h d d_v p s", positive=True, integer=True)
    got = cm.ring_payload_bytes(b, p * t, h, d, dv, p, s)
    assert sympy.simplify(got - (p - 1) * b * t * h * (d + dv) * s) == 0
    assert cm.ring_payload_bytes(1, 4100, 1, 1, 1, 8, 1) == 7 * 513 * 2  # ceil(4100 / 8)


def test_auto_merge_of_an_empty_problem_is_allreduce():
    """No sequences, queries or heads: nothing to merge; a real problem asks best_merge."""
    from tree_attention_edu.core import merges

    full = merges.MergeProblem(1, 1, 16, 16, 128, 128, 1 << 20, "bfloat16", (2, 8))
    for empty in (
        full._replace(batch=0),
        full._replace(q_len=0),
        full._replace(q_heads=0, kv_heads=1),
    ):
        assert cm.auto_merge(empty) == "allreduce"
    topo = dataclasses.replace(cm.DGX_H100, nodes=2, devices_per_node=8)
    assert cm.auto_merge(full) == cm.best_merge(
        1 << 20, topo, itemsize=2, patterns=merges.AUTO_MERGES
    )


def test_one_device_predicts_no_communication():
    """One device is a legal topology with no collectives (issue 30, item 5: `predict_all`
    raised "`collectives` is empty"). Every method is the local kernel's roofline over the
    whole cache plus its local merge: with n = B·Tq·Hq rows and s the statistics' itemsize,
    the merge reads n·(Dv+1)·s bytes for "allreduce" and "one_pass", none for the pass-KV
    ring and the butterfly (no round on one device), and n·(Dv+2)·s for the others (p = 1:
    no padding, one state)."""
    topo = cm.DGX_H100.with_devices(1)
    b, n_keys, hq, hkv, d, dv, item, s = 2, 4096, 8, 2, 64, 48, 2, 4
    got = cm.predict_all(
        n_keys,
        topo,
        batch=b,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        v_dim=dv,
        itemsize=item,
        stat_itemsize=s,
    )
    assert list(got) == [*MERGE_NAMES, *cm.RINGS]
    compute = max(
        b * n_keys * hkv * (d + dv) * item / topo.mem_Bps,
        2 * b * hq * n_keys * (d + dv) / topo.flops,
    )
    n = b * hq
    # the butterfly on one device has no round, so no combine: nothing to read
    merge = {"allreduce": n * (dv + 1) * s, "one_pass": n * (dv + 1) * s, "ring": 0, "butterfly": 0}
    for name, pred in got.items():
        assert (pred.devices, pred.comm_s, pred.overhead_s) == (1, 0.0, 0.0), name
        assert pred.compute_s == pytest.approx(compute, rel=1e-12), name
        want = merge.get(name, n * (dv + 2) * s) / topo.mem_Bps
        assert pred.merge_s == pytest.approx(want, rel=1e-12), name
        assert pred.total_s == pytest.approx(compute + want, rel=1e-12), name
    assert cm.collectives_time([], topo) == 0.0 and cm.collective_bytes([]) == 0
    ring = cm.predict_ring(
        n_keys,
        dataclasses.replace(topo, copy_Bps=1e9),
        batch=b,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        v_dim=dv,
        itemsize=item,
    )
    assert ring.compute_s == pytest.approx(compute, rel=1e-12)  # no block is sent, or copied
    micro = cm.paper_microbenchmark(n_keys, 1)
    assert micro["ring"].comm_s == micro["tree"].comm_s == 0.0


def test_costmodel_is_the_facade_of_its_parts():
    """`costmodel.X` is the part's own object for every public name of every part (the
    notebooks read the model through the facade), and the merge patterns are named once."""
    import ast
    import inspect

    from tree_attention_edu.core import merges, validate
    from tree_attention_edu.perf import crossover, formulas, links, paper, patterns, predict

    for part in (formulas, links, patterns, predict, paper, crossover):
        tree = ast.parse(inspect.getsource(part))
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        defined |= {
            t.id
            for n in tree.body
            if isinstance(n, ast.Assign | ast.AnnAssign)
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Name)
        }
        public = {n for n in defined if not n.startswith("_")}
        assert public - set(cm.__all__) == set(), part.__name__
        assert all(getattr(cm, n) is getattr(part, n) for n in public), part.__name__
    assert cm.MERGES is MERGE_NAMES and tuple(merges.MERGES) == MERGE_NAMES
    # The sympy-aware checks live in perf.checks; the core's checks know plain values only.
    assert "sympy" not in inspect.getsource(validate)
    assert "symbolic" not in inspect.signature(validate.check_int).parameters
    assert "symbolic" not in inspect.signature(validate.check_real).parameters


# --- XLA:CPU over gloo (`Topology.ring_only`), as read in the source and timed per call ---

GLOO = cm.Topology(
    nodes=2,
    devices_per_node=4,
    intra=cm.Link(1e-3, 400e6),
    inter=cm.Link(20e-3, 100e6),
    mem_Bps=1e9,
    flops=float("inf"),
    overlap=False,
    ring_only=True,
    uplinks=1,
)


def test_gloo_runs_each_collective_flat_at_its_slowest_hop():
    """Over all of a 2-node mesh at once, gloo's all-reduce is one ring of 2(p−1) steps and
    its all-gather one of p−1, each step at the larger α and the smaller β (one device per
    node crosses, so β is not shared); XLA's all-to-all posts every send at once, the bytes
    across sharing the node's one uplink."""
    n, p, a, b = 8192.0, 8, 20e-3, 100e6
    assert cm.slowest_link(GLOO) == cm.Link(a, b)
    assert cm.collective_time("all-reduce", n, GLOO) == pytest.approx(2 * 7 * (a + n / p / b))
    assert cm.collective_time("all-gather", n, GLOO) == pytest.approx(7 * (a + n / p / b))
    # all-to-all: 3/8 of n inside at 400 MB/s, 4/8 across at 100/4 MB/s, at once
    assert cm.collective_time("all-to-all", n, GLOO) == pytest.approx(a + 4 / 8 * n / (b / 4))
    # A library that reduces in stages (not ring_only): inside the nodes, then across, each
    # the cheaper of ring and recursive doubling (here recursive doubling, 2 and 1 steps).
    staged = dataclasses.replace(GLOO, ring_only=False)
    shared = cm.Link(a, b / 4)
    want = 2 * GLOO.intra.send(n) + shared.send(n)
    assert cm.collective_time("all-reduce", n, staged) == pytest.approx(want)
    # One node: the node's own link. One-device nodes: the inter-node link alone.
    assert cm.slowest_link(dataclasses.replace(GLOO, nodes=1)) == GLOO.intra
    lone = dataclasses.replace(GLOO, nodes=4, devices_per_node=1, intra=cm.Link(1.0, 1.0))
    assert cm.slowest_link(lone) == GLOO.inter
    # Crossed links: the larger α from one, the smaller β from the other.
    crossed = dataclasses.replace(GLOO, intra=cm.Link(30e-3, 1e9))
    assert cm.slowest_link(crossed) == cm.Link(30e-3, 100e6)


def test_a_ring_measured_over_all_devices_prices_their_gloo_collectives():
    """`flat_ring`, one step of the ring over all devices as measured on it, replaces
    `slowest_link`'s rule for the collectives over all of them, in closed form; kept for
    the same device count only; and the cluster's flat topology runs the tree's merge
    on it (`cluster.methods.topologies`)."""
    n, p, a, b = 8192.0, 8, 3e-3, 50e6
    ring = dataclasses.replace(GLOO, flat_ring=cm.Link(a, b))
    assert cm.ring_step_link(ring) == cm.Link(a, b)
    assert cm.ring_step_link(GLOO) == cm.slowest_link(GLOO)  # none measured: the rule
    assert cm.collective_time("all-reduce", n, ring) == pytest.approx(2 * 7 * (a + n / p / b))
    assert cm.collective_time("all-gather", n, ring) == pytest.approx(7 * (a + n / p / b))
    across = 4 / 8 * n / (GLOO.inter.beta_Bps / 4)  # the bytes across, on the shared uplink
    assert cm.collective_time("all-to-all", n, ring) == pytest.approx(a + across)
    # The levels' all-reduces (the 2-level tree's merge) keep their own links.
    assert cm.hierarchical_allreduce_time(n, ring) == cm.hierarchical_allreduce_time(n, GLOO)
    assert ring.with_devices(8).flat_ring == cm.Link(a, b)
    assert ring.with_devices(4).flat_ring is None  # measured on 8 devices, not 4
    with pytest.raises(TypeError, match="flat_ring"):
        dataclasses.replace(GLOO, flat_ring=(a, b))
    with pytest.raises(ValueError, match="ring_only=True"):
        dataclasses.replace(ring, ring_only=False)  # only gloo's rings are priced at it
    # The cluster's view: the flat tree's topology is one node of p devices whose link is
    # the measured ring's step; without a measured ring (older records), the rule's.
    from tree_attention_edu.cluster import methods

    s = SimpleNamespace(nodes=2, processes_per_node=2, devices_per_process=2, devices=8)
    fit = {"inter": {"alpha_s": 20e-3, "beta_Bps": 100e6}, "overhead_s": 0.0}
    fit["intra"] = {"alpha_s": 1e-3, "beta_Bps": 400e6}
    local = {"mem_Bps": 1e9, "sync_s": 0.0, "copy_Bps": 1e9}
    two, flat = methods.topologies(
        SimpleNamespace(s=s), fit | {"flat": {"alpha_s": a, "beta_Bps": b}}, local
    )
    assert two.flat_ring == cm.Link(a, b) and flat.intra == cm.Link(a, b)
    assert (flat.nodes, flat.devices_per_node, flat.flat_ring) == (1, 8, None)
    assert methods.topologies(SimpleNamespace(s=s), fit, local)[1].intra == cm.Link(20e-3, 100e6)
    # The ring over all 8 devices is measured with large all-reduces 4x a level's, so that
    # its steps (n/8) carry what a 2-device ring's do (n/2), above the tbf bucket.
    from tree_attention_edu.cluster import levels

    eight = SimpleNamespace(flat=SimpleNamespace(size=8))
    node, flat_sizes = levels.sizes(eight, "node"), levels.sizes(eight, "flat")
    assert node == list(levels.LEVEL_SIZES)
    assert [f // 8 for f, n in zip(flat_sizes, node, strict=True) if n > 16384] == [
        n // 2 for n in node if n > 16384
    ]
    assert [f for f, n in zip(flat_sizes, node, strict=True) if n <= 16384] == [
        n for n in node if n <= 16384
    ]


def _cluster_settings(**over):
    from tree_attention_edu.cluster.context import Settings

    fields = dict(
        nodes=2,
        processes_per_node=2,
        devices_per_process=2,
        coordinator="",
        rates_bps=[1e9],
        seq_len=16384,
        methods=["tree"],
        repeats=3,
        sweep=[],
        batch=1,
        q_heads=8,
        kv_heads=8,
        head_dim=64,
        seed=0,
        init_timeout=1,
        control="",
    )
    return Settings(**(fields | over))


def test_the_cluster_prices_all_gathers_and_all_to_alls_as_measured_alone():
    """`levels.fit_kinds` reads α (the mean of the small calls) and β (the inverse
    least-squares slope over the large) of each kind from times `overhead + α + n/β`;
    `methods.topologies` hands them to the 2-level topology as `measured`, which prices
    those kinds and no other; a record without them (before) prices by the formulas."""
    from tree_attention_edu.cluster import levels, methods
    from tree_attention_edu.perf import calibrate

    overhead = 3e-4
    want = {"all-gather": cm.Link(4e-3, 80e6), "all-to-all": cm.Link(2e-3, 50e6)}
    times = {
        f"{name} {n}": [overhead + want[kind].send(n) + jitter for jitter in (-1e-5, 0, 1e-5)]
        for name, kind in levels.KINDS.items()
        for n in levels.kind_sizes(8)
    }
    assert levels.kind_sizes(8) == list(levels.KIND_SIZES)  # multiples of 4·8 already
    fits = levels.fit_kinds(times, overhead, 8)
    assert set(fits) == {"all-gather", "all-to-all"}
    small = [n for n in levels.KIND_SIZES if n <= calibrate.SMALL_MESSAGE]
    assert len(small) == 2  # α: the mean of both sizes' times (the jitter cancels)
    for kind, link in want.items():
        alpha = link.alpha_s + sum(small) / 2 / link.beta_Bps
        assert fits[kind]["alpha_s"] == pytest.approx(alpha, rel=1e-9)
        assert fits[kind]["beta_Bps"] == pytest.approx(link.beta_Bps, rel=1e-9)  # the slope
        assert len(fits[kind]["points"]) == 3 * len(levels.KIND_SIZES)
    # Two modes (peers awake: 1 ms; one to wake: 5 ms), the slow one in 1 call of 3: the
    # mean, 7/3 ms, not the median, 1 ms (a decode pays the modes as often as they come).
    modes = {
        f"{name} {n}": [overhead + t for t in (1e-3, 5e-3, 1e-3)]
        for name in levels.KINDS
        for n in small
    }
    bimodal = levels.fit_kinds(times | modes, overhead, 8)
    assert all(f["alpha_s"] == pytest.approx(7e-3 / 3) for f in bimodal.values())
    # β unresolved (inf) with one large size, or none: the rule's edge, not an error
    assert levels.alpha_beta([(1024, 1e-3), (2048, 2e-3)]) == (1.5e-3, math.inf)
    assert levels.alpha_beta([(1024, 1e-3), (1 << 20, 9e-3)])[1] == math.inf
    s = SimpleNamespace(nodes=2, processes_per_node=2, devices_per_process=2, devices=8)
    fit = {
        "inter": {"alpha_s": 20e-3, "beta_Bps": 100e6},
        "intra": {"alpha_s": 1e-3, "beta_Bps": 400e6},
        "overhead_s": 0.0,
        "kinds": {k: {"alpha_s": v.alpha_s, "beta_Bps": v.beta_Bps} for k, v in want.items()},
    }
    local = {"mem_Bps": 1e9, "sync_s": 0.0, "copy_Bps": 1e9}
    two, _ = methods.topologies(SimpleNamespace(s=s), fit, local)
    older, _ = methods.topologies(SimpleNamespace(s=s), fit | {"kinds": {}}, local)
    n = 3696.0
    for kind, link in want.items():
        assert cm.collective_time(kind, n, two) == pytest.approx(link.alpha_s + n / link.beta_Bps)
        assert cm.collective_time(kind, n, older) != pytest.approx(link.send(n))
    for kind in ("all-reduce", "collective-permute", "reduce-scatter"):
        assert cm.collective_time(kind, n, two) == cm.collective_time(kind, n, older)


def test_the_cluster_prices_a_step_of_back_to_back_all_reduces_from_a_chain():
    """`levels.fit_chain`: each round's chain of `CHAIN` all-reduces over all p devices,
    less the lone all-reduce of the same size and round, over (CHAIN − 1)·2(p − 1) steps,
    averaged over the small sizes and rounds; at least 0."""
    from tree_attention_edu.cluster import levels
    from tree_attention_edu.perf import calibrate

    ctx = SimpleNamespace(flat=SimpleNamespace(size=8))
    steps = 2 * 7
    small = [n for n in levels.sizes(ctx, "flat") if n <= calibrate.SMALL_MESSAGE]
    lone = [0.9e-3, 2.0e-3, 0.7e-3]  # a lone call's step, per round (wakes peers)
    chained = [0.5e-3, 0.8e-3, 0.5e-3]  # a step of a later all-reduce of the chain
    times = {}
    for n in small:
        times[f"flat {n}"] = [1e-4 + steps * a for a in lone]
        times[f"chain {n}"] = [
            1e-4 + steps * a + (levels.CHAIN - 1) * steps * c
            for a, c in zip(lone, chained, strict=True)
        ]
    fit = levels.fit_chain(ctx, times)
    assert fit["alpha_s"] == pytest.approx(np.mean(chained), rel=1e-9) and fit["resolved"]
    assert len(fit["points"]) == len(small) * 3
    times = {k: [t / 2 for t in v] if k.startswith("chain") else v for k, v in times.items()}
    fit = levels.fit_chain(ctx, times)  # a chain faster than one call: not resolved
    assert fit["alpha_s"] == 0.0 and not fit["resolved"]


@pytest.mark.parametrize("shape", [(3, 2), (2, 3), (7, 1)])
def test_the_cluster_s_kind_calls_run_on_device_counts_that_do_not_divide_their_sizes(shape):
    """`levels.kind_calls` on 6 and 7 devices: each size rounded down to a multiple of 4·p
    bytes (`kind_sizes`), so that every all-to-all splits into p parts and every
    all-gather receives p; each call returns what the collective should (all ones in, p
    ones gathered per word; the all-to-all a permutation of ones)."""
    from jax.sharding import Mesh

    from tree_attention_edu.cluster import levels

    p = shape[0] * shape[1]
    sizes = levels.kind_sizes(p)
    assert all(n % (4 * p) == 0 and n <= k for n, k in zip(sizes, levels.KIND_SIZES, strict=True))
    mesh = Mesh(np.array(jax.devices()[:p]).reshape(shape), ("node", "gpu"))
    calls = levels.kind_calls(SimpleNamespace(two=mesh))
    assert set(calls) == {f"{k} {n}" for k in levels.KINDS for n in sizes}
    for name, (fn, args) in calls.items():
        if int(name.split()[1]) > 16384:
            continue  # the MB-sized calls: the same programs, longer
        out = np.asarray(fn(*args))
        assert out.size == p * int(name.split()[1]) // 4 and np.all(out == 1), name


def test_the_cluster_prices_a_reduce_scatter_after_another_collective_from_its_pair():
    """`levels.fit_last`: each of `LAST_KINDS` fitted alone from every process's times
    pooled (`fit_kinds`); the reduce-scatter's α is the mean over the small sizes and over every
    process's rounds of "after" (an all-gather, then a reduce-scatter) less the
    all-gather alone of that size, process and round, its lone α kept beside it; β the
    lone calls' slope. A pair no slower than the all-gather alone (noise) is not
    resolved, and the lone α stays."""
    from tree_attention_edu.cluster import levels
    from tree_attention_edu.perf import calibrate

    overhead, p = 3e-4, 8
    lone = {"all-gather": cm.Link(9e-3, 100e6), "reduce-scatter": cm.Link(4e-3, 150e6)}
    times = {
        f"{name} {n}": [overhead + lone[kind].send(n) + j for j in (-1e-5, 0.0, 1e-5)]
        for name, kind in levels.LAST_KINDS.items()
        for n in levels.kind_sizes(p)
    }
    small = [n for n in levels.kind_sizes(p) if n <= calibrate.SMALL_MESSAGE]
    # the reduce-scatter's share of the pair, per round, on processes 0 and 1; process 1's
    # all-gather alone runs 5 ms slower, which the pair's difference cancels
    after = ([12e-3, 6e-3, 15e-3], [20e-3, 3e-3, 13e-3])  # means 11 and 12 ms
    everyone = {name: [ts, [t + 5e-3 for t in ts]] for name, ts in times.items()}
    for n in small:
        ag = everyone[f"all_gather {n}"]
        everyone[f"after {n}"] = [
            [a + r for a, r in zip(ag[i], after[i], strict=True)] for i in (0, 1)
        ]
    fits = levels.fit_last(everyone, overhead, p)
    alone = levels.fit_kinds(levels.pooled(everyone), overhead, p, levels.LAST_KINDS)
    rs = fits["reduce-scatter"]
    assert rs["after"]["resolved"] and rs["alpha_s"] == pytest.approx(11.5e-3, rel=1e-9)
    assert rs["alpha_alone_s"] == alone["reduce-scatter"]["alpha_s"] != rs["alpha_s"]
    assert rs["beta_Bps"] == pytest.approx(150e6, rel=1e-9)
    assert len(rs["after"]["points"]) == 2 * 3 * len(small)
    assert fits["all-gather"] == alone["all-gather"]
    quicker = everyone | {f"after {n}": everyone[f"all_gather {n}"] for n in small}
    rs = levels.fit_last(quicker, overhead, p)["reduce-scatter"]
    assert not rs["after"]["resolved"] and rs["alpha_s"] == rs["alpha_alone_s"]


@pytest.mark.parametrize("shape", [(2, 4), (7, 1)])
def test_the_cluster_s_last_calls_time_the_reduce_scatter_alone_and_after_an_all_gather(shape):
    """`levels.last_calls`: each of `LAST_KINDS` at `kind_sizes`, and "after" at the small
    ones, whose all-gather of ones receives the whole buffer and whose reduce-scatter
    sums p copies of it (scaled by 1.0001 between the two), tiled back to that size."""
    from jax.sharding import Mesh

    from tree_attention_edu.cluster import levels
    from tree_attention_edu.perf import calibrate
    from tree_attention_edu.perf.introspect import parse_hlo

    p = shape[0] * shape[1]
    mesh = Mesh(np.array(jax.devices()[:p]).reshape(shape), ("node", "gpu"))
    calls = levels.last_calls(SimpleNamespace(two=mesh))
    sizes = levels.kind_sizes(p)
    small = [n for n in sizes if n <= calibrate.SMALL_MESSAGE]
    assert set(calls) == {f"{k} {n}" for k in levels.LAST_KINDS for n in sizes} | {
        f"after {n}" for n in small
    }
    for n in small:
        fn, args = calls[f"after {n}"]
        out = np.asarray(fn(*args))
        assert out.size == p * n // 4 and np.allclose(out, p * 1.0001, rtol=1e-6), n
        # the merge's order, each collective of the size it has alone (as compiled)
        pair, *alone = (
            parse_hlo(f.lower(*a).compile().as_text() or "").collectives
            for f, a in (calls[f"after {n}"], calls[f"all_gather {n}"], calls[f"psum_scatter {n}"])
        )
        assert [c.kind for c in pair] == ["all-gather", "reduce-scatter"], pair
        assert [c.bytes for c in pair] == [c.bytes for one in alone for c in one], pair


def test_the_cluster_prices_the_local_decode_as_the_collective_after_it_waits():
    """`levels.fit_local`: `mem_Bps` is a shard's K and V bytes over the median, over every
    process's rounds, of "both" less "tiny" (`waited_kernel_s`), never above the kernel
    timed alone (`kernel_alone_Bps`: the median over every process's rounds, less the
    per-call overhead); `sync_s` is 0 (the wait is in the rate, which scales with the
    length)."""
    from tree_attention_edu.cluster import levels

    s = _cluster_settings()
    ctx = SimpleNamespace(s=s, say=lambda text: None)
    shard = s.problem(levels.cal_len(ctx)).kv_bytes / s.devices
    overhead, kernel = 2e-4, 3e-3

    def proc(tiny, wait):  # one process's 3 rounds; "both" = tiny + the waited kernel
        return {
            "local kernel": [kernel] * 3,
            "local copy": [1e-3] * 3,
            "local tiny": [tiny] * 3,
            "local both": [tiny + w for w in wait],
        }

    procs = [proc(1.4e-3, (6e-3, 9e-3, 7e-3)), proc(5e-3, (5e-3, 8e-3, 6.5e-3))]
    procs[1]["local kernel"] = [2e-3, 9e-3, 4e-3]  # the kernel alone: median of the six, 3 ms
    everyone = {n: [p_[n] for p_ in procs] for n in procs[0]}
    assert levels.waited_kernel_s(everyone) == pytest.approx(6.75e-3)  # of the six
    local = levels.fit_local(ctx, procs[0], overhead, everyone)
    assert local["mem_Bps"] == pytest.approx(shard / 6.75e-3)
    assert local["kernel_alone_Bps"] == pytest.approx(shard / (kernel - overhead))
    procs[1]["local kernel"] = [9e-3, 9e-3, 9e-3]  # now 6 ms, pooled, whatever process 0's
    everyone = {n: [p_[n] for p_ in procs] for n in procs[0]}
    slower = levels.fit_local(ctx, procs[0], overhead, everyone)
    assert slower["kernel_alone_Bps"] == pytest.approx(shard / (6e-3 - overhead))
    assert local["waited_kernel_s"] == pytest.approx(6.75e-3) and local["sync_s"] == 0.0
    # A wait shorter than the kernel alone (noise) does not make the kernel faster.
    quick = [proc(1.4e-3, (1e-3,) * 3)]
    everyone = {n: [p_[n] for p_ in quick] for n in quick[0]}
    local = levels.fit_local(ctx, quick[0], overhead, everyone)
    assert local["mem_Bps"] == local["kernel_alone_Bps"]
    # A record before this change (sync_s, kernel-alone mem_Bps) prices by its own fields.
    from tree_attention_edu.cluster import methods

    fit = {
        "inter": {"alpha_s": 1e-3, "beta_Bps": 1e8},
        "intra": {"alpha_s": 1e-3, "beta_Bps": 1e9},
        "overhead_s": overhead,
    }
    old = {"mem_Bps": 2e9, "sync_s": 3e-3, "copy_Bps": 1e10}
    two, _ = methods.topologies(ctx, fit, old)
    assert two.overhead_s == pytest.approx(overhead + 3e-3) and two.mem_Bps == 2e9


@pytest.mark.parametrize(("nodes", "per_node"), [(3, 2), (3, 1), (1, 1)])
def test_a_measured_ring_prices_odd_counts_and_one_device(nodes, per_node):
    """The measured ring's closed forms hold at device counts that are not powers of two
    (6 and 3), where the ring still has p−1 hops per pass; one device has no collective to
    price (0 s, measured ring or not); the cluster's flat topology and the ring's
    measuring sizes follow the count (`levels.sizes`: ⌊p/2⌋ times a level's large ones)."""
    from tree_attention_edu.cluster import levels, methods

    n, a, b = 6000.0, 3e-3, 50e6
    base = dataclasses.replace(GLOO, nodes=nodes, devices_per_node=per_node)
    topo = dataclasses.replace(base, flat_ring=cm.Link(a, b))
    p = nodes * per_node
    if p == 1:
        for kind in ("all-reduce", "all-gather", "all-to-all"):
            assert cm.collective_time(kind, n, topo) == 0.0 == cm.collective_time(kind, n, base)
    else:
        step = a + n / p / b
        assert cm.collective_time("all-reduce", n, topo) == pytest.approx(2 * (p - 1) * step)
        assert cm.collective_time("all-gather", n, topo) == pytest.approx((p - 1) * step)
        inside = (per_node - 1) / p * n / GLOO.intra.beta_Bps
        across = (p - per_node) / p * n / (GLOO.inter.beta_Bps / per_node)  # shared uplink
        assert cm.collective_time("all-to-all", n, topo) == pytest.approx(a + max(inside, across))
        # Without the measured step, the rule: GLOO's `inter` has both the larger α and the
        # smaller β, so every step is priced at it (crossed links: the `slowest_link` test).
        assert cm.collective_time("all-gather", n, base) == pytest.approx(
            (p - 1) * (20e-3 + n / p / 100e6)
        )
    assert topo.with_devices(p).flat_ring == cm.Link(a, b)
    s = SimpleNamespace(nodes=nodes, processes_per_node=per_node, devices_per_process=1, devices=p)
    fit = {
        "inter": {"alpha_s": 20e-3, "beta_Bps": 100e6},
        "intra": {"alpha_s": 1e-3, "beta_Bps": 400e6},
        "flat": {"alpha_s": a, "beta_Bps": b},
        "overhead_s": 0.0,
    }
    local = {"mem_Bps": 1e9, "sync_s": 0.0, "copy_Bps": 1e9}
    two, flat = methods.topologies(SimpleNamespace(s=s), fit, local)
    assert (flat.nodes, flat.devices_per_node, flat.intra) == (1, p, cm.Link(a, b))
    assert two.devices == p and two.flat_ring == cm.Link(a, b)
    mesh = SimpleNamespace(flat=SimpleNamespace(size=p))
    scale = {6: 3, 3: 1, 1: 1}[p]
    assert levels.sizes(mesh, "flat") == [
        x * scale if x > 16384 else x for x in (256, 1024, 4096, 1 << 20, 2 << 20, 4 << 20)
    ]


def test_operands_apart_lists_one_all_reduce_per_operand():
    """XLA:CPU's AllReduceThunk reduces the operands of one all-reduce one at a time, so the
    tree's merge runs three gloo rings: the max, the numerator, the denominator."""
    shape = dict(batch=2, q_len=1, q_heads=8, v_dim=64, p=8, stat_itemsize=4, levels=2)
    n = 2 * 8 * 4
    assert cm.merge_collectives("allreduce", **shape) == [
        ("all-reduce", n, 2),
        ("all-reduce", n * 65, 2),
    ]
    assert cm.merge_collectives("allreduce", **shape, operands_apart=True) == [
        ("all-reduce", n, 2),
        ("all-reduce", n * 64, 2),
        ("all-reduce", n, 2),
    ]
    fast = cm.merge_collectives("one_pass", **shape, operands_apart=True)
    assert fast == [("all-reduce", n * 64, 2), ("all-reduce", n, 2), ("all-reduce", 4, 2)]
    together = cm.merge_collectives("one_pass", **shape)
    assert together == [("all-reduce", n * 65 + 4, 2)]


def test_the_tree_on_gloo_pays_three_rings_per_level():
    """`predict_merge("allreduce")` on a gloo topology: per level (inside nodes, then
    across), one ring per operand, the closed form written out."""
    prob = dict(batch=1, q_heads=8, head_dim=64, itemsize=4, stat_itemsize=4)
    n = 8 * 4
    sizes = (n, n * 64, n)  # max, numerator, denominator

    def ring(nbytes, p, link):
        return 2 * (p - 1) * (link.alpha_s + nbytes / p / link.beta_Bps)

    shared = cm.Link(GLOO.inter.alpha_s, GLOO.inter.beta_Bps / 4)  # 4 devices, 1 uplink
    want = sum(ring(m, 4, GLOO.intra) + ring(m, 2, shared) for m in sizes)
    got = cm.predict_merge("allreduce", 8192, GLOO, **prob)
    assert got.comm_s == pytest.approx(want)
    staged = cm.predict_merge("allreduce", 8192, dataclasses.replace(GLOO, ring_only=False), **prob)
    assert staged.comm_s < got.comm_s  # two all-reduces per level, and the tree algorithm


def test_the_butterflys_inner_rounds_stay_inside_a_node():
    """log2(devices per node) rounds over `intra`, log2(nodes) across with every device of
    a node sending at once; when p or the node size is not a power of two, every round is
    priced across (an upper bound)."""
    nbytes = 8 * 66 * 4
    shared = cm.Link(GLOO.inter.alpha_s, GLOO.inter.beta_Bps / 4)
    want = 2 * GLOO.intra.send(nbytes) + shared.send(nbytes)  # p = 8: 3 rounds
    assert cm.butterfly_time(nbytes, GLOO) == pytest.approx(want)
    prob = dict(batch=1, q_heads=8, head_dim=64, itemsize=4, stat_itemsize=4)
    got = cm.predict_merge("butterfly", 8192, GLOO, **prob)
    assert got.comm_s == pytest.approx(want)
    odd = dataclasses.replace(GLOO, nodes=3, devices_per_node=2)  # p = 6: 4 rounds
    shared_odd = cm.Link(GLOO.inter.alpha_s, GLOO.inter.beta_Bps / 2)
    assert cm.butterfly_time(nbytes, odd) == pytest.approx(4 * shared_odd.send(nbytes))
    twelve = dataclasses.replace(GLOO, nodes=3)  # p = 12 (4 per node): 5 rounds, all across
    assert cm.butterfly_time(nbytes, twelve) == pytest.approx(5 * shared.send(nbytes))
    one = dataclasses.replace(GLOO, nodes=1)  # p = 4: 2 rounds inside
    assert cm.butterfly_time(nbytes, one) == pytest.approx(2 * GLOO.intra.send(nbytes))
    single = dataclasses.replace(GLOO, nodes=1, devices_per_node=1)
    assert cm.butterfly_time(nbytes, single) == 0.0


def test_measured_collectives_take_precedence_in_a_merge():
    """A kind timed on the mesh (`Topology.measured`) is priced as measured, also inside a
    merge: the all-reduces are then not split by level, nor the butterfly's rounds."""
    ar, cp = cm.Link(1e-3, 1e9), cm.Link(2e-3, 1e9)
    timed = dataclasses.replace(GLOO, measured=(("all-reduce", ar), ("collective-permute", cp)))
    prob = dict(batch=1, q_heads=8, head_dim=64, itemsize=4, stat_itemsize=4)
    n = 8 * 4
    tree = cm.predict_merge("allreduce", 8192, timed, **prob)
    assert tree.comm_s == pytest.approx(ar.send(n) + ar.send(n * 64) + ar.send(n))
    fly = cm.predict_merge("butterfly", 8192, timed, **prob)
    assert fly.comm_s == pytest.approx(3 * cp.send(n * 66))
