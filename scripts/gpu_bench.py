"""Local decode kernels against the device's bandwidth: the sweep of issue 14, as JSON.

For each dtype, shape and KV length, one decode step (one query per sequence) of each kernel
is timed on the first device (median of `--repeats` jitted calls after a warm-up), and its
effective bandwidth `(K + V bytes) / time` is reported as a fraction of the device's
measured read bandwidth and of its nominal HBM peak (`benchmark.device_info`).

Kernels:

* `xla_bthd`, `xla_bhtd`: `kernels.xla_state` on either cache layout;
* `cudnn`: `kernels.cudnn_state` (cuDNN through `jax.nn.dot_product_attention`). Without a
  CUDA GPU it runs JAX's xla implementation of the same call and is recorded as
  `cudnn_via_xla`, with `"implementation": "xla"`;
* `dot_product_attention`: `jax.nn.dot_product_attention` with its default implementation;
* `flash`: `kernels.flash_state`, where flash-attn-jax (the tested release) is installed;
* `tree_decode`: `tree_decode` on a one-device mesh with `local_kernel="auto"` (the record
  says which kernel "auto" chose).

    PYTHONPATH=. python scripts/gpu_bench.py                  # the full sweep, on a GPU
    PYTHONPATH=. python scripts/gpu_bench.py --quick --out /tmp/quick.json   # tiny, on CPU

The file holds `{"device": ..., "bandwidth": {"kernels": {NAME: record}}, "best": ...,
"config": ..., "generation": ...}`; NAME is `"<kernel> <dtype> <shape> Tk=<n>"`, and each
record has `gbs`, `frac_measured`, `frac_nominal`, `median_s`, `kv_bytes`, and what it
measured. A kernel that cannot run a case (cudnn in float32, a size over `--max-kv-fraction`
of the device's memory, an error) is recorded with `"skipped"` and the reason. `--attach
NAME=PATH` copies other JSON files (the generation runs) under `"generation"`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

SHAPES = {  # name: (batch, q_heads, kv_heads, head_dim)
    "h16x128_b1": (1, 16, 16, 128),
    "gqa32_8x128_b8": (8, 32, 8, 128),
}
QUICK_SHAPES = {"h4x32_b1": (1, 4, 4, 32), "gqa8_2x32_b2": (2, 8, 2, 32)}
SEQ_LENS = tuple(2**e for e in range(14, 21))  # 16k .. 1M
QUICK_SEQ_LENS = (256, 1024)
DTYPES = ("bfloat16", "float32")
KERNEL_NAMES = ("xla_bthd", "xla_bhtd", "cudnn", "dot_product_attention", "flash", "tree_decode")


class Parser(argparse.ArgumentParser):
    """Usage errors are one line, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _csv(kind, choices=None):
    def parse(text: str):
        items = [t.strip() for t in text.split(",")]
        if not text.strip() or any(not t for t in items):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        try:
            out = [kind(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a list of {kind.__name__}: {text!r}") from None
        bad = [
            t for t in out if (choices is not None and t not in choices) or (kind is int and t < 1)
        ]
        if bad:
            want = f"one of {', '.join(choices)}" if choices else "positive"
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not {want}")
        return out

    return parse


def _attach(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH of an existing file, got {text!r}")
    return name, Path(path)


def _fraction(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {x}")
    return x


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def build_parser() -> Parser:
    p = Parser(
        prog="gpu_bench.py",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes (Tk 256 and 1024, small heads) to check the script anywhere",
    )
    p.add_argument(
        "--seq-lens",
        type=_csv(int),
        default=None,
        help="KV lengths (default: 16k..1M by powers of 2; --quick: 256,1024)",
    )
    p.add_argument("--dtypes", type=_csv(str, DTYPES), default=list(DTYPES), help="dtypes")
    p.add_argument(
        "--shapes",
        type=_csv(str, (*SHAPES, *QUICK_SHAPES)),
        default=None,
        help=f"shapes, of {', '.join((*SHAPES, *QUICK_SHAPES))} (default: the first "
        f"two, or the quick two)",
    )
    p.add_argument(
        "--kernels", type=_csv(str, KERNEL_NAMES), default=list(KERNEL_NAMES), help="kernels"
    )
    p.add_argument("--repeats", type=_positive, default=10, help="timed calls (median)")
    p.add_argument(
        "--max-kv-fraction",
        type=_fraction,
        default=0.3,
        help="skip a case whose K + V exceed this fraction of the device's memory "
        "(the inputs, a head-major copy and temporaries must fit)",
    )
    p.add_argument(
        "--attach",
        type=_attach,
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a JSON file to copy under 'generation'",
    )
    p.add_argument(
        "--out", default=None, help="output path (default: results/gpu/<device kind>.json)"
    )
    return p


def _slug(kind: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "device"


def _device_bytes(dev) -> int | None:
    try:
        stats = dev.memory_stats()
    except Exception:  # CPU devices may not implement it
        return None
    return (stats or {}).get("bytes_limit")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from tqdm import tqdm

    from tree_attention_edu import tree_decode
    from tree_attention_edu.core import kernels
    from tree_attention_edu.perf import benchmark

    shapes = args.shapes or list(QUICK_SHAPES if args.quick else SHAPES)
    seq_lens = args.seq_lens or list(QUICK_SEQ_LENS if args.quick else SEQ_LENS)
    repeats = 2 if args.quick and args.repeats == 10 else args.repeats
    dev = jax.devices()[0]
    on_gpu = kernels.cudnn.unsupported_reason(jnp.bfloat16, 128, 128) is None
    device = benchmark.device_info(measure=True, nbytes=(64 * 2**20 if args.quick else None))
    print(
        f"device: {device['platform']} ({device['kind']}), jax {device['jax_version']}; "
        f"measured {device['measured_gbs']:.1f} GB/s, nominal {device['nominal_gbs']}"
    )
    limit = _device_bytes(dev)
    mesh1 = Mesh(np.array([dev]), ("x",))

    def fns(dtype, head_dim):
        impl = "cudnn" if on_gpu else "xla"
        out = {
            "xla_bthd": ("bthd", lambda q, k, v: kernels.xla_state(q, k, v).out),
            "xla_bhtd": ("bhtd", lambda q, k, v: kernels.xla_state(q, k, v, layout="bhtd").out),
            "cudnn": (
                "bthd",
                lambda q, k, v: kernels.cudnn_state(q, k, v, implementation=impl).out,
            ),
            "dot_product_attention": ("bthd", jax.nn.dot_product_attention),
            "flash": ("bthd", lambda q, k, v: kernels.flash_state(q, k, v).out),
            "tree_decode": ("bthd", lambda q, k, v: tree_decode(q, k, v, mesh=mesh1)),
        }
        return {n: out[n] for n in args.kernels}

    def skip_reason(name, dtype, head_dim, kv_bytes):
        if limit and kv_bytes * (2 if name == "xla_bhtd" else 1) > args.max_kv_fraction * limit:
            return f"K + V ({kv_bytes / 2**30:.1f} GiB) over --max-kv-fraction of the device"
        if name == "cudnn" and on_gpu:
            return kernels.cudnn.unsupported_reason(dtype, head_dim, head_dim)
        if name == "flash":
            return kernels.flash.unsupported_reason(dtype, head_dim, head_dim, False)
        return None

    out = Path(args.out or f"results/gpu/{_slug(device['kind'])}.json")

    def write(records: dict[str, dict], complete: bool) -> dict[str, dict]:
        """The report of the cases run so far (rewritten after each case, so a sweep cut
        off by a time limit still leaves its figures)."""
        records = {k: dict(r) for k, r in records.items()}
        timed = {k: r for k, r in records.items() if "gbs" in r}
        benchmark.device_fractions(timed, device)
        for r in records.values():
            r.setdefault("frac_measured", None)
            r.setdefault("frac_nominal", None)
        long_bf16 = [
            r
            for r in timed.values()
            if r["dtype"] == "bfloat16"
            and r["seq_len"] >= (131072 if not args.quick else max(seq_lens))
        ]
        best = max(long_bf16, key=lambda r: r["gbs"], default=None)
        report = {
            "device": device,
            "bandwidth": {"machine_read_gbs": device["measured_gbs"], "kernels": records},
            "best": None
            if best is None
            else {
                "kernel": best["kernel"],
                "shape": best["shape"],
                "seq_len": best["seq_len"],
                "gbs": best["gbs"],
                "frac_measured": best["frac_measured"],
                "frac_nominal": best["frac_nominal"],
                "target_frac_nominal": 0.7,
                "meets_target": (
                    None if best["frac_nominal"] is None else best["frac_nominal"] >= 0.7
                ),
            },
            "config": {
                "complete": complete,
                "quick": args.quick,
                "repeats": repeats,
                "seq_lens": seq_lens,
                "shapes": {
                    s: dict(
                        zip(
                            ("batch", "q_heads", "kv_heads", "head_dim"),
                            {**SHAPES, **QUICK_SHAPES}[s],
                            strict=True,
                        )
                    )
                    for s in shapes
                },
                "dtypes": args.dtypes,
                "kernels": args.kernels,
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            },
            "generation": {name: json.loads(path.read_text()) for name, path in args.attach},
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")  # a kill mid-write leaves the last report
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, out)
        return records

    records: dict[str, dict] = {}
    cases = [(dt, sh, n) for dt in args.dtypes for sh in shapes for n in seq_lens]
    bar = tqdm(
        total=len(cases) * len(args.kernels),
        desc="kernels",
        unit="run",
        file=sys.stderr,
        disable=None,
    )
    for dtype_name, shape, seq_len in cases:
        batch, hq, hkv, d = {**SHAPES, **QUICK_SHAPES}[shape]
        dtype = jnp.dtype(dtype_name)
        prob = benchmark.Problem(
            seq_len=seq_len, batch=batch, q_heads=hq, kv_heads=hkv, head_dim=d, dtype=dtype_name
        )
        kq, kk, kv = jax.random.split(jax.random.key(seq_len), 3)
        arrays: dict[str, tuple] = {}

        def inputs(
            layout,
            kq=kq,
            kk=kk,
            kv=kv,
            batch=batch,
            hq=hq,
            hkv=hkv,
            d=d,
            seq_len=seq_len,
            dtype=dtype,
            arrays=arrays,
        ):
            if layout not in arrays:
                arrays.clear()  # one layout on the device at a time
                shape_kv = (
                    (batch, seq_len, hkv, d) if layout == "bthd" else (batch, hkv, seq_len, d)
                )
                with jax.default_device(dev):
                    arrays[layout] = (
                        jax.random.normal(kq, (batch, 1, hq, d), dtype),
                        jax.random.normal(kk, shape_kv, dtype),
                        jax.random.normal(kv, shape_kv, dtype),
                    )
            return arrays[layout]

        for name, (layout, fn) in sorted(fns(dtype, d).items(), key=lambda kv: kv[1][0]):
            label = "cudnn_via_xla" if name == "cudnn" and not on_gpu else name
            key = f"{label} {dtype_name} {shape} Tk={seq_len}"
            bar.set_postfix_str(key)
            rec = dict(
                kernel=label,
                dtype=dtype_name,
                shape=shape,
                batch=batch,
                q_heads=hq,
                kv_heads=hkv,
                head_dim=d,
                seq_len=seq_len,
                layout=layout,
                kv_bytes=prob.kv_bytes,
            )
            if name == "cudnn":
                rec["implementation"] = "cudnn" if on_gpu else "xla"
            if name == "tree_decode":
                rec["local_kernel"] = kernels.resolve(
                    "auto", dtype=dtype, head_dim=d, v_dim=d, needs_mask=False
                )
            reason = skip_reason(name, dtype, d, prob.kv_bytes)
            if reason is None:
                try:
                    q, k, v = inputs(layout)
                    jfn = jax.jit(fn)
                    t = benchmark.median_time(jfn, q, k, v, repeats=repeats)
                    rec.update(median_s=t, gbs=prob.kv_bytes / t / 1e9)
                except Exception as err:  # record it, go on with the sweep
                    reason = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                    traceback.print_exc(limit=1, file=sys.stderr)
            if reason is not None:
                rec["skipped"] = reason
            records[key] = rec
            bar.update(1)
        arrays.clear()
        write(records, complete=False)
    bar.close()
    records = write(records, complete=True)

    width = max(map(len, records), default=10)
    for k, r in records.items():
        if "gbs" in r:
            nominal = "" if r["frac_nominal"] is None else f"  {r['frac_nominal']:6.1%} of nominal"
            print(
                f"{k:<{width}}  {r['gbs']:9.2f} GB/s  {r['frac_measured']:6.1%} of measured"
                f"{nominal}"
            )
        else:
            print(f"{k:<{width}}  skipped: {r['skipped']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
