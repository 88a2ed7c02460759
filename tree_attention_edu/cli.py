"""Command line: `tree-attention-edu demo | bench | generate | launch`.

Device setup must happen before JAX initialises, so every subcommand parses its arguments,
calls `simulate_devices`, and only then computes anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm


def _problem_args(p: argparse.ArgumentParser, seq_len: int = 65536) -> None:
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--seq-len", type=int, default=seq_len, help="KV length Tk")
    p.add_argument("--heads", type=int, default=16, help="query (and kv) heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=5, help="timed calls per method (median)")
    p.add_argument("--mesh", default="1d", choices=["1d", "2level"],
                   help="1d: one 'x' axis; 2level: ('node', 'gpu') with 2 nodes")


def _setup(args) -> None:
    from .devices import simulate_devices

    simulate_devices(args.devices)
    import jax

    jax.config.update("jax_enable_x64", True)  # for float64 references; inputs stay explicit


def _mesh(args):
    from .devices import make_mesh

    if args.mesh == "2level":
        if args.devices % 2:
            raise SystemExit("--mesh 2level needs an even --devices")
        return make_mesh((2, args.devices // 2), ("node", "gpu"))
    return make_mesh(args.devices, "x")


def _problem(args, seq_len: int):
    from .benchmark import Problem

    return Problem(seq_len=seq_len, batch=args.batch, q_heads=args.heads, kv_heads=args.heads,
                   head_dim=args.head_dim, dtype=args.dtype)


def _measure(args, seq_len: int, methods):
    from . import benchmark

    bar = tqdm(total=len(methods), desc=f"Tk={seq_len}: compiling and timing", unit="method",
               file=sys.stderr, disable=None)

    def progress(name):
        bar.set_postfix_str(name)
        bar.update(0)

    records = benchmark.run(_mesh(args), _problem(args, seq_len), methods=methods,
                            repeats=args.repeats, progress=lambda n: (progress(n), bar.update(1)))
    bar.close()
    return records


def three_way_agreement() -> float:
    """Single-device story: softmax, grad of the energy, and MAP agree (float64)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from . import attention, attention_from_energy, map_estimate, symbolic

    print("1. One device: attention three ways (float64, B=2, Tq=3, Hq=4, Hkv=2, Tk=50, causal)")
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 3, 4, 16), jnp.float64)
    k = jax.random.normal(kk, (2, 50, 2, 16), jnp.float64)
    v = jax.random.normal(kv, (2, 50, 2, 16), jnp.float64)
    kw = dict(causal=True, kv_lengths=jnp.array([50, 21]))
    soft = attention(q, k, v, **kw)
    grad = attention_from_energy(q, k, v, **kw)
    z, zeta = map_estimate(q, k, v, **kw)
    e1 = float(np.abs(grad - soft).max())
    e2 = float(np.abs(z - soft).max())
    print(f"   softmax vs grad_zeta F(0):        max |diff| = {e1:.1e}")
    print(f"   softmax vs MAP z* of Gamma:       max |diff| = {e2:.1e}   (|zeta*| <= "
          f"{float(np.abs(zeta).max()):.1e})")
    ok = symbolic.verify_all()
    print(f"   sympy identities that hold:       {sum(ok.values())}/{len(ok)}")
    if max(e1, e2) > 1e-10 or not all(ok.values()):
        raise SystemExit("three-way agreement FAILED")
    return max(e1, e2)


def cmd_demo(args) -> int:
    _setup(args)
    from .benchmark import table
    from .plots import message_patterns

    three_way_agreement()
    print(f"\n2. {args.devices} devices ({args.mesh} mesh): Tk={args.seq_len}, "
          f"{args.heads} heads x {args.head_dim}, {args.dtype}, batch {args.batch}")
    records = _measure(args, args.seq_len, ["single", "tree", "tree_energy", "ring"])
    print(table(records))
    worst = max(r.max_abs_err for r in records)
    tol = 1e-4 if args.dtype == "float32" else 2e-2
    print(f"   all methods agree with float64 attention: max |err| = {worst:.1e} (tol {tol:g})")
    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
        message_patterns({r.method: r.collective_bytes for r in records if r.method != "single"},
                         p=args.devices, path=args.figure)
        print(f"   figure: {args.figure}")
    return 0 if worst <= tol else 1


def cmd_bench(args) -> int:
    _setup(args)
    from .benchmark import METHODS, table

    out = []
    for seq_len in args.seq_lens:
        records = _measure(args, seq_len, list(args.methods or METHODS))
        print(table(records))
        by = {r.method: r for r in records}
        if {"tree", "ring", "single"} <= set(by):
            t, r, s = by["tree"], by["ring"], by["single"]
            print(f"   tree/single latency {t.median_s / s.median_s:.2f}x, ring/tree latency "
                  f"{r.median_s / t.median_s:.2f}x, ring/tree bytes "
                  f"{r.collective_bytes / max(t.collective_bytes, 1):.3g}x, ring/tree temp "
                  f"{r.temp_bytes / max(t.temp_bytes, 1):.2f}x")
        out += [r.as_json() for r in records]
    report: dict = {"records": out}
    if "bandwidth" in args.sections:
        report["bandwidth"] = _bandwidth(args)
    if "calibration" in args.sections:
        report["calibration"] = _calibration(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def _bandwidth(args) -> dict:
    from . import calibrate

    seq_len = max(args.seq_lens)
    print(f"\nBandwidth: one decode step at Tk={seq_len}, {args.heads} heads x {args.head_dim}, "
          f"{args.dtype}; effective GB/s = (K + V bytes) / median time")
    with tqdm(desc="bandwidth", unit="kernel", file=sys.stderr, disable=None) as bar:
        section = calibrate.bandwidth(_mesh(args), _problem(args, seq_len), repeats=args.repeats,
                                      progress=lambda n: (bar.set_postfix_str(n), bar.update(1)))
    print(calibrate.bandwidth_table(section))
    return section


def _calibration(args) -> list[dict]:
    from . import calibrate

    print(f"\nCalibration: alpha-beta model with parameters measured here, against measured "
          f"tree and ring latency on {args.devices} devices")
    with tqdm(desc="calibration", unit="step", file=sys.stderr, disable=None) as bar:
        cal, rows = calibrate.calibrate(
            _mesh(args), args.calibration_seq_lens, problem=_problem(args, 0),
            repeats=args.repeats, progress=lambda n: (bar.set_postfix_str(n), bar.update(1)))
    print(calibrate.calibration_table(cal, rows))
    return rows


def _prompts(args) -> list[list[int]]:
    """Ragged prompts: lengths N, 3N/4, N/2, ... (cycled over the batch), from `--seed`."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    fracs = (1.0, 0.75, 0.5, 0.25)
    lens = [max(1, int(args.prompt_len * fracs[b % len(fracs)])) for b in range(args.batch)]
    return [rng.integers(0, args.vocab, n).tolist() for n in lens]


# `model.METHODS`, spelled here so that parsing arguments does not import JAX before
# `_setup` has set the XLA flags (a test keeps the two equal).
GENERATE_METHODS = ("tree", "ring", "single")


def _method_list(text: str) -> list[str]:
    methods = [m for m in text.split(",") if m]
    bad = sorted(set(methods) - set(GENERATE_METHODS))
    if bad or not methods:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {bad or text!r}; use one of {', '.join(GENERATE_METHODS)} "
            "or a comma list")
    return list(dict.fromkeys(methods))  # drop repeats, keep order


def cmd_generate(args) -> int:
    _setup(args)
    import dataclasses
    import statistics

    import jax
    import numpy as np

    from . import model

    cfg = dataclasses.replace(model.PRESETS[args.preset], vocab=args.vocab)
    params = model.init_params(cfg, jax.random.key(args.seed))
    prompts = _prompts(args)
    print(f"model {args.preset}: {cfg.layers} layers, dim {cfg.dim}, {cfg.q_heads} q heads / "
          f"{cfg.kv_heads} kv heads x {cfg.head_dim}; prompts of {[len(p) for p in prompts]} "
          f"tokens; {args.new_tokens} new tokens; {args.devices} devices ({args.mesh} mesh)")
    methods = args.method + (["single"] if args.check and "single" not in args.method else [])
    results = {}
    for method in methods:
        prefill = args.prefill_method if method in args.method else None
        gen = model.Generator(params, cfg, _mesh(args), method, prefill_chunk=args.prefill_chunk,
                              prefill_method=prefill)
        out = gen.generate(prompts, args.new_tokens, key=jax.random.key(args.seed + 1),
                           temperature=args.temperature, progress=True)
        steady = out.step_s[1:] or out.step_s  # the first decode step compiles
        per_tok = statistics.median(steady)
        results[method] = out
        print(f"{method:>7}: median per-token latency {per_tok * 1e3:.1f} ms, "
              f"{len(prompts) / per_tok:.1f} tokens/s (batch {len(prompts)}), "
              f"compiled the step {gen.traces}x; prefill ({gen.prefill_method}) "
              f"{out.prefill_s:.1f} s")
    print("first tokens:", results[args.method[0]].tokens[:, :8].tolist())
    if "single" not in results:
        return 0
    code = 0
    for method in args.method:
        if method == "single":
            continue
        same = np.array_equal(results[method].tokens, results["single"].tokens)
        diff = float(np.abs(results[method].logits - results["single"].logits).max())
        print(f"{method}: tokens identical to single-device generation: {same}; "
              f"max |logit difference| {diff:.1e}")
        code |= 0 if same else 1
    return code


def cmd_launch(args) -> int:
    from .launch import run_local

    code = run_local(args.processes, args.devices_per_process, args.seq_len, args.timeout)
    print("launch: all processes agree with the single-device answer" if code == 0
          else "launch: FAILED", file=sys.stderr if code else sys.stdout)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tree-attention-edu", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="three-way agreement, then tree vs ring on 8 devices")
    _problem_args(demo)
    demo.add_argument("--figure", default="out/demo_message_patterns.png",
                      help="where to save the message-pattern figure ('' to skip)")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="measure every method; write JSON records")
    _problem_args(bench)
    bench.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")],
                       default=[65536], help="comma-separated KV lengths")
    bench.add_argument("--methods", type=lambda s: s.split(","), default=None,
                       help="comma-separated subset of single,tree,tree_energy,ring,xla_auto")
    bench.add_argument("--json", default=None, help="write records to this path")
    bench.add_argument("--sections", type=lambda s: s.split(",") if s else [],
                       default=["bandwidth", "calibration"],
                       help="extra sections after the method table: bandwidth,calibration "
                            "(default both; '' for none)")
    bench.add_argument("--calibration-seq-lens", type=lambda s: [int(x) for x in s.split(",")],
                       default=[16384, 32768, 65536, 131072],
                       help="KV lengths at which the cost model is checked")
    bench.set_defaults(func=cmd_bench)

    gen = sub.add_parser("generate", help="generate with a sharded KV cache; check tokens")
    gen.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    gen.add_argument("--mesh", default="1d", choices=["1d", "2level"])
    gen.add_argument("--method", type=_method_list, default=["tree"],
                     help="tree, ring or single, or several comma-separated (timed one after "
                          "another in the same run)")
    gen.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    gen.add_argument("--vocab", type=int, default=256)
    gen.add_argument("--prompt-len", type=int, default=1024,
                     help="longest prompt; the batch's others are 3/4, 1/2, 1/4 of it")
    gen.add_argument("--new-tokens", type=int, default=32)
    gen.add_argument("--batch", type=int, default=3)
    gen.add_argument("--prefill-chunk", type=int, default=512)
    gen.add_argument("--prefill-method", default=None, choices=GENERATE_METHODS,
                     help="attention that fills the cache (default: --method); e.g. tree "
                          "prefill before ring decoding on long prompts")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-check", dest="check", action="store_false",
                     help="skip the single-device generation the tokens are checked against")
    gen.set_defaults(func=cmd_generate)

    launch = sub.add_parser("launch", help="tree and ring decoding across real processes")
    launch.add_argument("--processes", type=int, default=2)
    launch.add_argument("--devices-per-process", type=int, default=4)
    launch.add_argument("--seq-len", type=int, default=4096)
    launch.add_argument("--timeout", type=float, default=300.0)
    launch.set_defaults(func=cmd_launch)

    args = parser.parse_args(argv)
    if os.environ.get("XLA_FLAGS", "").find("xla_force_host_platform_device_count") >= 0:
        print("note: XLA_FLAGS sets a device count; --devices is applied on top", file=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
