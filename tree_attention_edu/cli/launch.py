"""`tree-attention-edu launch`: tree and ring decoding across real processes on this machine
(`jax.distributed` over gloo), or one process of a SLURM run with `--cluster`."""

from __future__ import annotations

import argparse
from typing import Any

from .. import commandline as cl
from ..cluster import launch

NAME = "launch"
HELP = "tree and ring decoding across real processes (jax.distributed)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    launch.add_arguments(p)


def validate(parser: argparse.ArgumentParser, args: Any) -> None:
    if args.cluster and args.port:
        parser.error("--port is for local runs; with --cluster the coordinator comes from "
                     "SLURM")
    total = args.processes * args.devices_per_process
    if not args.cluster and total > cl.MAX_DEVICES:
        parser.error(f"--processes x --devices-per-process = {total} devices is more than "
                     f"{cl.MAX_DEVICES}")
    _check_launch_memory(parser, args)


def _check_launch_memory(parser, args) -> None:
    """Each worker holds the launch problem's q, K, V (float32, padded) and a float64 copy."""
    kv = 2 * 2 * args.seq_len * 2 * 64 * 4  # batch 2, 2 kv heads x 64 (launch.worker)
    per_process = 4 * kv + 400 * 2**20  # + the JAX runtime of one process
    processes = 1 if args.cluster else args.processes
    cl.check_memory(parser, "--seq-len/--processes", processes * per_process,
                  f"{processes} process(es) at Tk={args.seq_len} (K and V: {kv:,} bytes in "
                  "each, with copies)")
    cl.check_positions(parser, "--seq-len", args.seq_len)


def run(args: Any) -> int:
    if args.cluster:
        return launch.main(["--cluster", "--seq-len", str(args.seq_len)])
    code = launch.run_local(args.processes, args.devices_per_process, args.seq_len,
                            args.timeout, port=args.port, init_timeout=args.init_timeout)
    if code == 0:
        print("launch: all processes agree with the single-device answer")
    return code  # on failure run_local has printed its one line

