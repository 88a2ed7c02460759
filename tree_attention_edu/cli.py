"""Command line: `tree-attention-edu demo | bench | generate | launch`.

Device setup must happen before JAX initialises, so every subcommand parses its arguments,
calls `simulate_devices`, and only then computes anything.

Every argument is checked before any work starts: a bad flag, an unwritable output path or
a size this machine cannot hold ends in one line on stderr and exit status 2; a failure
while running ends in one line and exit status 1 (set `TREE_ATTENTION_EDU_TRACEBACK=1` to
see the traceback instead).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from tqdm import tqdm

from . import __version__

PROG = "tree-attention-edu"
TRACEBACK_ENV = "TREE_ATTENTION_EDU_TRACEBACK"
MAX_DEVICES = 1024  # simulated CPU devices: 1024 already take ~30 s and 1.3 GB to sum a vector
MAX_POSITION = 2**31 - 1  # positions and lengths are int32

# `benchmark.METHODS` and `model.METHODS`, spelled here so that parsing arguments does not
# import JAX before `_setup` has set the device count (tests keep them equal).
BENCH_METHODS = ("single", "tree", "tree_energy", "ring", "ring_pass_q", "xla_auto")
GENERATE_METHODS = ("tree", "ring", "single")
SECTIONS = ("bandwidth", "calibration", "patterns")
DEFAULT_SECTIONS = ("bandwidth", "calibration")  # "patterns" is opt-in: a second calibration


class CommandFailed(Exception):
    """A subcommand ran but its check failed; the message is the one line to print."""


# ---------------------------------------------------------------------------------------
# Argument types: each raises ArgumentTypeError, which argparse turns into one usage line.


def _int(text: str) -> int:
    """An integer; also accepts integral floats such as 1e6 and underscores (65_536)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not (math.isfinite(value) and value.is_integer()):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    return int(value)


def _positive(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _devices(text: str) -> int:
    value = _positive(text)
    if value > MAX_DEVICES:
        raise argparse.ArgumentTypeError(
            f"{value} simulated devices is more than the {MAX_DEVICES} this command allows "
            "(each one is an XLA CPU device with its own threads and buffers)")
    return value


def _seed(text: str) -> int:
    value = _int(text)
    if not 0 <= value < 2**63 - 1:
        raise argparse.ArgumentTypeError(f"must be in 0..{2**63 - 2}, got {text!r}")
    return value


def _lengths(text: str) -> list[int]:
    parts = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}")
    return [_positive(s) for s in parts]


def _token_ids(text: str) -> list[int]:
    """A prompt as comma-separated token ids (non-negative integers)."""
    parts = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids such as 1,2,3, got {text!r}")
    ids = [_int(s) for s in parts]
    if min(ids) < 0 or max(ids) > MAX_POSITION:
        raise argparse.ArgumentTypeError(f"token ids must be non-negative integers, got {text!r}")
    return ids


def _finite(text: str, what: str, ok, requirement: str) -> float:
    """A finite float flag value that satisfies `ok`, or an ArgumentTypeError saying why."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}")
    return value


def _temperature(text: str) -> float:
    return _finite(text, "a number", lambda t: t >= 0, "a finite number >= 0 (0 is greedy)")


def _seconds(text: str) -> float:
    return _finite(text, "a number of seconds", lambda t: t > 0,
                   "a positive number of seconds")


def _port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0: pick a free one), got {text!r}")
    return value


def _names(known: tuple[str, ...], allow_empty: bool = False):
    """A comma list of names from `known` (repeats dropped, order kept)."""
    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",") if s.strip()]
        bad = [n for n in names if n not in known]
        if bad or not (names or allow_empty):
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, bad)) or 'empty list ' + repr(text)}; use one or "
                f"more of {','.join(known)}, comma-separated" + (" ('' for none)" if allow_empty
                                                                  else ""))
        return list(dict.fromkeys(names))
    return parse


def _method_list(text: str) -> list[str]:
    return _names(GENERATE_METHODS)(text)


class Parser(argparse.ArgumentParser):
    """Usage errors are one line (the usage itself is one `--help` away), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where there is none to show (None, or a flag)."""

    def _get_help_string(self, action):
        if action.default is None or action.nargs == 0:  # flags: --no-check, --version, ...
            return action.help
        return super()._get_help_string(action)


# ---------------------------------------------------------------------------------------
# Checks after parsing, before any work


def _ram_bytes() -> int | None:
    """This machine's physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _gb(n: float) -> str:
    return f"{n / 1e9:,.0f} GB" if n >= 1e11 else f"{n / 1e9:.3g} GB"


def _check_memory(parser, flag: str, need: int, what: str) -> None:
    ram = _ram_bytes()
    if ram and need > ram:
        parser.error(f"{flag}: needs about {_gb(need)} of memory ({need:,} bytes), more than "
                     f"this machine's {_gb(ram)} of RAM: {what}")


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def _check_positions(parser, flag: str, n: int) -> None:
    if n > MAX_POSITION:
        parser.error(f"{flag}: {n} is more than {MAX_POSITION} positions (they are int32)")


def _check_decode_memory(parser, args, flag: str, seq_len: int) -> None:
    """K/V of `2·B·Tk·H·D·itemsize` bytes, held on the host, once more on the devices, and
    in float64 for the reference: `(2 + 8 / itemsize)` times K/V in all."""
    item = _itemsize(args.dtype)
    kv = 2 * args.batch * seq_len * args.heads * args.head_dim * item
    need = kv * (2 + 8 // item)
    _check_memory(parser, flag, need,
                  f"Tk={seq_len} with batch {args.batch}, {args.heads} heads x {args.head_dim}, "
                  f"{args.dtype} (K and V alone are 2·B·Tk·H·D·itemsize = {kv:,} bytes)")
    _check_positions(parser, flag, seq_len)


RANDOM_MODEL_DEFAULTS = {"preset": "tiny", "vocab": 256, "prompt_len": 1024, "batch": 3}
"""`generate`'s flags for the random-weights model, and their defaults (None in the parser,
so that giving one together with --checkpoint can be refused)."""


def _check_generate(parser, args) -> None:
    """`generate`: the random model's flags, or a checkpoint, its prompts and its memory."""
    random_flags = {f"--{k.replace('_', '-')}": getattr(args, k) for k in RANDOM_MODEL_DEFAULTS}
    if args.checkpoint is None:
        for flag, value in (("--prompt", args.prompt), ("--prompt-ids", args.prompt_ids)):
            if value:
                parser.error(f"{flag}: needs --checkpoint DIR; without a checkpoint the model "
                             "has random weights and random prompts (--prompt-len, --batch)")
        if args.dtype != "float32":
            parser.error("--dtype: is the dtype of a checkpoint's weights; it needs "
                         "--checkpoint DIR")
        for key, default in RANDOM_MODEL_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, default)
        _check_generate_memory(parser, args)
        return
    given = [flag for flag, value in random_flags.items() if value is not None]
    if given:
        parser.error(f"{given[0]}: sets the random-weights model; with --checkpoint the "
                     "checkpoint sets the model, and --prompt or --prompt-ids the prompts")
    if not (args.prompt or args.prompt_ids):
        parser.error("--checkpoint: give the prompts, as text with --prompt TEXT or as token "
                     "ids with --prompt-ids 1,2,3 (each flag repeatable for a batch)")
    from .checkpoint import inspect_checkpoint, load_tokenizer  # imports JAX, does not start it

    flag = f"--checkpoint {args.checkpoint}"
    try:
        args.info = info = inspect_checkpoint(args.checkpoint)
        args.tokenizer = load_tokenizer(args.checkpoint) if info.tokenizer else None
    except (ValueError, TypeError) as e:
        parser.error(f"{flag}: {_one_line(e)}")
    vocab = info.cfg.vocab
    if args.prompt:
        if args.tokenizer is None:
            parser.error(f"--prompt: {flag} has no tokenizer.json to turn text into token ids; "
                         "pass token ids with --prompt-ids 1,2,3")
        args.prompts = [args.tokenizer.encode(text).ids for text in args.prompt]
        for text, ids in zip(args.prompt, args.prompts, strict=True):
            if not ids:
                parser.error(f"--prompt: {text!r} encodes to no tokens")
    else:
        args.prompts = args.prompt_ids
    for i, ids in enumerate(args.prompts):
        bad = [t for t in ids if t >= vocab]
        if bad:
            parser.error(f"{'--prompt' if args.prompt else '--prompt-ids'}: token id {bad[0]} "
                         f"(prompt {i + 1}, position {ids.index(bad[0])}) is outside the "
                         f"checkpoint's vocabulary [0, {vocab})")
    _check_checkpoint_memory(parser, args, info)


def _check_checkpoint_memory(parser, args, info) -> None:
    """Weights once (on CPU the simulated devices share one host copy; `single` takes a
    second), the cache twice while it is updated, and the logits kept."""
    cfg = info.cfg
    weights = info.num_params * _itemsize(args.dtype)
    longest = max(len(p) for p in args.prompts)
    capacity = -(-longest // args.prefill_chunk) * args.prefill_chunk + args.new_tokens
    capacity = -(-capacity // args.devices) * args.devices
    batch = len(args.prompts)
    cache = 4 * cfg.layers * 2 * batch * capacity * cfg.kv_heads * cfg.head_dim
    logits = 4 * batch * cfg.vocab * (args.new_tokens * (len(args.method) + 1) + 1)
    single = "single" in args.method or args.check
    need = weights * (2 if single else 1) + 2 * cache + logits
    _check_memory(parser, f"--checkpoint {args.checkpoint}", need,
                  f"weights of {weights:,} bytes as {args.dtype}"
                  f"{' (twice: single-device generation copies them)' if single else ''}, "
                  f"and a KV cache of {capacity} positions x batch {batch} ({cache:,} bytes)")
    _check_positions(parser, "--prompt-ids/--new-tokens", capacity)


def _check_generate_memory(parser, args) -> None:
    from .model import PRESETS  # imports JAX, but does not start it

    cfg = PRESETS[args.preset]
    dim, vocab = cfg.dim, args.vocab
    qd, kd = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    params = 4 * (2 * vocab * dim + cfg.layers * (dim * (qd + 2 * kd) + qd * dim
                                                  + 3 * dim * cfg.hidden + 2 * dim) + dim)
    capacity = -(-args.prompt_len // args.prefill_chunk) * args.prefill_chunk + args.new_tokens
    capacity = -(-capacity // args.devices) * args.devices
    cache = 4 * cfg.layers * 2 * args.batch * capacity * cfg.kv_heads * cfg.head_dim
    logits = 4 * args.batch * vocab * (args.new_tokens * (len(args.method) + 1)
                                       + args.prefill_chunk)
    # Weights are replicated on every device; the cache may exist twice while it is updated.
    need = params * (args.devices + 1) + 2 * cache + logits
    flag = max((params * (args.devices + 1), "--vocab"), (2 * cache, "--prompt-len/--batch"),
               (logits, "--vocab/--new-tokens/--prefill-chunk"))[1]
    _check_memory(parser, flag, need,
                  f"the {args.preset} model with vocab {vocab} (weights {params:,} bytes, "
                  f"replicated on {args.devices} devices) and a KV cache of {capacity} positions "
                  f"x batch {args.batch} ({cache:,} bytes)")
    _check_positions(parser, "--prompt-len + --new-tokens", capacity)


def _check_launch_memory(parser, args) -> None:
    """Each worker holds the launch problem's q, K, V (float32, padded) and a float64 copy."""
    kv = 2 * 2 * args.seq_len * 2 * 64 * 4  # batch 2, 2 kv heads x 64 (launch.worker)
    per_process = 4 * kv + 400 * 2**20  # + the JAX runtime of one process
    processes = 1 if args.cluster else args.processes
    _check_memory(parser, "--seq-len/--processes", processes * per_process,
                  f"{processes} process(es) at Tk={args.seq_len} (K and V: {kv:,} bytes in "
                  "each, with copies)")
    _check_positions(parser, "--seq-len", args.seq_len)


def _check_output(parser, flag: str, path: str, formats: set[str] | None = None) -> None:
    """Fail now, not after the run, if `path` cannot be written."""
    p = Path(path)
    if formats is not None and p.suffix and p.suffix[1:].lower() not in formats:
        parser.error(f"{flag} {path}: unknown image format {p.suffix!r}; use one of "
                     f"{', '.join(sorted(formats))}")
    if p.is_dir():
        parser.error(f"{flag} {path}: is a directory; give a file name")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists():
            open(p, "ab").close()  # append mode: the file is not truncated
        else:
            open(p, "xb").close()
            p.unlink()
    except OSError as e:
        parser.error(f"{flag} {path}: cannot write there ({e.strerror or e})")


def _figure_formats() -> set[str]:
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())


def _validate(args) -> None:
    """Checks that need several arguments together; each failure is one usage line."""
    sub = args.subparser
    if getattr(args, "mesh", "1d") == "2level" and args.devices % 2:
        sub.error(f"--mesh 2level needs an even --devices (2 nodes), got {args.devices}")
    if args.command == "demo":
        _check_decode_memory(sub, args, "--seq-len", args.seq_len)
    elif args.command == "bench":  # --seq-len N is --seq-lens N
        flag = "--seq-lens" if args.seq_lens is not None else "--seq-len"
        if args.seq_lens is None:
            args.seq_lens = [args.seq_len or 65536]
        elif args.seq_len is not None and args.seq_lens != [args.seq_len]:
            sub.error(f"--seq-len {args.seq_len} and --seq-lens "
                      f"{','.join(map(str, args.seq_lens))} disagree; give one of them")
        args.seq_len = max(args.seq_lens)
        _check_decode_memory(sub, args, flag, args.seq_len)
        if "calibration" in args.sections:
            _check_decode_memory(sub, args, "--calibration-seq-lens",
                                 max(args.calibration_seq_lens))
    elif args.command == "generate":
        _check_generate(sub, args)
    elif args.command == "launch":
        if args.cluster and args.port:
            sub.error("--port is for local runs; with --cluster the coordinator comes from "
                      "SLURM")
        total = args.processes * args.devices_per_process
        if not args.cluster and total > MAX_DEVICES:
            sub.error(f"--processes x --devices-per-process = {total} devices is more than "
                      f"{MAX_DEVICES}")
        _check_launch_memory(sub, args)
    # Output paths last: checking them may create their folder.
    if getattr(args, "json", None):
        _check_output(sub, "--json", args.json)
    if getattr(args, "figure", None):
        _check_output(sub, "--figure", args.figure, _figure_formats())


# ---------------------------------------------------------------------------------------
# Running


def _setup(args) -> None:
    from .devices import simulate_devices

    simulate_devices(args.devices)
    import jax

    jax.config.update("jax_enable_x64", True)  # for float64 references; inputs stay explicit


def _mesh(args):
    from .devices import make_mesh

    if args.mesh == "2level":  # `_validate` made sure --devices is even
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

    try:
        return benchmark.run(_mesh(args), _problem(args, seq_len), methods=methods,
                             repeats=args.repeats,
                             progress=lambda n: (progress(n), bar.update(1)))
    finally:
        bar.close()


def three_way_agreement() -> float:
    """Single-device story: softmax, grad of the energy, and the stationary point of Γ agree
    (float64). The paper calls that point a MAP estimate; it is a saddle (see `bayes`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from . import attention, attention_from_energy, stationary_point, symbolic

    print("1. One device: attention three ways (float64, B=2, Tq=3, Hq=4, Hkv=2, Tk=50, causal)")
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 3, 4, 16), jnp.float64)
    k = jax.random.normal(kk, (2, 50, 2, 16), jnp.float64)
    v = jax.random.normal(kv, (2, 50, 2, 16), jnp.float64)
    kw = dict(causal=True, kv_lengths=jnp.array([50, 21]))
    soft = attention(q, k, v, **kw)
    grad = attention_from_energy(q, k, v, **kw)
    z, zeta = stationary_point(q, k, v, **kw)
    e1 = float(np.abs(grad - soft).max())
    e2 = float(np.abs(z - soft).max())
    print(f"   softmax vs grad_zeta F(0):        max |diff| = {e1:.1e}")
    print(f"   softmax vs saddle z* of Gamma:    max |diff| = {e2:.1e}   (|zeta*| <= "
          f"{float(np.abs(zeta).max()):.1e})")
    ok = symbolic.verify_all()
    print(f"   sympy identities that hold:       {sum(ok.values())}/{len(ok)}")
    if max(e1, e2) > 1e-10 or not all(ok.values()):
        raise CommandFailed(f"three-way agreement FAILED (max |diff| {max(e1, e2):.1e}; "
                            f"{sum(ok.values())}/{len(ok)} sympy identities hold)")
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
    if worst > tol:
        raise CommandFailed(f"the methods disagree with float64 attention: max |err| = "
                            f"{worst:.1e} > tol {tol:g}")
    return 0


def cmd_bench(args) -> int:
    _setup(args)
    from .benchmark import table

    out = []
    for seq_len in args.seq_lens:
        records = _measure(args, seq_len, list(args.methods or BENCH_METHODS))
        print(table(records))
        by = {r.method: r for r in records}
        if {"tree", "ring"} <= set(by):
            t, r = by["tree"], by["ring"]
            total = (r.argument_bytes + r.temp_bytes) / max(t.argument_bytes + t.temp_bytes, 1)
            single = (f"tree/single latency {t.median_s / by['single'].median_s:.2f}x, "
                      if "single" in by else "")
            print(f"   {single}ring/tree latency {r.median_s / t.median_s:.2f}x, ring/tree bytes "
                  f"{r.collective_bytes / max(t.collective_bytes, 1):.3g}x, ring/tree memory "
                  f"per device (arguments + temp) {total:.2f}x (paper eqs. 8-9: 2x)")
        out += [r.as_json() for r in records]
    report: dict = {"device": _device(), "records": out}
    if "bandwidth" in args.sections:
        report["bandwidth"] = _bandwidth(args, report["device"])
    if "calibration" in args.sections:
        report["calibration"] = _calibration(args)
    if "patterns" in args.sections:
        report["patterns"] = _patterns(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def _device() -> dict:
    from . import benchmark

    dev = benchmark.device_info(measure=True)
    nominal = f"{dev['nominal_gbs']:.0f} GB/s" if dev["nominal_gbs"] else "unknown"
    print(f"\ndevice: {dev['platform']} ({dev['kind']}), jax {dev['jax_version']}; read "
          f"bandwidth measured {dev['measured_gbs']:.1f} GB/s (jnp.sum on the device), nominal "
          f"HBM peak {nominal}")
    return dev


def _bandwidth(args, device: dict) -> dict:
    from . import benchmark, calibrate

    # The kernels' K/V are placed on the mesh along the sequence: a multiple of --devices.
    seq_len = -(-max(args.seq_lens) // args.devices) * args.devices
    print(f"\nBandwidth: one decode step at Tk={seq_len}, {args.heads} heads x {args.head_dim}, "
          f"{args.dtype}; effective GB/s = (K + V bytes) / median time")
    with tqdm(desc="bandwidth", unit="kernel", file=sys.stderr, disable=None) as bar:
        section = calibrate.bandwidth(_mesh(args), _problem(args, seq_len), repeats=args.repeats,
                                      progress=lambda n: (bar.set_postfix_str(n), bar.update(1)))
    print(calibrate.bandwidth_table(section))
    benchmark.device_fractions(section["kernels"], device)
    print("of the device: " + ", ".join(
        f"{name} {r['frac_measured']:.0%} of measured"
        + (f", {r['frac_nominal']:.0%} of nominal" if r["frac_nominal"] is not None else "")
        for name, r in section["kernels"].items()))
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


def _patterns(args) -> list[dict]:
    from . import benchmark, calibrate

    print(f"\nPatterns: every merge pattern of tree_decode and both rings on {args.devices} "
          f"devices, timed in one run (repeats interleaved), against the cost model with a "
          f"topology measured here; one_pass counts its fast path (its exact fallback is a "
          f"conditional branch)")
    mesh = _mesh(args)
    steps = 2 + len(args.seq_lens) * (len(benchmark.PATTERNS) + 1)
    with tqdm(total=steps, desc="patterns", unit="step", file=sys.stderr, disable=None) as bar:
        def progress(name):
            bar.set_postfix_str(name)
            bar.update(1)

        cal = calibrate.pattern_calibration(mesh, args.seq_lens, problem=_problem(args, 0),
                                            repeats=args.repeats, progress=progress)
        records = []
        for seq_len in args.seq_lens:
            records += calibrate.bench_patterns(mesh, _problem(args, seq_len), calibration=cal,
                                               repeats=args.repeats, progress=progress)
    print(calibrate.pattern_records_table(records))
    return [r.as_json() for r in records]


def _prompts(args) -> list[list[int]]:
    """Ragged prompts: lengths N, 3N/4, N/2, ... (cycled over the batch), from `--seed`."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    fracs = (1.0, 0.75, 0.5, 0.25)
    lens = [max(1, int(args.prompt_len * fracs[b % len(fracs)])) for b in range(args.batch)]
    return [rng.integers(0, args.vocab, n).tolist() for n in lens]


def _model(args):
    """(params, cfg, prompts, tokenizer) of `generate`: a checkpoint, or random weights."""
    import dataclasses

    import jax

    from . import model

    if args.checkpoint is None:
        cfg = dataclasses.replace(model.PRESETS[args.preset], vocab=args.vocab)
        print(f"model {args.preset} (random weights): ", end="")
        return model.init_params(cfg, jax.random.key(args.seed)), cfg, _prompts(args), None
    import jax.numpy as jnp

    from .checkpoint import load_checkpoint

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    params, cfg = load_checkpoint(args.checkpoint, dtype=dtype, mesh=_mesh(args))
    print(f"checkpoint {args.checkpoint} ({args.info.num_params:,} weights as {args.dtype}): ",
          end="")
    return params, cfg, args.prompts, args.tokenizer


def _show(tokens: list[int], limit: int = 24) -> str:
    return str(tokens) if len(tokens) <= limit else f"{tokens[:limit]}"[:-1] + ", ...]"


def cmd_generate(args) -> int:
    _setup(args)
    import statistics

    import jax
    import numpy as np

    from . import model

    params, cfg, prompts, tokenizer = _model(args)
    print(f"{cfg.layers} layers, dim {cfg.dim}, {cfg.q_heads} q heads / {cfg.kv_heads} kv heads "
          f"x {cfg.head_dim}, vocab {cfg.vocab}; prompts of {[len(p) for p in prompts]} tokens; "
          f"{args.new_tokens} new tokens; {args.devices} devices ({args.mesh} mesh)")
    methods = args.method + (["single"] if args.check and "single" not in args.method else [])
    results, timing = {}, {}
    for method in methods:
        prefill = args.prefill_method if method in args.method else None
        gen = model.Generator(params, cfg, _mesh(args), method, prefill_chunk=args.prefill_chunk,
                              prefill_method=prefill)
        out = gen.generate(prompts, args.new_tokens, key=jax.random.key(args.seed + 1),
                           temperature=args.temperature, progress=True)
        steady = out.step_s[1:] or out.step_s  # the first decode step compiles
        per_tok = statistics.median(steady) if steady else float("nan")
        results[method], timing[method] = out, (per_tok, out.prefill_s)
        print(f"{method:>7}: median per-token latency {per_tok * 1e3:.1f} ms, "
              f"{len(prompts) / per_tok:.1f} tokens/s (batch {len(prompts)}), "
              f"compiled the step {gen.traces}x; prefill ({gen.prefill_method}) "
              f"{out.prefill_s:.1f} s")
    first = results[args.method[0]]
    if args.checkpoint is None:
        print("first tokens:", first.tokens[:, :8].tolist())
    else:
        for b, row in enumerate(first.tokens.tolist()):
            print(f"prompt {b + 1}: {_show(row)}")
            if tokenizer is not None:
                print(f"   {tokenizer.decode(list(prompts[b]))!r} -> {tokenizer.decode(row)!r}")
    report = {"checkpoint": args.checkpoint, "method": args.method[0],
              "prompts": [list(map(int, p)) for p in prompts],
              "tokens": first.tokens.tolist(), "logits_last": first.logits[:, 0].tolist(),
              "methods": {}}
    if tokenizer is not None:
        report["text"] = [tokenizer.decode(row) for row in first.tokens.tolist()]
    differ = []
    for method in args.method:
        entry = {"tokens": results[method].tokens.tolist(), "per_token_s": timing[method][0],
                 "prefill_s": timing[method][1]}
        report["methods"][method] = entry
        if method == "single" or "single" not in results:
            continue
        same = np.array_equal(results[method].tokens, results["single"].tokens)
        diff = float(np.abs(results[method].logits - results["single"].logits).max())
        entry |= {"tokens_identical_to_single": bool(same), "max_abs_logit_diff_vs_single": diff}
        print(f"{method}: tokens identical to single-device generation: {same}; "
              f"max |logit difference| {diff:.1e}")
        if not same:
            differ.append(method)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report))
        print(f"wrote {args.json}")
    if differ:
        raise CommandFailed(f"tokens of {', '.join(differ)} differ from single-device "
                            "generation")
    return 0


def cmd_launch(args) -> int:
    from . import launch

    if args.cluster:
        return launch.main(["--cluster", "--seq-len", str(args.seq_len)])
    code = launch.run_local(args.processes, args.devices_per_process, args.seq_len,
                            args.timeout, port=args.port, init_timeout=args.init_timeout)
    if code == 0:
        print("launch: all processes agree with the single-device answer")
    return code  # on failure run_local has printed its one line


# ---------------------------------------------------------------------------------------
# Parser and entry point


def launch_args(p: argparse.ArgumentParser) -> None:
    """The options of a multi-process run, shared by `launch` and `python -m ...launch`."""
    from .launch import INIT_TIMEOUT_S

    p.add_argument("--processes", type=_positive, default=2,
                   help="local processes, one mesh 'node' each")
    p.add_argument("--devices-per-process", type=_positive, default=4,
                   help="simulated CPU devices per process")
    p.add_argument("--seq-len", type=_positive, default=4096, help="KV length Tk")
    p.add_argument("--timeout", type=_seconds, default=120.0,
                   help="seconds for the whole run; then every worker is killed")
    p.add_argument("--init-timeout", type=_positive, default=None,
                   help=f"seconds jax.distributed start-up waits for the other workers "
                        f"(default: {INIT_TIMEOUT_S}, or --timeout if shorter)")
    p.add_argument("--port", type=_port, default=0,
                   help="coordinator port on 127.0.0.1 (0: pick a free one)")
    p.add_argument("--cluster", action="store_true",
                   help="be one process of a cluster run (e.g. under srun): "
                        "jax.distributed.initialize() reads SLURM's environment; "
                        "--processes, --devices-per-process, --port and the timeouts "
                        "are not used")


def _problem_args(p: argparse.ArgumentParser, seq_len: int | None = 65536) -> None:
    p.add_argument("--devices", type=_devices, default=8,
                   help=f"simulated CPU devices (at most {MAX_DEVICES})")
    p.add_argument("--seq-len", type=_positive, default=seq_len,
                   help="KV length Tk" + ("" if seq_len else
                                          " (default 65536; the same as --seq-lens N)"))
    p.add_argument("--heads", type=_positive, default=16, help="query (and kv) heads")
    p.add_argument("--head-dim", type=_positive, default=128, help="size of each head")
    p.add_argument("--batch", type=_positive, default=1, help="sequences decoded together")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of q, K and V")
    p.add_argument("--repeats", type=_positive, default=5, help="timed calls per method (median)")
    p.add_argument("--mesh", default="1d", choices=["1d", "2level"],
                   help="1d: one 'x' axis; 2level: ('node', 'gpu') with 2 nodes")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="show the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to run; 'COMMAND --help' lists its options")

    def add(name: str, help: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
        p.set_defaults(func=func, subparser=p)
        return p

    demo = add("demo", "three-way agreement, then tree vs ring on 8 devices", cmd_demo)
    _problem_args(demo)
    demo.add_argument("--figure", default="out/demo_message_patterns.png",
                      help="where to save the message-pattern figure ('' to skip)")

    bench = add("bench", "measure every method; write JSON records", cmd_bench)
    _problem_args(bench, seq_len=None)
    bench.add_argument("--seq-lens", type=_lengths, default=None,
                       help="comma-separated KV lengths (default: --seq-len, else 65536)")
    bench.add_argument("--methods", type=_names(BENCH_METHODS), default=None,
                       help=f"comma-separated subset of {','.join(BENCH_METHODS)} (default: all)")
    bench.add_argument("--json", default=None, help="write records to this path")
    bench.add_argument("--sections", type=_names(SECTIONS, allow_empty=True),
                       default=",".join(DEFAULT_SECTIONS),
                       help="extra sections after the method table, comma-separated ('' for "
                            "none), among bandwidth, calibration and patterns (every merge "
                            "pattern and both rings, measured and predicted)")
    bench.add_argument("--calibration-seq-lens", type=_lengths,
                       default="16384,32768,65536,131072",
                       help="KV lengths at which the cost model is checked")

    gen = add("generate", "generate with a sharded KV cache; check tokens", cmd_generate)
    gen.add_argument("--checkpoint", default=None, metavar="DIR",
                     help="a Hugging Face Llama checkpoint folder (config.json, *.safetensors, "
                          "optionally tokenizer.json); without one the model has random "
                          "weights (--preset, --vocab) and random prompts (--prompt-len, "
                          "--batch)")
    prompts = gen.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                         help="a text prompt, turned into token ids by the checkpoint's "
                              "tokenizer.json; repeat for a batch")
    prompts.add_argument("--prompt-ids", action="append", type=_token_ids, default=None,
                         metavar="1,2,3",
                         help="a prompt as comma-separated token ids; repeat for a ragged batch")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                     help="the checkpoint's weights in memory: float32 converts bf16 weights, "
                          "bfloat16 keeps them (compute is float32 either way)")
    gen.add_argument("--devices", type=_devices, default=8,
                     help=f"simulated CPU devices (at most {MAX_DEVICES})")
    gen.add_argument("--mesh", default="1d", choices=["1d", "2level"],
                     help="1d: one 'x' axis; 2level: ('node', 'gpu') with 2 nodes")
    gen.add_argument("--method", type=_method_list, default="tree",
                     help="tree, ring or single, or several comma-separated (timed one after "
                          "another in the same run)")
    gen.add_argument("--preset", default=None, choices=["tiny", "small"],
                     help="size of the random-weights model (default: tiny)")
    gen.add_argument("--vocab", type=_positive, default=None,
                     help="vocabulary of the random-weights model (default: 256)")
    gen.add_argument("--prompt-len", type=_positive, default=None,
                     help="longest random prompt; the batch's others are 3/4, 1/2, 1/4 of it "
                          "(default: 1024)")
    gen.add_argument("--new-tokens", type=_positive, default=32,
                     help="tokens generated per prompt")
    gen.add_argument("--batch", type=_positive, default=None,
                     help="random prompts generated together (default: 3)")
    gen.add_argument("--prefill-chunk", type=_positive, default=512,
                     help="prompt tokens per prefill step")
    gen.add_argument("--prefill-method", default=None, choices=GENERATE_METHODS,
                     help="attention that fills the cache (default: --method); e.g. tree "
                          "prefill before ring decoding on long prompts")
    gen.add_argument("--temperature", type=_temperature, default=0.0,
                     help="sampling temperature, >= 0; 0 is greedy")
    gen.add_argument("--seed", type=_seed, default=0,
                     help="seed of the random weights and prompts, and of sampling")
    gen.add_argument("--no-check", dest="check", action="store_false",
                     help="skip the single-device generation the tokens are checked against")
    gen.add_argument("--json", default=None, metavar="OUT",
                     help="write the prompts, the generated tokens and the logits of the "
                          "first generated position (per prompt, and per method) to this path")

    launch = add("launch", "tree and ring decoding across real processes (jax.distributed)",
                 cmd_launch)
    launch_args(launch)
    return parser


def _one_line(e: BaseException) -> str:
    text = next((s.strip() for s in str(e).splitlines() if s.strip()), "")
    if isinstance(e, ValueError | TypeError | CommandFailed):
        return text or type(e).__name__
    return (f"{type(e).__name__}: {text}" if text else type(e).__name__) + \
        f" (set {TRACEBACK_ENV}=1 for the traceback)"


def main(argv: list[str] | None = None) -> int:
    """Parse and check every argument, then run the subcommand.

    Returns the exit status: 0, or 1 when the run fails (one line on stderr). Bad arguments
    raise `SystemExit(2)` after one usage line, as argparse does.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(args)
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        print("note: XLA_FLAGS sets a device count; --devices is applied on top", file=sys.stderr)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
