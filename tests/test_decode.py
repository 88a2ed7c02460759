"""Tree, energy-tree and ring decoding against the float64 reference, on 8 simulated devices."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import padded, rand_qkv, tol
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import np_attention

import tree_attention_edu as tae
from tree_attention_edu.core import decode

METHODS = [padded(f) for f in (tae.tree_decode, tae.tree_decode_from_energy, tae.ring_decode)]
# The shapes the differential grid (tests/test_differential.py: every decoder and merge, on
# 1 to 8 devices and two 2x4 meshes, lengths 0, mid-shard and full, causal, GQA, every dtype
# and layout) does not reach: a cache the devices do not divide, several causal queries
# with ragged lengths, one kv head for four query heads, one key, and shards longer than
# the xla kernel's block (its scan over blocks plus a tail block).
HARD_CASES = {
    "tk_not_divisible": (dict(Tk=29), dict()),
    "causal_ragged": (dict(Tq=3, Tk=37), dict(causal=True, kv_lengths=np.array([2, 33]))),
    "mqa": (dict(Hq=4, Hkv=1), dict()),
    "single_key": (dict(Tk=1), dict()),
    "long_shards": (
        dict(B=1, Tq=1, Hq=2, Hkv=1, Tk=8 * 263 - 3),
        dict(kv_lengths=np.array([2000])),
    ),
}


@pytest.mark.parametrize("method", METHODS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("case", "mesh_name"),  # each case on one mesh, alternating
    [(c, ("mesh8", "mesh2x4")[i % 2]) for i, c in enumerate(sorted(HARD_CASES))],
)
def test_hard_cases_float64(method, case, mesh_name, request):
    mesh = request.getfixturevalue(mesh_name)
    shape, kw = HARD_CASES[case]
    q, k, v = rand_qkv(sorted(HARD_CASES).index(case), **shape)
    out = method(q, k, v, mesh=mesh, **kw)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(out, np_attention(q, k, v, **kw), **tol(jnp.float64))


@pytest.mark.parametrize("method", METHODS, ids=lambda f: f.__name__)
def test_head_major_cache(method, mesh2x4):
    """A `[B, Hkv, Tk, D]` cache sharded along axis 2 gives the same answer."""
    q, k, v = rand_qkv(9, Tq=2, Tk=37)
    kw = dict(causal=True, kv_lengths=np.array([37, 11]))
    kh, vh = (jnp.swapaxes(x, 1, 2) for x in (k, v))
    out = method(q, kh, vh, mesh=mesh2x4, layout="bhtd", **kw)
    np.testing.assert_allclose(out, np_attention(q, k, v, **kw), **tol(jnp.float64))
    with pytest.raises(ValueError, match=r"`k`.*and `v`.*must agree"):
        method(q, kh, vh[:, :, :5], mesh=mesh2x4, layout="bhtd")


def test_sharded_inputs_and_jit(mesh8):
    q, k, v = rand_qkv(4, Tk=64)
    kv_sharding = NamedSharding(mesh8, P(None, "x"))
    k, v = jax.device_put(k, kv_sharding), jax.device_put(v, kv_sharding)
    out = jax.jit(lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh8))(q, k, v)
    np.testing.assert_allclose(out, np_attention(q, k, v), **tol(q.dtype))


def test_inputs_placed_elsewhere_are_moved_onto_the_mesh(mesh8):
    """Arrays committed to one device, or sharded on another mesh, are placed on the decode's
    mesh (JAX's jit refuses them with 'incompatible devices')."""
    q, k, v = rand_qkv(7, Tk=16)
    want = np_attention(q, k, v)
    devs = jax.devices()
    other = NamedSharding(tae.make_mesh(4, "y", devices=devs[4:]), P(None, "y"))
    placements = {
        "committed to one device": (
            jax.device_put(q, devs[5]),
            jax.device_put(k, devs[3]),
            jax.device_put(v, devs[3]),
        ),
        "sharded on another mesh": (q, jax.device_put(k, other), jax.device_put(v, other)),
    }
    for name, (qq, kk, vv) in placements.items():
        for f in (tae.tree_decode, tae.ring_decode, tae.ring_decode_pass_q):
            np.testing.assert_allclose(
                f(qq, kk, vv, mesh=mesh8), want, **tol(jnp.float64), err_msg=f"{f.__name__}: {name}"
            )


# Placement happens once, at every decoder's door, before any merge: one merge stands for all.
REVERSED_MESH_DECODERS = {
    "tree_decode[allreduce]": partial(tae.tree_decode, merge="allreduce"),
    "tree_decode_from_energy": tae.tree_decode_from_energy,
    "ring_decode": tae.ring_decode,
    "ring_decode_pass_q": tae.ring_decode_pass_q,
}


@pytest.mark.cpu_only
@pytest.mark.parametrize("name", [*REVERSED_MESH_DECODERS, "tree_energy"])
def test_inputs_on_the_same_devices_in_another_order(name):
    """q, k, v and the lengths on a mesh of the decode's devices in reverse order: `jit`
    needs one device order for all its arguments (the same set is not enough; it raised
    'Received incompatible devices for jitted computation'), so they are placed first."""
    mesh = tae.make_mesh(6, "x")
    rev = Mesh(np.array(jax.devices()[:6])[::-1], ("x",))
    q, k, v = rand_qkv(8, Tk=12)
    n = np.array([12, 5], np.int32)
    kw = dict(causal=True, kv_lengths=n)
    qq, nn = (jax.device_put(x, NamedSharding(rev, P())) for x in (q, n))
    kk, vv = (jax.device_put(x, NamedSharding(rev, P(None, "x"))) for x in (k, v))
    if name == "tree_energy":
        zeta = jnp.asarray(np.random.default_rng(9).standard_normal((2, 3, 4, 6)))
        zz = jax.device_put(zeta, NamedSharding(rev, P()))
        got = tae.tree_energy(qq, kk, vv, zz, mesh=mesh, causal=True, kv_lengths=nn)
        want = tae.energy(q, k, v, zeta, **kw)
    else:
        got = REVERSED_MESH_DECODERS[name](qq, kk, vv, mesh=mesh, causal=True, kv_lengths=nn)
        want = np_attention(q, k, v, **kw)
    np.testing.assert_allclose(got, want, **tol(jnp.float64))


@pytest.mark.cpu_only
def test_inputs_placed_as_wanted_are_not_copied():
    """An argument already sharded as the decode shards it is passed on as it is; one on a
    mesh of the same devices in the same order (another shape) is left to `jit`."""
    mesh = tae.make_mesh(8, "x")
    q, k, v = rand_qkv(10, Tk=16)
    static = dict(seq_axes=None, scale=None, causal=False, local_kernel="xla", layout="bthd")
    plan, _ = decode.make_plan(q, k, v, mesh=mesh, kv_lengths=None, **static)
    kk = jax.device_put(k, NamedSharding(mesh, plan.kv_spec))
    same_order = tae.make_mesh((2, 4), ("node", "gpu"))
    vv = jax.device_put(v, NamedSharding(same_order, P(None, ("node", "gpu"))))
    qq = jax.device_put(q, NamedSharding(mesh, P()))
    placed = decode._place(plan, qq, kk, vv, None)
    assert all(a is b for a, b in zip(placed, (qq, kk, vv, None), strict=True))
    np.testing.assert_allclose(
        tae.tree_decode(qq, kk, vv, mesh=mesh), np_attention(q, k, v), **tol(jnp.float64)
    )
    rev = Mesh(np.array(jax.devices())[::-1], ("x",))
    moved = decode._place(plan, q, jax.device_put(k, NamedSharding(rev, P(None, "x"))), v, None)[1]
    assert moved.sharding == NamedSharding(mesh, plan.kv_spec)


def test_seq_axes_subset(mesh2x4):
    """Sharding over "gpu" only replicates the cache across "node"; the answer is unchanged."""
    q, k, v = rand_qkv(5, Tk=20)
    out = padded(tae.tree_decode)(q, k, v, mesh=mesh2x4, seq_axes="gpu")
    np.testing.assert_allclose(out, np_attention(q, k, v), **tol(q.dtype))


def test_huge_logits(mesh8):
    q, k, v = rand_qkv(6, Tk=40)
    out = padded(tae.tree_decode)(q * 300, k * 300, v, mesh=mesh8)
    np.testing.assert_allclose(out, np_attention(q * 300, k * 300, v), **tol(q.dtype))


def test_bad_mesh_arguments(mesh2x4):
    q, k, v = rand_qkv(0)
    with pytest.raises(ValueError, match=r"`seq_axes` names \['seq'\].*not axes of the mesh"):
        tae.tree_decode(q, k, v, mesh=mesh2x4, seq_axes="seq")
    with pytest.raises(TypeError, match=r"`mesh` must be a jax\.sharding\.Mesh"):
        tae.ring_decode(q, k, v, mesh="x")
    with pytest.raises(ValueError, match=r"`k`.*and `v`.*must agree"):
        tae.tree_decode(q, k, v[:, :4], mesh=mesh2x4)


@pytest.mark.cpu_only
def test_too_many_devices_requested():
    msg = r"needs 16 devices but JAX sees 8.*simulate_devices\(16\)"
    with pytest.raises(ValueError, match=msg):
        tae.make_mesh((4, 4), ("node", "gpu"))
    with pytest.raises(ValueError, match="has 2 axes but `axis_names`"):
        tae.make_mesh((2, 4), ("x",))


@pytest.mark.cpu_only
def test_simulate_devices_too_late():
    tae.simulate_devices(8)  # already 8: fine
    with pytest.raises(RuntimeError, match=r"already initialised with 8.*Restart the Python"):
        tae.simulate_devices(16)


def test_flash_on_cpu_is_a_clear_error(mesh8):
    q, k, v = rand_qkv(0, Dv=8, Tk=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="local_kernel='flash' needs a CUDA GPU"):
        tae.tree_decode(q, k, v, mesh=mesh8, local_kernel="flash")
    with pytest.raises(ValueError, match="`local_kernel` must be one of"):
        tae.tree_decode(q, k, v, mesh=mesh8, local_kernel="cuda")
