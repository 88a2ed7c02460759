"""`tree-attention-edu launch`: tree and ring decoding across real processes on this machine
(`jax.distributed` over gloo), or one process of a SLURM run with `--cluster`
(`cluster.launch`)."""

from __future__ import annotations

import argparse
import os

from . import memory
from . import plumbing as cl

NAME = "launch"
HELP = "tree and ring decoding across real processes (jax.distributed)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cluster.launch import INIT_TIMEOUT_S

    p.add_argument(
        "--processes",
        type=cl.positive,
        default=2,
        help="local processes, one mesh 'node' each",
    )
    p.add_argument(
        "--devices-per-process",
        type=cl.positive,
        default=4,
        help="simulated CPU devices per process",
    )
    p.add_argument("--seq-len", type=cl.positive, default=4096, help="KV length Tk")
    p.add_argument(
        "--timeout",
        type=cl.seconds,
        default=120.0,
        help="seconds for the whole run; then every worker is killed",
    )
    p.add_argument(
        "--init-timeout",
        type=cl.positive,
        default=None,
        help=f"seconds jax.distributed start-up waits for the other workers "
        f"(default: {INIT_TIMEOUT_S}, or --timeout if shorter)",
    )
    p.add_argument(
        "--port",
        type=cl.port,
        default=0,
        help="coordinator port on 127.0.0.1 (0: pick a free one)",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="be one process of a cluster run (e.g. under srun): "
        "jax.distributed.initialize() reads SLURM's environment; "
        "--processes, --devices-per-process, --port and the timeouts are not used",
    )


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from ..cluster.launch import launch_problem

    if args.cluster and args.port:
        parser.error("--port is for local runs; with --cluster the coordinator comes from SLURM")
    total = args.processes * args.devices_per_process
    if not args.cluster and total > cl.MAX_DEVICES:
        parser.error(
            f"--processes x --devices-per-process = {total} devices is more than {cl.MAX_DEVICES}"
        )
    processes = 1 if args.cluster else args.processes
    need = memory.workers({"--seq-len/--processes": launch_problem(args.seq_len)}, processes)
    memory.check(parser, need)
    memory.check_positions(parser, "--seq-len", args.seq_len)


def run(args: argparse.Namespace) -> int:
    from ..cluster import launch
    from ..cluster.processes import PARENT_ENV, guard_parent

    if args.cluster:  # this process is one of the run's: srun (or `cluster --slurm`) started it
        if parent := os.environ.get(PARENT_ENV):  # `cluster --slurm`: die with that launcher
            guard_parent(int(parent))
        return launch.slurm_worker(args.seq_len)
    code = launch.run_local(
        args.processes,
        args.devices_per_process,
        args.seq_len,
        args.timeout,
        port=args.port,
        init_timeout=args.init_timeout,
    )
    if code == 0:
        print("launch: all processes agree with the single-device answer")
    return code  # on failure run_local has printed its one line
