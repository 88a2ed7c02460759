"""Speed of generation against the memory roofline of this machine.

A decode step at batch 1 is a chain of matrix-vector products: it reads every weight once
and the whole KV cache once, and does about two flops per weight it reads, far too few to
be limited by arithmetic. Its time is bounded below by the bytes it reads over the read
bandwidth of the memory: the *roofline* time. `step_bytes` counts those bytes,
`decode_speed` measures a decode step next to the machine's read bandwidth
(`perf.benchmark.DeviceReader`, a `jnp.sum` over 256 MiB), alternating the two so that the
other work on a shared machine slows both alike.

Bytes per step, for a model of `W` weight bytes and a cache of `C` bytes:

* `single` (one device): `W + C`;
* `tree` on `p` *simulated* devices: `p·W + C`. The weights are replicated (this package
  shards the sequence, not the weights), and every device computes the replicated matrix
  products itself, so the one memory bus of this machine carries the weights `p` times,
  and each device its `C/p` of the cache. On `p` real GPUs each reads `W + C/p` from its
  own memory, in parallel: the roofline there is `(W + C/p) / bandwidth of one GPU`.
* `ring`: every device also folds all `p` blocks of the cache (the query is replicated), so
  the cache is read `p` times, besides the blocks it passes around: `p·W + p·C` at least
  (`StepBytes.cache_reads`).

`W` counts every layer weight, the final RMSNorm and the output projection (the embedding
itself when the embeddings are tied; a step looks up only one row of it otherwise), and `C`
every layer's K and V over the cache's capacity: the kernels read every slot and mask the
ones past each sequence's length.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ..core import validate
from ..core.names import Method
from ..perf.benchmark import DeviceReader
from .cache import KVCache, empty_cache
from .config import Config, Params, check_config, check_params
from .forward import METHODS
from .generator import Generator

ITEMSIZE = 4
"""Bytes per weight and per cache entry: the model computes, and keeps its cache, in float32."""


@dataclass(frozen=True)
class StepBytes:
    """What one decode step reads: `weights` (bytes, one copy) and `cache` (bytes, all
    devices together), how many `devices` hold a replica of the weights, and how many times
    the devices together read the cache (`cache_reads`: 1 for single and tree; `p` for the
    ring, whose every device folds every block)."""

    weights: int
    cache: int
    devices: int = 1
    cache_reads: int = 1

    @property
    def per_device(self) -> int:
        """One device's bytes: the weights and its share of the cache reads (a real GPU's
        load: `C/p` for tree, all of `C` for the ring)."""
        return self.weights + self.cache_reads * self.cache // self.devices

    @property
    def machine(self) -> int:
        """The bytes this machine's memory carries when the devices are simulated on it:
        each reads the replicated weights, and together they read the cache
        `cache_reads` times."""
        return self.devices * self.weights + self.cache_reads * self.cache


def weight_bytes(params: Params, cfg: Config) -> int:
    """Bytes of the weights a decode step reads: every layer weight, the final RMSNorm and
    the output projection (`embed` when tied, `unembed` otherwise), at their own dtypes."""
    check_params(params, cfg)
    read = [
        params["layers"],
        params["final_norm"],
        params["embed"] if cfg.tie_embeddings else params["unembed"],
    ]
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(read))


def cache_bytes(cfg: Config, capacity: int, batch: int = 1) -> int:
    """Bytes of a float32 cache of `capacity` positions: `layers · 2 · B · Hkv · S · D · 4`."""
    check_config(cfg)
    validate.check_int(capacity, "capacity")
    validate.check_int(batch, "batch")
    return cfg.layers * 2 * batch * cfg.kv_heads * capacity * cfg.head_dim * ITEMSIZE


def step_bytes(
    params: Params,
    cfg: Config,
    capacity: int,
    batch: int = 1,
    devices: int = 1,
    method: Method = "tree",
) -> StepBytes:
    """The bytes of one decode step of `method` (see the module docstring), for `devices`
    replicas."""
    validate.check_int(devices, "devices")
    validate.check_choice(method, METHODS, "method")
    return StepBytes(
        weight_bytes(params, cfg),
        cache_bytes(cfg, capacity, batch),
        devices,
        devices if method == "ring" else 1,
    )


@dataclass
class Speed:
    """One method at one context: the bytes, the measured bandwidth and step time.

    `read_gbs` is the machine's read bandwidth measured between the steps (median);
    `roofline_s = bytes / read_gbs` with the bytes this machine carries (`machine_bytes`);
    `median_s` the median decode step; `fraction = roofline_s / median_s`;
    `gpu_roofline_s`: what `p` real devices of the same bandwidth would need
    (`per_device_bytes / read_gbs`)."""

    method: str
    devices: int
    context: int
    capacity: int
    batch: int
    weight_bytes: int
    cache_bytes: int
    machine_bytes: int
    per_device_bytes: int
    read_gbs: float
    roofline_s: float
    gpu_roofline_s: float
    median_s: float
    step_s: list[float]
    compile_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.median_s

    @property
    def fraction(self) -> float:
        return self.roofline_s / self.median_s

    def as_json(self) -> dict:
        return asdict(self) | {"tokens_per_s": self.tokens_per_s, "fraction": self.fraction}


def synthetic_cache(
    cfg: Config, batch: int, capacity: int, context: int, mesh: Mesh, key: jax.Array
) -> KVCache:
    """A cache of `capacity` positions holding random keys and values, `context` of them
    filled per sequence (lengths = `context`): what a prefill would leave, for timing. What
    the entries hold does not change the bytes a step reads or the work it does."""
    validate.check_int(context, "context")
    if context >= capacity:
        raise ValueError(
            f"`context` {context} must be below `capacity` {capacity}, to leave "
            f"room for the decoded tokens."
        )
    empty = empty_cache(cfg, batch, capacity, mesh)
    sharding = empty.layers[0][0].sharding
    keys = iter(jax.random.split(key, 2 * cfg.layers))

    def fill(k):
        return jax.jit(
            lambda: jax.random.normal(k, empty.layers[0][0].shape, jnp.float32),
            out_shardings=sharding,
        )()

    layers = tuple((fill(next(keys)), fill(next(keys))) for _ in range(cfg.layers))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return KVCache(layers, jax.device_put(jnp.full((batch,), context, jnp.int32), rep))


def decode_speed(
    params: Params,
    cfg: Config,
    mesh: Mesh,
    method: Method,
    context: int,
    *,
    steps: int = 8,
    batch: int = 1,
    reader: DeviceReader | None = None,
    seed: int = 0,
) -> Speed:
    """Time `steps` greedy decode steps of `method` after a context of `context` tokens,
    alternating each step with one read of `reader` (a `DeviceReader`, built if None).

    The cache is `synthetic_cache` with `capacity = context + steps + 1` rounded up to the
    device count; the first step compiles and is not timed. Returns a `Speed`.
    """
    validate.check_choice(method, METHODS, "method")
    validate.check_int(steps, "steps")
    gen = Generator(params, cfg, mesh, method)
    p = gen.mesh.size
    capacity = -(-(context + steps + 1) // p) * p
    key = jax.random.key(seed)
    cache = synthetic_cache(cfg, batch, capacity, context, gen.mesh, key)
    tok = jax.device_put(jnp.zeros((batch,), jnp.int32), gen._rep)
    t0 = time.perf_counter()
    tok, _, cache = gen.step(cache, tok)
    jax.block_until_ready(tok)
    compile_s = time.perf_counter() - t0
    reader = DeviceReader() if reader is None else reader
    times, gbs = [], []
    for _ in range(steps):
        gbs.append(reader.gbs())
        t0 = time.perf_counter()
        tok, _, cache = gen.step(cache, tok)
        jax.block_until_ready(tok)
        times.append(time.perf_counter() - t0)
    nb = step_bytes(params, cfg, capacity, batch, p, method)  # packed or not, the same bytes
    read = statistics.median(gbs)
    return Speed(
        method=method,
        devices=p,
        context=context,
        capacity=capacity,
        batch=batch,
        weight_bytes=nb.weights,
        cache_bytes=nb.cache,
        machine_bytes=nb.machine,
        per_device_bytes=nb.per_device,
        read_gbs=read,
        roofline_s=nb.machine / (read * 1e9),
        gpu_roofline_s=nb.per_device / (read * 1e9),
        median_s=statistics.median(times),
        step_s=times,
        compile_s=compile_s,
    )


def table(records: list[Speed]) -> str:
    """A fixed-width table of `decode_speed` records."""
    head = (
        f"{'method':<7}{'devices':>8}{'context':>8}{'weights MB':>11}{'cache MB':>10}"
        f"{'read MB':>9}{'GB/s':>7}{'roofline ms':>12}{'measured ms':>12}{'of roofline':>12}"
        f"{'tokens/s':>9}"
    )
    rows = [head, "-" * len(head)]
    for r in records:
        rows.append(
            f"{r.method:<7}{r.devices:>8}{r.context:>8}{r.weight_bytes / 1e6:>11.1f}"
            f"{r.cache_bytes / 1e6:>10.1f}{r.machine_bytes / 1e6:>9.0f}"
            f"{r.read_gbs:>7.1f}{r.roofline_s * 1e3:>12.1f}{r.median_s * 1e3:>12.1f}"
            f"{r.fraction:>12.0%}{r.tokens_per_s:>9.2f}"
        )
    return "\n".join(rows)


def summary(records: list[Speed]) -> dict[str, Any]:
    """Plain data for a JSON report: the records and the machine's medians."""
    return {
        "records": [r.as_json() for r in records],
        "read_gbs_median": float(np.median([r.read_gbs for r in records])),
    }
