"""`tree-attention-edu demo`: the three-way agreement on one device, then tree, energy-tree
and ring decoding of one cache on simulated devices, with latency, bytes, memory and error."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import common
from . import plumbing as cl

NAME = "demo"
HELP = "three-way agreement, then tree vs ring on 8 devices"


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.problem_args(p)
    p.add_argument(
        "--figure",
        default="out/demo_message_patterns.png",
        help="where to save the message-pattern figure ('' to skip)",
    )


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    common.check_mesh(parser, args)
    common.check_problem(parser, args, "--seq-len", args.seq_len)
    if args.figure:
        cl.check_output(parser, "--figure", args.figure, cl.figure_formats())


def three_way_agreement() -> float:
    """Single-device story: softmax, grad of the energy, and the stationary point of Γ agree
    (float64). The paper calls that point a MAP estimate; it is a saddle (see `bayes`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from .. import attention, attention_from_energy, stationary_point
    from ..theory import symbolic

    print("1. One device: attention three ways (float64, B=2, Tq=3, Hq=4, Hkv=2, Tk=50, causal)")
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 3, 4, 16), jnp.float64)
    k = jax.random.normal(kk, (2, 50, 2, 16), jnp.float64)
    v = jax.random.normal(kv, (2, 50, 2, 16), jnp.float64)
    kw: dict[str, Any] = dict(causal=True, kv_lengths=jnp.array([50, 21]))
    soft = attention(q, k, v, **kw)
    grad = attention_from_energy(q, k, v, **kw)
    z, zeta = stationary_point(q, k, v, **kw)
    e1 = float(np.abs(grad - soft).max())
    e2 = float(np.abs(z - soft).max())
    print(f"   softmax vs grad_zeta F(0):        max |diff| = {e1:.1e}")
    print(
        f"   softmax vs saddle z* of Gamma:    max |diff| = {e2:.1e}   (|zeta*| <= "
        f"{float(np.abs(zeta).max()):.1e})"
    )
    ok = symbolic.verify_all()
    print(f"   sympy identities that hold:       {sum(ok.values())}/{len(ok)}")
    if max(e1, e2) > 1e-10 or not all(ok.values()):
        raise cl.CommandFailed(
            f"three-way agreement FAILED (max |diff| {max(e1, e2):.1e}; "
            f"{sum(ok.values())}/{len(ok)} sympy identities hold)"
        )
    return max(e1, e2)


def run(args: argparse.Namespace) -> int:
    common.setup(args)
    from ..perf.benchmark import speedup_line, table
    from ..plots import message_patterns

    three_way_agreement()
    print(
        f"\n2. {args.devices} devices ({args.mesh} mesh): Tk={args.seq_len}, "
        f"{args.heads} heads x {args.head_dim}, {args.dtype}, batch {args.batch}"
    )
    records = common.measure(
        args, args.seq_len, ["single", "single_kernel", "tree", "tree_energy", "ring"]
    )
    print(table(records))
    print(speedup_line(records))
    worst = max(r.max_abs_err for r in records)
    tol = 1e-4 if args.dtype == "float32" else 2e-2
    print(f"   all methods agree with float64 attention: max |err| = {worst:.1e} (tol {tol:g})")
    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
        message_patterns(
            {r.method: r.collective_bytes for r in records if r.devices > 1},
            p=args.devices,
            path=args.figure,
        )
        print(f"   figure: {args.figure}")
    if worst > tol:
        raise cl.CommandFailed(
            f"the methods disagree with float64 attention: max |err| = {worst:.1e} > tol {tol:g}"
        )
    return 0
