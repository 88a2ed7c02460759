"""`tree-attention-edu cluster`: a cluster on this machine (network namespaces as nodes,
`tc tbf`-shaped links, with `--link-delay-ms` a set one-way delay through a forwarder,
`jax.distributed` workers over gloo), measured against the cost model (`cluster.run`);
`--probe` measures the links alone (`cluster.probe`); `--slurm` runs SLURM's path
(`launch --cluster` under a simulated srun, `cluster.slurm`). Needs root: without it, one line and
exit status 2."""

from __future__ import annotations

import argparse
import re
import sys
from typing import TYPE_CHECKING

from . import memory
from . import plumbing as cl

if TYPE_CHECKING:
    from ..cluster.run import ClusterConfig

NAME = "cluster"
HELP = (
    "a cluster on this machine: network namespaces, shaped links, jax.distributed "
    "workers (needs root)"
)


def _rates(text: str) -> list[float]:
    parts = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated rates in Gbit/s, got {text!r}")
    # tc's token bucket counts whole bits per second; below 1 Mbit/s a decode step's few
    # kilobytes would take seconds per message anyway.
    return [
        cl.finite(s, "a rate in Gbit/s", lambda r: 0.001 <= r <= 100, "in [0.001, 100]")
        for s in parts
    ]


def _delay_ms(text: str) -> float:
    from ..cluster.delay import MAX_DELAY_MS

    return cl.finite(
        text,
        "a delay in milliseconds",
        lambda d: 0 <= d <= MAX_DELAY_MS,
        f"in [0, {MAX_DELAY_MS:g}] ms",
    )


def _delays_ms(text: str) -> list[float]:
    parts = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated delays in milliseconds, got {text!r}"
        )
    return [_delay_ms(s) for s in parts]


def _lengths_or_none(text: str) -> list[int]:
    return cl.lengths(text) if text.strip() else []


def _prefix(text: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9-]{1,15}", text):
        raise argparse.ArgumentTypeError(
            f"expected 2-16 lower-case letters, digits or '-', starting with a letter, got {text!r}"
        )
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cluster.netns import PREFIX

    p.add_argument("--nodes", type=cl.positive, default=2, help="nodes: network namespaces")
    p.add_argument(
        "--processes-per-node",
        type=cl.positive,
        default=1,
        help="jax.distributed processes in each node",
    )
    p.add_argument(
        "--devices-per-process",
        type=cl.positive,
        default=2,
        help="simulated CPU devices per process",
    )
    p.add_argument(
        "--link-gbit",
        type=_rates,
        default="1,0.5",
        help="inter-node link rate(s) in Gbit/s, each direction; a second rate "
        "repeats the measurements at that rate (e.g. 1,0.5 halves it)",
    )
    p.add_argument(
        "--link-delay-ms",
        type=_delay_ms,
        default=None,
        metavar="D",
        help="one-way delay of every inter-node link, in ms: each node gets a TUN device "
        "and a forwarder holds each packet D ms (0 still uses the forwarder); without "
        "it, veth links with no added delay",
    )
    p.add_argument(
        "--probe",
        type=_delays_ms,
        default=None,
        metavar="DELAYS",
        help="instead of a run, measure the links between 2 nodes: a small message's "
        "round trip and a TCP stream's rate at each --link-gbit rate, over veth and "
        "then the forwarder at each of these one-way delays in ms (e.g. 0,2,5,10,20)",
    )
    p.add_argument(
        "--slurm",
        action="store_true",
        help="instead of a run, SLURM's path: start `tree-attention-edu launch --cluster` "
        "in each node's namespace (--processes-per-node tasks per node) with the "
        "environment srun gives each task and no coordinator argument, so that "
        "jax.distributed.initialize() detects SLURM itself; checks tree and ring decoding "
        "at --seq-len over the first --link-gbit rate",
    )
    _measurement_args(p.add_argument_group("what is measured"))
    p.add_argument(
        "--timeout",
        type=cl.seconds,
        default=600.0,
        help="seconds for the whole run; then everything is torn down",
    )
    p.add_argument(
        "--init-timeout",
        type=cl.positive,
        default=60,
        help="seconds jax.distributed start-up waits for the other workers",
    )
    p.add_argument(
        "--prefix",
        type=_prefix,
        default=PREFIX,
        help="name prefix of the namespaces this run owns (leftovers of killed "
        "runs with this prefix are removed at start)",
    )
    p.add_argument(
        "--keep-outputs",
        action="store_true",
        help="store each replicated method's output in the JSON (small shapes)",
    )
    p.add_argument("--json", default=None, metavar="OUT", help="write the report to this path")


def _measurement_args(g: argparse._ArgumentGroup) -> None:
    from ..cluster.context import MAX_WARMUP_ROUNDS
    from ..cluster.methods import CLUSTER_METHODS

    g.add_argument(
        "--seq-len",
        type=cl.positive,
        default=16384,
        help="KV length Tk (a multiple of the device count)",
    )
    g.add_argument("--heads", type=cl.positive, default=8, help="query heads")
    g.add_argument(
        "--kv-heads",
        type=cl.positive,
        default=None,
        help="key/value heads, dividing --heads (default: --heads)",
    )
    g.add_argument("--head-dim", type=cl.positive, default=64, help="size of each head")
    g.add_argument(
        "--methods",
        type=cl.names(CLUSTER_METHODS),
        default=",".join(CLUSTER_METHODS),
        help=f"comma-separated subset of {','.join(CLUSTER_METHODS)}",
    )
    g.add_argument(
        "--repeats",
        type=cl.positive,
        default=9,
        help="interleaved rounds, each timing every method and every message size "
        "of the link fits once (each method's median and mean over them; the link fits pool "
        "every process's rounds); make cluster takes 27, with which a cell's error "
        "varied less in the runs so far (runs that also differed otherwise: notebook 9)",
    )
    g.add_argument(
        "--warmup-rounds",
        type=cl.nonnegative,
        default=1,
        help="untimed rounds, each like a timed one, before each set of --repeats rounds "
        "(at each rate, the reduce-scatter's last rounds and each --sweep length; "
        f"0 for none, as runs before this flag; at most {MAX_WARMUP_ROUNDS}): the first "
        "round after compiling was the slowest more often than chance",
    )
    g.add_argument(
        "--sweep",
        type=_lengths_or_none,
        default="",
        help="comma-separated KV lengths at which tree and ring are also timed, "
        "for the crossover ('' for none)",
    )


def _config(args: argparse.Namespace) -> ClusterConfig:
    from ..cluster.run import ClusterConfig

    return ClusterConfig(
        nodes=args.nodes,
        processes_per_node=args.processes_per_node,
        devices_per_process=args.devices_per_process,
        link_gbit=tuple(args.link_gbit),
        link_delay_ms=args.link_delay_ms,
        seq_len=args.seq_len,
        methods=tuple(args.methods),
        repeats=args.repeats,
        warmup_rounds=args.warmup_rounds,
        sweep=tuple(args.sweep),
        q_heads=args.heads,
        kv_heads=args.kv_heads or args.heads,
        head_dim=args.head_dim,
        timeout=args.timeout,
        init_timeout=args.init_timeout,
        prefix=args.prefix,
        keep_outputs=args.keep_outputs,
    )


SLURM_UNUSED = (
    "probe",
    "json",
    "sweep",
    "keep_outputs",
    "methods",
    "repeats",
    "warmup_rounds",
    "heads",
    "kv_heads",
    "head_dim",
    "init_timeout",
)
"""Flags `--slurm` does not use: its tasks decode `launch`'s fixed problem, JAX's own
start-up timeout applies (initialize() takes no argument), and it writes no report."""


PROBE_UNUSED = (
    "nodes",
    "processes_per_node",
    "devices_per_process",
    "link_delay_ms",
    "slurm",
    "timeout",
    "init_timeout",
    "keep_outputs",
    "seq_len",
    "heads",
    "kv_heads",
    "head_dim",
    "methods",
    "repeats",
    "warmup_rounds",
    "sweep",
)
"""Flags `--probe` does not use: it measures two nodes' links alone, no workers, at the
delays it is given (its list replaces --link-delay-ms) and each --link-gbit rate."""


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    config = _config(args)
    try:
        config.check()
    except ValueError as e:
        parser.error(str(e).replace("`", ""))
    if args.probe is not None:
        _refuse_unused(parser, args, PROBE_UNUSED, "--probe measures the links alone")
        if args.json:
            cl.check_output(parser, "--json", args.json)
        return
    if args.slurm:
        _check_slurm(parser, args, config)
        return
    _check_memory(parser, config)
    if args.json:
        cl.check_output(parser, "--json", args.json)


def _check_memory(parser: argparse.ArgumentParser, config: ClusterConfig) -> None:
    """Each worker holds the problem at --seq-len and, while it sweeps, at the longest
    --sweep length (`cluster.context.Settings.problem`)."""
    settings = config.settings(coordinator="", control="")
    problems = {"--seq-len": settings.problem(config.seq_len)}
    if config.sweep:
        problems["--sweep"] = settings.problem(max(config.sweep))
    memory.check(parser, memory.workers(problems, config.processes))
    memory.check_positions(parser, "--seq-len/--sweep", max((config.seq_len, *config.sweep)))


def _check_slurm(
    parser: argparse.ArgumentParser, args: argparse.Namespace, config: ClusterConfig
) -> None:
    """`--slurm` with a flag it would ignore is a mistake: say which. Each task holds
    `launch`'s problem at --seq-len."""
    from ..cluster.launch import launch_problem

    _refuse_unused(parser, args, SLURM_UNUSED, "--slurm runs launch's decode check only")
    need = memory.workers({"--seq-len": launch_problem(config.seq_len)}, config.processes)
    memory.check(parser, need)
    memory.check_positions(parser, "--seq-len", config.seq_len)


def _refuse_unused(
    parser: argparse.ArgumentParser, args: argparse.Namespace, unused: tuple[str, ...], mode: str
) -> None:
    """A flag that `mode` would ignore, given a value other than its default, is a mistake:
    one line that names it."""
    given = []
    for action in parser._actions:
        if action.dest not in unused:
            continue
        default = action.default
        if isinstance(default, str) and callable(action.type):
            default = action.type(default)  # argparse converts string defaults too
        if getattr(args, action.dest) != default:
            given.append(action.option_strings[0])
    if given:
        parser.error(f"{mode} and does not use {', '.join(given)}")


def run(args: argparse.Namespace) -> int:
    """A cluster of network namespaces on this machine (needs root): `cluster.run`."""
    from ..cluster import netns
    from ..cluster import run as cluster_run

    reason = netns.missing_privileges()
    if reason:  # a usage problem, not a failure of the run: one line, status 2
        print(f"{cl.PROG} cluster: error: {reason}", file=sys.stderr)
        return 2
    command = " ".join([cl.PROG, *sys.argv[1:]])
    if args.probe is not None:
        return _probe(args, command)
    if args.slurm:
        from ..cluster import slurm

        code, srep = slurm.run_slurm(_config(args))
        if srep is not None:
            print(slurm.summary(srep))
        return code
    code, rep = cluster_run.run_cluster(_config(args), args.json, command=command)
    if rep is not None:
        print(cluster_run.summary(rep))
        if args.json:
            print(f"wrote {args.json}")
    return code


def _probe(args: argparse.Namespace, command: str) -> int:
    """`--probe`: the links alone (`cluster.probe`), no workers."""
    import json

    from ..cluster import probe

    rep = probe.probe(
        [r * 1e9 for r in args.link_gbit],
        [d / 1e3 for d in args.probe],
        prefix=args.prefix,
        command=command,
    )
    print(probe.summary(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
        print(f"wrote {args.json}")
    return 0
