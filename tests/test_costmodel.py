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
