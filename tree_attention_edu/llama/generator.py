"""Generation: a `Generator` prefills a sharded cache from prompts and decodes, one jitted
step per token, with single-device, tree or ring attention; `sample` draws the next token.

The whole step is one jitted function of fixed shapes, so generation compiles once, and
`Generator`s of the same model, mesh and methods share their compiled programs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import validate
from ..core.names import Method
from .cache import KVCache, append, check_mesh, empty_cache
from .config import Config, Params, check_config, check_params
from .forward import (
    METHODS,
    ShardStats,
    attend_fn,
    forward,
    forward_with_shard_stats,
    read_only_step,
    trunk,
    unembed,
)
from .layers import pack_projections


def check_prompts(prompts: Any, vocab: int) -> list[np.ndarray]:
    """Prompts: a non-empty sequence of non-empty sequences of token ids in [0, vocab)."""
    example = "[[1, 2, 3], [4, 5]]"
    if isinstance(prompts, str | bytes) or not isinstance(prompts, list | tuple | np.ndarray):
        raise TypeError(
            f"`prompts` must be a list of prompts, each a sequence of token ids, "
            f"e.g. {example}, got {validate.describe(prompts)}."
        )
    if len(prompts) == 0:
        raise ValueError(f"`prompts` is empty; pass at least one prompt, e.g. {example}.")
    out = []
    for i, p in enumerate(prompts):
        name = f"prompts[{i}]"
        if isinstance(p, str | bytes) or not (
            isinstance(p, list | tuple | range) or hasattr(p, "shape")
        ):
            raise TypeError(
                f"`{name}` must be a sequence of token ids (ints), e.g. [1, 2, 3], "
                f"got {validate.describe(p)}."
            )
        arr = np.asarray(p)
        if arr.ndim != 1:
            raise ValueError(
                f"`{name}` must be a flat sequence of token ids, got shape {arr.shape}."
            )
        if arr.size == 0:
            raise ValueError(f"`{name}` is empty; every prompt needs at least one token.")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(
                f"`{name}` must hold int token ids, got dtype {arr.dtype}; "
                f"convert with `[int(t) for t in {name}]`."
            )
        bad = (arr < 0) | (arr >= vocab)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(
                f"`{name}` has token id {arr[j]} at position {j}; token ids must "
                f"lie in [0, vocab) = [0, {vocab})."
            )
        out.append(arr.astype(np.int32))
    return out


def _check_capacity(capacity: int, longest: int, padded: int, new_tokens: int = 0) -> None:
    """The cache holds the prompts padded to whole prefill chunks, and the new tokens."""
    need = max(padded, longest + new_tokens)
    if capacity < need:
        plus = f" plus {new_tokens} new tokens" if new_tokens else ""
        raise ValueError(
            f"`capacity` {capacity} cannot hold the longest prompt ({longest} tokens, "
            f"{padded} once padded to whole prefill chunks){plus}; pass capacity >= {need} "
            f"(or None for the smallest that fits)."
        )


def sample(logits: Array, key: Array, temperature: float) -> Array:
    """Greedy (`temperature == 0`) or softmax sampling at `temperature` from `[B, vocab]`.

    `temperature` is a concrete number >= 0 (not NaN or inf); `key` is a PRNG key.
    """
    validate.check_array(logits, "logits", rank=2, layout="[B, vocab]", kind="float")
    temperature = _check_temperature(temperature)
    validate.check_prng_key(key)
    return _draw(logits, key, jnp.float32(temperature), temperature == 0)


def _draw(logits: Array, key: Array, temperature: Array, greedy: bool) -> Array:
    """`sample` without the checks; `temperature` may be traced (> 0 unless `greedy`).

    The Gumbel-max trick: argmax(l/T + g) with g ~ Gumbel is a sample of softmax(l/T), and
    so is argmax(l + T·g) for T > 0. Below T = 1 the second form is selected: l/T overflows
    for tiny T (1e-45 made every logit inf, and every sample token 0), while T·g only
    shrinks, and the sample tends to the greedy token as T -> 0."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    g = jax.random.gumbel(key, logits.shape, logits.dtype)
    t = temperature.astype(logits.dtype)
    z = jnp.where(t >= 1, logits / t + g, logits + t * g)
    return jnp.argmax(z, axis=-1).astype(jnp.int32)


def _check_temperature(temperature: float) -> float:
    return validate.check_real(
        temperature, "temperature", low=0.0, hint="0 is greedy, 1 samples the model's distribution"
    )


class Generation(NamedTuple):
    """`tokens [B, new_tokens]`, the `logits [B, new_tokens, vocab]` each was drawn from,
    `step_s`: wall seconds of each decode step after the first token (the first of them
    includes compiling the step), and `prefill_s`: wall seconds of the prefill (compiling
    included)."""

    tokens: np.ndarray
    logits: np.ndarray
    step_s: list[float]
    prefill_s: float


class _Programs:
    """The jitted decode step, prefill chunk and teacher-forced pass of one model on one
    mesh: built once per `(cfg, mesh, method, prefill_method)` (`_programs`) and shared by
    every `Generator` of those, so that a second one compiles nothing. The prefill depends
    on `prefill_method` only, and is shared by every decoding method (`_prefill_program`).
    Each function takes the params first; the cache (second) is donated."""

    def __init__(self, cfg: Config, mesh: Mesh, method: Method, prefill_method: Method):
        attend = attend_fn(method, mesh)
        # The Generator calling now: compilations are counted on it.
        self.caller: Generator | None = None

        def step(params, cache, tokens, key, temperature, greedy):
            # `temperature` is traced (a new value compiles nothing); only greedy is static.
            if self.caller is not None:  # runs only while tracing: counts compilations
                self.caller.traces += 1
            logits, cache = forward(params, cfg, tokens[:, None], cache, attend, mesh)
            logits = logits[:, 0]
            return _draw(logits, key, temperature, greedy), logits, cache

        def read_step(params, cache, tokens, key, temperature, greedy):
            # One device: read the cache here, write it in `append` (`read_only_step`).
            if self.caller is not None:
                self.caller.traces += 1
            logits, new = read_only_step(params, cfg, tokens[:, None], cache, attend, mesh)
            logits = logits[:, 0]
            return _draw(logits, key, temperature, greedy), logits, new

        def probe(params, cache, tokens):
            return forward_with_shard_stats(params, cfg, tokens, cache, attend, mesh)

        if method == "single":
            self.read_step = jax.jit(read_step, static_argnums=5)
            self.append = jax.jit(functools.partial(append, mesh=mesh), donate_argnums=0)
        self.step = jax.jit(step, static_argnums=5, donate_argnums=1)
        self.prefill = _prefill_program(cfg, mesh, prefill_method)
        self.probe = jax.jit(probe, donate_argnums=1)


@functools.lru_cache(maxsize=16)
def _programs(cfg: Config, mesh: Mesh, method: Method, prefill_method: Method) -> _Programs:
    return _Programs(cfg, mesh, method, prefill_method)


@functools.lru_cache(maxsize=16)
def _prefill_program(cfg: Config, mesh: Mesh, prefill_method: Method) -> Callable:
    """The jitted prefill chunk of one model on one mesh with one attention, whatever the
    method that decodes after it (tree prefill, then ring decoding, compiles it once)."""
    attend = attend_fn(prefill_method, mesh)

    def prefill(params, cache, tokens, last_index):
        # last_index [B]: which position of this chunk holds each prompt's last token
        # (-1 if it is not in this chunk). Only that position is projected onto the
        # vocabulary: with a large vocabulary the projection would cost more than the rest.
        x, cache, _ = trunk(params, cfg, tokens, cache, attend, mesh)
        last = jnp.take_along_axis(x, jnp.clip(last_index, 0)[:, None, None], 1)[:, 0]
        return unembed(params, cfg, last), cache

    return jax.jit(prefill, donate_argnums=1)


def _under_own_mesh(method: Callable) -> Callable:
    """Run a `Generator` method under the generator's own (Auto) mesh: a mesh the caller set
    with `jax.set_mesh` (an Explicit one, say) would otherwise give the arrays made here its
    axis types, which clash with the programs' shardings."""

    @functools.wraps(method)
    def wrapped(self, *args, **kw):
        with jax.set_mesh(self.mesh):
            return method(self, *args, **kw)

    return wrapped


class Generator:
    """Jitted prefill and decode for one model, method and mesh; compiled once per shape.

    Generators of the same `cfg`, mesh and methods share their compiled programs: the
    second compiles nothing (its `traces` stays 0). `traces` counts the compilations of the
    decode step that this generator's calls caused.

    Args:
      params: the model's weights (`init_params(cfg, key)`; checked against `cfg`).
      cfg: the model's sizes.
      mesh: the devices the cache is sharded over (`single` uses the mesh's first device).
        With `single`, a decode step reads the cache in one program and appends the step's
        keys and values in a second (`forward._attend_then_append`), and the generator keeps its
        weights packed (`pack_projections`): both measured to matter on XLA:CPU.
      method: "single", "tree" or "ring": the attention of each decode step.
      prefill_chunk: prompt tokens per prefill step.
      prefill_method: the attention that fills the cache from the prompt; defaults to
        `method`. With `method="single"` everything runs on the mesh's first device.
    """

    def __init__(
        self,
        params: Params,
        cfg: Config,
        mesh: Mesh,
        method: Method = "tree",
        prefill_chunk: int = 512,
        prefill_method: Method | None = None,
    ):
        check_config(cfg)
        check_params(params, cfg)
        mesh = check_mesh(mesh)
        validate.check_choice(method, METHODS, "method")
        prefill_method = method if prefill_method is None else prefill_method
        validate.check_choice(prefill_method, METHODS, "prefill_method")
        if prefill_method == "single" and method != "single":
            # xla_state outside shard_map on a sequence-sharded cache: GSPMD would gather the
            # whole cache onto every device, at every layer of every chunk.
            raise ValueError(
                f"`prefill_method` 'single' needs `method` 'single' (the cache of "
                f"method {method!r} is sharded over the mesh); use 'tree' to "
                f"prefill it."
            )
        validate.check_int(prefill_chunk, "prefill_chunk", example="`prefill_chunk=512`")
        if method == "single":
            mesh = Mesh(np.array(mesh.devices).ravel()[:1], ("x",))
        self.cfg, self.mesh, self.method, self.chunk = cfg, mesh, method, prefill_chunk
        self.prefill_method = prefill_method
        self._rep = rep = NamedSharding(mesh, P())
        self.params = jax.device_put(params, rep)
        if method == "single":  # one device runs one product at a time: fewer, larger ones
            self.params = pack_projections(self.params, cfg)
        self.traces = 0
        self._programs = _programs(cfg, mesh, method, prefill_method)

    def _run(self, name: str, *args):
        """Call the shared program `name`, counting any compilation it does as this
        generator's (`traces`)."""
        programs = self._programs
        programs.caller = self
        try:
            return getattr(programs, name)(self.params, *args)
        finally:
            programs.caller = None

    @_under_own_mesh
    def step(
        self, cache: KVCache, tokens: Array, key: Array | None = None, temperature: float = 0.0
    ) -> tuple[Array, Array, KVCache]:
        """One decode step: `tokens [B]` at positions `cache.lengths`; returns the next
        tokens `[B]` (greedy at temperature 0), their logits `[B, vocab]` and the cache
        with the step's keys and values written. `cache` is donated: its buffers are
        updated in place and must not be used again."""
        validate.check_instance(cache, KVCache, "cache", "build one with prefill(...)")
        temperature = _check_temperature(temperature)
        key = jax.random.key(0) if key is None else key
        validate.check_prng_key(key)
        ts = validate.check_array(tokens, "tokens", rank=1, layout="[B]", kind="int")
        validate.check_shape(
            ts, tuple(cache.lengths.shape), "tokens", "[B]", "one token per sequence of the cache"
        )
        # Placed on this generator's mesh: arrays made under another (say an Explicit
        # context mesh) carry its axis types.
        tokens, key = jax.device_put((jnp.asarray(tokens, jnp.int32), key), self._rep)
        return self._step(cache, tokens, key, temperature)

    def _step(
        self, cache: KVCache, tokens: Array, key: Array, temperature: float
    ) -> tuple[Array, Array, KVCache]:
        """The decode step's programs, on checked arguments placed on this mesh."""
        args = (tokens, key, jnp.float32(temperature), temperature == 0)
        if self.method != "single":
            return self._run("step", cache, *args)
        # One device: a program that reads the cache, then one that appends to it in place.
        tokens, logits, new = self._run("read_step", cache, *args)
        return tokens, logits, self._programs.append(cache, new)

    @_under_own_mesh
    def teacher_force(self, cache: KVCache, tokens: Array) -> tuple[Array, KVCache, ShardStats]:
        """Run `tokens [B, T]` (given, not sampled) at positions `cache.lengths` with this
        generator's attention: their logits `[B, T, vocab]`, the cache with them written,
        and what each device's shard contributed at every layer (`ShardStats`, each field
        `[layers, p, B, T, Hq]`, `p` this generator's devices). `cache` is donated."""
        validate.check_instance(cache, KVCache, "cache", "build one with prefill(...)")
        validate.check_array(tokens, "tokens", rank=2, layout="[B, T]", kind="int")
        return self._run("probe", cache, jax.device_put(jnp.asarray(tokens, jnp.int32), self._rep))

    def _padded(self, longest: int) -> int:
        """`longest` rounded up to whole prefill chunks."""
        return -(-longest // self.chunk) * self.chunk

    @_under_own_mesh
    def prefill(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[np.ndarray],
        capacity: int,
        progress: bool | None = False,
    ) -> tuple[Array, KVCache]:
        """Fill a fresh cache from right-padded prompts; return each prompt's last logits.

        `prompts` are non-empty sequences of token ids in `[0, vocab)`; `capacity` must hold
        the longest, padded to whole `prefill_chunk`s. `progress` shows a bar over the
        prompt's chunks (`None`: when there are more than 8). Everything is checked before
        any work is done.
        """
        from tqdm import tqdm

        checked = check_prompts(prompts, self.cfg.vocab)
        validate.check_int(capacity, "capacity")
        validate.check_bool(progress, "progress", optional=True)
        lengths = np.array([len(p) for p in checked])
        padded = self._padded(int(lengths.max()))
        _check_capacity(capacity, int(lengths.max()), padded)
        tokens = np.zeros((len(checked), padded), np.int32)
        for b, p in enumerate(checked):
            tokens[b, : len(p)] = p
        cache = empty_cache(self.cfg, len(checked), capacity, self.mesh)
        last = jnp.zeros((len(checked), self.cfg.vocab), jnp.float32)
        n_chunks = padded // self.chunk
        bar = tqdm(
            total=n_chunks,
            desc=f"{self.prefill_method} prefill",
            unit="chunk",
            disable=(n_chunks <= 8) if progress is None else not progress,
        )
        for c in range(0, padded, self.chunk):
            idx = lengths - 1 - c
            inside = (idx >= 0) & (idx < self.chunk)
            chunk = jnp.asarray(tokens[:, c : c + self.chunk])
            pick, cache = self._run("prefill", cache, chunk, jnp.asarray(np.where(inside, idx, -1)))
            last = jnp.where(jnp.asarray(inside)[:, None], pick, last)
            if not bar.disable:
                jax.block_until_ready(last)  # so the bar tracks the work, not the dispatch
                bar.update(1)
        bar.close()
        # Each sequence continues right after its own prompt; padding slots get overwritten.
        lengths = jax.device_put(jnp.asarray(lengths, jnp.int32), self._rep)
        return last, cache._replace(lengths=lengths)

    @_under_own_mesh
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        new_tokens: int,
        *,
        key: Array,
        temperature: float = 0.0,
        capacity: int | None = None,
        progress: bool | None = None,
        stop_at: int | None = None,
    ) -> Generation:
        """Prefill, then decode `new_tokens` tokens per prompt (greedy at temperature 0).

        Args:
          prompts: a non-empty list of non-empty sequences of token ids in `[0, vocab)`.
          new_tokens: tokens to generate per prompt, >= 1.
          key: a PRNG key (`jax.random.key(0)`), used when `temperature > 0`.
          temperature: >= 0; 0 is greedy.
          capacity: cache positions; it must hold the longest prompt padded to whole
            `prefill_chunk`s and the longest prompt plus `new_tokens`. `None` (the default)
            picks the padded prompt length plus `new_tokens`.
          progress: `None` shows progress bars for decoding more than 64 tokens and for
            prefilling more than 8 chunks; `True` or `False` forces both on or off.
          stop_at: a token id (e.g. the end-of-sequence id): decoding stops once every
            prompt has produced it, so fewer than `new_tokens` may come back (a prompt that
            stopped early continues after its stop token until the others stop). None
            decodes `new_tokens`.

        Every argument is checked before any work is done.
        """
        import time

        checked = check_prompts(prompts, self.cfg.vocab)
        validate.check_int(new_tokens, "new_tokens", example="`new_tokens=32`")
        validate.check_prng_key(key)
        temperature = _check_temperature(temperature)
        key = jax.device_put(key, self._rep)  # made under another mesh, maybe (see `step`)
        validate.check_bool(progress, "progress", optional=True)
        if stop_at is not None:
            validate.check_int(stop_at, "stop_at", minimum=0, example="the EOS id, e.g. 2")
        longest = max(len(p) for p in checked)
        padded = self._padded(longest)
        if capacity is None:
            capacity = padded + new_tokens
        validate.check_int(capacity, "capacity", example="`capacity=None` (the smallest that fits)")
        _check_capacity(capacity, longest, padded, new_tokens)
        t0 = time.perf_counter()
        logits, cache = self.prefill(checked, capacity, progress=progress)
        jax.block_until_ready(logits)
        prefill_s = time.perf_counter() - t0
        tokens, all_logits, times = self._decode(
            cache, logits, key, new_tokens, temperature, progress, stop_at
        )
        return Generation(tokens, all_logits, times, prefill_s)

    def _decode(
        self,
        cache: KVCache,
        logits: Array,
        key: Array,
        new_tokens: int,
        temperature: float,
        progress: bool | None,
        stop_at: int | None,
    ) -> tuple[np.ndarray, np.ndarray, list[float]]:
        """`generate`'s decoding, on checked arguments: from each prompt's last `logits`,
        up to `new_tokens` tokens `[B, n]`, their logits `[B, n, vocab]`, and the wall
        seconds of each step after the first token."""
        import time

        from tqdm import tqdm

        tok = jax.device_put(sample(logits, jax.random.fold_in(key, 0), temperature), self._rep)
        toks, all_logits, times = [tok], [logits], []
        bar = tqdm(
            total=new_tokens,
            desc=f"{self.method} decode",
            unit="tok",
            disable=(new_tokens <= 64) if progress is None else not progress,
        )
        bar.update(1)
        stopped = np.asarray(tok) == stop_at
        for i in range(1, new_tokens):
            if stopped.all():
                break
            t0 = time.perf_counter()
            tok, logits, cache = self._step(cache, tok, jax.random.fold_in(key, i), temperature)
            jax.block_until_ready(tok)
            times.append(time.perf_counter() - t0)
            toks.append(tok)
            all_logits.append(logits)
            stopped |= np.asarray(tok) == stop_at
            bar.update(1)
        bar.close()
        return (
            np.stack([np.asarray(t) for t in toks], 1),
            np.stack([np.asarray(x) for x in all_logits], 1),
            times,
        )
