"""Closed-form costs against the compiled program and the paper's formulas."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tree_attention_edu as tae
from tree_attention_edu import costmodel as cm


@pytest.mark.parametrize(("n", "p", "b"), [(1, 1, 2), (1024, 1, 2), (1024, 8, 2), (1000, 7, 3),
                                           (5, 8, 2), (2**20, 128, 2)])
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
    assert ring.total_bytes == cm.ring_payload_bytes(B, tk, Hkv, D, Dv, p)


def test_paper_formulas():
    b, t, n_h, d_h, p = 1, 8192, 16, 128, 8
    d = n_h * d_h
    # Mem_ring - Mem_tree = 2btd - 2bn_h: tree saves the second K/V buffer.
    assert cm.paper_memory_ring(b, t, n_h, d_h) - cm.paper_memory_tree(b, t, n_h, d_h) == \
        2 * b * t * d - 2 * b * n_h
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
    """Two-level meshes pay the tree payload once per level; a ragged Tk pads the ring blocks."""
    mesh = tae.make_mesh(shape, axes)
    B, Tq, Hq, Hkv, D, Dv, tk = 1, 1, 4, 2, 16, 8, 4100
    kv = NamedSharding(mesh, P())  # 4100 keys do not split 8 ways: the decoder pads them
    kshape = (B, tk, Hkv, D) if layout == "bthd" else (B, Hkv, tk, D)
    vshape = (*kshape[:3], Dv)
    q = jax.ShapeDtypeStruct((B, Tq, Hq, D), jnp.float32, sharding=NamedSharding(mesh, P()))
    k = jax.ShapeDtypeStruct(kshape, jnp.float32, sharding=kv)
    v = jax.ShapeDtypeStruct(vshape, jnp.float32, sharding=kv)
    kw = dict(mesh=mesh, layout=layout)
    tree = tae.collective_stats(lambda q, k, v: tae.tree_decode(q, k, v, **kw), q, k, v)
    ring = tae.collective_stats(lambda q, k, v: tae.ring_decode(q, k, v, **kw), q, k, v)
    assert tree.total_bytes == cm.tree_payload_bytes(B, Tq, Hq, Dv, levels=len(shape))
    assert ring.total_bytes == cm.ring_payload_bytes(B, tk, Hkv, D, Dv, 8)


def test_model_reduces_to_paper_formulas():
    """Symbolically: the model's memory is eqs. 8-9, and its ring-allreduce wire volume of the
    tree payload is eq. 14."""
    b, t, n_h, d_h = sympy.symbols("b t n_h d_h", positive=True, integer=True)
    d = n_h * d_h
    assert sympy.simplify(cm.peak_memory_tree(b, t, n_h, d_h) - (2*b*t*d + 2*b*d + 2*b*n_h)) == 0
    assert sympy.simplify(cm.peak_memory_ring(b, t, n_h, d_h) - (4*b*t*d + 2*b*d)) == 0
    unit = cm.Link(alpha_s=0, beta_Bps=1)  # time = elements on the wire
    for p in (2, 8, 128):
        payload = cm.tree_payload_bytes(b, 1, n_h, d_h, itemsize=1)
        wire = cm.ring_allreduce_time(payload, p, unit)
        assert sympy.simplify(wire - cm.paper_volume_tree(b, n_h, d_h, p)) == 0


def test_allreduce_choice_and_hierarchy():
    link = cm.Link(alpha_s=10e-6, beta_Bps=10e9)
    # Latency-bound messages take the log-depth tree; bandwidth-bound ones the ring.
    assert cm.allreduce_time(1e3, 64, link)[1] == "tree"
    assert cm.allreduce_time(1e9, 64, link)[1] == "ring"
    t, _ = cm.allreduce_time(1e3, 64, link)
    assert t == pytest.approx(6 * (10e-6 + 1e3 / 10e9))
    # Hierarchical: intra-node stage over 8 devices, inter-node stage over 16 nodes.
    topo = cm.DGX_H100
    want = cm.allreduce_time(4096, 8, topo.intra)[0] + cm.allreduce_time(4096, 16, topo.inter)[0]
    assert cm.hierarchical_allreduce_time(4096, topo) == pytest.approx(want)
    assert cm.hierarchical_allreduce_time(4096, topo.with_devices(8)) == pytest.approx(
        cm.allreduce_time(4096, 8, topo.intra)[0])
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
    send = 2 * topo.inter.send(t * 16 * 128 * 2)  # the ring crosses nodes: the slow link
    assert ring.comm_s == pytest.approx(15 * (send - block_s))  # overlap hides one block
    no_overlap = cm.predict_ring(2**20, topo, overlap=False)
    assert no_overlap.comm_s == pytest.approx(15 * send)
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
    assert (cm.decode_intensity(1, 4), cm.decode_intensity(1, 2), cm.decode_intensity(4, 2)) \
        == (0.5, 1.0, 4.0)
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
    assert cm.local_decode_time(b, t, hkv, d, d, hkv * group, unit, itemsize, q_len) == \
        max(nbytes, flops)
    assert cm.decode_intensity(group, itemsize, q_len) == flops / nbytes


def test_ridge_point():
    assert cm.DGX_H100.ridge_point == pytest.approx(989e12 / 3.35e12)
    # Decode of Llama 3.1-8B is memory-bound on an H100 up to 73 queries per step.
    assert cm.decode_intensity(4, 2, q_len=73) < cm.DGX_H100.ridge_point
    assert cm.decode_intensity(4, 2, q_len=74) > cm.DGX_H100.ridge_point


def test_model_shape_counts_the_weights_of_the_model():
    """`ModelShape.params` against the package's own model, and Llama 3.1-8B's 8.03B."""
    from tree_attention_edu import model

    for cfg in (model.PRESETS["tiny"], model.Config(tie_embeddings=True, q_heads=8, kv_heads=1)):
        params = model.init_params(cfg, jax.random.key(0))
        shape = cm.ModelShape(cfg.layers, cfg.dim, cfg.q_heads, cfg.kv_heads, cfg.head_dim,
                              cfg.hidden, cfg.vocab, cfg.tie_embeddings)
        assert shape.params == sum(x.size for x in jax.tree.leaves(params))
    llama = cm.LLAMA_3_1_8B
    assert llama.params == 8_030_261_248  # "8.03B" on the model card
    assert llama.weight_bytes == 2 * llama.params
    assert llama.q_heads * llama.head_dim == llama.dim


def test_paper_microbenchmark_and_generation_time():
    pred = cm.paper_microbenchmark(1_280_000, 16)
    topo = cm.DGX_H100.with_devices(16)
    assert pred["tree"] == cm.predict_tree(1_280_000, topo, q_heads=16, head_dim=128,
                                           itemsize=2)
    assert pred["ring"] == cm.predict_ring(1_280_000, topo, q_heads=16, head_dim=128,
                                           itemsize=2)
    node = cm.DGX_H100.with_devices(8)
    llama = cm.LLAMA_3_1_8B
    got = cm.generation_time(65536, node, tokens=3)
    for method, fn in (("tree", cm.predict_tree), ("ring", cm.predict_ring)):
        step = fn(65536, node, q_heads=32, kv_heads=8, head_dim=128, itemsize=2).total_s
        assert got[method] == pytest.approx(3 * (32 * step + llama.weight_bytes / 3.35e12))
    assert got["ring"] > got["tree"]


def test_paper_llama_table_is_consistent():
    """The transcribed means reproduce the table's own rounded speedup column."""
    assert PAPER_KEYS == set(cm.PAPER_LLAMA) == set(cm.PAPER_LLAMA_STDERR) \
        == set(cm.PAPER_LLAMA_SPEEDUP)
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
