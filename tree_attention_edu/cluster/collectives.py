"""How many one-way link delays each collective pays under XLA:CPU's gloo collectives:
tiny collectives timed across real processes at several link delays D, and the slope of
time against D in units of D.

What the source says (gloo and XLA read at the commits named in
`results/cluster/latency-collectives.json`; `ALGORITHMS` below). Every device is its own
gloo rank (XLA:CPU makes one gloo context per device of the replica group; devices of one
process meet over TCP too, with no in-process pre-reduction), ranks in device order, so the
nodes hold contiguous blocks of ranks. Gloo's TCP transport sends an unbound-buffer message
only once the receiver's "ready to receive" notice has arrived: a message whose receive is
posted when its send is (every collective below) costs a notice one way and the data the
other, **two one-way delays** when it crosses nodes.

A small message is latency only, so the time of a call is `c + k·D`: `k` one-way delays
on its critical path, `c` what does not depend on D. `slope(times, delays)` is `k`.

Run from the launcher side with `measure(...)` (as root; `scripts/latency_collectives.py`);
each worker runs `worker_main`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

from . import netns
from . import processes as ps

COORDINATOR_PORT = 47200
KINDS = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "collective-permute",
    "permute-exchange",
    "all-reduce-pair",
    "allreduce-merge",
    "reduce-scatter",
)
"""What is timed, in this order each round. "collective-permute" shifts every device's
block to the next device (a ring step); "permute-exchange" swaps blocks between device i
and i XOR p/2 (one butterfly round across the nodes). "all-reduce-pair" is one `psum` of
two arrays, which XLA compiles to one all-reduce with two operands; "allreduce-merge" is
the tree's merge itself (`merges.allreduce_core` on a state `[1, 1, 4p, 64]`: a `pmax`,
then that pair), the whole of `tree_decode`'s communication on a flat mesh.
"reduce-scatter" comes last: after a gloo reduce-scatter, later transfers between devices
of one process crawl (`cluster.methods.POISON`)."""

ALGORITHMS: dict[str, dict[str, str]] = {
    "all-reduce": {
        "algorithm": "gloo ring (XLA sets AllreduceOptions::Algorithm::RING): reduce-scatter "
        "then all-gather around the rank ring, 2 segments per rank in flight",
        "latency_terms": "2(p-1) steps in lockstep; with any hop across nodes each step "
        "pays its 2D (notice + data): 4(p-1)D",
    },
    "all-gather": {
        "algorithm": "gloo::allgather: a ring, each contribution in 2 halves in flight",
        "latency_terms": "p-1 steps in lockstep, 2D each across nodes: 2(p-1)D",
    },
    "reduce-scatter": {
        "algorithm": "gloo ReduceScatterHalvingDoubling (built per call), preregistered "
        "buffers: data goes without a notice",
        "latency_terms": "log2 p exchange steps, 1D each across nodes (log2 nodes of them), "
        "then the chunks' redistribution (1D) and the buffer-free notices (1D)",
    },
    "all-to-all": {
        "algorithm": "XLA's own: every send and receive posted at once (not gloo::alltoall)",
        "latency_terms": "1 round: 2D",
    },
    "collective-permute": {
        "algorithm": "XLA's own: one send to each target, one receive from the source",
        "latency_terms": "1 message: 2D",
    },
    "all-reduce-pair": {
        "algorithm": "one XLA all-reduce with 2 operands: AllReduceThunk calls the "
        "communicator's AllReduce once per operand, one after the other (2 gloo rings)",
        "latency_terms": "2 rings: 8(p-1)D",
    },
    "allreduce-merge": {
        "algorithm": "merges.allreduce_core: an all-reduce(max) of the lse (1 operand), then "
        "the all-reduce(sum) of the numerator and denominator (2 operands): 3 gloo rings",
        "latency_terms": "3 rings: 12(p-1)D",
    },
}

SOURCES = {
    "gloo (pytorch/gloo 70dc360272dfc57e3617184c78ff9b06f8cd4757)": [
        "gloo/allreduce.cc: ring() (reduce-scatter and all-gather loops, 2 segments/rank)",
        "gloo/allgather.cc: allgather() ring, 2 chunks in flight",
        "gloo/reduce_scatter.h: ReduceScatterHalvingDoubling::run()",
        "gloo/transport/tcp/pair.cc: Pair::send / Pair::recv / handleRemotePendingRecv "
        "(a send waits for the receiver's NOTIFY_RECV_READY)",
    ],
    "xla (openxla/xla)": [
        "xla/backends/cpu/collectives/gloo_communicator.cc @3e1a45f9: AllReduce sets "
        "Algorithm::RING; AllGather calls gloo::allgather; ReduceScatter builds "
        "ReduceScatterHalvingDoubling; AllToAll and CollectivePermute post sends/recvs",
        "xla/pjrt/cpu/gloo_collectives.cc @03f1159c: the same in the older layout; "
        "GetCommunicator: one gloo context per (device list, rank)",
        "xla/backends/cpu/runtime/collective_thunk.cc @0d7221e2: rank = the device's "
        "position in the replica group (RankInGlobalDevices); AcquireCommunicator per rank",
        "xla/backends/cpu/collectives/cpu_cliques.cc @80c095fc: one communicator per rank",
    ],
}
"""Where `ALGORITHMS` was read."""


@dataclass
class Spec:
    """What each worker is told."""

    nodes: int
    processes_per_node: int
    devices_per_process: int
    coordinator: str
    repeats: int
    init_timeout: float
    control: str

    @property
    def processes(self) -> int:
        return self.nodes * self.processes_per_node


# ---------------------------------------------------------------------------------------
# Plain helpers (no JAX)


MeasuredAs = Literal["mean_s", "median_s"]
"""Which measured time `delay_sweep` fits: the mean over every process's rounds, or the
slowest process's median."""


def slope(delays_s: list[float], times_s: list[float]) -> tuple[float, float]:
    """Least-squares line `t = c + k·D` through `(D, t)` points: returns `(k, c)`; `k` is the
    number of one-way delays on the critical path (at least 2 distinct delays)."""
    n = len(delays_s)
    if n != len(times_s) or len(set(delays_s)) < 2:
        raise ValueError(f"need times at 2 or more distinct delays, got {delays_s!r}")
    mx, my = sum(delays_s) / n, sum(times_s) / n
    sxx = sum((x - mx) ** 2 for x in delays_s)
    k = sum((x - mx) * (y - my) for x, y in zip(delays_s, times_s, strict=True)) / sxx
    return k, my - k * mx


def predicted_terms(p: int, ranks_per_node: int) -> dict[str, int]:
    """One-way delays per call that the source predicts (module docstring, `ALGORITHMS`),
    for `p` ranks on nodes of `ranks_per_node` consecutive ranks, p a power of two.

    A gloo ring runs in lockstep: each step waits both for the data from one neighbour and
    for its own send to the other to complete, which needs that neighbour's notice. So a
    crossing hop's 2D reaches every rank, and every step of the ring pays it."""
    nodes = p // ranks_per_node
    across = nodes > 1
    ring = 2 * 2 * (p - 1) * across  # one gloo all-reduce ring: 2(p-1) steps of 2D
    return {
        "all-reduce": ring,
        "all-gather": 2 * (p - 1) * across,
        "all-to-all": 2 * across,
        "collective-permute": 2 * across,
        "permute-exchange": 2 * across,
        "all-reduce-pair": 2 * ring,  # one ring per operand
        "allreduce-merge": 3 * ring,  # the max, then the numerator and the denominator
        # halving-doubling: its steps whose partner is on another node (1D each, no
        # notice), the chunks' redistribution (1D), the last "buffer free" notices (1D).
        "reduce-scatter": ((nodes - 1).bit_length() + 2) * across,
    }


# ---------------------------------------------------------------------------------------
# Worker side


def _programs(p: int) -> dict[str, Any]:
    """`kind -> f(x)` for `x` sharded `[p·p·4]` over the flat mesh's "x": tiny blocks."""
    import jax.numpy as jnp
    from jax import lax

    from ..core.merges import allreduce_core
    from ..core.states import AttentionState

    def merge(x: Any) -> Any:
        """The tree's merge of a state `[1, 1, 4p, 64]` built from the block."""
        lse = x[None, None, :]
        out = jnp.broadcast_to(x[None, None, :, None], (1, 1, x.shape[0], 64))
        got = allreduce_core(AttentionState(out, lse, jnp.zeros_like(lse)), ("x",))
        return got.out[0, 0, :, 0] + got.lse[0, 0]

    shift = [(i, (i + 1) % p) for i in range(p)]
    swap = [(i, i ^ (p // 2)) for i in range(p)] if p % 2 == 0 else shift
    return {
        "all-reduce": lambda x: lax.psum(x, "x"),
        "all-gather": lambda x: lax.all_gather(x, "x", tiled=True)[: x.shape[0]],
        "all-to-all": lambda x: lax.all_to_all(x, "x", 0, 0, tiled=True),
        "collective-permute": lambda x: lax.ppermute(x, "x", shift),
        "permute-exchange": lambda x: lax.ppermute(x, "x", swap),
        "all-reduce-pair": lambda x: sum(lax.psum((x, 2 * x), "x")),
        "allreduce-merge": merge,
        "reduce-scatter": lambda x: lax.psum_scatter(x, "x", tiled=True),
    }


def time_collectives(s: Spec, pid: int) -> dict[str, list[float]]:
    """Each of `KINDS` on tiny blocks, compiled and warmed up, then timed in `s.repeats`
    interleaved rounds (each call waited for): `kind -> seconds of each call`."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..core.devices import make_mesh

    jax.config.update("jax_num_cpu_devices", s.devices_per_process)
    ps.initialize_distributed(s.coordinator, s.processes, pid, s.init_timeout)
    p = jax.device_count()
    mesh = make_mesh(p, "x")
    x = jax.device_put(np.ones(p * p * 4, np.float32), NamedSharding(mesh, P("x")))
    calls = {}
    for kind, f in _programs(p).items():
        fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        calls[kind] = fn.lower(x).compile()
        for _ in range(2):  # the first call connects gloo's pairs
            calls[kind](x).block_until_ready()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(s.repeats):
        for kind, call in calls.items():
            t0 = time.perf_counter()
            call(x).block_until_ready()
            times[kind].append(time.perf_counter() - t0)
    jax.distributed.shutdown()
    return times


def worker_main(settings: dict[str, Any], pid: int) -> int:
    """A worker: time the collectives, write `times-{pid}.json` into the control folder."""
    times = time_collectives(Spec(**settings), pid)
    with open(os.path.join(settings["control"], f"times-{pid}.json"), "w") as f:
        json.dump(times, f)
    return 0


# ---------------------------------------------------------------------------------------
# Launcher side


def run_at(spec: Spec, delay_s: float, rate_bps: float, prefix: str, timeout: float) -> dict:
    """One network at one delay: start every worker in its node, wait, and return each
    kind's median seconds per call (the slowest process's) and every process's calls."""
    control = spec.control
    with netns.network(spec.nodes, rate_bps, prefix=prefix, delay_s=delay_s) as net:
        settings = asdict(spec) | {"coordinator": f"{net.addresses[0]}:{COORDINATOR_PORT}"}
        env = ps.worker_env()
        procs, logs = [], []
        try:
            with ps.signal_flag() as flag:
                for i in range(spec.processes):
                    cmd = ps.WorkerSpec("collectives", i, settings).write(
                        os.path.join(control, f"worker{i}.json")
                    )
                    logs.append(os.path.join(control, f"worker{i}.log"))
                    node = net.node(i // spec.processes_per_node)
                    procs.append(
                        ps.start_worker(["ip", "netns", "exec", node, *cmd], env, logs[-1])
                    )
                outcome = ps.watch_workers(procs, logs, flag, time.monotonic() + timeout, timeout)
        finally:
            ps.kill_workers(procs)
    if outcome.code:
        raise RuntimeError(f"collectives at D={delay_s * 1e3:g} ms: {outcome.message}")
    per_process = []
    for i in range(spec.processes):
        with open(os.path.join(control, f"times-{i}.json")) as f:
            per_process.append(json.load(f))
    kinds = list(per_process[0])
    return {
        "median_s": {k: max(statistics.median(t[k]) for t in per_process) for k in kinds},
        "calls_s_process0": per_process[0],
    }


def measure(
    nodes: int,
    processes_per_node: int,
    devices_per_process: int,
    delays_ms: list[float],
    *,
    rate_gbit: float = 1.0,
    repeats: int = 15,
    prefix: str = netns.PREFIX,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Every kind's median time per call at each delay, and its slope in units of D beside
    what the source predicts (`predicted_terms`). Needs root (network namespaces)."""
    reason = netns.missing_privileges()
    if reason:
        raise netns.NoPrivilege(reason)
    netns.clear_leftovers(prefix)
    points = []
    for d in delays_ms:
        with tempfile.TemporaryDirectory(prefix="tae-coll-") as control:
            spec = Spec(nodes, processes_per_node, devices_per_process, "", repeats, 60.0, control)
            rec = run_at(spec, d / 1e3, rate_gbit * 1e9, prefix, timeout)
        points.append({"delay_ms": d, **rec})
        print(
            f"D={d:g} ms: " + ", ".join(f"{k} {t * 1e3:.2f}" for k, t in rec["median_s"].items()),
            file=sys.stderr,
            flush=True,
        )
    p = nodes * processes_per_node * devices_per_process
    want = predicted_terms(p, processes_per_node * devices_per_process)
    fits = {}
    for kind in KINDS:
        k, c = slope(
            [pt["delay_ms"] / 1e3 for pt in points], [pt["median_s"][kind] for pt in points]
        )
        fits[kind] = {"delays_per_call": k, "intercept_s": c, "predicted_delays": want[kind]}
    return {
        "layout": f"{nodes}x{processes_per_node}x{devices_per_process}",
        "p": p,
        "rate_gbit": rate_gbit,
        "repeats": repeats,
        "points": points,
        "fits": fits,
    }


def delay_sweep(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Cluster reports (`run.report`, one per link delay, same layout) as time against D:
    per method (those every report holds) the slowest process's median (`median_s`), the
    mean over every process's rounds (`mean_s`, where every report keeps it for every
    method they share) and the cost model's prediction at each D, and the relative error
    and the slope in units of D (one-way delays per decode step, measured and as the cost
    model prices them) of the measured time that `measured_as` names: that mean (as
    `rel_err` takes it in each report), else the median. Needs 2 or more reports with a
    method in common (ValueError otherwise)."""
    if len(reports) < 2:
        raise ValueError(
            f"`reports` needs 2 or more reports (one per link delay) to fit a slope, got "
            f"{len(reports)}; run the cluster at two or more `--link-delay-ms` values."
        )
    reports = sorted(reports, key=lambda r: r["config"]["link_delay_ms"])
    delays = [r["config"]["link_delay_ms"] / 1e3 for r in reports]
    names = [n for n in reports[0]["methods"] if all(n in r["methods"] for r in reports)]
    if not names:
        raise ValueError(
            "`reports` have no method in common; run every delay with the same `--methods`."
        )
    measured_as: MeasuredAs = (
        "mean_s" if all("mean_s" in r["methods"][n] for r in reports for n in names) else "median_s"
    )
    methods: dict[str, Any] = {}
    for name in names:
        rows = [r["methods"][name] for r in reports]
        measured = [m[measured_as] for m in rows]
        predicted = [m["predicted_s"] for m in rows]
        methods[name] = {
            "median_s": [m["median_s"] for m in rows],
            **({"mean_s": measured} if measured_as == "mean_s" else {}),
            "predicted_s": predicted,
            "rel_err": [p / m - 1 for p, m in zip(predicted, measured, strict=True)],
            "delays_per_step": slope(delays, measured)[0],
            "predicted_delays_per_step": slope(delays, predicted)[0],
            "collectives": reports[0]["methods"][name]["collectives"],
        }
    return {
        "measured_as": measured_as,
        "delays_ms": [d * 1e3 for d in delays],
        "commands": [r["config"]["command"] for r in reports],
        "inter_alpha_s": [r["links"]["inter"]["alpha_s"] for r in reports],
        "methods": methods,
    }
