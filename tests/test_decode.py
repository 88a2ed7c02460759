"""Tree, energy-tree and ring decoding against the float64 reference, on 8 simulated devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import padded, rand_qkv, tol
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from reference import np_attention

import tree_attention_edu as tae

METHODS = [padded(f) for f in (tae.tree_decode, tae.tree_decode_from_energy, tae.ring_decode)]
HARD_CASES = {
    "plain": (dict(), dict()),
    "tk_not_divisible": (dict(Tk=29), dict()),
    "ragged_fully_masked_shards": (dict(Tk=32), dict(kv_lengths=np.array([3, 0]))),
    "causal_multi_token": (dict(Tq=4, Tk=40), dict(causal=True)),
    "causal_ragged": (dict(Tq=3, Tk=37), dict(causal=True, kv_lengths=np.array([2, 33]))),
    "mqa": (dict(Hq=4, Hkv=1), dict()),
    "batch3_gqa": (dict(B=3, Hq=6, Hkv=2, Tk=24), dict(kv_lengths=np.array([24, 7, 13]))),
    "single_key": (dict(Tk=1), dict()),
    # Shards longer than the xla kernel's block: its scan over blocks plus a tail block.
    "long_shards": (dict(B=1, Tq=1, Hq=2, Hkv=1, Tk=8 * 263 - 3),
                    dict(kv_lengths=np.array([2000]))),
}


@pytest.mark.parametrize("method", METHODS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(("case", "mesh_name"),  # each case on one mesh: the grid of
                         [(c, ("mesh8", "mesh2x4")[i % 2])  # test_differential has both
                          for i, c in enumerate(sorted(HARD_CASES))])
def test_hard_cases_float64(method, case, mesh_name, request):
    mesh = request.getfixturevalue(mesh_name)
    shape, kw = HARD_CASES[case]
    q, k, v = rand_qkv(sorted(HARD_CASES).index(case), **shape)
    out = method(q, k, v, mesh=mesh, **kw)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(out, np_attention(q, k, v, **kw), **tol(jnp.float64))


@pytest.mark.parametrize("method", METHODS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_low_precision_returns_input_dtype(method, dtype, mesh2x4):
    q, k, v = rand_qkv(3, Tk=45, dtype=dtype)
    kw = dict(causal=True, kv_lengths=np.array([45, 20]))
    out = method(q, k, v, mesh=mesh2x4, **kw)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), np_attention(q, k, v, **kw),
                               **tol(dtype))


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
        "committed to one device": (jax.device_put(q, devs[5]), jax.device_put(k, devs[3]),
                                    jax.device_put(v, devs[3])),
        "sharded on another mesh": (q, jax.device_put(k, other), jax.device_put(v, other)),
    }
    for name, (qq, kk, vv) in placements.items():
        for f in (tae.tree_decode, tae.ring_decode, tae.ring_decode_pass_q):
            np.testing.assert_allclose(f(qq, kk, vv, mesh=mesh8), want, **tol(jnp.float64),
                                       err_msg=f"{f.__name__}: {name}")


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
