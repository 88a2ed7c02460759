"""The ring's permute link on the simulated devices: `ppermute` used the way the pass-KV
ring uses it, on blocks shaped like the cache. Its programs (`ring_pass_calls`), the
seconds per message they give (`ring_pass_points`, `ring_pass_times`), the link fitted from
them (`ring_link`), and that link fitted again from the programs timed in other programs'
rounds (`refit_ring_link`): `calibrate.validate_patterns(local=True)` times them in the
cells' rounds, as it does the local parts (`perf.localfit`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import validate
from ..core.decode import kv_spec
from . import benchmark
from .links import Link, Topology
from .microbench import check_points, check_times, fit_link

RING_PASS = "ring pass "
"""The start of each `ring_pass_calls` program's name; its end is the message's bytes."""


def ring_pass_calls(
    mesh: Mesh, problem: benchmark.Problem, sizes: Iterable[int]
) -> dict[str, tuple[Callable, tuple]]:
    """`ring_pass_times`' programs as `"ring pass <bytes>" -> (fn, (k, v))`, `<bytes>` the
    message each moves (the size rounded down to whole keys, at least one), for timing in
    other programs' rounds (`ring_pass_points` reads their medians). `sizes`: positive
    ints; sizes that round to the same keys make one program. K and V are two arrays, as
    in the ring's cache."""
    validate.check_instance(mesh, Mesh, "mesh", "e.g. tree_attention_edu.make_mesh(8, 'x')")
    validate.check_instance(problem, benchmark.Problem, "problem", "modelcheck.PROBLEM")
    sizes = validate.check_sizes_list(sizes, "sizes", "message_sizes([2**20, 2**23])")
    axes = tuple(mesh.axis_names)
    p = mesh.size
    perm = [(i, (i + 1) % p) for i in range(p)]
    key_bytes = problem.batch * problem.kv_heads * problem.head_dim
    key_bytes *= jnp.dtype(problem.dtype).itemsize
    spec = kv_spec(axes)

    def body(k, v):
        acc = jnp.zeros((), jnp.float32)
        for _ in range(p - 1):
            k_next, v_next = lax.ppermute(k, axes, perm), lax.ppermute(v, axes, perm)
            acc = acc + jnp.sum(k, dtype=jnp.float32) + jnp.sum(v, dtype=jnp.float32)
            k, v = k_next, v_next
        return acc[None]

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=P(axes), check_vma=False)
    )
    calls: dict[str, tuple[Callable, tuple]] = {}
    for n in sizes:
        keys = max(1, n // key_bytes)
        shape = (problem.batch, keys * p, problem.kv_heads, problem.head_dim)
        k, v = (
            jax.device_put(jnp.full(shape, c, problem.dtype), NamedSharding(mesh, spec))
            for c in (1.0, 2.0)
        )
        calls[f"{RING_PASS}{keys * key_bytes}"] = (fn, (k, v))
    return calls


def ring_pass_points(p: int, seconds: dict[str, float]) -> list[tuple[int, float]]:
    """`(message bytes, seconds per message)` from the times of `ring_pass_calls`' programs
    (`seconds`, by name; other names are left alone): each over its 2(p−1) messages (on one
    device, where a program holds no permute, over 2)."""
    p = validate.check_int(p, "p", example="`p=mesh.size`")
    check_times(seconds, (), "ring_pass_calls")  # a dict, before reading its names
    ours = {k: k[len(RING_PASS) :] for k in seconds if str(k).startswith(RING_PASS)}
    for k, n in ours.items():
        if not (n.isascii() and n.isdigit() and n[0] != "0"):
            raise ValueError(f"`seconds` has {k!r}: a ring-pass name ends in a positive int.")
    times = check_times(seconds, ours, "ring_pass_calls")
    return sorted((int(n), times[k] / (2 * max(p - 1, 1))) for k, n in ours.items())


def ring_pass_times(
    mesh: Mesh, problem: benchmark.Problem, sizes: Iterable[int], *, repeats: int = 5
) -> list[tuple[int, float]]:
    """Seconds per message of `ppermute` used the way a ring uses it.

    For each per-device message size, K and V blocks shaped like the problem's cache
    (`[B, keys, Hkv, D]`) go around the ring for p−1 chained steps (each step's blocks are
    read, as the decode does); the time is divided by the 2(p−1) messages. Communication
    only: no attention. (On XLA:CPU, chained permutes of 4-D blocks cost several times what
    one permute of a flat buffer suggests, so the link is measured in this shape.)
    """
    calls = ring_pass_calls(mesh, problem, sizes)
    times = {
        k: benchmark.median_time(fn, *args, repeats=repeats) for k, (fn, args) in calls.items()
    }
    return ring_pass_points(mesh.size, times)


def refit_ring_link(topology: Topology, seconds: dict[str, float]) -> Topology:
    """`topology` with its ring-pass link (`intra` and `inter`) fitted again, as
    `calibrate.measure_topology` fits it (`ring_link`), from the medians of
    `ring_pass_calls`' programs (`seconds`, by name, "ring pass <bytes>"; other names are
    left alone). `topology` is one node's simulated devices, as `measure_topology` makes
    it: one link for both levels."""
    validate.check_instance(topology, Topology, "topology", "calibrate.measure_topology(...)")
    if topology.nodes != 1:
        raise ValueError(
            f"`topology` has {topology.nodes} nodes; the ring-pass link is measured on one "
            "node's simulated devices (`calibrate.measure_topology`), one link for both levels."
        )
    points = ring_pass_points(topology.devices, seconds)
    if not points:
        raise ValueError(
            f'`seconds` holds no "{RING_PASS}<bytes>" time: time the programs of '
            "`ring_pass_calls(mesh, problem, sizes)` with the others."
        )
    link = ring_link(points, topology.overhead_s, topology.devices)
    return replace(topology, intra=link, inter=link)


def ring_link(points: Iterable[tuple[float, float]], overhead_s: float, p: int) -> Link:
    """The ring-pass link (`fit_link` with its curve) from `ring_pass_points`' seconds per
    message on `p` devices, each less its share of the per-call overhead `overhead_s`: one
    program holds 2(p−1) messages, and its dispatch is spread over them."""
    pts = check_points(points)
    validate.check_real(overhead_s, "overhead_s", low=0.0, hint="seconds per call")
    p = validate.check_int(p, "p", example="`p=mesh.size`")
    share = overhead_s / (2 * max(p - 1, 1))
    return fit_link([(n, max(t - share, 0.0)) for n, t in pts], keep_points=True)
