"""Render a chat template that came with an untrusted checkpoint file, within bounds.

A GGUF file carries its chat template as Jinja source (`tokenizer.chat_template`).
transformers and llama.cpp render it in a sandbox that blocks access to Python internals,
but a sandbox alone leaves time and memory unbounded: `{{ 2 ** (2 ** 40) }}` computes for
minutes, `{{ 'a' * 4000000000 }}` allocates 4 GB and two nested `range(100000)` loops run
10**10 times. Here the template runs in Jinja's immutable sandbox with four more limits:

* arithmetic that would build a huge number or string (`**`, `*`, `%`) is refused before
  it runs, and so is any call or filter given a size above `MAX_SIZE`;
* `range` counts its items against `MAX_ITERATIONS` over the whole render;
* the output stops at `MAX_OUTPUT` characters;
* a wall-clock limit of `TIME_LIMIT_S` (a SIGALRM timer, on the main thread, where the CLI
  runs; elsewhere the other limits still apply).

Whatever goes wrong inside the template (a Jinja error, a ZeroDivisionError, a
RecursionError from a self-calling macro, a limit) becomes one `TemplateLimitError` or
the template's own error, for the caller to report with the file's name.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

MAX_SIZE = 1_000_000
"""Largest string, list or number of repetitions a template may build in one step."""
MAX_ITERATIONS = 1_000_000
"""Items all of a render's `range` calls may produce together."""
MAX_OUTPUT = 1_000_000
"""Characters a rendered prompt may hold."""
TIME_LIMIT_S = 5.0
"""Seconds a render may take (a real chat template takes milliseconds)."""


class TemplateLimitError(RuntimeError):
    """A chat template went past one of this module's limits."""


def render(template: str, **context: Any) -> str:
    """`template` rendered with `context`, within the limits above.

    Raises:
      TemplateLimitError: the template went past a limit.
      Exception: the template's own error (jinja2.TemplateError, ZeroDivisionError, ...).
    """
    env = _limited_environment(time.monotonic() + TIME_LIMIT_S)
    pieces: list[str] = []
    size = 0
    with _alarm(TIME_LIMIT_S):
        for piece in env.from_string(template).generate(**context):
            size += len(piece)
            if size > MAX_OUTPUT:
                raise TemplateLimitError(f"its output passes {MAX_OUTPUT:,} characters")
            env.check_time()
            pieces.append(piece)
    return "".join(pieces)


def _limited_environment(deadline: float) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Limited(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["**", "*", "%"])

        def check_time(self) -> None:
            if time.monotonic() > deadline:
                raise TemplateLimitError(f"it ran for more than {TIME_LIMIT_S:g} s")

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            self.check_time()
            if operator == "**":
                _check_power(left, right)
            elif operator == "*":
                _check_repeat(left, right)
                _check_repeat(right, left)
            elif operator == "%" and isinstance(left, str):
                _check_args((right,) if not isinstance(right, tuple | dict) else right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            __self.check_time()
            _check_args(args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    env = Limited(trim_blocks=True, lstrip_blocks=True)
    env.filters = {name: _guarded(f, env.check_time) for name, f in env.filters.items()}
    env.globals["range"] = _counted_range(env.check_time)
    return env


def _check_power(base: Any, exponent: Any) -> None:
    if not (_is_number(base) and _is_number(exponent)):
        return
    if isinstance(exponent, float) or isinstance(base, float):
        return  # floats overflow to OverflowError (or inf): no big allocation
    if abs(base) > 1 and exponent * math.log2(abs(base)) > 64 * 1024:
        raise TemplateLimitError(
            f"it computes {base} ** {exponent}, a number of more than 65,536 bits"
        )


def _check_repeat(seq: Any, times: Any) -> None:
    if (
        isinstance(seq, str | list | tuple | bytes)
        and _is_number(times)
        and not isinstance(times, float)
        and len(seq) * times > MAX_SIZE
    ):
        raise TemplateLimitError(
            f"it repeats a sequence of {len(seq):,} items {times:,} "
            f"times (more than {MAX_SIZE:,} in all)"
        )


def _check_args(args: Any, kwargs: dict | None = None) -> None:
    values = list(args.values() if isinstance(args, dict) else args)
    values += list((kwargs or {}).values())
    for x in values:
        if _is_number(x) and not isinstance(x, float) and abs(x) > MAX_SIZE:
            raise TemplateLimitError(
                f"it calls a function with the size {x:,} (more than {MAX_SIZE:,})"
            )


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _guarded(f: Callable, check_time: Callable[[], None]) -> Callable:
    # Jinja passes the context or environment first to a filter marked `jinja_pass_arg`,
    # then the value filtered; the arguments after those are the sizes to check.
    skip = 2 if hasattr(f, "jinja_pass_arg") else 1

    def guarded(*args: Any, **kwargs: Any) -> Any:
        check_time()
        _check_args(args[skip:], kwargs)
        return f(*args, **kwargs)

    if hasattr(f, "jinja_pass_arg"):
        guarded.jinja_pass_arg = f.jinja_pass_arg  # type: ignore[attr-defined]
    return guarded


def _counted_range(check_time: Callable[[], None]) -> Callable[..., Iterator[int]]:
    used = [0]

    def counted(*args: int) -> Iterator[int]:
        _check_args(args)
        for i in range(*args):
            used[0] += 1
            if used[0] > MAX_ITERATIONS:
                raise TemplateLimitError(f"its loops run more than {MAX_ITERATIONS:,} times")
            if used[0] % 1024 == 0:
                check_time()
            yield i

    return counted


class _alarm:
    """A SIGALRM timer for `seconds` on the main thread (a no-op elsewhere), which turns a
    render stuck in one long step into a `TemplateLimitError`; the previous handler and
    timer are restored."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.active = threading.current_thread() is threading.main_thread() and hasattr(
            signal, "SIGALRM"
        )

    def __enter__(self) -> None:
        if not self.active:
            return

        def stop(signum: int, frame: Any) -> None:
            raise TemplateLimitError(f"it ran for more than {self.seconds:g} s")

        self.old_handler = signal.signal(signal.SIGALRM, stop)
        self.old_timer = signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc: Any) -> None:
        if not self.active:
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.old_handler)
        if self.old_timer[0] > 0:  # someone else's timer was running: give it back
            signal.setitimer(signal.ITIMER_REAL, *self.old_timer)
