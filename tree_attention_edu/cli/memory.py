"""Will it fit? Each subcommand's memory, estimated from the problem it builds, and checked
against this machine's RAM before any work starts.

An estimate is a `Need`: bytes by the flag that sets them. When the total is more than the
machine holds, the one usage line (exit status 2) names the flag with the largest share,
the one to lower. Positions are int32, so a cache longer than 2³¹ − 1 is refused too.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .plumbing import MAX_POSITION

if TYPE_CHECKING:
    from ..llama.model import Config
    from ..perf.benchmark import Problem

RUNTIME_BYTES = 400 * 2**20
"""The JAX runtime of one worker process, before it holds any array."""


@dataclass(frozen=True)
class Need:
    """Bytes a run needs, by the flag that sets each part, and what they hold."""

    parts: dict[str, int]
    what: str

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def flag(self) -> str:
        """The flag whose parts weigh most."""
        return max(self.parts, key=lambda f: self.parts[f])


def ram_bytes() -> int | None:
    """This machine's physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def gb(n: float) -> str:
    return f"{n / 1e9:,.0f} GB" if n >= 1e11 else f"{n / 1e9:.3g} GB"


def check(parser: argparse.ArgumentParser, need: Need) -> None:
    """A usage error naming `need.flag` if `need` is more than this machine's RAM."""
    ram, total = ram_bytes(), need.total
    if ram and total > ram:
        parser.error(
            f"{need.flag}: needs about {gb(total)} of memory ({total:,} bytes), more than "
            f"this machine's {gb(ram)} of RAM: {need.what}"
        )


def check_positions(parser: argparse.ArgumentParser, flag: str, n: int) -> None:
    if n > MAX_POSITION:
        parser.error(f"{flag}: {n} is more than {MAX_POSITION} positions (they are int32)")


# ---------------------------------------------------------------------------------------
# Decoding one cache: demo, bench, launch, cluster


def decode(problem: Problem, flag: str) -> Need:
    """`demo` and `bench`: K/V of `2·B·Tk·H·D·itemsize` bytes, held on the host, once more on
    the devices, and in float64 for the reference: `(2 + 8 / itemsize)` times K/V in all."""
    kv, p = problem.kv_bytes, problem
    item = kv // (2 * p.batch * p.seq_len * p.kv_heads * p.head_dim)
    return Need(
        {flag: kv * (2 + 8 // item)},
        f"Tk={p.seq_len} with batch {p.batch}, {p.kv_heads} heads x {p.head_dim}, {p.dtype} "
        f"(K and V alone are 2·B·Tk·H·D·itemsize = {kv:,} bytes)",
    )


def workers(problems: dict[str, Problem], processes: int) -> Need:
    """`launch` and `cluster`: every worker process makes the whole problem's q, K and V from
    the seed (float32), keeps its padded or placed copy and a float64 copy for the reference
    (4 times K/V), beside the JAX runtime; `problems` are the problems each holds at once,
    by the flag that sets each."""
    parts = {flag: processes * 4 * p.kv_bytes for flag, p in problems.items()}
    first = next(iter(parts))
    parts[first] += processes * RUNTIME_BYTES
    sizes = ", ".join(f"Tk={p.seq_len}: {p.kv_bytes:,} bytes" for p in problems.values())
    return Need(parts, f"{processes} process(es), each with K and V ({sizes}) and copies")


# ---------------------------------------------------------------------------------------
# A model: generate, speed


def weight_count(cfg: Config) -> int:
    """The weights of the random-weights model of `cfg`, from `init_params`'s shapes (traced
    abstractly: nothing is allocated and JAX's devices are not started)."""
    import jax

    from ..llama import model

    shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def itemsize(dtype: str) -> int:
    import jax.numpy as jnp

    return int(jnp.dtype(dtype).itemsize)


def capacity(longest: int, prefill_chunk: int, new_tokens: int, devices: int) -> int:
    """The generator's cache positions: the longest prompt padded to whole prefill chunks,
    the new tokens, rounded up to a multiple of the device count."""
    padded = -(-longest // prefill_chunk) * prefill_chunk
    return -(-(padded + new_tokens) // devices) * devices


def generation(
    cfg: Config,
    weights: tuple[str, int],
    prompts: tuple[str, int],
    *,
    batch: int,
    prefill_chunk: int,
    new_tokens: int,
    devices: int,
    runs: int,
    what: str,
) -> Need:
    """`generate`: the weights (`(flag, bytes)`, copies included), the float32 cache twice
    while it is updated, and the float32 logits kept: `runs` generations of `new_tokens`
    rows, and the prefill's last row. The cache's positions are the prompts' (`(flag,
    longest)`, padded to whole prefill chunks) and `--new-tokens`'."""
    from ..llama.speed import cache_bytes

    flag, longest = prompts
    padded = -(-longest // prefill_chunk) * prefill_chunk
    positions = capacity(longest, prefill_chunk, new_tokens, devices)
    position = 2 * cache_bytes(cfg, 1, batch)  # one position of the cache, twice
    row = 4 * batch * cfg.vocab  # one float32 row of logits per prompt
    parts = {
        weights[0]: weights[1],
        flag: position * padded,
        "--new-tokens": position * (positions - padded) + row * (new_tokens * runs + 1),
    }
    cache = cache_bytes(cfg, positions, batch)
    return Need(
        parts, f"{what} and a KV cache of {positions} positions x batch {batch} ({cache:,} bytes)"
    )


def decode_steps(cfg: Config, weights: tuple[str, int], longest: int, batch: int) -> Need:
    """`speed`: the weights twice (shared by the simulated devices on CPU; `single` places a
    second copy), the float32 cache of `longest` positions and its random fill (3 caches)."""
    from ..llama.speed import cache_bytes

    cache = cache_bytes(cfg, longest, batch)
    return Need(
        {weights[0]: 2 * weights[1], "--contexts": 3 * cache},
        f"weights of {weights[1]:,} bytes and a float32 cache of {longest} positions x batch "
        f"{batch} ({cache:,} bytes)",
    )
