"""`tree-attention-edu generate`: generation with a sequence-sharded KV cache, from random
weights or a checkpoint, checked token for token against single-device generation."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .. import commandline as cl
from ..llama.model import METHODS
from . import common

NAME = "generate"
HELP = "generate with a sharded KV cache; check tokens"


RANDOM_MODEL_DEFAULTS = {"preset": "tiny", "vocab": 256, "prompt_len": 1024, "batch": 3}
"""`generate`'s flags for the random-weights model, and their defaults (None in the parser,
so that giving one together with --checkpoint can be refused)."""



def add_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("--checkpoint", default=None, metavar="DIR|FILE.gguf",
                     help="a Hugging Face Llama checkpoint folder (config.json, *.safetensors, "
                          "optionally tokenizer.json) or a llama.cpp GGUF file (e.g. the one "
                          "'fetch-model' fetches); without one the model has random "
                          "weights (--preset, --vocab) and random prompts (--prompt-len, "
                          "--batch)")
    prompts = gen.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                         help="a text prompt, turned into token ids by the checkpoint's "
                              "tokenizer.json; repeat for a batch")
    prompts.add_argument("--prompt-ids", action="append", type=cl.token_ids, default=None,
                         metavar="1,2,3",
                         help="a prompt as comma-separated token ids; repeat for a ragged batch")
    gen.add_argument("--chat", action="store_true",
                     help="format each --prompt as a user message with the GGUF file's chat "
                          "template")
    gen.add_argument("--no-stop", dest="stop", action="store_false",
                     help="generate all --new-tokens even after the end-of-sequence token (a "
                          "GGUF file names it; generation stops there by default)")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                     help="the checkpoint's weights in memory: float32 converts bf16 weights, "
                          "bfloat16 keeps them (compute is float32 either way)")
    gen.add_argument("--devices", type=cl.devices, default=8,
                     help=f"simulated CPU devices (at most {cl.MAX_DEVICES})")
    gen.add_argument("--mesh", default="1d", choices=["1d", "2level"],
                     help="1d: one 'x' axis; 2level: ('node', 'gpu') with 2 nodes")
    gen.add_argument("--method", type=cl.names(METHODS), default="tree",
                     help="tree, ring or single, or several comma-separated (timed one after "
                          "another in the same run)")
    gen.add_argument("--preset", default=None, choices=["tiny", "small"],
                     help="size of the random-weights model (default: tiny)")
    gen.add_argument("--vocab", type=cl.positive, default=None,
                     help="vocabulary of the random-weights model (default: 256)")
    gen.add_argument("--prompt-len", type=cl.positive, default=None,
                     help="longest random prompt; the batch's others are 3/4, 1/2, 1/4 of it "
                          "(default: 1024)")
    gen.add_argument("--new-tokens", type=cl.positive, default=32,
                     help="tokens generated per prompt")
    gen.add_argument("--batch", type=cl.positive, default=None,
                     help="random prompts generated together (default: 3)")
    gen.add_argument("--prefill-chunk", type=cl.positive, default=512,
                     help="prompt tokens per prefill step")
    gen.add_argument("--prefill-method", default=None, choices=METHODS,
                     help="attention that fills the cache (default: --method); e.g. tree "
                          "prefill before ring decoding on long prompts")
    gen.add_argument("--temperature", type=cl.temperature, default=0.0,
                     help="sampling temperature, >= 0; 0 is greedy")
    gen.add_argument("--seed", type=cl.seed, default=0,
                     help="seed of the random weights and prompts, and of sampling")
    gen.add_argument("--no-check", dest="check", action="store_false",
                     help="skip the single-device generation the tokens are checked against")
    gen.add_argument("--json", default=None, metavar="OUT",
                     help="write the prompts, the generated tokens and the logits of the "
                          "first generated position (per prompt, and per method) to this path")


def validate(parser: argparse.ArgumentParser, args: Any) -> None:
    common.check_mesh(parser, args)
    _check_generate(parser, args)
    if args.json:
        cl.check_output(parser, "--json", args.json)


def _check_generate(parser, args) -> None:
    """`generate`: the random model's flags, or a checkpoint, its prompts and its memory."""
    random_flags = {f"--{k.replace('_', '-')}": getattr(args, k) for k in RANDOM_MODEL_DEFAULTS}
    if args.chat and not args.prompt:
        parser.error("--chat: formats text prompts with the checkpoint's chat template; give "
                     "them with --prompt TEXT")
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
    from ..llama import gguf_checkpoint
    from ..llama.checkpoint import inspect_checkpoint, load_tokenizer

    flag = f"--checkpoint {args.checkpoint}"
    info: Any
    args.gguf = Path(args.checkpoint).is_file()  # a folder is Hugging Face's layout
    try:
        if args.gguf:
            args.info = info = gguf_checkpoint.inspect_gguf(args.checkpoint)
            args.tokenizer = (gguf_checkpoint.load_gguf_tokenizer(args.checkpoint)
                              if info.tokenizer else None)
            if args.chat:
                args.prompt = [gguf_checkpoint.render_chat(
                    info, [{"role": "user", "content": text}], tokenizer=args.tokenizer)
                    for text in args.prompt]
        else:
            if args.chat:
                parser.error("--chat: needs a chat template, which this package reads from "
                             "GGUF files; format the prompt yourself for a folder checkpoint")
            args.info = info = inspect_checkpoint(args.checkpoint)
            args.tokenizer = load_tokenizer(args.checkpoint) if info.tokenizer else None
    except (ValueError, TypeError) as e:
        parser.error(f"{flag}: {cl.one_line(e)}")
    vocab = info.cfg.vocab
    if args.prompt:
        if args.tokenizer is None:
            parser.error(f"--prompt: {flag} has no tokenizer this package reads to turn text "
                         "into token ids; pass token ids with --prompt-ids 1,2,3")
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
    weights = info.num_params * cl.itemsize(args.dtype)
    longest = max(len(p) for p in args.prompts)
    capacity = -(-longest // args.prefill_chunk) * args.prefill_chunk + args.new_tokens
    capacity = -(-capacity // args.devices) * args.devices
    batch = len(args.prompts)
    cache = 4 * cfg.layers * 2 * batch * capacity * cfg.kv_heads * cfg.head_dim
    logits = 4 * batch * cfg.vocab * (args.new_tokens * (len(args.method) + 1) + 1)
    single = "single" in args.method or args.check
    need = weights * (2 if single else 1) + 2 * cache + logits
    cl.check_memory(parser, f"--checkpoint {args.checkpoint}", need,
                  f"weights of {weights:,} bytes as {args.dtype}"
                  f"{' (twice: single-device generation copies them)' if single else ''}, "
                  f"and a KV cache of {capacity} positions x batch {batch} ({cache:,} bytes)")
    cl.check_positions(parser, "--prompt-ids/--new-tokens", capacity)


def _check_generate_memory(parser, args) -> None:
    from ..llama.model import PRESETS

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
    cl.check_memory(parser, flag, need,
                  f"the {args.preset} model with vocab {vocab} (weights {params:,} bytes, "
                  f"replicated on {args.devices} devices) and a KV cache of {capacity} positions "
                  f"x batch {args.batch} ({cache:,} bytes)")
    cl.check_positions(parser, "--prompt-len + --new-tokens", capacity)


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

    from ..llama import model

    if args.checkpoint is None:
        cfg = dataclasses.replace(model.PRESETS[args.preset], vocab=args.vocab)
        print(f"model {args.preset} (random weights): ", end="")
        return model.init_params(cfg, jax.random.key(args.seed)), cfg, _prompts(args), None
    import jax.numpy as jnp

    from ..llama.checkpoint import load_checkpoint
    from ..llama.gguf_checkpoint import load_gguf

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    load = load_gguf if args.gguf else load_checkpoint
    params, cfg = load(args.checkpoint, dtype=dtype, mesh=common.mesh(args))
    print(f"checkpoint {args.checkpoint} ({args.info.num_params:,} weights as {args.dtype}): ",
          end="")
    return params, cfg, args.prompts, args.tokenizer


def _show(tokens: list[int], limit: int = 24) -> str:
    return str(tokens) if len(tokens) <= limit else f"{tokens[:limit]}"[:-1] + ", ...]"


def run(args: Any) -> int:
    common.setup(args)
    import statistics

    import jax
    import numpy as np

    from ..llama import model

    params, cfg, prompts, tokenizer = _model(args)
    print(f"{cfg.layers} layers, dim {cfg.dim}, {cfg.q_heads} q heads / {cfg.kv_heads} kv heads "
          f"x {cfg.head_dim}, vocab {cfg.vocab}; prompts of {[len(p) for p in prompts]} tokens; "
          f"{args.new_tokens} new tokens; {args.devices} devices ({args.mesh} mesh)")
    methods = args.method + (["single"] if args.check and "single" not in args.method else [])
    results, timing = {}, {}
    eos = None
    if args.checkpoint is not None and args.gguf and args.stop:
        from ..llama.gguf_checkpoint import eos_token_id

        eos = eos_token_id(args.info)
    for method in methods:
        prefill = args.prefill_method if method in args.method else None
        gen = model.Generator(params, cfg, common.mesh(args), method,
                              prefill_chunk=args.prefill_chunk, prefill_method=prefill)
        out = gen.generate(prompts, args.new_tokens, key=jax.random.key(args.seed + 1),
                           temperature=args.temperature, progress=True, stop_at=eos)
        bad = np.argwhere(~np.isfinite(out.logits))
        if bad.size:  # NaN weights, or finite ones whose activations overflow float32
            b, step = (int(i) for i in bad[0][:2])
            raise cl.CommandFailed(f"{method}: the logits of prompt {b + 1} at new token "
                                   f"{step + 1} are not finite (NaN or inf): the weights "
                                   "overflow float32 or are damaged; no token is reported")
        steady = out.step_s[1:] or out.step_s  # the first decode step compiles
        per_tok = statistics.median(steady) if steady else None  # None: one new token only
        results[method], timing[method] = out, (per_tok, out.prefill_s)
        speed = ("no decode step timed" if per_tok is None else
                 f"median per-token latency {per_tok * 1e3:.1f} ms, "
                 f"{len(prompts) / per_tok:.1f} tokens/s (batch {len(prompts)})")
        print(f"{method:>7}: {speed}, compiled the step {gen.traces}x; prefill "
              f"({gen.prefill_method}) {out.prefill_s:.1f} s")
    first = results[args.method[0]]

    def rows(out) -> list[list[int]]:  # each prompt's tokens, up to its end-of-sequence token
        return [r[:r.index(eos) + 1] if eos in r else r for r in out.tokens.tolist()]

    if args.checkpoint is None:
        print("first tokens:", first.tokens[:, :8].tolist())
    else:
        for b, row in enumerate(rows(first)):
            print(f"prompt {b + 1}: {_show(row)}")
            if tokenizer is not None:
                print(f"   {tokenizer.decode(list(prompts[b]))!r} -> {tokenizer.decode(row)!r}")
    report = {"checkpoint": args.checkpoint, "method": args.method[0],
              "prompts": [list(map(int, p)) for p in prompts],
              "tokens": rows(first), "logits_last": first.logits[:, 0].tolist(),
              "methods": {}}
    if tokenizer is not None:
        report["text"] = [tokenizer.decode(row) for row in rows(first)]
    differ = []
    for method in args.method:
        entry = {"tokens": rows(results[method]), "per_token_s": timing[method][0],
                 "prefill_s": timing[method][1]}
        report["methods"][method] = entry
        if method == "single" or "single" not in results:
            continue
        same = np.array_equal(results[method].tokens, results["single"].tokens)
        n = min(results[method].logits.shape[1], results["single"].logits.shape[1])
        diff = float(np.abs(results[method].logits[:, :n]
                            - results["single"].logits[:, :n]).max())
        entry |= {"tokens_identical_to_single": bool(same), "max_abs_logit_diff_vs_single": diff}
        print(f"{method}: tokens identical to single-device generation: {same}; "
              f"max |logit difference| {diff:.1e}")
        if not same:
            differ.append(method)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, allow_nan=False))
        print(f"wrote {args.json}")
    if differ:
        raise cl.CommandFailed(f"tokens of {', '.join(differ)} differ from single-device "
                            "generation")
    return 0

