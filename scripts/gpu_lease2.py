"""The second GPU lease (issue 33): the forms of a decode step on the default `bthd` layout,
bf16 operands with float32 accumulation against `HIGHEST` upcasts, the fixed cost per call,
and SmolLM2's decode step, as one JSON file.

Every part runs on any backend; `--quick` uses tiny sizes (a CPU check of the script).
The record in `results/gpu/lease2/` was made at commit 3eda559 (the package before the
lease's fixes): its `pkg_*` forms were the kernels as they were then; run today, they
measure the changed ones (`pkg_xla_bthd` and `pkg_xla_bhtd` in bf16 take the `mx_hi`
scores' product). The script as it ran differs from this one in one place: its "no cond"
SmolLM2 variant replaced `forward._attend_then_append` (which then held each layer's
`lax.cond`) by a one-pass read; since the fix there is no per-layer cond, and the variant
replaces `generator.read_only_step` instead.

    PYTHONPATH=. python scripts/gpu_lease2.py --out lease2.json            # on the GPU
    PYTHONPATH=. python scripts/gpu_lease2.py --quick --out /tmp/q.json    # anywhere

Parts (each writes the JSON when it ends, so a run cut off keeps what it measured):

* `forms`: one decode step (one query per sequence, GQA 32/8 x 128, batch 8) in each form,
  at each Tk and dtype: its median time, `(K + V bytes) / time`, and the compiled program's
  scratch (`memory_analysis().temp_size_in_bytes`) against the cache's bytes, so a
  cache-sized copy shows. The forms:
  - `pkg_xla_bthd`, `pkg_xla_bhtd`: `kernels.xla_state` as it is (blocks of 256 keys on
    "bthd"; at the lease, HIGHEST products on float32 upcasts; now, for bf16 on either
    layout, the scores' product of `_exact_products`);
  - `pkg_cudnn`: `kernels.cudnn_state` (bf16 only), `dpa`: `jax.nn.dot_product_attention`;
  - `einsum_<layout>_<qk>_<pv>`: the whole cache in one einsum per product, written to read
    it in its own layout (`bqhgd,bthd->bhgqt`, no explicit transpose). The scores' product
    `qk` is `hi` (float32 upcasts, HIGHEST), `mx` (the cache's own dtype, float32
    accumulation via `preferred_element_type`; products of two bf16 numbers are exact in
    float32) or `df` (float32 at XLA's default precision: TF32 on NVIDIA, for reference);
    the weighted sum `pv` is `hi`, `p16` (the weights rounded to the cache's dtype, float32
    accumulation: flash-attention's choice) or `df`;
  - `chunk<C>_bthd_<qk>_hi`: the same, folded over chunks of C keys (online softmax), the
    bounded-memory form a long query block needs (`mx` scores in bf16, `hi` in float32).
  Within `forms`, at its first length (16,384), each form's `max |out - ref| / max |v|`
  against a float64 numpy reference on the same (rounded) inputs.
* `fixed_cost`: the forms of `Cfg.fixed_forms` over Tk, with `t = a + bytes / bw` fitted by
  least squares, beside a trivial jitted call (the dispatch floor) and the kernels in each
  compiled program.
* `smollm2`: SmolLM2-135M's shape with random weights (speed does not depend on them):
  `llama.speed.decode_speed` for single and tree on one device, at each context, plus
  `single` with the one-pass read only (no `lax.cond`), and the kernels of each program.
  (The lease-2 record ran this before the step's mend moved from a `lax.cond` in each layer
  to one per step, `forward.read_only_step`: "as is" there had 30 conds, "no cond" none.)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tree_attention_edu.core.kernels import cudnn_state, xla_state
from tree_attention_edu.perf import benchmark

HI = lax.Precision.HIGHEST
F32 = jnp.float32
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


# --------------------------------------------------------------------------- forms


def _spec(layout: str) -> str:
    return "bthd" if layout == "bthd" else "bhtd"


def _scores(qg, k, layout, qk):
    """`qg [B, Tq, Hkv, G, D]` against `k` in its layout -> `[B, Hkv, G, Tq, Tk]` float32."""
    eq = f"bqhgd,{_spec(layout)}->bhgqt"
    if qk == "hi":
        return jnp.einsum(eq, qg.astype(F32), k.astype(F32), precision=HI)
    if qk == "mx":
        return jnp.einsum(eq, qg.astype(k.dtype), k, preferred_element_type=F32)
    return jnp.einsum(eq, qg.astype(F32), k.astype(F32))  # "df"


def _weighted(p, v, layout, pv):
    """`p [B, Hkv, G, Tq, C]` float32 times `v` -> `[B, Tq, Hkv, G, Dv]` float32."""
    eq = f"bhgqt,{_spec(layout).replace('d', 'v')}->bqhgv"
    if pv == "hi":
        return jnp.einsum(eq, p, v.astype(F32), precision=HI)
    if pv == "p16":
        return jnp.einsum(eq, p.astype(v.dtype), v, preferred_element_type=F32)
    return jnp.einsum(eq, p, v.astype(F32))  # "df"


def einsum_form(layout: str, qk: str, pv: str, chunk: int | None = None):
    """A decode step `(q [B, Tq, Hq, D], k, v) -> out [B, Tq, Hq, Dv]` float32."""

    def fold(carry, qg, kb, vb, scale):
        m, l, o = carry
        s = _scores(qg, kb, layout, qk) * scale
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        r = jnp.exp(m - m_new)
        o = o * jnp.moveaxis(r, 3, 1)[..., None] + _weighted(p, vb, layout, pv)
        return m_new, l * r + p.sum(-1), o

    def f(q, k, v):
        B, Tq, Hq, D = q.shape
        t_ax = 1 if layout == "bthd" else 2
        Hkv, Tk, Dv = k.shape[3 - t_ax], k.shape[t_ax], v.shape[-1]
        G = Hq // Hkv
        qg = q.reshape(B, Tq, Hkv, G, D)
        scale = 1.0 / math.sqrt(D)
        carry = (
            jnp.full((B, Hkv, G, Tq), -jnp.inf, F32),
            jnp.zeros((B, Hkv, G, Tq), F32),
            jnp.zeros((B, Tq, Hkv, G, Dv), F32),
        )
        if chunk is None or chunk >= Tk:
            _, l, o = fold(carry, qg, k, v, scale)
        else:
            assert Tk % chunk == 0, (Tk, chunk)

            def body(c, i):
                kb = lax.dynamic_slice_in_dim(k, i * chunk, chunk, t_ax)
                vb = lax.dynamic_slice_in_dim(v, i * chunk, chunk, t_ax)
                return fold(c, qg, kb, vb, scale), None

            (_, l, o), _ = lax.scan(body, carry, jnp.arange(Tk // chunk))
        out = o / jnp.moveaxis(l, 3, 1)[..., None]
        return out.reshape(B, Tq, Hq, Dv)

    return f


def pkg_forms(dtype: str) -> dict:
    forms = {
        "pkg_xla_bthd": ("bthd", lambda q, k, v: xla_state(q, k, v, layout="bthd").out),
        "pkg_xla_bhtd": ("bhtd", lambda q, k, v: xla_state(q, k, v, layout="bhtd").out),
    }
    if dtype != "float32":
        forms["pkg_cudnn"] = ("bthd", lambda q, k, v: cudnn_state(q, k, v, **_impl()).out)
    forms["dpa"] = ("bthd", lambda q, k, v: jax.nn.dot_product_attention(q, k, v))
    return forms


def _impl() -> dict:
    return {} if jax.default_backend() == "gpu" else {"implementation": "xla"}


def all_forms(dtype: str, chunks: tuple[int, ...]) -> dict:
    forms = pkg_forms(dtype)
    combos = [("hi", "hi"), ("df", "df")]
    if dtype != "float32":
        combos += [("mx", "hi"), ("mx", "p16")]
    for layout in ("bthd", "bhtd"):
        for qk, pv in combos:
            forms[f"einsum_{layout}_{qk}_{pv}"] = (layout, einsum_form(layout, qk, pv))
    for c in chunks:
        qk = "hi" if dtype == "float32" else "mx"
        forms[f"chunk{c}_bthd_{qk}_hi"] = ("bthd", einsum_form("bthd", qk, "hi", c))
    return forms


def make_qkv(B, Hq, Hkv, D, Tk, dtype, layout, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    shape = (B, Tk, Hkv, D) if layout == "bthd" else (B, Hkv, Tk, D)
    gen = jax.jit(lambda key, s: jax.random.normal(key, s, F32).astype(dtype), static_argnums=1)
    return gen(kq, (B, 1, Hq, D)), gen(kk, shape), gen(kv, shape)


def count_kernels(hlo: str) -> dict:
    """Instructions that launch work in an optimised HLO module: those of the entry and of
    while bodies (times their known trip count), not inside fusions. Approximate: a fusion
    or custom call is one kernel; bookkeeping ops (parameter, tuple, bitcast, ...) are none."""
    skip = {
        "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while",
        "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier",
    }  # fmt: skip
    comps: dict[str, list[str]] = {}
    name, entry = None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            name = head.group(2)
            comps[name] = []
            if head.group(1):
                entry = name
            continue
        if line.startswith("}"):
            name = None
            continue
        if name is not None:
            comps[name].append(line)

    def ops(comp: str, depth: int = 0) -> tuple[int, int, int]:
        n, whiles, conds = 0, 0, 0
        for line in comps.get(comp, []):
            m = re.search(r"= [^=]*? ([a-z\-]+)\(", line)
            if not m:
                continue
            op = m.group(1)
            if op == "while" and depth < 4:
                whiles += 1
                body = re.search(r"body=%?([\w.\-]+)", line)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                k = int(trips.group(1)) if trips else 1
                if body:
                    b, w, c = ops(body.group(1), depth + 1)
                    n, whiles, conds = n + k * b, whiles + w, conds + c
            elif op == "conditional" and depth < 4:
                conds += 1
                branches = re.findall(
                    r"(?:branch_computations=\{|true_computation=)%?([\w.\-]+)", line
                )
                if branches:
                    b, w, c = ops(branches[0], depth + 1)
                    n, whiles, conds = n + b, whiles + w, conds + c
            elif op not in skip:
                n += 1
        return n, whiles, conds

    n, whiles, conds = ops(entry) if entry else (0, 0, 0)
    return {"kernels": n, "whiles": whiles, "conditionals": conds}


def compile_info(fn, *args) -> tuple:
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    temp = None if mem is None else int(mem.temp_size_in_bytes)
    return compiled, temp, count_kernels(compiled.as_text())


def time_compiled(compiled, args, repeats) -> float:
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_forms(cfg, record, save, device) -> None:
    B, Hq, Hkv, D = cfg.shape
    out = record.setdefault("forms", {})
    for Tk in cfg.seq_lens:  # both dtypes at a length before the next length
        for dtype in cfg.dtypes:
            forms = all_forms(dtype, cfg.chunks)
            if elapsed() > cfg.budget_s * cfg.forms_share:
                out["stopped"] = f"time budget at Tk={Tk} {dtype}"
                save()
                return
            q, k, v = make_qkv(B, Hq, Hkv, D, Tk, dtype, "bthd")
            head_major = jax.jit(lambda x: x.transpose(0, 2, 1, 3))
            data = {"bthd": (q, k, v), "bhtd": (q, head_major(k), head_major(v))}
            del k, v
            kv_bytes = 2 * data["bthd"][1].nbytes
            ref = None
            if Tk == cfg.error_tk:
                ref = reference(*data["bthd"])
            for name, (layout, fn) in forms.items():
                key = f"{name} {dtype} Tk={Tk}"
                try:
                    compiled, temp, kern = compile_info(fn, *data[layout])
                    t = time_compiled(compiled, data[layout], cfg.repeats)
                    rec = {
                        "form": name, "dtype": dtype, "seq_len": Tk, "layout": layout,
                        "median_s": t, "kv_bytes": kv_bytes, "gbs": kv_bytes / t / 1e9,
                        "temp_bytes": temp,
                        "temp_over_cache": None if temp is None else temp / kv_bytes,
                        **kern,
                    }  # fmt: skip
                    if device.get("nominal_gbs"):
                        rec["frac_nominal"] = rec["gbs"] / device["nominal_gbs"]
                    if ref is not None:
                        got = np.asarray(compiled(*data[layout]), np.float64)
                        v64 = np.asarray(data["bthd"][2].astype(F32), np.float64)
                        rec["err_over_max_v"] = float(np.abs(got - ref).max() / np.abs(v64).max())
                except Exception as e:  # a form that cannot run here says why
                    rec = {"form": name, "dtype": dtype, "seq_len": Tk, "skipped": repr(e)[:400]}
                out[key] = rec
                print(
                    key,
                    {
                        k: rec.get(k)
                        for k in ("gbs", "temp_over_cache", "err_over_max_v", "skipped")
                    },
                    flush=True,
                )
            del data
            save()


def reference(q, k, v) -> np.ndarray:
    """float64 attention of one query per sequence, on the inputs as rounded, `bthd`."""
    q, k, v = (np.asarray(x.astype(F32), np.float64) for x in (q, k, v))
    B, Tq, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, Tq, Hkv, Hq // Hkv, D)
    s = np.einsum("bqhgd,bthd->bhgqt", qg, k, optimize=True) / math.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = (
        np.einsum("bhgqt,bthv->bqhgv", p, v, optimize=True)
        / np.moveaxis(p.sum(-1), 3, 1)[..., None]
    )
    return o.reshape(B, Tq, Hq, -1)


# --------------------------------------------------------------------------- fixed cost


def run_fixed_cost(cfg, record, save) -> None:
    B, Hq, Hkv, D = cfg.shape
    dtype = cfg.dtypes[0]
    trivial = jax.jit(lambda x: x + 1)
    x = jnp.ones((1,), F32)
    floor = time_compiled(trivial.lower(x).compile(), (x,), 31)
    res = {"dtype": dtype, "trivial_call_s": floor, "forms": {}}
    record["fixed_cost"] = res
    names = [n for n in cfg.fixed_forms if n in all_forms(dtype, cfg.chunks)]
    forms = all_forms(dtype, cfg.chunks)
    for name in names:
        layout, fn = forms[name]
        pts = []
        for Tk in cfg.fixed_lens:
            if elapsed() > cfg.budget_s * cfg.fixed_share:
                res["stopped"] = f"time budget at {name} Tk={Tk}"
                break
            args = make_qkv(B, Hq, Hkv, D, Tk, dtype, layout)
            try:
                compiled, _, kern = compile_info(fn, *args)
                t = time_compiled(compiled, args, cfg.repeats)
            except Exception as e:
                pts.append({"seq_len": Tk, "skipped": repr(e)[:300]})
                continue
            pts.append({"seq_len": Tk, "kv_bytes": 2 * args[1].nbytes, "median_s": t, **kern})
        good = [p for p in pts if "median_s" in p]
        fit = None
        if len(good) >= 3:
            A = np.array([[1.0, p["kv_bytes"]] for p in good])
            y = np.array([p["median_s"] for p in good])
            (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
            fit = {"fixed_s": float(a), "stream_gbs": float(1 / b / 1e9) if b > 0 else None}
            at16 = [p for p in good if p["seq_len"] == 16384]
            if at16:
                fit["fixed_share_at_16k"] = float(a / at16[0]["median_s"])
        res["forms"][name] = {"points": pts, "fit": fit}
        print("fixed", name, fit, flush=True)
        save()


# --------------------------------------------------------------------------- smollm2


def run_smollm2(cfg, record, save) -> None:
    from tree_attention_edu.core.devices import make_mesh
    from tree_attention_edu.llama import forward, generator, speed
    from tree_attention_edu.llama.config import Config, init_params

    smol = Config(
        vocab=49152, dim=576, layers=30, q_heads=9, kv_heads=3, head_dim=64, hidden=1536,
        rope_theta=100000.0, tie_embeddings=True,
    ) if not cfg.quick else Config()  # fmt: skip
    params = init_params(smol, jax.random.key(0))
    mesh = make_mesh(1, "x")
    res = record.setdefault("smollm2", {"records": [], "programs": {}})
    reader = benchmark.DeviceReader()

    def programs(method, context):
        gen = generator.Generator(params, smol, mesh, method)
        cap = context + 8
        cache = speed.synthetic_cache(smol, 1, cap, context, gen.mesh, jax.random.key(1))
        tok = jax.device_put(jnp.zeros((1,), jnp.int32), gen._rep)
        args = (gen.params, cache, tok, jax.random.key(0), jnp.float32(0.0), True)
        progs = gen._programs
        name = "read_step" if method == "single" else "step"
        lowered = getattr(progs, name).lower(*args)
        info = {name: count_kernels(lowered.compile().as_text())}
        return info

    original = generator.read_only_step

    def one_pass_only(params, cfg_, tokens, cache, attend, mesh_):  # no lax.cond at all
        x, new, _ = forward.trunk(
            params, cfg_, tokens, cache, attend, mesh_, read_only=True, padding="finite"
        )
        return forward.unembed(params, cfg_, x), new

    runs = cfg.smollm2_runs or [(m, c, "as is") for c in cfg.contexts for m in ("single", "tree")]
    if not cfg.smollm2_runs:
        runs += [("single", cfg.contexts[0], "no cond")]
    for method, context, variant in runs:
        if elapsed() > cfg.budget_s:
            res["stopped"] = f"time budget at {method} {context} {variant}"
            break
        try:
            if variant == "no cond":
                generator.read_only_step = one_pass_only
                generator._programs.cache_clear()
            t0 = time.perf_counter()
            r = speed.decode_speed(
                params, smol, mesh, method, context, steps=cfg.steps, reader=reader
            ).as_json()
            r["variant"], r["wall_s"] = variant, time.perf_counter() - t0
            if f"{method} {variant}" not in res["programs"]:
                res["programs"][f"{method} {variant}"] = programs(method, context)
        except Exception as e:
            r = {"method": method, "context": context, "variant": variant, "skipped": repr(e)[:400]}
            traceback.print_exc()
        finally:
            generator.read_only_step = original
            generator._programs.cache_clear()
        res["records"].append(r)
        print(
            "smollm2",
            {
                k: r.get(k)
                for k in (
                    "method",
                    "context",
                    "variant",
                    "median_s",
                    "fraction",
                    "compile_s",
                    "skipped",
                )
            },
            flush=True,
        )
        save()


# --------------------------------------------------------------------------- main


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--parts", default="forms,fixed_cost,smollm2")
    p.add_argument("--budget-s", type=float, default=330.0)
    p.add_argument(
        "--smollm2-runs",
        default="",
        help="METHOD:CONTEXT[:nocond],... (default: single and tree at every context, and "
        "single without the cond at the first)",
    )
    return p


class Cfg:
    def __init__(self, quick: bool, budget_s: float):
        self.quick, self.budget_s = quick, budget_s
        self.shape = (2, 8, 2, 32) if quick else (8, 32, 8, 128)
        self.dtypes = ("bfloat16", "float32")
        self.seq_lens = (256, 1024) if quick else (16384, 131072, 262144)
        self.error_tk = self.seq_lens[0]
        self.chunks = (128,) if quick else (16384, 65536)
        self.repeats = 3 if quick else 7
        self.fixed_forms = ("pkg_cudnn", "einsum_bthd_mx_hi", "einsum_bhtd_mx_hi", "pkg_xla_bhtd")
        self.fixed_lens = (64, 256, 1024) if quick else (1024, 4096, 16384, 65536, 131072)
        self.contexts = (64,) if quick else (4096, 8192, 131072)
        self.steps = 3 if quick else 20
        self.forms_share, self.fixed_share = 0.45, 0.6
        self.smollm2_runs: list[tuple[str, int, str]] = []


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # SmolLM2's programs are compiled by the run and again for their kernel count: the
    # persistent cache makes the second a lookup.
    jax.config.update("jax_compilation_cache_dir", "/tmp/tae_jax_cache")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cfg = Cfg(args.quick, args.budget_s)
    for item in filter(None, args.smollm2_runs.split(",")):
        method, context, *rest = item.split(":")
        cfg.smollm2_runs.append((method, int(context), "no cond" if rest else "as is"))
    device = benchmark.device_info(nbytes=2**24 if args.quick else None)
    record = {"device": device, "argv": sys.argv[1:], "config": vars(cfg).copy()}

    def save():
        record["elapsed_s"] = elapsed()
        args.out.write_text(json.dumps(record, indent=1, default=str))

    save()
    parts = args.parts.split(",")
    for part, fn in (
        ("forms", run_forms),
        ("fixed_cost", run_fixed_cost),
        ("smollm2", run_smollm2),
    ):
        if part not in parts:
            continue
        try:
            if part == "forms":
                fn(cfg, record, save, device)
            else:
                fn(cfg, record, save)
        except Exception:
            record.setdefault("errors", {})[part] = traceback.format_exc()[-2000:]
            traceback.print_exc()
        save()
    print(f"done in {elapsed():.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
