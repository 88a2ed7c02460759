"""`tree-attention-edu speed`: decode steps of a model timed against the memory roofline of
this machine (`llama.speed`): bytes per token, roofline time, tokens/s, per method and
context."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..llama.model import METHODS, PRESETS
from . import common, memory
from . import plumbing as cl

if TYPE_CHECKING:
    from ..llama.checkpoint import CheckpointInfo
    from ..llama.gguf_checkpoint import GGUFInfo
    from ..llama.model import Config

NAME = "speed"
HELP = "time decode steps against the memory roofline (bytes per token / read bandwidth)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR|FILE.gguf",
        help="the model: a Hugging Face Llama folder or a GGUF file (e.g. "
        "the one 'fetch-model' fetches); without one, random weights of "
        "--preset",
    )
    p.add_argument(
        "--preset",
        default=None,
        choices=list(PRESETS),
        help="the random-weights model without --checkpoint (default: tiny)",
    )
    p.add_argument(
        "--contexts",
        type=cl.lengths,
        default="4096",
        help="comma-separated context lengths (tokens already in the cache)",
    )
    p.add_argument(
        "--methods",
        type=cl.names(METHODS),
        default="single,tree",
        help=f"comma-separated subset of {','.join(METHODS)}",
    )
    p.add_argument(
        "--steps",
        type=cl.positive,
        default=8,
        help="timed decode steps per method and context (median), each after "
        "one read of the bandwidth probe",
    )
    p.add_argument(
        "--devices",
        type=cl.devices,
        default=8,
        help=f"simulated CPU devices of tree and ring (at most {cl.MAX_DEVICES})",
    )
    p.add_argument("--batch", type=cl.positive, default=1, help="sequences decoded together")
    p.add_argument(
        "--seed",
        type=cl.seed,
        default=0,
        help="seed of the random weights and of the synthetic cache",
    )
    p.add_argument("--json", default=None, metavar="OUT", help="write the records to this path")


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.checkpoint is not None and args.preset is not None:
        parser.error(
            "--preset: sets the random-weights model; with --checkpoint the checkpoint sets "
            "the model"
        )
    args.preset = args.preset or "tiny"
    longest = max(args.contexts) + args.steps + 1
    memory.check_positions(parser, "--contexts", longest)
    args.gguf = args.checkpoint is not None and Path(args.checkpoint).is_file()
    cfg, weights = _model_size(parser, args)
    memory.check(parser, memory.decode_steps(cfg, weights, longest, args.batch))
    if args.json:
        cl.check_output(parser, "--json", args.json)


def _model_size(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[Config, tuple[str, int]]:
    """The model's config, and its float32 weights' bytes with the flag that sets them."""
    if args.checkpoint is None:
        cfg = PRESETS[args.preset]
        return cfg, ("--preset", 4 * memory.weight_count(cfg))
    from ..llama import gguf_checkpoint
    from ..llama.checkpoint import inspect_checkpoint

    try:
        info: CheckpointInfo | GGUFInfo = (
            gguf_checkpoint.inspect_gguf(args.checkpoint)
            if args.gguf
            else inspect_checkpoint(args.checkpoint)
        )
    except (ValueError, TypeError) as e:
        parser.error(f"--checkpoint {args.checkpoint}: {cl.one_line(e)}")
    return info.cfg, (f"--checkpoint {args.checkpoint}", 4 * info.num_params)


def run(args: argparse.Namespace) -> int:
    common.setup(args)
    import dataclasses

    import jax

    from ..core.devices import make_mesh
    from ..llama import model, speed
    from ..perf import benchmark

    mesh = make_mesh(args.devices, "x")
    if args.checkpoint is None:
        cfg = model.PRESETS[args.preset]
        params = model.init_params(cfg, jax.random.key(args.seed))
        name = f"{args.preset} (random weights)"
    else:
        from ..llama.checkpoint import load_checkpoint
        from ..llama.gguf_checkpoint import load_gguf

        params, cfg = (load_gguf if args.gguf else load_checkpoint)(args.checkpoint, mesh=mesh)
        name = args.checkpoint
    reader = benchmark.DeviceReader()
    print(
        f"model {name}: {cfg.layers} layers, dim {cfg.dim}, {cfg.q_heads} q / "
        f"{cfg.kv_heads} kv heads x {cfg.head_dim}, vocab {cfg.vocab}; float32; batch "
        f"{args.batch}; {args.steps} timed steps per row (median), each after one read of "
        f"{reader.x.nbytes // 2**20} MiB (jnp.sum) for the bandwidth"
    )
    records = []
    for context in args.contexts:
        for method in args.methods:
            records.append(
                speed.decode_speed(
                    params,
                    cfg,
                    mesh,
                    method,
                    context,
                    steps=args.steps,
                    batch=args.batch,
                    reader=reader,
                    seed=args.seed,
                )
            )
            print(f"  {method} at {context}: {records[-1].median_s * 1e3:.1f} ms", flush=True)
    print(speed.table(records))
    print(
        "read MB: the bytes one step moves through this machine's memory: weights and "
        "cache once on one device; on p simulated devices the replicated weights p times "
        "(each device computes the replicated products) and the cache once (p times for "
        "the ring, whose every device folds every block). On p real devices each reads the "
        "weights and its share of the cache in parallel: 'gpu_roofline_s' in the JSON."
    )
    if "single" in args.methods and args.devices > 1:
        print(
            f"single ran in a process that also simulates {args.devices} devices, which "
            "XLA:CPU makes slower for one device; '--methods single --devices 1' times it "
            "alone."
        )
    if args.json:
        report = {
            "device": benchmark.device_info(measure=False),
            "model": name,
            "config": dataclasses.asdict(cfg),
            **speed.summary(records),
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0
