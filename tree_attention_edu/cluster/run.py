"""The launcher of a cluster on one machine: namespaces, shaped links, workers, the report.

`run_cluster(ClusterConfig(...), json_out)`:

1. clears what earlier runs killed without teardown left behind (`netns.clear_leftovers`,
   by name prefix only; live runs are kept);
2. makes one namespace per node and a switch, links shaped to the first rate (`netns`);
   with `link_delay_ms`, TUN links through the delay forwarder (`delay`), which must live
   as long as the run (if it dies, the run ends with one line);
3. starts `nodes × processes_per_node` workers (`worker.py`), each with
   `ip netns exec NODE python -m tree_attention_edu.cli.worker SPEC.json`, and watches them
   with the launchers' loop (`processes.watch_workers`); when process 0 asks for the next
   link rate, it sets it;
4. tears everything down on every way out: success, failure, SIGINT/SIGTERM/SIGHUP (exit
   128 + signal), a worker that dies; if the launcher itself is killed with SIGKILL, the
   workers die with it (`processes.guard_parent`) and the next start removes the
   namespaces;
5. writes the JSON report (`report`) and prints its tables (`summary`).

Each failure ends in one line on stderr; the workers' logs are kept in a folder it names.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import methods, netns
from . import processes as ps
from .context import MAX_WARMUP_ROUNDS, Settings
from .delay import MAX_DELAY_MS, TUN_MTU
from .methods import CLUSTER_METHODS

COORDINATOR_PORT = 47100  # in node 0's fresh namespace nothing else can hold it
LINK_TEXT = {
    "veth": "veth pairs to a bridge in a switch namespace; tbf on both ends' egress "
    "(node -> switch and switch -> node)",
    "delay": "a TUN device per node; a forwarder in the switch namespace holds each packet "
    "for link_delay_ms (one way); tbf on each TUN's egress (what a node sends)",
}


@dataclass
class ClusterConfig:
    """The settings of a cluster run (the CLI's flags)."""

    nodes: int = 2
    processes_per_node: int = 1
    devices_per_process: int = 2
    link_gbit: tuple[float, ...] = (1.0, 0.5)
    link_delay_ms: float | None = None  # None: veth links; else TUNs and the forwarder
    seq_len: int = 16384
    methods: tuple[str, ...] = CLUSTER_METHODS
    repeats: int = 9
    warmup_rounds: int = 1
    sweep: tuple[int, ...] = ()
    batch: int = 1
    q_heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    seed: int = 0
    timeout: float = 600.0
    init_timeout: float = 60.0
    prefix: str = netns.PREFIX
    keep_outputs: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def processes(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def devices(self) -> int:
        return self.processes * self.devices_per_process

    @property
    def delay_s(self) -> float | None:
        return None if self.link_delay_ms is None else self.link_delay_ms / 1e3

    def check(self) -> None:
        """Raise ValueError naming the setting and the fix, before anything is made."""
        for name in (
            "nodes",
            "processes_per_node",
            "devices_per_process",
            "seq_len",
            "repeats",
            "batch",
            "q_heads",
            "kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {value!r}")
        w = self.warmup_rounds
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= MAX_WARMUP_ROUNDS:
            raise ValueError(
                f"`warmup_rounds` must be an int in [0, {MAX_WARMUP_ROUNDS}] (0: none), got {w!r}"
            )
        if self.nodes < 2:
            raise ValueError(
                f"`nodes` must be >= 2 (one node has no inter-node link), got {self.nodes}"
            )
        if self.processes_per_node * self.devices_per_process < 2:
            raise ValueError(
                "a node needs 2 or more devices (processes_per_node × "
                "devices_per_process), or it has no intra-node level"
            )
        for name, n in (("seq_len", self.seq_len), *(("sweep", s) for s in self.sweep)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n % self.devices:
                raise ValueError(
                    f"`{name}` lengths must be multiples of the {self.devices} "
                    f"devices (each holds a whole shard), got {n!r}"
                )
        if self.q_heads % self.kv_heads:
            raise ValueError(f"`kv_heads` ({self.kv_heads}) must divide `q_heads` ({self.q_heads})")
        if not self.link_gbit or not all(0 < r <= 100 for r in self.link_gbit):
            raise ValueError(
                f"`link_gbit` must be one or more rates in (0, 100] Gbit/s, got {self.link_gbit!r}"
            )
        d = self.link_delay_ms
        if d is not None and not (
            isinstance(d, int | float) and not isinstance(d, bool) and 0 <= d <= MAX_DELAY_MS
        ):
            raise ValueError(f"`link_delay_ms` must be in [0, {MAX_DELAY_MS:g}] ms, got {d!r}")
        bad = [m for m in self.methods if m not in CLUSTER_METHODS]
        if bad or not self.methods:
            raise ValueError(
                f"`methods` must be among {', '.join(CLUSTER_METHODS)}, got {bad or 'none'}"
            )

    def settings(self, coordinator: str, control: str) -> Settings:
        """What each worker is told (`processes.WorkerSpec`)."""
        return Settings(
            nodes=self.nodes,
            processes_per_node=self.processes_per_node,
            devices_per_process=self.devices_per_process,
            coordinator=coordinator,
            rates_bps=[r * 1e9 for r in self.link_gbit],
            seq_len=self.seq_len,
            methods=list(self.methods),
            repeats=self.repeats,
            warmup_rounds=self.warmup_rounds,
            sweep=list(self.sweep),
            batch=self.batch,
            q_heads=self.q_heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            seed=self.seed,
            init_timeout=self.init_timeout,
            control=control,
            keep_outputs=self.keep_outputs,
        )


def _serve(
    net: netns.Network, control: str, served: set[str]
) -> Callable[[list[int | None]], ps.Outcome | None]:
    """A `watch_workers` check: set the link rate that process 0 asks for; end the run if
    the delay forwarder died (the workers would wait on a dead link until the timeout)."""

    def check(codes: list[int | None]) -> ps.Outcome | None:
        if (gone := net.forwarder_exit()) is not None:
            return ps.Outcome(1, gone)
        for name in sorted(os.listdir(control)):
            if name.endswith(".request") and name not in served:
                with open(os.path.join(control, name)) as f:
                    rate = float(json.load(f)["rate_bps"])
                netns.set_rate(net, rate)
                served.add(name)
                with open(os.path.join(control, name[: -len(".request")] + ".done"), "w"):
                    pass
                print(
                    f"cluster: link rate set to {rate / 1e9:g} Gbit/s", file=sys.stderr, flush=True
                )
        return None

    return check


def run_cluster(
    cfg: ClusterConfig, json_out: str | None = None, *, command: str | None = None
) -> tuple[int, dict | None]:
    """Run the cluster; returns `(exit status, report)` (report None on failure).

    Raises `netns.NoPrivilege` before making anything when this process may not create
    namespaces, and ValueError on bad settings. SIGTERM, SIGHUP and SIGINT tear everything
    down and raise `SystemExit(128 + signal)`.
    """
    cfg.check()
    reason = netns.missing_privileges()
    if reason:
        raise netns.NoPrivilege(reason)
    t_start = time.monotonic()
    _clear_leftovers(cfg.prefix)
    control = tempfile.mkdtemp(prefix="tae-cluster-")
    failed = False
    try:
        with ps.signal_flag() as flag:
            outcome, net, killed = _build_and_watch(cfg, control, flag)
        if flag.signum is not None and outcome.code == 128 + flag.signum:
            name = signal.Signals(flag.signum).name
            print(
                f"cluster: stopped by {name}; killed {killed} worker(s) and removed the namespaces",
                file=sys.stderr,
            )
            raise SystemExit(outcome.code)
        if outcome.code:
            failed = True
            print(f"cluster: error: {outcome.message} (worker logs: {control})", file=sys.stderr)
            return outcome.code, None
        assert net is not None  # created before any worker started
        rep = report(cfg, net, control, command, time.monotonic() - t_start)
        if json_out:
            with open(json_out, "w") as f:
                json.dump(rep, f, indent=1)
        return 0, rep
    finally:
        if not failed:  # the logs of a failed run stay, for its one line names them
            shutil.rmtree(control, ignore_errors=True)


def _clear_leftovers(prefix: str) -> None:
    removed = netns.clear_leftovers(prefix)
    if removed:
        print(
            f"cluster: note: removed {len(removed)} leftover(s) of a run killed without "
            f"teardown: {', '.join(removed)}",
            file=sys.stderr,
            flush=True,
        )


def _build_and_watch(
    cfg: ClusterConfig, control: str, flag: ps.SignalFlag
) -> tuple[ps.Outcome, netns.Network | None, int]:
    """Make the network, start the workers in it and watch them to the end; then kill
    every worker and remove the network, whatever happened. Returns the outcome, the
    network (None if it was never made) and how many workers were killed."""
    procs: list[subprocess.Popen] = []
    logs = [os.path.join(control, f"worker{i}.log") for i in range(cfg.processes)]
    net = None
    try:
        net = netns.create(
            cfg.nodes, cfg.link_gbit[0] * 1e9, prefix=cfg.prefix, delay_s=cfg.delay_s
        )
        _start_workers(cfg, net, control, flag, procs, logs)
        deadline = time.monotonic() + cfg.timeout
        outcome = ps.watch_workers(
            procs,
            logs[: len(procs)],
            flag,
            deadline,
            cfg.timeout,
            check=_serve(net, control, set()),
        )
    except netns.NetworkError as e:
        if flag.signum is None:
            raise
        outcome = ps.Outcome(128 + flag.signum, f"stopped while building the network ({e})")
    finally:
        killed = ps.kill_workers(procs)
        if net is not None:
            netns.destroy(net)
    return outcome, net, killed


def _start_workers(
    cfg: ClusterConfig,
    net: netns.Network,
    control: str,
    flag: ps.SignalFlag,
    procs: list[subprocess.Popen],
    logs: list[str],
) -> None:
    """Start every worker in its node's namespace (into `procs`, as each starts), unless a
    signal arrives first."""
    settings = asdict(cfg.settings(f"{net.addresses[0]}:{COORDINATOR_PORT}", control))
    env = ps.worker_env()
    for i in range(cfg.processes):
        if flag.signum is not None:
            break
        spec = ps.WorkerSpec("cluster", i, settings)
        cmd = spec.write(os.path.join(control, f"worker{i}.json"))
        netns_exec = ["ip", "netns", "exec", net.node(i // cfg.processes_per_node)]
        procs.append(ps.start_worker([*netns_exec, *cmd], env, logs[i]))


def report(
    cfg: ClusterConfig, net: netns.Network, control: str, command: str | None, wall_s: float
) -> dict:
    """The JSON report from process 0's result and every process's lines.

    `links` and `methods` are those at the first rate (`config.link_gbit[0]`); `rates`
    holds every rate's; `ring_vs_rate` and `topology_claim` compare them."""
    with open(os.path.join(control, "result.json")) as f:
        result = json.load(f)
    lines = {}
    for i in range(cfg.processes):
        with contextlib.suppress(OSError), open(os.path.join(control, f"lines-{i}.json")) as f:
            lines[str(i)] = json.load(f)
    phases = result["phases"]
    keep = ("mean_s", "median_s", "predicted_s", "bytes_inter", "bytes_intra", "max_abs_err")

    def links_of(phase):  # the brief's keys first, then the raw points
        inter, intra = phase["links"]["inter"], phase["links"]["intra"]
        first = ("alpha_s", "beta_Bps", "set_Bps")
        return {
            "inter": {**{k: inter[k] for k in first}, **inter},
            "intra": {**{k: intra[k] for k in first[:2]}, **intra},
            "flat": phase["links"]["flat"],
            "kinds": phase["links"]["kinds"],
            "overhead_s": phase["links"]["overhead_s"],
        }

    def methods_of(phase):
        return {
            n: {**{k: r[k] for k in keep}, **{k: v for k, v in r.items() if k not in keep}}
            for n, r in phase["methods"].items()
        }

    first = phases[0]
    config = asdict(cfg)
    config.pop("extra")
    config.update(cfg.extra)
    config.update(
        devices=cfg.devices,
        processes=cfg.processes,
        command=command,
        addresses=net.addresses,
        namespaces=net.namespaces,
        link=LINK_TEXT["veth" if cfg.link_delay_ms is None else "delay"],
        tun_mtu=None if cfg.link_delay_ms is None else TUN_MTU,
        tbf=netns.tbf_args(cfg.link_gbit[0] * 1e9),
        problem=dict(
            batch=cfg.batch,
            q_len=1,
            q_heads=cfg.q_heads,
            kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            dtype="float32",
        ),
    )
    rep = {
        "config": config,
        "links": links_of(first),
        "methods": methods_of(first),
        "local": result["local"],
        "rates": [
            {
                "set_Bps": ph["set_Bps"],
                "links": links_of(ph),
                "local": ph["local"],
                "methods": methods_of(ph),
                "round_s_by_process": ph["round_s_by_process"],
            }
            for ph in phases
        ],
        "process_lines": lines,
        "wall_s": wall_s,
    }
    if "crossover" in first:
        rep["crossover"] = first["crossover"]
    rep.update(comparisons(rep))
    return rep


def comparisons(rep: dict) -> dict:
    """`topology_claim`: flat against 2-level tree on the slowest link (their slowest
    process's medians, and `verdict` on process 0's rounds); `ring_vs_rate`: each method's
    latency at each rate (the slowest process's median), and the ratio of the slowest
    rate's to the fastest's. (The prediction's `rel_err` is against the mean over every
    process's rounds, `methods.method_records`.)"""
    out = {}
    rates = sorted(rep["rates"], key=lambda r: r["set_Bps"])
    slow = rates[0]
    if {"tree", "tree_2level"} <= set(slow["methods"]):
        flat, two = slow["methods"]["tree"], slow["methods"]["tree_2level"]
        out["topology_claim"] = {
            "set_Bps": slow["set_Bps"],
            "flat_s": flat["median_s"],
            "two_level_s": two["median_s"],
            "flat_predicted_s": flat["predicted_s"],
            "two_level_predicted_s": two["predicted_s"],
            "flat_over_two_level": flat["median_s"] / two["median_s"],
            "flat_link_bytes": flat["link_bytes"],
            "two_level_link_bytes": two["link_bytes"],
            "flat_collectives": flat["collectives"],
            "two_level_collectives": two["collectives"],
            **verdict(flat.get("round_s", []), two.get("round_s", [])),
        }
    if len(rates) > 1:
        names = [n for n in rates[0]["methods"] if all(n in r["methods"] for r in rates)]
        out["ring_vs_rate"] = {
            "set_Bps": [r["set_Bps"] for r in rates],
            "median_s": {n: [r["methods"][n]["median_s"] for r in rates] for n in names},
            "predicted_s": {n: [r["methods"][n]["predicted_s"] for r in rates] for n in names},
            "slowdown": {
                n: rates[0]["methods"][n]["median_s"] / rates[-1]["methods"][n]["median_s"]
                for n in names
            },
            "rate_ratio": rates[-1]["set_Bps"] / rates[0]["set_Bps"],
        }
    return out


def verdict(flat_s: list[float], two_level_s: list[float]) -> dict:
    """Is the 2-level tree faster than the flat one? From their timed rounds (interleaved, so
    that both saw the same load): the median of the per-round differences flat − 2-level,
    and its spread (the interquartile range of those differences). "2-level faster" or
    "flat faster" only when the median difference exceeds half that spread; otherwise "no
    measurable difference"."""
    if not flat_s or len(flat_s) != len(two_level_s):
        return {"verdict": "not measured"}
    d = np.array(flat_s) - np.array(two_level_s)
    med, (q1, q3) = float(np.median(d)), np.percentile(d, [25, 75])
    spread = float(q3 - q1)
    word = (
        "2-level faster"
        if med > spread / 2
        else "flat faster"
        if -med > spread / 2
        else "no measurable difference"
    )
    return {
        "difference_s": med,
        "difference_iqr_s": spread,
        "two_level_faster_rounds": int((d > 0).sum()),
        "rounds": len(d),
        "verdict": word,
    }


def _error_bound(err: float) -> str:
    """A method's error against float64 as the power of ten above it (`<1e-7`): its last
    digits are float32 rounding, which differs between CPUs; the JSON keeps the number."""
    if err == 0:
        return "0"
    if not math.isfinite(err):
        return str(err)
    return f"<1e{math.ceil(round(math.log10(err), 12))}"


def _fit_lines(r: dict) -> list[str]:
    """One rate's fits, as `summary` prints them above its table: the links, and where the
    record holds them, the kinds timed alone and the local decode's two rates."""
    inter, intra = r["links"]["inter"], r["links"]["intra"]
    rows: list[str] = []
    set_ = r["set_Bps"]
    rows.append(
        f"link set to {set_ * 8 / 1e9:g} Gbit/s ({set_ / 1e6:.1f} MB/s): inter "
        f"alpha {inter['alpha_s'] * 1e6:.0f} us, beta "
        f"{inter['beta_Bps'] / 1e6:.1f} MB/s ({inter['beta_Bps'] / set_:.0%} of "
        f"set); intra alpha {intra['alpha_s'] * 1e6:.0f} us, beta "
        f"{intra['beta_Bps'] / 1e6:.0f} MB/s"
        + (
            f"; ring over all devices, per step: alpha {flat['alpha_s'] * 1e6:.0f} us"
            + (
                f" (in a chain; {flat['alpha_alone_s'] * 1e6:.0f} us alone)"
                if "alpha_alone_s" in flat
                else ""
            )
            + f", beta {flat['beta_Bps'] / 1e6:.1f} MB/s"
            if (flat := r["links"].get("flat"))
            else ""
        )
    )
    if kinds := r["links"].get("kinds"):
        rows.append(
            "over all devices, each alone: "
            + "; ".join(
                f"{kind} alpha {fit['alpha_s'] * 1e6:.0f} us, beta {fit['beta_Bps'] / 1e6:.1f} MB/s"
                for kind, fit in kinds.items()
            )
        )
    if (local := r.get("local")) and "waited_kernel_s" in local:
        rows.append(
            f"local decode per device: {local['mem_Bps'] / 1e9:.2f} GB/s as the "
            f"collective after it waits for it, {local['kernel_alone_Bps'] / 1e9:.2f} "
            "GB/s timed alone"
        )
    return rows


def _method_table(ms: dict[str, dict[str, Any]]) -> list[str]:
    """One rate's methods as `summary` prints them: the mean over every process's rounds,
    the slowest process's median, the prediction and its error against the mean
    (`methods.method_records`); a method whose record keeps no mean (made before it was
    kept) prints "-" for it and the error against the median, as it was checked then."""
    head = (
        f"{'method':<15}{'mean ms':>9}{'median ms':>11}{'predicted':>11}{'rel err':>9}"
        f"{'inter B/dev':>13}{'intra B/dev':>13}{'link B':>12}{'max |err|':>11}"
    )
    kept = ["mean_s" in m for m in ms.values()]
    against = (
        "the mean over every process's rounds"
        if all(kept)
        else "the slowest process's median (the record keeps no mean)"
        if not any(kept)
        else "the mean over every process's rounds where kept (else the median)"
    )
    rows = [f"rel err: predicted against {against}; median: the slowest process's", head]
    rows.append("-" * len(head))
    for name, m in ms.items():
        measured = m["mean_s"] if "mean_s" in m else m["median_s"]
        rows.append(
            f"{name:<15}"
            + (f"{m['mean_s'] * 1e3:>9.2f}" if "mean_s" in m else f"{'-':>9}")
            + f"{m['median_s'] * 1e3:>11.2f}{m['predicted_s'] * 1e3:>11.2f}"
            f"{m['predicted_s'] / measured - 1:>+9.0%}{m['bytes_inter']:>13,.0f}"
            f"{m['bytes_intra']:>13,.0f}{m['link_bytes']:>12,.0f}"
            f"{_error_bound(m['max_abs_err']):>11}"
        )
    return rows


def summary(rep: dict) -> str:
    """The report as fixed-width tables: links, methods at each rate, the comparisons."""
    c = rep["config"]
    rows = [
        f"cluster: {c['nodes']} nodes x {c['processes_per_node']} process(es) x "
        f"{c['devices_per_process']} device(s) = {c['devices']} devices; Tk={c['seq_len']}, "
        f"{c['problem']['q_heads']} q heads / {c['problem']['kv_heads']} kv heads x "
        f"{c['problem']['head_dim']}, float32; links: "
        + (
            "veth, no added delay"
            if c.get("link_delay_ms") is None
            else f"one-way delay {c['link_delay_ms']:g} ms (TUN forwarder)"
        )
    ]
    for r in rep["rates"]:
        rows += ["", *_fit_lines(r)]
        rows += _method_table(r["methods"])
    if "topology_claim" in rep:
        t = rep["topology_claim"]
        rows += [
            "",
            f"2-level vs flat tree at {t['set_Bps'] * 8 / 1e9:g} Gbit/s: the slowest "
            f"process's medians flat {t['flat_s'] * 1e3:.2f} ms, 2-level "
            f"{t['two_level_s'] * 1e3:.2f} ms (flat / 2-level = "
            f"{t['flat_over_two_level']:.2f}); from process 0's rounds: {t['verdict']}",
        ]
    if "ring_vs_rate" in rep:
        v = rep["ring_vs_rate"]
        rows += [
            "",
            f"rate x{v['rate_ratio']:g}: slowdown "
            + ", ".join(f"{n} x{s:.2f}" for n, s in v["slowdown"].items()),
        ]
    if "crossover" in rep:
        x = rep["crossover"]
        for key in ("tree_2level_vs_ring", "tree_vs_ring"):
            tree = key.removesuffix("_vs_ring")
            if key in x and "model_s" in x:
                m = methods.crossover_words(
                    x["seq_lens"], x["measured_s"][tree], x["measured_s"]["ring"]
                )
                p = methods.crossover_words(
                    x["model_grid"], x["model_s"][tree], x["model_s"]["ring"]
                )
                rows.append(f"{key}: measured {m}; model {p}")
    return "\n".join(rows)
