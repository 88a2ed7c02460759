"""What `demo` and `bench` share, and every subcommand's device setup: the flags of the
decode problem, the problem they build and the memory it needs, the mesh, and measuring the
methods with a progress bar."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, get_args

from tqdm import tqdm

from . import memory
from . import plumbing as cl

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from ..perf.benchmark import Problem, Record

MeshKind = Literal["1d", "2level"]
"""`--mesh`: one "x" axis, or ("node", "gpu") with 2 nodes."""
MESH_KINDS: tuple[MeshKind, ...] = get_args(MeshKind)
DTYPES = ("float32", "bfloat16", "float16")


def setup(args: argparse.Namespace) -> None:
    """Simulate `--devices` CPU devices (before any JAX computation), and float64 for the
    references."""
    import jax

    from ..core.devices import simulate_devices

    simulate_devices(args.devices)
    have, backend = jax.device_count(), jax.default_backend()
    if have < args.devices and backend != "cpu":  # the CPU devices are simulated, a GPU's not
        raise RuntimeError(
            f"--devices {args.devices}: JAX's default backend is {backend}, with {have} "
            f"device(s); pass --devices {have} to run there, or set JAX_PLATFORMS=cpu to "
            f"simulate {args.devices} CPU devices"
        )
    jax.config.update("jax_enable_x64", True)  # for float64 references; inputs stay explicit


def mesh(args: argparse.Namespace) -> Mesh:
    """The `--mesh` of `--devices` devices: 1d ("x") or 2level (2 nodes of ("node", "gpu"))."""
    from ..core.devices import make_mesh

    if args.mesh == "2level":  # `check_mesh` made sure --devices is even
        return make_mesh((2, args.devices // 2), ("node", "gpu"))
    return make_mesh(args.devices, "x")


def check_mesh(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if getattr(args, "mesh", "1d") == "2level" and args.devices % 2:
        parser.error(f"--mesh 2level needs an even --devices (2 nodes), got {args.devices}")


def problem(args: argparse.Namespace, seq_len: int) -> Problem:
    """The decode problem of the flags `problem_args` adds, at KV length `seq_len`."""
    from ..perf.benchmark import Problem

    return Problem(
        seq_len=seq_len,
        batch=args.batch,
        q_heads=args.heads,
        kv_heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
    )


def check_problem(
    parser: argparse.ArgumentParser, args: argparse.Namespace, flag: str, seq_len: int
) -> None:
    """The problem at `seq_len` fits this machine's memory and int32 positions."""
    memory.check(parser, memory.decode(problem(args, seq_len), flag))
    memory.check_positions(parser, flag, seq_len)


def measure(args: argparse.Namespace, seq_len: int, methods: Sequence[str]) -> list[Record]:
    from ..perf import benchmark

    bar = tqdm(
        total=len(methods),
        desc=f"Tk={seq_len}: compiling and timing",
        unit="method",
        file=sys.stderr,
        disable=None,
    )

    def progress(name: str) -> None:
        bar.set_postfix_str(name)
        bar.update(1)

    try:
        return benchmark.run(
            mesh(args),
            problem(args, seq_len),
            methods=methods,
            repeats=args.repeats,
            progress=progress,
        )
    finally:
        bar.close()


def problem_args(p: argparse.ArgumentParser, seq_len: int | None = 65536) -> None:
    p.add_argument(
        "--devices",
        type=cl.devices,
        default=8,
        help=f"simulated CPU devices (at most {cl.MAX_DEVICES})",
    )
    p.add_argument(
        "--seq-len",
        type=cl.positive,
        default=seq_len,
        help="KV length Tk" + ("" if seq_len else " (default 65536; the same as --seq-lens N)"),
    )
    p.add_argument("--heads", type=cl.positive, default=16, help="query (and kv) heads")
    p.add_argument("--head-dim", type=cl.positive, default=128, help="size of each head")
    p.add_argument("--batch", type=cl.positive, default=1, help="sequences decoded together")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of q, K and V")
    p.add_argument("--repeats", type=cl.positive, default=5, help="timed calls per method (median)")
    p.add_argument(
        "--mesh",
        default="1d",
        choices=MESH_KINDS,
        help="1d: one 'x' axis; 2level: ('node', 'gpu') with 2 nodes",
    )
