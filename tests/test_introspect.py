"""What crosses the wire, read from the compiled program."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tree_attention_edu as tae
from tree_attention_edu.perf.introspect import parse_hlo, shape_bytes, structs


def stats(method, mesh, B=1, Tq=1, Hq=16, Hkv=16, D=128, Dv=128, Tk=8192):
    return tae.collective_stats(
        lambda q, k, v: method(q, k, v, mesh=mesh),
        *structs(mesh, Tk, batch=B, q_len=Tq, q_heads=Hq, kv_heads=Hkv, head_dim=D, v_dim=Dv),
    )


@pytest.mark.parametrize("Tk", [4096, 32768])
@pytest.mark.parametrize(("B", "Tq", "Hq", "Hkv", "Dv"), [(1, 1, 16, 16, 128), (2, 3, 8, 2, 64)])
def test_tree_bytes_are_independent_of_tk(mesh8, Tk, B, Tq, Hq, Hkv, Dv):
    s = stats(tae.tree_decode, mesh8, B=B, Tq=Tq, Hq=Hq, Hkv=Hkv, Dv=Dv, Tk=Tk)
    # Allreduce(max) of lse [B,Tq,Hq] + Allreduce(sum) of num [B,Tq,Hq,Dv] and den [B,Tq,Hq].
    assert s.total_bytes == B * Tq * Hq * (Dv + 2) * 4
    assert set(s.by_kind()) == {"all-reduce"}


def test_hierarchical_schedule_replica_groups(mesh2x4):
    s = stats(tae.tree_decode, mesh2x4)
    groups = [c.groups for c in s.collectives]
    inner = ((0, 1, 2, 3), (4, 5, 6, 7))  # inside each node ("gpu" axis)
    outer = ((0, 4), (1, 5), (2, 6), (3, 7))  # across nodes ("node" axis)
    assert groups == [inner, outer, inner, outer]  # max: gpu then node; sum: gpu then node
    assert s.total_bytes == 2 * 16 * (128 + 2) * 4  # one payload per level


@pytest.mark.parametrize("Tk", [4096, 16384])
@pytest.mark.parametrize("mesh_name", ["mesh8", "mesh2x4"])
def test_ring_bytes_match_formula(Tk, mesh_name, request):
    mesh = request.getfixturevalue(mesh_name)
    p, Hkv, D, Dv, itemsize = 8, 4, 64, 32, 4
    s = stats(tae.ring_decode, mesh, Hq=8, Hkv=Hkv, D=D, Dv=Dv, Tk=Tk)
    # Each of p-1 steps forwards one K block and one V block of Tk/p keys...
    assert s.by_kind()["collective-permute"] == (p - 1) * (Tk // p) * Hkv * (D + Dv) * itemsize
    # ...then one all-reduce broadcasts shard 0's output [B, Tq, Hq, Dv].
    assert s.by_kind()["all-reduce"] == 8 * Dv * itemsize
    assert set(s.by_kind()) == {"collective-permute", "all-reduce"}
    # A scan: one K and one V permute in the loop body, each run p-1 times.
    assert sorted(c.count for c in s.collectives) == [1, p - 1, p - 1]


def test_ring_to_tree_ratios(mesh8):
    ring = stats(tae.ring_decode, mesh8, Tk=65536).total_bytes
    tree = stats(tae.tree_decode, mesh8, Tk=65536).total_bytes
    assert ring == 939_524_096 + 8_192 and tree == 8_320  # K/V blocks + the output broadcast
    assert ring / tree >= 1e4
    mem = {
        m.__name__: tae.memory_stats(
            lambda q, k, v, m=m: m(q, k, v, mesh=mesh8), *structs(mesh8, 65536)
        ).temp_bytes
        for m in (tae.ring_decode, tae.tree_decode)
    }
    assert mem["ring_decode"] >= 2 * mem["tree_decode"]


def test_loop_collectives_count_trip_count(mesh8):
    """A fori_loop ring: 2 permutes in a while body of 7 trips count 14 times."""
    perm = [(i, (i + 1) % 8) for i in range(8)]

    def ring(k, v):
        def body(_, kv):
            return lax.ppermute(kv[0], "x", perm), lax.ppermute(kv[1], "x", perm)

        return lax.fori_loop(0, 7, body, (k, v))

    f = jax.shard_map(ring, mesh=mesh8, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x")))
    x = jax.ShapeDtypeStruct((8 * 16, 4), jnp.float32, sharding=NamedSharding(mesh8, P("x")))
    s = tae.collective_stats(f, x, x)
    assert [c.count for c in s.collectives] == [7, 7]
    assert s.total_bytes == 14 * 16 * 4 * 4


def test_unsharded_shape_structs(mesh8):
    q = jax.ShapeDtypeStruct((1, 1, 4, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 64, 4, 8), jnp.float32)
    s = tae.collective_stats(lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh8), q, k, k)
    assert s.by_kind()["all-reduce"] == 4 * (8 + 2) * 4


def test_parse_iota_replica_groups_and_tuples():
    hlo = """HloModule m
ENTRY %main (p: f32[4]) -> f32[4] {
  %ar = (f32[4]{0}, bf16[2,3]{1,0}) all-reduce(%p, %p), replica_groups=[2,4]<=[4,2]T(1,0), \
to_apply=%add
  %cp = f32[4]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}
}
"""
    s = parse_hlo(hlo)
    ar, cp = s.collectives
    assert ar.groups == ((0, 2, 4, 6), (1, 3, 5, 7)) and ar.bytes == 16 + 12
    assert cp.groups == ((0, 1), (1, 0)) and cp.bytes == 16
    assert shape_bytes("(f32[2,2], s32[], token[])") == 20


def test_bad_arguments_name_the_argument():
    x = jnp.zeros(4)
    for fn in (tae.collective_stats, tae.memory_stats):
        with pytest.raises(
            TypeError,
            match=r"`fn` must be a callable \(the function to "
            r"compile.*got int 42",
        ):
            fn(42, x)
    with pytest.raises(TypeError, match="`text` must be a str"):
        parse_hlo(b"HloModule m")
    with pytest.raises(ValueError, match="`text` has no ENTRY computation"):
        parse_hlo("not an HLO module")
    with pytest.raises(TypeError, match="`shape_text` must be a str"):
        shape_bytes(None)


def test_structs_place_qkv_as_the_decoders_do(mesh2x4):
    q, k, v = structs(
        mesh2x4,
        64,
        batch=2,
        q_len=3,
        q_heads=8,
        kv_heads=2,
        head_dim=16,
        v_dim=4,
        dtype=jnp.bfloat16,
    )
    assert (q.shape, k.shape, v.shape) == ((2, 3, 8, 16), (2, 64, 2, 16), (2, 64, 2, 4))
    assert {x.dtype for x in (q, k, v)} == {jnp.dtype(jnp.bfloat16)}
    assert q.sharding == NamedSharding(mesh2x4, P())
    assert k.sharding == v.sharding == NamedSharding(mesh2x4, P(None, ("node", "gpu")))
    # the abstract k holds 64 / 8 keys per device, as `tree_decode` shards it
    assert k.sharding.shard_shape(k.shape) == (2, 8, 2, 16)


def test_structs_defaults_are_the_paper_microbenchmark(mesh8):
    q, k, v = structs(mesh8, 1024)
    assert (q.shape, k.shape, v.shape) == ((1, 1, 16, 128), (1, 1024, 16, 128), (1, 1024, 16, 128))
    assert q.dtype == k.dtype == v.dtype == jnp.float32


def test_structs_seq_axes_and_layout(mesh2x4):
    _, k, v = structs(mesh2x4, 64, seq_axes="gpu", layout="bhtd", head_dim=8, v_dim=4)
    assert (k.shape, v.shape) == ((1, 16, 64, 8), (1, 16, 64, 4))
    assert k.sharding.spec == tae.core.decode.kv_spec(("gpu",), "bhtd") == P(None, None, ("gpu",))
    assert k.sharding.shard_shape(k.shape) == (1, 16, 16, 8)  # replicated across nodes


def test_structs_measure_what_the_real_arrays_measure(mesh8):
    """Compiling on the structs gives the same program as compiling on placed arrays."""
    shapes = dict(batch=2, q_heads=4, kv_heads=2, head_dim=8, v_dim=8)
    abstract = structs(mesh8, 256, **shapes)
    arrays = [jax.device_put(jnp.ones(s.shape, s.dtype), s.sharding) for s in abstract]
    fn = lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh8)  # noqa: E731
    assert str(tae.collective_stats(fn, *abstract)) == str(tae.collective_stats(fn, *arrays))
    assert tae.collective_stats(fn, *abstract).total_bytes == 2 * 4 * (8 + 2) * 4


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        (dict(mesh="x", kv_len=64), TypeError, "mesh"),
        (dict(kv_len=60), ValueError, "kv_len"),
        (dict(kv_len=64.0), TypeError, "kv_len"),
        (dict(kv_len=64, q_heads=0), ValueError, "q_heads"),
        (dict(kv_len=64, q_heads=6, kv_heads=4), ValueError, "q_heads"),
        (dict(kv_len=64, dtype=jnp.int32), TypeError, "dtype"),
        (dict(kv_len=64, seq_axes="y"), ValueError, "seq_axes"),
        (dict(kv_len=64, layout="tbhd"), ValueError, "layout"),
    ],
)
def test_structs_bad_arguments_name_the_argument(mesh8, kwargs, exc, name):
    kwargs = {"mesh": mesh8, **kwargs}
    with pytest.raises(exc, match=f"`{name}`"):
        structs(kwargs.pop("mesh"), kwargs.pop("kv_len"), **kwargs)


@pytest.mark.parametrize(
    "dtype",
    [
        jnp.int4,
        jnp.uint2,
        jnp.float4_e2m1fn,
        jnp.float8_e4m3fn,
        jnp.float8_e8m0fnu,
        jnp.complex128,
        jnp.bool_,
        jnp.bfloat16,
    ],
)
def test_shape_bytes_of_every_kind_of_xla_type(dtype):
    """Against XLA's own memory analysis: the parameter as the signature prints it (no
    layout: sub-byte types packed) and the output as its instruction prints it (with the
    layout, `{0:E(4)}` where packed)."""
    compiled = jax.jit(lambda x: x.reshape(-1)[1:]).lower(jnp.zeros((3, 5), dtype)).compile()
    text = compiled.as_text()
    param = re.search(r"ENTRY[^\n]*?: (.*?)\) ->", text).group(1)
    root = re.search(r"ROOT %\S+ = (.*?) \w+\(", text).group(1)
    mem = compiled.memory_analysis()
    assert shape_bytes(param) == mem.argument_size_in_bytes
    assert shape_bytes(root) == mem.output_size_in_bytes
