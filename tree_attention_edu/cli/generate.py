"""`tree-attention-edu generate`: generation with a sequence-sharded KV cache, from random
weights or a checkpoint, checked token for token against single-device generation."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..llama.model import METHODS, PRESETS
from . import common, memory
from . import plumbing as cl

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ..core.names import Method
    from ..llama.model import Config, Generation, Params

NAME = "generate"
HELP = "generate with a sharded KV cache; check tokens"


RANDOM_MODEL_DEFAULTS = {"preset": "tiny", "vocab": 256, "prompt_len": 1024, "batch": 3}
"""`generate`'s flags for the random-weights model, and their defaults (None in the parser,
so that giving one together with --checkpoint can be refused)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    _model_args(p.add_argument_group("the model"))
    _prompt_args(p.add_argument_group("the prompts"))
    _generation_args(p.add_argument_group("generation"))
    p.add_argument(
        "--devices",
        type=cl.devices,
        default=8,
        help=f"simulated CPU devices (at most {cl.MAX_DEVICES})",
    )
    p.add_argument(
        "--mesh",
        default="1d",
        choices=common.MESH_KINDS,
        help="1d: one 'x' axis; 2level: ('node', 'gpu') with 2 nodes",
    )
    p.add_argument(
        "--json",
        default=None,
        metavar="OUT",
        help="write the prompts, the generated tokens and the logits of the "
        "first generated position (per prompt, and per method) to this path",
    )


def _model_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR|FILE.gguf",
        help="a Hugging Face Llama checkpoint folder (config.json, *.safetensors, "
        "optionally tokenizer.json) or a llama.cpp GGUF file (e.g. the one "
        "'fetch-model' fetches); without one the model has random "
        "weights (--preset, --vocab) and random prompts (--prompt-len, "
        "--batch)",
    )
    g.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the checkpoint's weights in memory: float32 converts bf16 weights, "
        "bfloat16 keeps them (compute is float32 either way)",
    )
    g.add_argument(
        "--preset",
        default=None,
        choices=list(PRESETS),
        help="size of the random-weights model (default: tiny)",
    )
    g.add_argument(
        "--vocab",
        type=cl.positive,
        default=None,
        help="vocabulary of the random-weights model (default: 256)",
    )


def _prompt_args(g: argparse._ArgumentGroup) -> None:
    prompts = g.add_mutually_exclusive_group()
    prompts.add_argument(
        "--prompt",
        action="append",
        default=None,
        metavar="TEXT",
        help="a text prompt, turned into token ids by the checkpoint's "
        "tokenizer.json; repeat for a batch",
    )
    prompts.add_argument(
        "--prompt-ids",
        action="append",
        type=cl.token_ids,
        default=None,
        metavar="1,2,3",
        help="a prompt as comma-separated token ids; repeat for a ragged batch",
    )
    g.add_argument(
        "--chat",
        action="store_true",
        help="format each --prompt as a user message with the GGUF file's chat template",
    )
    g.add_argument(
        "--prompt-len",
        type=cl.positive,
        default=None,
        help="longest random prompt; the batch's others are 3/4, 1/2, 1/4 of it (default: 1024)",
    )
    g.add_argument(
        "--batch",
        type=cl.positive,
        default=None,
        help="random prompts generated together (default: 3)",
    )


def _generation_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--method",
        type=cl.names(METHODS),
        default="tree",
        help="tree, ring or single, or several comma-separated (timed one after "
        "another in the same run)",
    )
    g.add_argument("--new-tokens", type=cl.positive, default=32, help="tokens generated per prompt")
    g.add_argument(
        "--no-stop",
        dest="stop",
        action="store_false",
        help="generate all --new-tokens even after the end-of-sequence token (a "
        "GGUF file names it; generation stops there by default)",
    )
    g.add_argument(
        "--prefill-chunk", type=cl.positive, default=512, help="prompt tokens per prefill step"
    )
    g.add_argument(
        "--prefill-method",
        default=None,
        choices=METHODS,
        help="attention that fills the cache (default: --method); e.g. tree "
        "prefill before ring decoding on long prompts",
    )
    g.add_argument(
        "--temperature",
        type=cl.temperature,
        default=0.0,
        help="sampling temperature, >= 0; 0 is greedy",
    )
    g.add_argument(
        "--seed",
        type=cl.seed,
        default=0,
        help="seed of the random weights and prompts, and of sampling",
    )
    g.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the single-device generation the tokens are checked against",
    )


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    common.check_mesh(parser, args)
    if args.chat and not args.prompt:
        parser.error(
            "--chat: formats text prompts with the checkpoint's chat template; give them "
            "with --prompt TEXT"
        )
    if args.checkpoint is None:
        _check_random_model(parser, args)
    else:
        _check_checkpoint(parser, args)
    if args.json:
        cl.check_output(parser, "--json", args.json)


def _check_random_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """No checkpoint: no prompts or weights' dtype either; the random model's defaults."""
    for flag, value in (("--prompt", args.prompt), ("--prompt-ids", args.prompt_ids)):
        if value:
            parser.error(
                f"{flag}: needs --checkpoint DIR; without a checkpoint the model has random "
                "weights and random prompts (--prompt-len, --batch)"
            )
    if args.dtype != "float32":
        parser.error("--dtype: is the dtype of a checkpoint's weights; it needs --checkpoint DIR")
    for key, default in RANDOM_MODEL_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    cfg = dataclasses.replace(PRESETS[args.preset], vocab=args.vocab)
    weights = 4 * memory.weight_count(cfg)
    # Random weights are replicated on every device, and kept once more on the host.
    need = _generation_memory(
        args,
        cfg,
        ("--vocab", weights * (args.devices + 1)),
        ("--prompt-len/--batch", args.prompt_len),
        args.batch,
        f"the {args.preset} model with vocab {args.vocab} (weights {weights:,} bytes, "
        f"replicated on {args.devices} devices)",
    )
    memory.check(parser, need)
    capacity = memory.capacity(args.prompt_len, args.prefill_chunk, args.new_tokens, args.devices)
    memory.check_positions(parser, "--prompt-len + --new-tokens", capacity)


def _check_checkpoint(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A checkpoint: it sets the model, and the prompts are given (text or token ids)."""
    given = [k for k in RANDOM_MODEL_DEFAULTS if getattr(args, k) is not None]
    if given:
        parser.error(
            f"--{given[0].replace('_', '-')}: sets the random-weights model; with --checkpoint "
            "the checkpoint sets the model, and --prompt or --prompt-ids the prompts"
        )
    if not (args.prompt or args.prompt_ids):
        parser.error(
            "--checkpoint: give the prompts, as text with --prompt TEXT or as token ids with "
            "--prompt-ids 1,2,3 (each flag repeatable for a batch)"
        )
    _read_checkpoint(parser, args)
    args.prompts = _checkpoint_prompts(parser, args, args.info.cfg.vocab)
    weights = args.info.num_params * memory.itemsize(args.dtype)
    single = "single" in args.method or args.check
    # On CPU the simulated devices share one host copy; `single` takes a second.
    need = _generation_memory(
        args,
        args.info.cfg,
        (f"--checkpoint {args.checkpoint}", weights * (2 if single else 1)),
        ("--prompt" if args.prompt else "--prompt-ids", max(len(p) for p in args.prompts)),
        len(args.prompts),
        f"weights of {weights:,} bytes as {args.dtype}"
        f"{' (twice: single-device generation copies them)' if single else ''}",
    )
    memory.check(parser, need)
    longest = max(len(p) for p in args.prompts)
    capacity = memory.capacity(longest, args.prefill_chunk, args.new_tokens, args.devices)
    memory.check_positions(parser, "--prompt-ids/--new-tokens", capacity)


def _read_checkpoint(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`args.info` and `args.tokenizer` of the checkpoint (a GGUF file or a Hugging Face
    folder), and `args.prompt` rendered with the GGUF file's chat template (`--chat`)."""
    from ..llama import gguf_checkpoint
    from ..llama.checkpoint import inspect_checkpoint, load_tokenizer

    args.gguf = Path(args.checkpoint).is_file()  # a folder is Hugging Face's layout
    if args.chat and not args.gguf:
        parser.error(
            "--chat: needs a chat template, which this package reads from GGUF files; "
            "format the prompt yourself for a folder checkpoint"
        )
    try:
        if args.gguf:
            args.info = gguf_checkpoint.inspect_gguf(args.checkpoint)
            args.tokenizer = (
                gguf_checkpoint.load_gguf_tokenizer(args.checkpoint)
                if args.info.tokenizer
                else None
            )
        else:
            args.info = inspect_checkpoint(args.checkpoint)
            args.tokenizer = load_tokenizer(args.checkpoint) if args.info.tokenizer else None
        if args.chat:
            args.prompt = [
                gguf_checkpoint.render_chat(
                    args.info, [{"role": "user", "content": text}], tokenizer=args.tokenizer
                )
                for text in args.prompt
            ]
    except (ValueError, TypeError) as e:
        parser.error(f"--checkpoint {args.checkpoint}: {cl.one_line(e)}")


def _checkpoint_prompts(
    parser: argparse.ArgumentParser, args: argparse.Namespace, vocab: int
) -> list[list[int]]:
    """The prompts as token ids: `--prompt` through the tokenizer, or `--prompt-ids`; each
    id inside the checkpoint's vocabulary."""
    if args.prompt:
        if args.tokenizer is None:
            parser.error(
                f"--prompt: --checkpoint {args.checkpoint} has no tokenizer this package "
                "reads to turn text into token ids; pass token ids with --prompt-ids 1,2,3"
            )
        prompts = [args.tokenizer.encode(text).ids for text in args.prompt]
        for text, ids in zip(args.prompt, prompts, strict=True):
            if not ids:
                parser.error(f"--prompt: {text!r} encodes to no tokens")
    else:
        prompts = args.prompt_ids
    for i, ids in enumerate(prompts):
        bad = [t for t in ids if t >= vocab]
        if bad:
            parser.error(
                f"{'--prompt' if args.prompt else '--prompt-ids'}: token id {bad[0]} "
                f"(prompt {i + 1}, position {ids.index(bad[0])}) is outside the "
                f"checkpoint's vocabulary [0, {vocab})"
            )
    return prompts


def _generation_memory(
    args: argparse.Namespace,
    cfg: Config,
    weights: tuple[str, int],
    prompts: tuple[str, int],
    batch: int,
    what: str,
) -> memory.Need:
    """What generating needs (`memory.generation`): the weights, the cache of the longest
    prompt and the new tokens, the logits of every method and the check's."""
    return memory.generation(
        cfg,
        weights,
        prompts,
        batch=batch,
        prefill_chunk=args.prefill_chunk,
        new_tokens=args.new_tokens,
        devices=args.devices,
        runs=len(args.method) + 1,
        what=what,
    )


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    """Ragged prompts: lengths N, 3N/4, N/2, ... (cycled over the batch), from `--seed`."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    fracs = (1.0, 0.75, 0.5, 0.25)
    lens = [max(1, int(args.prompt_len * fracs[b % len(fracs)])) for b in range(args.batch)]
    return [rng.integers(0, args.vocab, n).tolist() for n in lens]


def _model(
    args: argparse.Namespace,
) -> tuple[Params, Config, list[list[int]], Tokenizer | None]:
    """(params, cfg, prompts, tokenizer) of `generate`: a checkpoint, or random weights."""
    import jax

    from ..llama import model

    if args.checkpoint is None:
        cfg = dataclasses.replace(PRESETS[args.preset], vocab=args.vocab)
        print(f"model {args.preset} (random weights): ", end="")
        return model.init_params(cfg, jax.random.key(args.seed)), cfg, _prompts(args), None
    import jax.numpy as jnp

    from ..llama.checkpoint import load_checkpoint
    from ..llama.gguf_checkpoint import load_gguf

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    load = load_gguf if args.gguf else load_checkpoint
    params, cfg = load(args.checkpoint, dtype=dtype, mesh=common.mesh(args))
    print(
        f"checkpoint {args.checkpoint} ({args.info.num_params:,} weights as {args.dtype}): ",
        end="",
    )
    return params, cfg, args.prompts, args.tokenizer


def _show(tokens: list[int], limit: int = 24) -> str:
    return str(tokens) if len(tokens) <= limit else f"{tokens[:limit]}"[:-1] + ", ...]"


def run(args: argparse.Namespace) -> int:
    common.setup(args)
    params, cfg, prompts, tokenizer = _model(args)
    print(
        f"{cfg.layers} layers, dim {cfg.dim}, {cfg.q_heads} q heads / {cfg.kv_heads} kv heads "
        f"x {cfg.head_dim}, vocab {cfg.vocab}; prompts of {[len(p) for p in prompts]} tokens; "
        f"{args.new_tokens} new tokens; {args.devices} devices ({args.mesh} mesh)"
    )
    eos = _stop_token(args)
    methods = args.method + (["single"] if args.check and "single" not in args.method else [])
    runs = {m: _generate(args, params, cfg, prompts, m, eos) for m in methods}
    first = runs[args.method[0]]
    _show_tokens(args, first, prompts, tokenizer)
    report = _report(args, runs, prompts, tokenizer)
    differ = _compare_with_single(args, runs, report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, allow_nan=False))
        print(f"wrote {args.json}")
    if differ:
        raise cl.CommandFailed(
            f"tokens of {', '.join(differ)} differ from single-device generation"
        )
    return 0


@dataclasses.dataclass
class _Run:
    """One method's generation: the tokens (each prompt's, up to its stop token), the
    logits, and its median per-token latency (None: one new token, no decode step timed)."""

    out: Generation
    rows: list[list[int]]
    per_token_s: float | None


def _stop_token(args: argparse.Namespace) -> int | None:
    """The end-of-sequence token generation stops at: a GGUF file's, unless --no-stop."""
    if args.checkpoint is None or not args.gguf or not args.stop:
        return None
    from ..llama.gguf_checkpoint import eos_token_id

    return eos_token_id(args.info)


def _generate(
    args: argparse.Namespace,
    params: Params,
    cfg: Config,
    prompts: list[list[int]],
    method: Method,
    eos: int | None,
) -> _Run:
    """Generate with `method`, refuse non-finite logits, and say how fast it went."""
    import statistics

    import jax
    import numpy as np

    from ..llama import model

    prefill = args.prefill_method if method in args.method else None
    gen = model.Generator(
        params,
        cfg,
        common.mesh(args),
        method,
        prefill_chunk=args.prefill_chunk,
        prefill_method=prefill,
    )
    out = gen.generate(
        prompts,
        args.new_tokens,
        key=jax.random.key(args.seed + 1),
        temperature=args.temperature,
        progress=True,
        stop_at=eos,
    )
    bad = np.argwhere(~np.isfinite(out.logits))
    if bad.size:  # NaN weights, or finite ones whose activations overflow float32
        b, step = (int(i) for i in bad[0][:2])
        raise cl.CommandFailed(
            f"{method}: the logits of prompt {b + 1} at new token {step + 1} are not finite "
            "(NaN or inf): the weights overflow float32 or are damaged; no token is reported"
        )
    steady = out.step_s[1:] or out.step_s  # the first decode step compiles
    per_tok = statistics.median(steady) if steady else None
    speed = (
        "no decode step timed"
        if per_tok is None
        else f"median per-token latency {per_tok * 1e3:.1f} ms, "
        f"{len(prompts) / per_tok:.1f} tokens/s (batch {len(prompts)})"
    )
    print(
        f"{method:>7}: {speed}, compiled the step {gen.traces}x; prefill "
        f"({gen.prefill_method}) {out.prefill_s:.1f} s"
    )
    # Each prompt's tokens, up to its end-of-sequence token.
    rows = [r[: r.index(eos) + 1] if eos in r else r for r in out.tokens.tolist()]
    return _Run(out, rows, per_tok)


def _show_tokens(
    args: argparse.Namespace, first: _Run, prompts: list[list[int]], tokenizer: Tokenizer | None
) -> None:
    """The first method's tokens: the first few of a random model's, or each prompt's (and
    its text, where there is a tokenizer)."""
    if args.checkpoint is None:
        print("first tokens:", first.out.tokens[:, :8].tolist())
        return
    for b, row in enumerate(first.rows):
        print(f"prompt {b + 1}: {_show(row)}")
        if tokenizer is not None:
            print(f"   {tokenizer.decode(list(prompts[b]))!r} -> {tokenizer.decode(row)!r}")


def _report(
    args: argparse.Namespace,
    runs: dict[str, _Run],
    prompts: list[list[int]],
    tokenizer: Tokenizer | None,
) -> dict[str, Any]:
    """The --json report: the prompts, the first method's tokens and first logits (and
    text), and each method's tokens and timings."""
    first = runs[args.method[0]]
    report: dict[str, Any] = {
        "checkpoint": args.checkpoint,
        "method": args.method[0],
        "prompts": [list(map(int, p)) for p in prompts],
        "tokens": first.rows,
        "logits_last": first.out.logits[:, 0].tolist(),
        "methods": {},
    }
    if tokenizer is not None:
        report["text"] = [tokenizer.decode(row) for row in first.rows]
    for method in args.method:
        report["methods"][method] = {
            "tokens": runs[method].rows,
            "per_token_s": runs[method].per_token_s,
            "prefill_s": runs[method].out.prefill_s,
        }
    return report


def _compare_with_single(
    args: argparse.Namespace, runs: dict[str, _Run], report: dict[str, Any]
) -> list[str]:
    """Each method's tokens and logits against single-device generation (into `report`);
    the methods whose tokens differ."""
    import numpy as np

    if "single" not in runs:
        return []
    single, differ = runs["single"].out, []
    for method in args.method:
        if method == "single":
            continue
        out = runs[method].out
        same = np.array_equal(out.tokens, single.tokens)
        n = min(out.logits.shape[1], single.logits.shape[1])
        diff = float(np.abs(out.logits[:, :n] - single.logits[:, :n]).max())
        report["methods"][method] |= {
            "tokens_identical_to_single": bool(same),
            "max_abs_logit_diff_vs_single": diff,
        }
        print(
            f"{method}: tokens identical to single-device generation: {same}; "
            f"max |logit difference| {diff:.1e}"
        )
        if not same:
            differ.append(method)
    return differ
