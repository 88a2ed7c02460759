"""Closed-form costs against the compiled program and the paper's formulas."""

import math

import jax
import jax.numpy as jnp
import pytest
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


def test_bad_arguments():
    with pytest.raises(ValueError):
        cm.reduction_steps(0, 1)
