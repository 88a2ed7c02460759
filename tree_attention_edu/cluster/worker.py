"""One process of a cluster run: `jax.distributed` with gloo, inside a node's namespace.

`run.py` starts `nodes × processes_per_node` of these with `ip netns exec NODE python -m
tree_attention_edu.cluster.worker --config FILE --process-id I`; process `I` lives on node
`I // processes_per_node` and simulates `devices_per_process` CPU devices. Together they
build two meshes over the same devices, in (process, id) order, so that each node's
devices are neighbours:

* `("node", "gpu")` of shape `(nodes, processes_per_node · devices_per_process)`, the
  2-level mesh: with `seq_axes=("node", "gpu")` the tree's Allreduces run over "gpu"
  (inside each node) first, then over "node" (across the slow links);
* `("x",)` over all devices, the flat mesh: one Allreduce over every device, which gloo
  runs as one ring whose every step waits for the ring's inter-node hops.

The K/V cache is sharded identically on both (device i holds keys `[i·t, (i+1)·t)`).

Then, at each link rate (the launcher changes the rate when process 0 asks, `_request`):

1. each level's link: α and β from ping-pongs of growing size between two devices of
   node 0 (intra) and between node 0 and node 1 (inter) (`measure_link`);
2. at the first rate, the local decode bandwidth and copy rate with every device busy;
3. every method on the same cache: median latency (repeats interleaved), bytes sent per
   device on each level (`level_bytes`, from the compiled program's collectives and
   their replica groups), max |error| against a float64 numpy reference computed here,
   and the cost model's prediction (`predictions`);
4. at the first rate, tree and ring over a range of sequence lengths (the crossover).

Every process prints what it does and holds, one line at a time; process 0 gathers every
process's timings and errors (`process_allgather`) and writes the result JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import launch

CLUSTER_METHODS = ("tree", "tree_2level", "allgather", "reduce_scatter", "all_to_all",
                   "one_pass", "ring", "ring_pass_q")
"""What a cluster run measures: `tree` (flat mesh), `tree_2level` (2-level mesh, paper's
Allreduce merge), the other merge patterns on the 2-level mesh, and both rings."""
CROSSOVER_METHODS = ("tree", "tree_2level", "ring")
LEVEL_SIZES = (256, 1024, 4096, 1 << 20, 2 << 20, 4 << 20)
"""Bytes per device of the all-reduces that measure each level: small ones for α (a few kB
on the link per step, <= `calibrate.SMALL_MESSAGE`), large ones for β (MBs per step, far
above the tbf bucket of 128 kB, which lets its first bytes through unshaped)."""
RATE_WAIT_S = 60.0  # process 0 waits this long for the launcher to change the rate
TOLERANCE = 2e-5  # float32 decode against the float64 reference, outputs of size O(1)
POISON = ("gloo under XLA:CPU: after one reduce-scatter over a set of devices, transfers "
          "between two devices of the same process in later collectives over that set run at "
          "~2 MB/s (a 4-device pass-KV ring at Tk=4096 went from 0.14 s to 8.5 s)")


# ---------------------------------------------------------------------------------------
# Plain helpers (no JAX): the reference, bytes per level, the crossover


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Softmax attention in float64 numpy, independent of the package's JAX code.

    q `[B, Tq, Hq, D]`, k `[B, Tk, Hkv, D]`, v `[B, Tk, Hkv, Dv]` (Hkv divides Hq, grouped
    query heads share a kv head); scale `1/sqrt(D)`, no mask. Returns `[B, Tq, Hq, Dv]`.
    """
    B, Tq, Hq, D = q.shape
    hkv = k.shape[2]
    qg = q.astype(np.float64).reshape(B, Tq, hkv, Hq // hkv, D)
    s = np.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(np.float64)) / math.sqrt(D)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    out = np.einsum("bhgqk,bkhd->bqhgd", w, v.astype(np.float64))
    return out.reshape(B, Tq, Hq, -1)


def level_bytes(collectives, node_of: Callable[[int], int], p: int) -> dict[str, float]:
    """Bytes each device sends inside its node and to other nodes, per call of the program.

    `collectives`: `introspect.Collective`s of the compiled program (replica groups or
    source→target pairs of partition ids 0..p−1); `node_of(i)`: the node of device i. Each
    collective is counted as gloo runs it under XLA:CPU, `n` its payload as
    `collective_stats` counts it:

    * all-reduce: a ring over the group: each member sends `2(g−1)/g·n` to the next;
    * all-gather (`n` received): a ring: each member sends `(g−1)/g·n` to the next;
    * reduce-scatter and all-to-all: each member sends `n/g` to every other member;
    * collective-permute: each source sends `n` to its target.

    Returns `{"bytes_inter", "bytes_intra"}` averaged over the p devices, and `"link_bytes"`:
    the bytes that leave the busiest node per call (what its uplink carries).
    """
    inter, intra = np.zeros(p), np.zeros(p)

    def send(a: int, b: int, nbytes: float) -> None:
        (inter if node_of(a) != node_of(b) else intra)[a] += nbytes

    for c in collectives:
        n = c.bytes * c.count
        if c.kind == "collective-permute":
            for a, b in c.groups:
                if a != b:
                    send(a, b, n)
            continue
        for group in c.groups or (tuple(range(p)),):
            g = len(group)
            if g < 2:
                continue
            for j, a in enumerate(group):
                if c.kind == "all-reduce":
                    send(a, group[(j + 1) % g], 2 * (g - 1) / g * n)
                elif c.kind == "all-gather":
                    send(a, group[(j + 1) % g], (g - 1) / g * n)
                else:  # reduce-scatter, all-to-all
                    for b in group:
                        if b != a:
                            send(a, b, n / g)
    nodes = sorted({node_of(i) for i in range(p)})
    link = max(sum(inter[i] for i in range(p) if node_of(i) == nd) for nd in nodes)
    return {"bytes_inter": float(inter.mean()), "bytes_intra": float(intra.mean()),
            "link_bytes": float(link)}


def crossover(seq_lens: list[int], tree_s: list[float], ring_s: list[float]) -> float | None:
    """The sequence length where tree becomes faster than ring: the first sign change of
    `ring − tree` from ≤ 0 to > 0, interpolated on log-log axes; None if there is none
    (tree faster everywhere, or ring faster everywhere)."""
    d = [r - t for t, r in zip(tree_s, ring_s, strict=True)]
    for i in range(1, len(d)):
        if d[i - 1] <= 0 < d[i]:
            (x0, x1), (t0, t1), (r0, r1) = (seq_lens[i - 1], seq_lens[i]), \
                (tree_s[i - 1], tree_s[i]), (ring_s[i - 1], ring_s[i])
            # log(ring/tree) is linear in log(L) between the points: find its zero.
            f0, f1 = math.log(r0 / t0), math.log(r1 / t1)
            w = f0 / (f0 - f1) if f0 != f1 else 0.0
            return float(math.exp(math.log(x0) + w * (math.log(x1) - math.log(x0))))
    return None


# ---------------------------------------------------------------------------------------
# The worker


@dataclasses.dataclass
class Settings:
    """The run's settings, as the launcher writes them (`config.json`)."""

    nodes: int
    processes_per_node: int
    devices_per_process: int
    coordinator: str
    rates_bps: list[float]
    seq_len: int
    methods: list[str]
    repeats: int
    sweep: list[int]
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    seed: int
    init_timeout: float
    control: str
    keep_outputs: bool = False

    @property
    def processes(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def devices(self) -> int:
        return self.processes * self.devices_per_process


class Worker:
    def __init__(self, s: Settings, process_id: int, out):
        self.s, self.pid, self.out = s, process_id, out
        self.node = process_id // s.processes_per_node
        self.lines: list[str] = []

    def say(self, text: str) -> None:
        """One line of this process's story, prefixed by who tells it."""
        line = f"[process {self.pid}/{self.s.processes} node {self.node}] {text}"
        self.lines.append(line)
        print(line, file=self.out, flush=True)

    # -- set-up -------------------------------------------------------------------------

    def start(self) -> None:
        import jax

        s = self.s
        jax.config.update("jax_num_cpu_devices", s.devices_per_process)
        jax.config.update("jax_enable_x64", True)  # for nothing but the checks; inputs f32
        t0 = time.perf_counter()
        launch.initialize_distributed(s.coordinator, s.processes, self.pid, s.init_timeout)
        mine = [d.id for d in jax.local_devices()]
        self.say(f"jax.distributed up in {time.perf_counter() - t0:.1f} s: "
                 f"{jax.process_count()} processes, {jax.device_count()} devices; mine: "
                 f"{mine} (gloo over {os.uname().nodename} -> {_my_address()})")

        from ..core.devices import make_mesh

        k = s.processes_per_node * s.devices_per_process
        self.two = make_mesh((s.nodes, k), ("node", "gpu"))
        self.flat = make_mesh(s.devices, "x")
        flat_devices = list(self.two.devices.flat)
        assert flat_devices == list(self.flat.devices.flat)  # the same order on both meshes
        self.node_of_device = [d.process_index // s.processes_per_node for d in flat_devices]
        where = [f"{i} (node {self.node_of_device[i]}, gpu {i % k})"
                 for i, d in enumerate(flat_devices) if d.process_index == self.pid]
        self.say(f"mesh ('node', 'gpu') = {tuple(self.two.devices.shape)}; my devices at "
                 f"mesh positions {', '.join(where)}")

    def node_of(self, i: int) -> int:
        return self.node_of_device[i]

    # -- measurements -------------------------------------------------------------------

    def level_calls(self) -> dict:
        """The programs that measure the two levels, all on the 2-level mesh with every
        device taking part (as the tree's own all-reduces do): an all-reduce over "node"
        and one over "gpu" of each of `LEVEL_SIZES` bytes per device, and the same program
        with no collective (the per-call overhead). `name -> (fn, args)`."""
        import jax
        from jax import lax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        if getattr(self, "_level_calls", None) is None:
            mesh, spec = self.two, P(("node", "gpu"))

            def program(body):
                return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                             check_vma=False))

            fns = {"node": program(lambda x: lax.psum(x, "node")),
                   "gpu": program(lambda x: lax.psum(x, "gpu")),
                   "noop": program(lambda x: x + 1)}
            calls = {}
            for n in LEVEL_SIZES:
                x = jax.device_put(np.ones(mesh.size * (n // 4), np.float32),
                                   NamedSharding(mesh, spec))
                for name, fn in fns.items():
                    calls[f"{name} {n}"] = (fn, (x,))
            self._level_calls = calls
        return self._level_calls

    def fit_level(self, axis: str, times: dict, overhead: float) -> dict:
        """α and β of one level from its all-reduces (`level_calls`, timed in `times`).

        gloo runs an all-reduce over g ranks as a ring: 2(g−1) steps, each sending n/g of a
        device's n bytes to the next rank. Over "node", all k devices of a node send at
        once through its one uplink, so a step puts k·n/g bytes on the link. Every timed
        call is a point `(bytes on the link per step, (time − overhead) / 2(g−1))`.

        α is the mean over the small messages' points (up to `calibrate.SMALL_MESSAGE` on
        the link per step), not their median as `calibrate.fit_link` takes: on this loaded
        machine a step's time has two modes (about 0.1 ms when its peers are awake, a
        scheduler slice of about 2 ms when one must be woken), and a decode's latency adds
        many steps, whose sum follows their mean. β is the inverse slope of a least-squares
        line through the large messages' points: the rate of the link itself, untouched by
        α and by the tbf bucket that lets a message's first 128 kB through unshaped, so
        comparable with the rate the tbf sets."""
        from ..perf import calibrate

        g = self.two.shape[axis]
        share = self.two.shape["gpu"] if axis == "node" else 1  # devices per uplink at once
        steps = 2 * (g - 1)
        points = [(share * n / g, max(t - overhead, 0.0) / steps)
                  for n in LEVEL_SIZES for t in times[f"{axis} {n}"]]
        alpha = float(np.mean([t for n, t in points if n <= calibrate.SMALL_MESSAGE]))
        big = np.array([(n, t) for n, t in points if n > calibrate.SMALL_MESSAGE])
        slope = np.polyfit(big[:, 0], big[:, 1], 1)[0] if len(set(big[:, 0])) > 1 else 0.0
        return {"alpha_s": alpha, "beta_Bps": float(1 / slope) if slope > 0 else math.inf,
                "steps": steps, "link_bytes_per_step_per_device_byte": share / g,
                "points": [[n, t] for n, t in points],
                "allreduce_median_s": [[n, statistics.median(times[f"{axis} {n}"])]
                                       for n in LEVEL_SIZES]}

    def fit_links(self, times: dict, rate_bps: float) -> dict:
        overhead = statistics.median(t for n in LEVEL_SIZES for t in times[f"noop {n}"])
        inter, intra = self.fit_level("node", times, overhead), \
            self.fit_level("gpu", times, overhead)
        inter["set_Bps"] = rate_bps / 8
        self.say(f"link fit at {rate_bps / 1e9:g} Gbit/s: inter alpha "
                 f"{inter['alpha_s'] * 1e6:.0f} us, beta {inter['beta_Bps'] / 1e6:.1f} MB/s "
                 f"({inter['beta_Bps'] / inter['set_Bps']:.0%} of the set "
                 f"{inter['set_Bps'] / 1e6:.1f} MB/s); intra alpha "
                 f"{intra['alpha_s'] * 1e6:.0f} us, beta {intra['beta_Bps'] / 1e6:.0f} MB/s")
        return {"inter": inter, "intra": intra, "overhead_s": overhead}

    def problem(self, seq_len: int):
        from ..perf import benchmark

        s = self.s
        return benchmark.Problem(seq_len=seq_len, batch=s.batch, q_len=1, q_heads=s.q_heads,
                                 kv_heads=s.kv_heads, head_dim=s.head_dim)

    def cal_len(self) -> int:
        """The length the local kernel is measured at: 3/4 of the decoded one (no method is
        measured there), at least 1024 keys per device (a kernel time well above the
        per-call overhead), a multiple of the device count."""
        p = self.s.devices
        return max(1024 * p, (3 * self.s.seq_len // 4) // p * p)

    def local_calls(self) -> dict:
        """Programs that measure one device's local work with every device busy, timed in
        the same rounds as everything else: `calibrate.local_calls` ("kernel", "copy") at
        `cal_len`, and for `sync_s`, "tiny" (an all-reduce of 4 bytes over every device)
        and "both" (the kernel, then that all-reduce on its result)."""
        import jax
        import jax.numpy as jnp
        from jax import lax
        from jax.sharding import PartitionSpec as P

        from ..core import kernels
        from ..core.decode import kv_spec
        from ..perf import calibrate

        if getattr(self, "_local_calls", None) is None:
            mesh, axes = self.two, ("node", "gpu")
            base = calibrate.local_calls(mesh, self.problem(self.cal_len()), self.s.seed)
            kv = kv_spec(axes)

            def program(body):
                return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), kv, kv),
                                             out_specs=P(axes), check_vma=False))

            def kernel(q, k, v):
                return kernels.xla_state(q, k, v).out[:, 0, 0, :1]

            def tiny(x):
                return lax.psum(jnp.sum(x, dtype=jnp.float32), axes)[None, None]

            args = base["kernel"][1]
            self._local_calls = {
                "local kernel": base["kernel"], "local copy": base["copy"],
                "local tiny": (program(lambda q, k, v: tiny(q[:1, :1, :1, :1])), args),
                "local both": (program(lambda q, k, v: kernel(q, k, v)
                                       + tiny(kernel(q, k, v))), args)}
        return self._local_calls

    def fit_local(self, times: dict, overhead_s: float) -> dict:
        """Per-device decode bandwidth and copy rate with all devices busy
        (`calibrate.local_rates`), and `sync_s`: what a collective costs beyond its own
        time when it follows the local kernel.

        On this machine the workers' threads outnumber the cores: a device that finishes its
        shard first waits inside gloo, and waking it and its peers when the last one
        arrives takes scheduler time that back-to-back collectives need not pay (with
        in-process collectives it is zero). `sync_s` is the median over the rounds of
        "both" less "kernel" and "tiny" (`local_calls`)."""
        from ..perf import calibrate

        prob = self.problem(self.cal_len())
        med = {n: statistics.median(times[f"local {n}"])
               for n in ("kernel", "copy", "tiny", "both")}
        mem, copy = calibrate.local_rates(prob, self.s.devices, med["kernel"], med["copy"],
                                          overhead_s)
        rounds = [b - k_ - t_ for b, k_, t_ in zip(times["local both"], times["local kernel"],
                                                   times["local tiny"], strict=True)]
        sync = max(statistics.median(rounds), 0.0)
        self.say(f"local decode {mem / 1e9:.2f} GB/s and copy {copy / 1e9:.2f} GB/s per "
                 f"device, all {self.s.devices} busy (Tk={prob.seq_len}); a collective after "
                 f"the kernel costs {sync * 1e3:.2f} ms more than alone")
        return {"mem_Bps": mem, "copy_Bps": copy, "overhead_s": overhead_s, "sync_s": sync,
                "seq_len": prob.seq_len, "median_s": med}

    def topologies(self, links: dict, local: dict):
        """The cost model's view of this cluster: `(two_level, flat)` topologies."""
        from ..perf import costmodel

        s = self.s
        inter = costmodel.Link(links["inter"]["alpha_s"], links["inter"]["beta_Bps"])
        intra = costmodel.Link(links["intra"]["alpha_s"], links["intra"]["beta_Bps"])
        two = costmodel.Topology(
            nodes=s.nodes, devices_per_node=s.processes_per_node * s.devices_per_process,
            intra=intra, inter=inter, mem_Bps=local["mem_Bps"], flops=float("inf"),
            overhead_s=links["overhead_s"] + local["sync_s"], overlap=False,
            copy_Bps=local["copy_Bps"], ring_only=True, uplinks=1,
            name="cluster of network namespaces (this machine)",
            sources=("measured by tree_attention_edu.cluster.worker",))
        # The flat mesh's Allreduce is one gloo ring over all p devices (in node order): each
        # step waits for its slowest hop, inside a node or across (one flow per uplink).
        slowest = costmodel.Link(max(inter.alpha_s, intra.alpha_s),
                                 min(inter.beta_Bps, intra.beta_Bps))
        flat = dataclasses.replace(two, nodes=1, devices_per_node=s.devices, intra=slowest,
                                   uplinks=None)
        return two, flat

    def predict(self, name: str, seq_len: int, two, flat) -> float:
        from ..perf import calibrate

        prob = self.problem(seq_len)
        if name == "tree":
            return calibrate.predict("tree", seq_len, flat, prob).total_s
        return calibrate.predict("tree" if name == "tree_2level" else name, seq_len, two,
                                 prob).total_s

    def method_fns(self, names: list[str]) -> dict[str, tuple[Any, Callable]]:
        """`name -> (mesh, fn(q, k, v))` from the package's one registry of methods
        (`perf.benchmark.method_fns`): "tree" on the flat mesh, "tree_2level" (the package's
        "tree") and every other method on the `("node", "gpu")` mesh, whose sequence axes
        reduce over "gpu" first."""
        from ..perf import benchmark

        fns: dict[str, tuple[Any, Callable]] = {}
        for name in names:
            mesh = self.flat if name == "tree" else self.two
            method = "tree" if name in ("tree", "tree_2level") else name
            fns[name] = (mesh, benchmark.method_fns(mesh, None, [method])[method][0])
        return fns

    def method_calls(self, names: list[str], seq_len: int) -> tuple[dict, dict]:
        """Every method in `names` on the same cache at `seq_len`, compiled once: the calls
        to time (`name -> (compiled, args)`) and what the program and its answer say: bytes
        per level (`level_bytes` on the compiled program's collectives), the collectives,
        and the max |error| on this process's devices against the float64 reference."""
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from ..perf import benchmark
        from ..perf.introspect import parse_hlo

        prob = self.problem(seq_len)
        q, k, v = benchmark.make_inputs(prob, self.s.seed)
        want = reference_attention(q, k, v)
        placed = {}
        for mesh in (self.two, self.flat):
            kv = NamedSharding(mesh, P(None, tuple(mesh.axis_names)))
            placed[id(mesh)] = tuple(jax.device_put(x, s) for x, s in
                                     zip((q, k, v), (NamedSharding(mesh, P()), kv, kv),
                                         strict=True))
        calls, static = {}, {}
        for name, (mesh, fn) in self.method_fns(names).items():
            args = placed[id(mesh)]
            compiled = jax.jit(fn).lower(*args).compile()
            stats = parse_hlo(compiled.as_text() or "")
            if name == "one_pass":
                stats = stats.fast_path()  # its exact fallback runs only past its window
            out = compiled(*args)
            err = max(float(np.abs(np.asarray(sh.data, np.float64) - want[sh.index]).max())
                      for sh in out.addressable_shards)
            static[name] = dict(level_bytes(stats.collectives, self.node_of, self.s.devices),
                                max_abs_err=err,
                                collectives=_count_kinds(stats.collectives))
            local = np.asarray(out.addressable_data(0), np.float64)
            if self.s.keep_outputs and local.shape == want.shape:  # a replicated output
                static[name]["output"] = local.tolist()
            calls[name] = (compiled, args)
        return calls, static

    def method_records(self, names: list[str], seq_len: int, times: dict, static: dict,
                       two, flat, label: str) -> dict:
        """Each method's record: every process's median (a call ends when the slowest
        process's does), the worst error over all processes, and the cost model's
        prediction. A collective: every process must call it."""
        seconds = {n: statistics.median(times[n]) for n in names}
        mine = np.array([[seconds[n], static[n]["max_abs_err"]] for n in names])
        everyone = _allgather(mine)  # [processes, methods, 2]
        out = {}
        for i, name in enumerate(names):
            per_process = [float(x) for x in everyone[:, i, 0]]
            rec = dict(static[name])
            rec["median_s"] = max(per_process)
            rec["median_s_by_process"] = per_process
            rec["round_s"] = list(times[name])  # this process's (process 0's in the report)
            rec["max_abs_err"] = float(everyone[:, i, 1].max())
            rec["predicted_s"] = self.predict(name, seq_len, two, flat)
            rec["rel_err"] = rec["predicted_s"] / rec["median_s"] - 1
            out[name] = rec
            self.say(f"{label} Tk={seq_len} {name:<15} median {seconds[name] * 1e3:9.2f} ms "
                     f"here, max |err| {static[name]['max_abs_err']:.1e} on my devices")
        return out

    def request_rate(self, i: int, rate_bps: float) -> None:
        """Ask the launcher for a new link rate and wait until every process knows it is set."""
        from jax.experimental import multihost_utils

        if self.pid == 0:
            req = os.path.join(self.s.control, f"rate-{i}.request")
            with open(req + ".tmp", "w") as f:
                json.dump({"rate_bps": rate_bps}, f)
            os.replace(req + ".tmp", req)
            done = os.path.join(self.s.control, f"rate-{i}.done")
            end = time.monotonic() + RATE_WAIT_S
            while not os.path.exists(done):
                if time.monotonic() > end:
                    raise RuntimeError(f"the launcher did not set the link rate within "
                                       f"{RATE_WAIT_S:g} s")
                time.sleep(0.02)
        multihost_utils.sync_global_devices(f"tae-cluster-rate-{i}")
        self.say(f"link rate is now {rate_bps / 1e9:g} Gbit/s")

    def run(self) -> dict:
        """Every rate in turn: the levels' all-reduces and the methods, timed in the same
        interleaved rounds (so that the load of a shared machine hits calibration and
        measurement alike), then the fits and the predictions; the crossover sweep at the
        first rate; a reduce-scatter, if asked for, last (`POISON`)."""
        from ..perf import benchmark

        s = self.s
        self.start()
        names = [m for m in s.methods if m != "reduce_scatter"]
        calls, static = self.method_calls(names, s.seq_len)
        phases: list[dict[str, Any]] = []
        for i, rate in enumerate(s.rates_bps):
            if i:
                self.request_rate(i, rate)
            label = f"[{rate / 1e9:g} Gbit/s]"
            self.say(f"{label} timing {len(names)} methods, {2 * len(LEVEL_SIZES)} level "
                     f"all-reduces and the local work, {s.repeats} interleaved rounds")
            times = benchmark.interleaved_times(
                {**self.level_calls(), **self.local_calls(), **calls}, repeats=s.repeats)
            links = self.fit_links(times, rate)
            local = self.fit_local(times, links["overhead_s"])
            two, flat = self.topologies(links, local)
            phase: dict[str, Any] = {"set_Bps": rate / 8, "links": links, "local": local,
                     "methods": self.method_records(names, s.seq_len, times, static, two,
                                                    flat, label)}
            if i == 0 and s.sweep:
                phase["crossover"] = self.sweep(two, flat, phase["methods"], label)
            phases.append(phase)
        if "reduce_scatter" in s.methods:
            if len(s.rates_bps) > 1:
                self.request_rate(len(s.rates_bps), s.rates_bps[0])
            two, flat = self.topologies(phases[0]["links"], phases[0]["local"])
            rs_calls, rs_static = self.method_calls(["reduce_scatter"], s.seq_len)
            times = benchmark.interleaved_times(rs_calls, repeats=s.repeats)
            rec = self.method_records(["reduce_scatter"], s.seq_len, times, rs_static, two,
                                      flat, f"[{s.rates_bps[0] / 1e9:g} Gbit/s, last]")
            rec["reduce_scatter"]["note"] = "measured last: " + POISON
            merged = {**phases[0]["methods"], **rec}
            phases[0]["methods"] = {m: merged[m] for m in s.methods if m in merged}
        return {"phases": phases, "local": phases[0]["local"]}

    def sweep(self, two, flat, at_len: dict, label: str) -> dict:
        """Tree (flat and 2-level) and ring over `sweep` lengths, measured and predicted, and
        where tree overtakes ring."""
        from ..perf import benchmark

        s = self.s
        names = [m for m in CROSSOVER_METHODS if m in s.methods]
        measured: dict[str, list[float]] = {m: [] for m in names}
        predicted: dict[str, list[float]] = {m: [] for m in names}
        lens = sorted(set(s.sweep))
        for n in lens:
            if n == s.seq_len:
                recs = {m: at_len[m] for m in names}
            else:
                calls, static = self.method_calls(names, n)
                times = benchmark.interleaved_times(calls, repeats=s.repeats)
                recs = self.method_records(names, n, times, static, two, flat, label)
                del calls
            for m in names:
                measured[m].append(recs[m]["median_s"])
                predicted[m].append(recs[m]["predicted_s"])
        grid = sorted({int(x) // s.devices * s.devices for x in
                       np.geomspace(s.devices, 16 * max(lens), 400)} - {0})
        model = {m: [self.predict(m, n, two, flat) for n in grid] for m in names}
        out = {"seq_lens": lens, "measured_s": measured, "predicted_s": predicted,
               "model_grid": grid, "model_s": model}
        for tree in ("tree_2level", "tree"):
            if tree in names and "ring" in names:
                out[f"{tree}_vs_ring"] = {
                    "measured": crossover(lens, measured[tree], measured["ring"]),
                    "predicted": crossover(grid, model[tree], model["ring"]),
                    "tree_faster_everywhere_measured": all(
                        t < r for t, r in zip(measured[tree], measured["ring"], strict=True)),
                }
        return out


def _count_kinds(collectives) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in collectives:
        counts[c.kind] = counts.get(c.kind, 0) + c.count
    return dict(sorted(counts.items()))


def _allgather(x: np.ndarray) -> np.ndarray:
    """`x` from every process, stacked `[processes, ...]` (a collective: all must call it)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def _my_address() -> str:
    import socket

    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    """`python -m tree_attention_edu.cluster.worker --config FILE --process-id I`."""
    parser = argparse.ArgumentParser(prog="python -m tree_attention_edu.cluster.worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--process-id", type=int, required=True)
    args = parser.parse_args(argv)
    parent = os.environ.get(launch.PARENT_ENV)
    if parent:
        launch.guard_parent(int(parent))  # die with the launcher, even by SIGKILL
    # Our lines go to the launcher's stdout; gloo's C++ prints ("Rank N is connected ...")
    # go to fd 1 too, so fd 1 becomes this worker's log (stderr).
    try:
        with open(args.config) as f:
            s = Settings(**json.load(f))
        launch.test_sleep(args.process_id)
        out = os.fdopen(os.dup(1), "w")
        sys.stdout.flush()
        os.dup2(2, 1)
        w = Worker(s, args.process_id, out)
        try:
            result = w.run()
        finally:
            with open(os.path.join(s.control, f"lines-{args.process_id}.json"), "w") as f:
                json.dump(w.lines, f)
        if args.process_id == 0:
            path = os.path.join(s.control, "result.json")
            with open(path + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(path + ".tmp", path)
        import jax

        jax.distributed.shutdown()
        return 0
    except Exception as e:
        line = next((s for s in str(e).splitlines() if s.strip()), "")
        print(f"{launch.WORKER_ERROR} {type(e).__name__}: {line}", file=sys.stderr, flush=True)
        if os.environ.get("TREE_ATTENTION_EDU_TRACEBACK"):
            raise
        return 1


if __name__ == "__main__":
    sys.exit(main())

