"""Bad input: every public function raises a ValueError or TypeError naming the argument.

One table of cases, `CASES`, built by a few generators, one per family of functions (q/k/v
attention, decoders on a mesh, partial states, Hopfield memory, the model, the cost model,
...). Each case calls a public function with one bad argument and expects the exception type
and a message that names that argument in backticks (`q`, `prompts[0]`, `memory.keys`).
Validation runs before any compilation, so each case takes milliseconds: the arrays are tiny
numpy arrays, and nothing here runs a model.

`test_table_covers_every_public_function` keeps the table complete: a new public function of
a listed module fails it until it has cases here (or a reason in `NOT_VALIDATED`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import NEEDS_DEVICES, ON_ACCELERATOR

import tree_attention_edu as tae
from tree_attention_edu.core import decode, devices, kernels, merges, states
from tree_attention_edu.llama import cache as llama_cache
from tree_attention_edu.llama import checkpoint, hf_config, model
from tree_attention_edu.llama import config as llama_config
from tree_attention_edu.llama import forward as llama_forward
from tree_attention_edu.llama import generator as llama_generator
from tree_attention_edu.llama import layers as llama_layers
from tree_attention_edu.perf import (
    costmodel,
    crossover,
    formulas,
    introspect,
    links,
    paper,
    patterns,
    predict,
)
from tree_attention_edu.theory import bayes
from tree_attention_edu.theory import hopfield as hf

if ON_ACCELERATOR:  # the cases are built on an 8-device mesh as they are collected
    pytest.skip(NEEDS_DEVICES, allow_module_level=True)

# The package exports functions named like these two modules: import the modules by path.
attention_module = importlib.import_module("tree_attention_edu.core.reference")
energy_module = importlib.import_module("tree_attention_edu.theory.energy")

KINDS = ("rank", "dtype", "shape", "range", "type")


@dataclass(frozen=True)
class Case:
    target: Callable  # the public function (or class) under test
    kind: str  # one of KINDS
    what: str  # what is wrong, for the test id
    call: Callable[[], object]  # calls `target` with the bad argument
    exc: type[Exception]  # ValueError or TypeError
    names: tuple[str, ...]  # the message names one of these arguments

    @property
    def id(self) -> str:
        return f"{_name(self.target)}-{self.kind}-{self.what}"


def _name(target) -> str:
    return f"{target.__module__.rsplit('.', 1)[-1]}.{target.__qualname__}"


def case(target, kind, what, call, exc, *names) -> Case:
    assert kind in KINDS and exc in (ValueError, TypeError)
    return Case(target, kind, what, call, exc, names)


# --- tiny inputs (numpy: validation must not need a device) ------------------------------------

F32 = np.float32
B, TQ, HQ, HKV, D, DV, TK = 2, 1, 2, 1, 4, 3, 8
Q = np.zeros((B, TQ, HQ, D), F32)
K = np.zeros((B, TK, HKV, D), F32)
V = np.zeros((B, TK, HKV, DV), F32)
LENGTHS = np.array([TK, 5], np.int32)
OUT = np.zeros((B, TQ, HQ, DV), F32)  # shaped like attention's output (z, zeta)
STATE = tae.AttentionState(OUT, np.zeros((B, TQ, HQ), F32), np.zeros((B, TQ, HQ), F32))


@functools.cache
def mesh():
    return tae.make_mesh(8, "x")


@functools.cache
def key():
    return jax.random.key(0)


# --- q/k/v attention ---------------------------------------------------------------------------


def qkv_cases(target, call, *, with_v=True, chunk=False) -> list[Case]:
    """`call(q, k, v, **kw)` (or `call(q, k, **kw)`) for a function of the attention inputs.

    The values of `kv_lengths` are not checked anywhere (that would differ under `jit`): they
    are clamped, which `test_jit_native` checks. `chunk` is kept for the callers' reading."""
    del chunk

    def c(q=Q, k=K, v=V, **kw):
        return (lambda: call(q, k, v, **kw)) if with_v else (lambda: call(q, k, **kw))

    qk = ("q", "k")
    out = [
        case(target, "rank", "q", c(q=Q[0]), ValueError, "q"),
        case(target, "rank", "k", c(k=K[0]), ValueError, "k"),
        case(target, "dtype", "q-int", c(q=Q.astype(np.int32)), TypeError, "q"),
        case(target, "dtype", "k-int", c(k=K.astype(np.int32)), TypeError, "k"),
        case(
            target,
            "dtype",
            "kv_lengths-float",
            c(kv_lengths=LENGTHS.astype(F32)),
            TypeError,
            "kv_lengths",
        ),
        case(target, "type", "q-list", c(q=Q.tolist()), TypeError, "q"),
        case(target, "type", "k-none", c(k=None), TypeError, "k"),
        case(target, "type", "scale-str", c(scale="0.5"), TypeError, "scale"),
        case(
            target,
            "type",
            "scale-traced",
            lambda: jax.jit(lambda s: c(scale=s)())(0.5),
            TypeError,
            "scale",
        ),
        case(
            target,
            "type",
            "kv_lengths-list",
            c(kv_lengths=LENGTHS.tolist()),
            TypeError,
            "kv_lengths",
        ),
        case(target, "shape", "batch", c(q=Q[:1]), ValueError, *qk),
        case(target, "shape", "head_dim", c(q=Q[..., :3]), ValueError, *qk),
        case(
            target,
            "shape",
            "heads-not-a-multiple",
            c(
                q=np.zeros((B, TQ, 3, D), F32),
                k=np.zeros((B, TK, 2, D), F32),
                v=np.zeros((B, TK, 2, DV), F32),
            ),
            ValueError,
            *qk,
        ),
        case(
            target,
            "shape",
            "kv_lengths",
            c(kv_lengths=np.array([1, 2, 3], np.int32)),
            ValueError,
            "kv_lengths",
        ),
        case(target, "range", "scale-nan", c(scale=float("nan")), ValueError, "scale"),
        case(target, "range", "head_dim-0", c(q=Q[..., :0], k=K[..., :0]), ValueError, *qk),
    ]
    if with_v:
        out += [
            case(target, "rank", "v", c(v=V[0]), ValueError, "v"),
            case(target, "dtype", "v-int", c(v=V.astype(np.int32)), TypeError, "v"),
            case(target, "type", "v-str", c(v="v"), TypeError, "v"),
            case(target, "shape", "v-kv_len", c(v=V[:, :5]), ValueError, "v"),
            case(target, "range", "v_dim-0", c(v=V[..., :0]), ValueError, "v"),
        ]
    return out


def like_output_cases(target, call, name) -> list[Case]:
    """`call(x)` where `x` (a source ζ or an estimate z) must be shaped like the output."""
    return [
        case(target, "rank", name, lambda: call(OUT[0]), ValueError, name),
        case(target, "shape", name, lambda: call(OUT[..., :2]), ValueError, name),
        case(target, "dtype", f"{name}-int", lambda: call(OUT.astype(np.int32)), TypeError, name),
        case(target, "type", f"{name}-list", lambda: call(OUT.tolist()), TypeError, name),
    ]


def decoder_cases(target) -> list[Case]:
    """A sequence-parallel decoder: the attention inputs plus mesh arguments."""

    def c(**kw):
        kw = dict(mesh=mesh()) | kw
        return lambda: target(Q, K, V, **kw)

    return [
        *qkv_cases(target, lambda q, k, v, **kw: target(q, k, v, mesh=mesh(), **kw)),
        case(target, "type", "mesh", c(mesh="x"), TypeError, "mesh"),
        case(target, "type", "seq_axes-int", c(seq_axes=5), TypeError, "seq_axes"),
        case(target, "range", "seq_axes-repeated", c(seq_axes=("x", "x")), ValueError, "seq_axes"),
        case(target, "range", "seq_axes-unknown", c(seq_axes="y"), ValueError, "seq_axes"),
        case(target, "range", "local_kernel", c(local_kernel="cuda"), ValueError, "local_kernel"),
        case(target, "range", "layout", c(layout="thd"), ValueError, "layout"),
    ]


def attention_family() -> list[Case]:
    cases = []
    for fn in (
        tae.attention,
        tae.attention_from_energy,
        tae.value_covariance,
        tae.value_covariance_formula,
    ):
        cases += qkv_cases(fn, fn)
    for fn in (attention_module.weights, tae.posterior):
        cases += qkv_cases(fn, fn, with_v=False)
    cases += qkv_cases(tae.energy, lambda q, k, v, **kw: tae.energy(q, k, v, OUT, **kw))
    cases += like_output_cases(tae.energy, lambda z: tae.energy(Q, K, V, z), "zeta")
    ll = tae.log_likelihood
    cases += qkv_cases(ll, lambda q, k, v, **kw: ll(OUT, OUT, q, k, v, **kw))
    cases += like_output_cases(ll, lambda z: ll(z, OUT, Q, K, V), "z")
    cases += like_output_cases(ll, lambda zeta: ll(OUT, zeta, Q, K, V), "zeta")
    me = tae.map_estimate
    cases += qkv_cases(me, me)
    cases += [
        case(me, "range", "tol", lambda: me(Q, K, V, tol=-1.0), ValueError, "tol"),
        case(me, "type", "tol", lambda: me(Q, K, V, tol="1e-8"), TypeError, "tol"),
        case(
            me, "range", "max_newton", lambda: me(Q, K, V, max_newton=0), ValueError, "max_newton"
        ),
        case(
            me, "type", "max_newton", lambda: me(Q, K, V, max_newton=2.5), TypeError, "max_newton"
        ),
        case(me, "type", "seed", lambda: me(Q, K, V, seed="0"), TypeError, "seed"),
    ]
    return cases


def bayes_family() -> list[Case]:
    """The corrected Bayesian reading: saddle, conjugate, rate function."""
    cases = []
    sp_ = bayes.stationary_point
    cases += qkv_cases(sp_, sp_)
    cases += [
        case(sp_, "range", "tol", lambda: sp_(Q, K, V, tol=0.0), ValueError, "tol"),
        case(
            sp_, "type", "max_newton", lambda: sp_(Q, K, V, max_newton=2.5), TypeError, "max_newton"
        ),
        case(sp_, "range", "seed", lambda: sp_(Q, K, V, seed=-1), ValueError, "seed"),
    ]
    gh = bayes.gamma_hessian
    cases += qkv_cases(gh, gh)
    cases += like_output_cases(gh, lambda zeta: gh(Q, K, V, zeta=zeta), "zeta")
    for fn in (bayes.conjugate_energy, bayes.rate_function, bayes.min_kl_with_mean):
        cases += qkv_cases(fn, lambda q, k, v, fn=fn, **kw: fn(OUT, q, k, v, **kw))
        cases += like_output_cases(fn, lambda z, fn=fn: fn(z, Q, K, V), "z")
        cases += [
            case(fn, "range", "tol", lambda fn=fn: fn(OUT, Q, K, V, tol=-1.0), ValueError, "tol"),
            case(fn, "type", "tol", lambda fn=fn: fn(OUT, Q, K, V, tol="1e-9"), TypeError, "tol"),
            case(
                fn,
                "range",
                "max_newton",
                lambda fn=fn: fn(OUT, Q, K, V, max_newton=0),
                ValueError,
                "max_newton",
            ),
        ]
    sd = bayes.saddlepoint_density
    cases += qkv_cases(sd, lambda q, k, v, **kw: sd(OUT, 4, q, k, v, **kw))
    cases += like_output_cases(sd, lambda z: sd(z, 4, Q, K, V), "z")
    cases += [
        case(sd, "range", "n", lambda: sd(OUT, 0, Q, K, V), ValueError, "n"),
        case(sd, "type", "n", lambda: sd(OUT, 2.5, Q, K, V), TypeError, "n"),
    ]
    sm = bayes.sample_means
    cases += qkv_cases(sm, lambda q, k, v, **kw: sm(key(), 4, 8, q, k, v, **kw))
    cases += [
        case(sm, "type", "key-int", lambda: sm(0, 4, 8, Q, K, V), TypeError, "key"),
        case(sm, "range", "n", lambda: sm(key(), 0, 8, Q, K, V), ValueError, "n"),
        case(
            sm, "type", "num_samples", lambda: sm(key(), 4, "8", Q, K, V), TypeError, "num_samples"
        ),
        case(
            sm, "range", "num_samples", lambda: sm(key(), 4, -1, Q, K, V), ValueError, "num_samples"
        ),
    ]
    tp = bayes.tilted_posterior
    cases += qkv_cases(tp, lambda q, k, v, **kw: tp(OUT, q, k, v, **kw))
    cases += like_output_cases(tp, lambda zeta: tp(zeta, Q, K, V), "zeta")
    pr = bayes.posterior_risk
    cases += qkv_cases(pr, lambda q, k, v, **kw: pr(OUT, q, k, v, **kw))
    cases += like_output_cases(pr, lambda z: pr(z, Q, K, V), "z")
    ha = bayes.hard_attention
    cases += qkv_cases(ha, ha)
    return cases


# --- partial states ----------------------------------------------------------------------------


def _state(**parts):
    return STATE._replace(**parts)


def states_family() -> list[Case]:
    cs, tr, sr, fin, ids = (
        tae.combine,
        tae.tree_reduce,
        tae.sequential_reduce,
        tae.finalize,
        tae.identity_state,
    )
    other_shape = _state(out=OUT[:1], lse=STATE.lse[:1])
    cases = [
        case(cs, "type", "a", lambda: cs("a", STATE), TypeError, "a"),
        case(cs, "type", "b", lambda: cs(STATE, 5), TypeError, "b"),
        case(cs, "shape", "a-vs-b", lambda: cs(STATE, other_shape), ValueError, "a", "b"),
        case(
            cs,
            "shape",
            "out-vs-lse",
            lambda: cs(_state(lse=STATE.lse[..., :1]), STATE),
            ValueError,
            "a",
        ),
        case(
            cs,
            "rank",
            "a",
            lambda: cs(_state(out=OUT[0], lse=STATE.lse[0]), STATE),
            ValueError,
            "a",
            "b",
        ),
        case(
            cs,
            "dtype",
            "int",
            lambda: cs(_state(out=OUT.astype(np.int32)), STATE),
            TypeError,
            "a",
            "b",
        ),
        case(
            cs,
            "shape",
            "lse_lo-vs-lse",
            lambda: cs(_state(lse_lo=STATE.lse[..., :1]), STATE),
            ValueError,
            "a",
        ),
        case(ids, "range", "batch", lambda: ids(-1, 1, 2, 3), ValueError, "batch"),
        case(ids, "type", "q_len", lambda: ids(2, 1.5, 2, 3), TypeError, "q_len"),
        case(ids, "type", "v_dim", lambda: ids(2, 1, 2, "3"), TypeError, "v_dim"),
        case(ids, "dtype", "int", lambda: ids(2, 1, 2, 3, jnp.int32), TypeError, "dtype"),
        case(fin, "type", "state", lambda: fin("state"), TypeError, "state"),
        case(fin, "type", "dtype", lambda: fin(STATE, "banana"), TypeError, "dtype"),
        case(fin, "dtype", "int", lambda: fin(STATE, jnp.int32), TypeError, "dtype"),
        case(tr, "type", "generator", lambda: tr(s for s in [STATE, STATE]), TypeError, "states"),
        case(tr, "type", "states-int", lambda: tr(5), TypeError, "states"),
        case(tr, "range", "empty", lambda: tr([]), ValueError, "states"),
        case(tr, "range", "branching", lambda: tr([STATE], branching=1), ValueError, "branching"),
        case(tr, "type", "branching", lambda: tr([STATE], branching=2.5), TypeError, "branching"),
        case(tr, "type", "op", lambda: tr([STATE, STATE], op=5), TypeError, "op"),
        case(sr, "type", "generator", lambda: sr(s for s in [STATE]), TypeError, "states"),
        case(sr, "range", "empty", lambda: sr([]), ValueError, "states"),
        case(sr, "type", "op", lambda: sr([STATE, STATE], op=5), TypeError, "op"),
        case(
            merges.allreduce_combine,
            "type",
            "state",
            lambda: merges.allreduce_combine("state", ("x",)),
            TypeError,
            "state",
        ),
        case(
            merges.allreduce_combine,
            "type",
            "axes",
            lambda: merges.allreduce_combine(STATE, 5),
            TypeError,
            "axes",
        ),
        *[
            c
            for fn in (
                merges.allgather_combine,
                merges.all_to_all_combine,
                merges.reduce_scatter_combine,
                merges.one_pass_combine,
                merges.butterfly_combine,
            )
            for c in (
                case(fn, "type", "state", lambda fn=fn: fn("state", ("x",)), TypeError, "state"),
                case(fn, "type", "axes", lambda fn=fn: fn(STATE, "x"), TypeError, "axes"),
            )
        ],
        *merge_helper_cases(),
        case(
            states.merge_stacked,
            "type",
            "stacked",
            lambda: states.merge_stacked([STATE, STATE]),
            TypeError,
            "stacked",
        ),
        case(
            cs,
            "type",
            "lse-list",
            lambda: cs(_state(lse=STATE.lse.tolist()), STATE),
            TypeError,
            "a.lse",
        ),
        # A merge is a collective: outside shard_map (or over an axis the enclosing
        # shard_map lacks) it is refused by name, not with JAX's unbound-axis NameError.
        *[
            case(
                fn,
                "range",
                "outside-shard_map",
                lambda fn=fn: fn(STATE, ("x",)),
                ValueError,
                "axes",
            )
            for fn in merges.MERGES.values()
        ],
        case(
            merges.allreduce_combine,
            "range",
            "unknown-axis",
            lambda: jax.shard_map(
                lambda o: merges.allreduce_combine(_state(out=o), ("y",)).out,
                mesh=mesh(),
                in_specs=jax.P(),
                out_specs=jax.P(),
            )(OUT),
            ValueError,
            "axes",
        ),
    ]
    ch = tae.chunk_states
    cases += qkv_cases(ch, lambda q, k, v, **kw: ch(q, k, v, [TK], **kw))
    cases += [
        case(
            ch, "range", "chunk_sizes-sum", lambda: ch(Q, K, V, [3, 4]), ValueError, "chunk_sizes"
        ),
        case(
            ch,
            "range",
            "chunk_sizes-negative",
            lambda: ch(Q, K, V, [-1, TK + 1]),
            ValueError,
            "chunk_sizes",
        ),
        case(ch, "type", "chunk_sizes-str", lambda: ch(Q, K, V, "ab"), TypeError, "chunk_sizes"),
        case(
            ch,
            "type",
            "chunk_sizes-float",
            lambda: ch(Q, K, V, [2.5, 5.5]),
            TypeError,
            "chunk_sizes",
        ),
    ]
    cases += qkv_cases(tae.local_state, tae.local_state, chunk=True)
    ls = tae.local_state
    cases += [
        case(
            ls,
            kind,
            f"kv_offset={bad!r}",
            lambda bad=bad: ls(Q, K, V, kv_offset=bad),
            exc,
            "kv_offset",
        )
        for kind, bad, exc in (
            ("type", 1.5, TypeError),
            ("type", "8", TypeError),
            ("shape", np.array([1, 2]), TypeError),
            ("type", True, TypeError),
            ("range", 2**40, ValueError),
        )
    ]
    return cases


def merge_helper_cases() -> list[Case]:
    hp, ow = merges.heads_per_device, merges.one_pass_window
    return [
        case(hp, "range", "p-0", lambda: hp(8, 0), ValueError, "p"),
        case(hp, "type", "q_heads-float", lambda: hp(8.0, 2), TypeError, "q_heads"),
        case(ow, "range", "p-0", lambda: ow(jnp.float32, 0), ValueError, "p"),
        case(ow, "range", "p-negative", lambda: ow(jnp.float32, -3), ValueError, "p"),
        case(
            ow,
            "range",
            "out_max-nan",
            lambda: ow(jnp.float32, 8, out_max=float("nan")),
            ValueError,
            "out_max",
        ),
        case(
            ow, "range", "out_max-0", lambda: ow(jnp.float32, 8, out_max=0), ValueError, "out_max"
        ),
        case(
            ow,
            "range",
            "out_min-negative",
            lambda: ow(jnp.float32, 8, out_min=-1),
            ValueError,
            "out_min",
        ),
        case(ow, "dtype", "int32", lambda: ow(jnp.int32, 8), TypeError, "dtype"),
        case(ow, "type", "p-float", lambda: ow(jnp.float32, 8.0), TypeError, "p"),
    ]


# --- devices, kernels, decoders ----------------------------------------------------------------


def devices_family() -> list[Case]:
    mm, sd = tae.make_mesh, tae.simulate_devices
    return [
        case(sd, "range", "0", lambda: sd(0), ValueError, "n"),
        case(sd, "type", "str", lambda: sd("8"), TypeError, "n"),
        case(sd, "type", "float", lambda: sd(2.5), TypeError, "n"),
        case(mm, "type", "shape-float", lambda: mm(2.5, "x"), TypeError, "shape"),
        case(mm, "type", "shape-str", lambda: mm("8", "x"), TypeError, "shape"),
        case(mm, "type", "shape-bool", lambda: mm(True, "x"), TypeError, "shape"),
        case(mm, "range", "shape-0", lambda: mm((0,), "x"), ValueError, "shape"),
        case(mm, "range", "shape-too-many-devices", lambda: mm(16, "x"), ValueError, "shape"),
        case(mm, "rank", "shape-empty", lambda: mm((), ()), ValueError, "shape"),
        case(
            mm,
            "shape",
            "one-name-per-axis",
            lambda: mm((2, 4), "x"),
            ValueError,
            "shape",
            "axis_names",
        ),
        case(
            mm,
            "range",
            "axis_names-repeated",
            lambda: mm((2, 2), ("a", "a")),
            ValueError,
            "axis_names",
        ),
        case(mm, "type", "axis_names-int", lambda: mm(8, 5), TypeError, "axis_names"),
        case(mm, "dtype", "devices-ints", lambda: mm(2, "x", devices=[0, 1]), TypeError, "devices"),
        case(mm, "type", "devices-int", lambda: mm(2, "x", devices=5), TypeError, "devices"),
        case(
            mm,
            "range",
            "devices-repeated",
            lambda: mm(2, "x", devices=[jax.devices()[0]] * 2),
            ValueError,
            "devices",
        ),
        case(
            mm,
            "range",
            "devices-too-few",
            lambda: mm(2, "x", devices=jax.devices()[:1]),
            ValueError,
            "shape",
            "devices",
        ),
        *pad_cache_cases(),
    ]


def pad_cache_cases() -> list[Case]:
    pc = tae.pad_cache
    return [
        case(pc, "rank", "k", lambda: pc(K[0], V, 8), ValueError, "k"),
        case(pc, "shape", "k-vs-v", lambda: pc(K, V[:, :5], 8), ValueError, "k", "v"),
        case(pc, "type", "k", lambda: pc(K.tolist(), V, 8), TypeError, "k"),
        case(pc, "type", "multiple", lambda: pc(K, V, 2.5), TypeError, "multiple"),
        case(pc, "range", "multiple", lambda: pc(K, V, 0), ValueError, "multiple"),
        case(pc, "range", "layout", lambda: pc(K, V, 8, layout="thd"), ValueError, "layout"),
        case(
            pc,
            "shape",
            "kv_lengths",
            lambda: pc(K, V, 8, kv_lengths=np.ones(3, np.int32)),
            ValueError,
            "kv_lengths",
        ),
        case(
            pc,
            "dtype",
            "kv_lengths",
            lambda: pc(K, V, 8, kv_lengths=np.ones(B, F32)),
            TypeError,
            "kv_lengths",
        ),
    ]


def kernels_family() -> list[Case]:
    xs, tl, rs, fs = kernels.xla_state, kernels.to_layout, kernels.resolve, kernels.flash_state
    cs = kernels.cudnn_state
    cs_xla = functools.partial(cs, implementation="xla")
    VD = np.zeros((B, TK, HKV, D), F32)  # v_dim == head_dim, as cudnn_state needs
    auto = dict(dtype=jnp.float32, head_dim=D, v_dim=D, needs_mask=False)
    return [
        *qkv_cases(xs, xs, chunk=True),
        case(xs, "range", "block-0", lambda: xs(Q, K, V, block=0), ValueError, "block"),
        case(xs, "type", "block-float", lambda: xs(Q, K, V, block=2.5), TypeError, "block"),
        case(xs, "range", "layout", lambda: xs(Q, K, V, layout="thd"), ValueError, "layout"),
        # kv_head_window (start, count): a start past the heads, a count of 0 or above Hkv,
        # a float start or count, and malformed pairs: named errors, never a clamp.
        *[
            case(
                xs,
                kind,
                f"kv_head_window={w!r}",
                lambda w=w: xs(Q[:, :, :1], K, V, kv_head_window=w),
                exc,
                "kv_head_window",
            )
            for kind, w, exc in (
                ("range", (1, 1), ValueError),
                ("range", (-1, 1), ValueError),
                ("range", (0, 2), ValueError),
                ("range", (0, 0), ValueError),
                ("type", (0.5, 1), TypeError),
                ("type", (0, 1.0), TypeError),
                ("type", (0,), TypeError),
                ("type", [0, 1], TypeError),
                ("type", (np.zeros(2, np.int32), 1), TypeError),
                ("type", (jnp.float32(0), 1), TypeError),
            )
        ],
        case(tl, "rank", "x", lambda: tl(K[0], "bthd", "bhtd"), ValueError, "x"),
        case(tl, "type", "x", lambda: tl(K.tolist(), "bthd", "bhtd"), TypeError, "x"),
        case(tl, "range", "src", lambda: tl(K, "thd", "bhtd"), ValueError, "src"),
        case(tl, "range", "dst", lambda: tl(K, "bthd", "thd"), ValueError, "dst"),
        case(rs, "range", "name", lambda: rs("cuda", **auto), ValueError, "name", "local_kernel"),
        case(rs, "range", "layout", lambda: rs("auto", **auto, layout="thd"), ValueError, "layout"),
        case(
            rs,
            "dtype",
            "dtype",
            lambda: rs("auto", **(auto | dict(dtype="banana"))),
            TypeError,
            "dtype",
        ),
        case(
            rs,
            "range",
            "head_dim",
            lambda: rs("auto", **(auto | dict(head_dim=0))),
            ValueError,
            "head_dim",
        ),
        case(
            rs,
            "type",
            "head_dim",
            lambda: rs("auto", **(auto | dict(head_dim="4"))),
            TypeError,
            "head_dim",
        ),
        case(fs, "rank", "q", lambda: fs(Q[0], K, V), ValueError, "q"),
        case(fs, "dtype", "q", lambda: fs(Q.astype(np.int32), K, V), TypeError, "q"),
        case(fs, "shape", "batch", lambda: fs(Q[:1], K, V), ValueError, "q", "k"),
        case(fs, "type", "q", lambda: fs(Q.tolist(), K, V), TypeError, "q"),
        case(fs, "range", "layout", lambda: fs(Q, K, V, layout="bhtd"), ValueError, "layout"),
        *qkv_cases(cs, cs_xla, chunk=True),
        case(cs, "shape", "v_dim", lambda: cs_xla(Q, K, V), ValueError, "v"),
        case(
            cs,
            "range",
            "implementation",
            lambda: cs(Q, K, VD, implementation="triton"),
            ValueError,
            "implementation",
        ),
        case(cs, "type", "causal", lambda: cs_xla(Q, K, VD, causal="yes"), TypeError, "causal"),
        case(cs, "range", "layout", lambda: cs_xla(Q, K, VD, layout="thd"), ValueError, "layout"),
        case(cs, "range", "cudnn-off-a-gpu", lambda: cs(Q, K, VD), ValueError, "local_kernel"),
        case(
            cs,
            "dtype",
            "float64",  # its softmax is float32 on both implementations
            lambda: cs_xla(*(x.astype(np.float64) for x in (Q, K, VD))),
            ValueError,
            "q",
            "k",
            "v",
        ),
        case(
            rs, "range", "cudnn-off-a-gpu", lambda: rs("cudnn", **auto), ValueError, "local_kernel"
        ),
        case(
            kernels.cudnn.head_dim_limit,
            "type",
            "capability-str",
            lambda: kernels.cudnn.head_dim_limit("9.0"),
            TypeError,
            "capability",
        ),
        case(
            xs,
            "type",
            "kv_offset-float",
            lambda: xs(Q, K, V, kv_offset=1.5),
            TypeError,
            "kv_offset",
        ),
        case(
            cs,
            "type",
            "kv_offset-str",
            lambda: cs_xla(Q, K, VD, kv_offset="8"),
            TypeError,
            "kv_offset",
        ),
    ]


def decode_family() -> list[Case]:
    fe = tae.tree_decode_from_energy
    td, te = tae.tree_decode, tae.tree_energy
    return [
        *decoder_cases(td),
        *decoder_cases(tae.ring_decode),
        *decoder_cases(tae.ring_decode_pass_q),
        *decoder_cases(fe),
        case(
            td,
            "range",
            "merge",
            lambda: td(Q, K, V, mesh=mesh(), merge="ring"),
            ValueError,
            "merge",
        ),
        case(
            td,
            "type",
            "merge-list",
            lambda: td(Q, K, V, mesh=mesh(), merge=["auto"]),
            TypeError,
            "merge",
        ),
        case(
            td,
            "type",
            "merge-array",
            lambda: td(Q, K, V, mesh=mesh(), merge=np.array(["allreduce"])),
            TypeError,
            "merge",
        ),
        *qkv_cases(te, lambda q, k, v, **kw: te(q, k, v, OUT, mesh=mesh(), **kw)),
        *like_output_cases(te, lambda z: te(Q, K, V, z, mesh=mesh()), "zeta"),
        case(te, "type", "mesh", lambda: te(Q, K, V, OUT, mesh="x"), TypeError, "mesh"),
        case(
            te,
            "range",
            "layout",
            lambda: te(Q, K, V, OUT, mesh=mesh(), layout="thd"),
            ValueError,
            "layout",
        ),
        case(
            fe,
            "range",
            "local_kernel-cudnn",
            lambda: fe(Q, K, V, mesh=mesh(), local_kernel="cudnn"),
            ValueError,
            "local_kernel",
        ),
        case(
            fe,
            "range",
            "local_kernel-flash",
            lambda: fe(Q, K, V, mesh=mesh(), local_kernel="flash"),
            ValueError,
            "local_kernel",
        ),
    ]


def introspect_family() -> list[Case]:
    cs, ms = tae.collective_stats, tae.memory_stats
    ph, sb, st = introspect.parse_hlo, introspect.shape_bytes, introspect.structs
    return [
        case(cs, "type", "fn", lambda: cs(42, Q), TypeError, "fn"),
        case(cs, "type", "fn-array", lambda: cs(Q, Q), TypeError, "fn"),
        case(ms, "type", "fn", lambda: ms(42, Q), TypeError, "fn"),
        case(ph, "type", "text", lambda: ph(42), TypeError, "text"),
        case(ph, "range", "text-not-hlo", lambda: ph("hello"), ValueError, "text"),
        case(sb, "type", "shape_text", lambda: sb(42), TypeError, "shape_text"),
        case(st, "type", "mesh", lambda: st("x", 64), TypeError, "mesh"),
        case(st, "type", "kv_len-float", lambda: st(mesh(), 64.0), TypeError, "kv_len"),
        case(st, "range", "kv_len-not-multiple", lambda: st(mesh(), 60), ValueError, "kv_len"),
        case(st, "range", "q_heads-0", lambda: st(mesh(), 64, q_heads=0), ValueError, "q_heads"),
        case(
            st,
            "shape",
            "heads-not-grouped",
            lambda: st(mesh(), 64, q_heads=6, kv_heads=4),
            ValueError,
            "q_heads",
        ),
        case(st, "dtype", "dtype-int", lambda: st(mesh(), 64, dtype=np.int32), TypeError, "dtype"),
        case(
            st,
            "range",
            "seq_axes-unknown",
            lambda: st(mesh(), 64, seq_axes="y"),
            ValueError,
            "seq_axes",
        ),
        case(st, "range", "layout", lambda: st(mesh(), 64, layout="tbhd"), ValueError, "layout"),
    ]


# --- associative memory ------------------------------------------------------------------------

MEM = hf.Memory(np.ones((4, 8), F32), np.ones((4, 6), F32))
IDX = np.array([0, 3])
XI = np.ones((2, 8), F32)


def hopfield_family() -> list[Case]:
    mk, nq, rt, rd = hf.make_memory, hf.noisy_queries, hf.retrieve, hf.retrieved
    en, st, ag = hf.hopfield_energy, hf.hopfield_step, hf.accuracy_grid
    ints = IDX.astype(np.int32)
    cases = [
        case(mk, "range", "num_patterns", lambda: mk(key(), 0, 8), ValueError, "num_patterns"),
        case(mk, "type", "dim", lambda: mk(key(), 4, 2.5), TypeError, "dim"),
        case(mk, "range", "value_dim-0", lambda: mk(key(), 4, 8, 0), ValueError, "value_dim"),
        case(mk, "type", "key-int", lambda: mk(0, 4, 8), TypeError, "key"),
        case(mk, "rank", "key-batch", lambda: mk(jax.random.split(key()), 4, 8), ValueError, "key"),
        case(mk, "dtype", "key-float", lambda: mk(np.zeros(2, F32), 4, 8), TypeError, "key"),
        case(
            mk, "shape", "key-legacy-3", lambda: mk(np.zeros(3, np.uint32), 4, 8), TypeError, "key"
        ),
        case(nq, "range", "flip", lambda: nq(key(), MEM, ints, 0.7), ValueError, "flip"),
        case(
            nq, "range", "flip-nan", lambda: nq(key(), MEM, ints, float("nan")), ValueError, "flip"
        ),
        case(nq, "type", "flip-str", lambda: nq(key(), MEM, ints, "0.1"), TypeError, "flip"),
        case(
            nq,
            "dtype",
            "indices-float",
            lambda: nq(key(), MEM, IDX.astype(F32), 0.1),
            TypeError,
            "indices",
        ),
        case(nq, "rank", "indices", lambda: nq(key(), MEM, ints[None], 0.1), ValueError, "indices"),
        case(
            nq,
            "type",
            "memory-tuple",
            lambda: nq(key(), tuple(MEM), ints, 0.1),
            TypeError,
            "memory",
        ),
        case(
            nq,
            "shape",
            "memory-values",
            lambda: nq(key(), MEM._replace(values=MEM.values[:3]), ints, 0.1),
            ValueError,
            "memory",
        ),
        case(rt, "type", "beta-str", lambda: rt(XI, MEM, "8"), TypeError, "beta"),
        case(rt, "range", "beta-negative", lambda: rt(XI, MEM, -1.0), ValueError, "beta"),
        case(rt, "range", "beta-nan", lambda: rt(XI, MEM, float("nan")), ValueError, "beta"),
        case(
            rt,
            "type",
            "beta-traced",
            lambda: jax.jit(lambda b: rt(XI, MEM, b))(8.0),
            TypeError,
            "beta",
        ),
        case(rt, "rank", "queries", lambda: rt(XI[0], MEM, 8.0), ValueError, "queries"),
        case(rt, "shape", "queries-dim", lambda: rt(XI[:, :5], MEM, 8.0), ValueError, "queries"),
        case(
            rt,
            "dtype",
            "queries-int",
            lambda: rt(XI.astype(np.int32), MEM, 8.0),
            TypeError,
            "queries",
        ),
        case(
            rt,
            "dtype",
            "memory-int",
            lambda: rt(XI, MEM._replace(keys=MEM.keys.astype(int)), 8.0),
            TypeError,
            "memory",
        ),
        case(
            rt,
            "rank",
            "memory-keys",
            lambda: rt(XI, MEM._replace(keys=MEM.keys[0]), 8.0),
            ValueError,
            "memory",
        ),
        case(rt, "type", "mesh", lambda: rt(XI, MEM, 8.0, mesh="x"), TypeError, "mesh"),
        case(rd, "shape", "out", lambda: rd(np.ones((3, 6), F32), MEM, ints), ValueError, "out"),
        case(rd, "rank", "out", lambda: rd(np.ones(6, F32), MEM, ints), ValueError, "out"),
        case(
            rd, "dtype", "out", lambda: rd(np.ones((2, 6), np.int32), MEM, ints), TypeError, "out"
        ),
        case(
            rd, "type", "memory", lambda: rd(np.ones((2, 6), F32), None, ints), TypeError, "memory"
        ),
    ]
    for fn in (en, st):
        cases += [
            case(fn, "rank", "xi", lambda fn=fn: fn(XI, MEM.keys, 8.0), ValueError, "xi"),
            case(
                fn, "shape", "xi-dim", lambda fn=fn: fn(XI[0, :5], MEM.keys, 8.0), ValueError, "xi"
            ),
            case(
                fn,
                "dtype",
                "xi-int",
                lambda fn=fn: fn(XI[0].astype(int), MEM.keys, 8.0),
                TypeError,
                "xi",
            ),
            case(fn, "rank", "keys", lambda fn=fn: fn(XI[0], MEM.keys[0], 8.0), ValueError, "keys"),
            case(fn, "range", "beta-0", lambda fn=fn: fn(XI[0], MEM.keys, 0.0), ValueError, "beta"),
            case(fn, "type", "beta-str", lambda fn=fn: fn(XI[0], MEM.keys, "8"), TypeError, "beta"),
        ]
    cases += [
        case(ag, "range", "sizes-0", lambda: ag(key(), [16, 0], [1.0]), ValueError, "sizes"),
        case(ag, "type", "sizes-int", lambda: ag(key(), 16, [1.0]), TypeError, "sizes"),
        case(ag, "dtype", "sizes-float", lambda: ag(key(), [16.5], [1.0]), TypeError, "sizes"),
        case(ag, "range", "betas-empty", lambda: ag(key(), [16], []), ValueError, "betas"),
        case(ag, "range", "betas-negative", lambda: ag(key(), [16], [-1.0]), ValueError, "betas"),
        case(ag, "range", "flip", lambda: ag(key(), [16], [1.0], flip=0.9), ValueError, "flip"),
        case(
            ag, "range", "queries", lambda: ag(key(), [16], [1.0], queries=0), ValueError, "queries"
        ),
        case(ag, "type", "key", lambda: ag(1, [16], [1.0]), TypeError, "key"),
        case(ag, "type", "mesh", lambda: ag(key(), [16], [1.0], mesh="x"), TypeError, "mesh"),
        case(
            ag,
            "rank",
            "sizes-2d",
            lambda: ag(key(), np.ones((1, 1), int), [1.0]),
            ValueError,
            "sizes",
        ),
        case(ag, "range", "dim-0", lambda: ag(key(), [16], [1.0], dim=0), ValueError, "dim"),
        case(
            ag,
            "shape",
            "key-batch",
            lambda: ag(jax.random.split(key()), [16], [1.0]),
            ValueError,
            "key",
        ),
    ]
    return cases


# --- the model ---------------------------------------------------------------------------------

CFG = model.Config(vocab=16, dim=8, layers=1, q_heads=2, kv_heads=1, head_dim=4, hidden=8)
CACHE = model.KVCache(
    ((np.zeros((1, 1, 8, 4), F32), np.zeros((1, 1, 8, 4), F32)),), np.zeros((1,), np.int32)
)


@functools.cache
def params():
    """Zero weights of the right shapes, without running (or compiling) `init_params`."""
    shapes = jax.eval_shape(functools.partial(model.init_params, CFG), jax.random.key(0))
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


@functools.cache
def generator():
    return model.Generator(params(), CFG, mesh(), "tree", prefill_chunk=4)


def model_family() -> list[Case]:
    Gen, C = model.Generator, model.Config

    def gen(**kw):
        kw = dict(prompts=[[1, 2]], new_tokens=2, key=key()) | kw
        return lambda: generator().generate(kw.pop("prompts"), kw.pop("new_tokens"), **kw)

    def pre(prompts=([1, 2],), capacity=8, **kw):
        return lambda: generator().prefill(list(prompts), capacity, **kw)

    def new(**kw):
        kw = dict(params=params(), cfg=CFG, mesh=mesh()) | kw
        return lambda: Gen(**kw)

    kv = np.zeros((1, 1, 8, 4), F32)
    one = np.zeros((1, 1, 1, 4), F32)

    def write(**kw):
        kw = (
            dict(cache_k=kv, cache_v=kv, k=one, v=one, start=np.zeros(1, np.int32), mesh=mesh())
            | kw
        )
        return lambda: model.write(**kw)

    def fwd(**kw):
        kw = (
            dict(
                params=params(),
                cfg=CFG,
                tokens=np.zeros((1, 1), np.int32),
                cache=CACHE,
                attend=lambda *a: None,
                mesh=mesh(),
            )
            | kw
        )
        return lambda: model.forward(**kw)

    x4, pos = np.zeros((1, 2, 1, 4), F32), np.zeros((1, 2), np.int32)
    wr, fw, rn, ro, sa = model.write, model.forward, model.rms_norm, model.rope, model.sample
    ip, cs, ec = model.init_params, model.cache_sharding, model.empty_cache
    pk, ap = model.pack_projections, model.append
    g, p = Gen.generate, Gen.prefill
    return [
        # §8: the Generator
        case(g, "range", "token-above-vocab", gen(prompts=[[1, 16]]), ValueError, "prompts"),
        case(g, "range", "token-negative", gen(prompts=[[-1, 3]]), ValueError, "prompts"),
        case(g, "range", "no-prompts", gen(prompts=[]), ValueError, "prompts"),
        case(g, "range", "empty-prompt", gen(prompts=[[1], []]), ValueError, "prompts"),
        case(g, "type", "prompts-str", gen(prompts="hello"), TypeError, "prompts"),
        case(g, "type", "prompt-int", gen(prompts=[5]), TypeError, "prompts"),
        case(g, "dtype", "token-float", gen(prompts=[[1.5]]), TypeError, "prompts"),
        case(g, "rank", "prompt-nested", gen(prompts=[[[1, 2]]]), ValueError, "prompts"),
        case(g, "range", "temperature-negative", gen(temperature=-1.0), ValueError, "temperature"),
        case(
            g, "range", "temperature-nan", gen(temperature=float("nan")), ValueError, "temperature"
        ),
        case(
            g, "range", "temperature-inf", gen(temperature=float("inf")), ValueError, "temperature"
        ),
        case(g, "type", "temperature-str", gen(temperature="1"), TypeError, "temperature"),
        case(g, "range", "capacity-0", gen(capacity=0), ValueError, "capacity"),
        case(g, "type", "capacity-float", gen(capacity=8.0), TypeError, "capacity"),
        case(
            g,
            "shape",
            "prompt-longer-than-capacity",
            gen(prompts=[[1] * 9], capacity=8),
            ValueError,
            "capacity",
        ),
        case(
            g,
            "shape",
            "new-tokens-do-not-fit",
            gen(new_tokens=9, capacity=8),
            ValueError,
            "capacity",
        ),
        case(g, "range", "new_tokens-0", gen(new_tokens=0), ValueError, "new_tokens"),
        case(g, "range", "new_tokens-negative", gen(new_tokens=-3), ValueError, "new_tokens"),
        case(g, "type", "new_tokens-float", gen(new_tokens=2.5), TypeError, "new_tokens"),
        case(g, "type", "new_tokens-bool", gen(new_tokens=True), TypeError, "new_tokens"),
        case(g, "type", "key-int", gen(key=0), TypeError, "key"),
        case(
            g, "rank", "key-batch", gen(key=jax.random.split(jax.random.key(0))), ValueError, "key"
        ),
        case(g, "type", "progress", gen(progress="yes"), TypeError, "progress"),
        case(p, "range", "no-prompts", pre(prompts=()), ValueError, "prompts"),
        case(p, "range", "token", pre(prompts=([99],)), ValueError, "prompts"),
        case(p, "shape", "capacity", pre(capacity=2, prompts=([1] * 5,)), ValueError, "capacity"),
        case(p, "type", "capacity", pre(capacity="8"), TypeError, "capacity"),
        case(p, "type", "progress", pre(progress=1), TypeError, "progress"),
        case(
            Gen.step,
            "type",
            "cache",
            lambda: generator().step("cache", np.zeros(1, np.int32)),
            TypeError,
            "cache",
        ),
        case(
            Gen.step,
            "range",
            "temperature",
            lambda: generator().step(CACHE, np.zeros(1, np.int32), temperature=-1.0),
            ValueError,
            "temperature",
        ),
        case(
            Gen.step,
            "type",
            "key",
            lambda: generator().step(CACHE, np.zeros(1, np.int32), key=0),
            TypeError,
            "key",
        ),
        case(
            Gen.teacher_force,
            "type",
            "cache",
            lambda: generator().teacher_force((1, 2), np.zeros((1, 1), np.int32)),
            TypeError,
            "cache",
        ),
        case(
            Gen.teacher_force,
            "rank",
            "tokens",
            lambda: generator().teacher_force(CACHE, np.zeros(1, np.int32)),
            ValueError,
            "tokens",
        ),
        case(
            Gen.teacher_force,
            "dtype",
            "tokens",
            lambda: generator().teacher_force(CACHE, np.zeros((1, 1), F32)),
            TypeError,
            "tokens",
        ),
        case(
            Gen.teacher_force,
            "shape",
            "tokens-batch",
            lambda: generator().teacher_force(CACHE, np.zeros((2, 1), np.int32)),
            ValueError,
            "tokens",
        ),
        case(Gen, "type", "params", new(params=[1]), TypeError, "params"),
        case(
            Gen,
            "shape",
            "params-of-another-config",
            new(
                cfg=model.Config(
                    vocab=32, dim=8, layers=1, q_heads=2, kv_heads=1, head_dim=4, hidden=8
                )
            ),
            ValueError,
            "params",
        ),
        case(Gen, "range", "params-missing", new(params={}), ValueError, "params"),
        case(Gen, "type", "cfg", new(cfg={}), TypeError, "cfg"),
        case(Gen, "type", "mesh", new(mesh=None), TypeError, "mesh"),
        case(Gen, "range", "method", new(method="star"), ValueError, "method"),
        case(
            Gen,
            "range",
            "prefill_method",
            new(prefill_method="flash"),
            ValueError,
            "prefill_method",
        ),
        case(Gen, "range", "prefill_chunk", new(prefill_chunk=0), ValueError, "prefill_chunk"),
        case(
            Gen,
            "range",
            "prefill_method-single-for-a-sharded-cache",
            new(method="tree", prefill_method="single"),
            ValueError,
            "prefill_method",
        ),
        case(Gen.step, "type", "tokens", lambda: generator().step(CACHE, [1]), TypeError, "tokens"),
        case(
            Gen.step,
            "rank",
            "tokens",
            lambda: generator().step(CACHE, np.zeros((1, 1), np.int32)),
            ValueError,
            "tokens",
        ),
        case(
            Gen.step,
            "dtype",
            "tokens",
            lambda: generator().step(CACHE, np.zeros(1, F32)),
            TypeError,
            "tokens",
        ),
        case(
            Gen.step,
            "shape",
            "tokens-batch",
            lambda: generator().step(CACHE, np.zeros(2, np.int32)),
            ValueError,
            "tokens",
        ),
        case(Gen, "type", "prefill_chunk", new(prefill_chunk=2.5), TypeError, "prefill_chunk"),
        # the model's parts
        case(pk, "type", "params-list", lambda: pk([1], CFG), TypeError, "params"),
        case(
            pk,
            "range",
            "params-already-packed",
            lambda: pk(pk(params(), CFG), CFG),
            ValueError,
            "params",
        ),
        case(pk, "type", "cfg", lambda: pk(params(), "tiny"), TypeError, "cfg"),
        case(ap, "type", "cache", lambda: ap((kv, kv), [(one, one)], mesh()), TypeError, "cache"),
        case(ap, "type", "new", lambda: ap(CACHE, one, mesh()), TypeError, "new"),
        case(
            ap,
            "shape",
            "new-layers",
            lambda: ap(CACHE, [(one, one)] * 2, mesh()),
            ValueError,
            "new",
        ),
        case(
            ap,
            "shape",
            "new-head_dim",
            lambda: ap(CACHE, [(one[..., :2], one)], mesh()),
            ValueError,
            "k",
        ),
        case(ap, "type", "mesh", lambda: ap(CACHE, [(one, one)], None), TypeError, "mesh"),
        case(C, "range", "vocab", lambda: C(vocab=0), ValueError, "vocab"),
        case(C, "type", "dim", lambda: C(dim=2.5), TypeError, "dim"),
        case(C, "shape", "heads", lambda: C(q_heads=3, kv_heads=2), ValueError, "q_heads"),
        case(C, "shape", "head_dim-odd", lambda: C(head_dim=5), ValueError, "head_dim"),
        case(C, "range", "rope_theta", lambda: C(rope_theta=0.0), ValueError, "rope_theta"),
        case(
            C,
            "range",
            "rope_theta-at-most-1",
            lambda: C(rope_theta=1e-300),
            ValueError,
            "rope_theta",
        ),
        case(
            C, "range", "init_scale-overflows", lambda: C(init_scale=1e30), ValueError, "init_scale"
        ),
        case(
            Gen,
            "dtype",
            "params-int",
            lambda: Gen(jax.tree.map(lambda x: x.astype(np.int32), params()), CFG, mesh()),
            TypeError,
            "params",
        ),
        case(C, "range", "norm_eps", lambda: C(norm_eps=-1.0), ValueError, "norm_eps"),
        case(
            C, "range", "init_scale", lambda: C(init_scale=float("nan")), ValueError, "init_scale"
        ),
        case(
            C, "type", "tie_embeddings", lambda: C(tie_embeddings="no"), TypeError, "tie_embeddings"
        ),
        case(ip, "type", "cfg", lambda: ip({}, key()), TypeError, "cfg"),
        case(ip, "type", "key", lambda: ip(CFG, 0), TypeError, "key"),
        case(ip, "shape", "key-batch", lambda: ip(CFG, jax.random.split(key())), ValueError, "key"),
        case(rn, "rank", "x", lambda: rn(np.float32(1.0), np.ones(1, F32), 1e-5), ValueError, "x"),
        case(
            rn,
            "dtype",
            "x",
            lambda: rn(np.ones((2, 4), np.int32), np.ones(4, F32), 1e-5),
            TypeError,
            "x",
        ),
        case(
            rn,
            "shape",
            "gain",
            lambda: rn(np.ones((2, 4), F32), np.ones(3, F32), 1e-5),
            ValueError,
            "gain",
        ),
        case(
            rn,
            "range",
            "eps",
            lambda: rn(np.ones((2, 4), F32), np.ones(4, F32), -1.0),
            ValueError,
            "eps",
        ),
        case(rn, "type", "x", lambda: rn([[1.0]], np.ones(1, F32), 1e-5), TypeError, "x"),
        case(ro, "rank", "x", lambda: ro(x4[0], pos, 1e4), ValueError, "x"),
        case(ro, "dtype", "x", lambda: ro(x4.astype(np.int32), pos, 1e4), TypeError, "x"),
        case(ro, "shape", "positions", lambda: ro(x4, pos[:, :1], 1e4), ValueError, "positions"),
        case(ro, "shape", "x-odd-head_dim", lambda: ro(x4[..., :3], pos, 1e4), ValueError, "x"),
        case(
            ro, "dtype", "positions", lambda: ro(x4, pos.astype(F32), 1e4), TypeError, "positions"
        ),
        case(ro, "range", "theta", lambda: ro(x4, pos, 0.0), ValueError, "theta"),
        case(ro, "type", "theta", lambda: ro(x4, pos, "1e4"), TypeError, "theta"),
        case(cs, "type", "mesh", lambda: cs("x"), TypeError, "mesh"),
        case(ec, "range", "batch", lambda: ec(CFG, 0, 8, mesh()), ValueError, "batch"),
        case(ec, "range", "capacity", lambda: ec(CFG, 1, 0, mesh()), ValueError, "capacity"),
        case(ec, "type", "capacity", lambda: ec(CFG, 1, 8.5, mesh()), TypeError, "capacity"),
        case(ec, "type", "cfg", lambda: ec("tiny", 1, 8, mesh()), TypeError, "cfg"),
        case(ec, "type", "mesh", lambda: ec(CFG, 1, 8, None), TypeError, "mesh"),
        case(wr, "rank", "cache_k", write(cache_k=kv[0]), ValueError, "cache_k"),
        case(wr, "dtype", "cache_k", write(cache_k=kv.astype(np.int32)), TypeError, "cache_k"),
        case(wr, "shape", "cache_v", write(cache_v=kv[..., :2]), ValueError, "cache_v"),
        case(wr, "shape", "k-heads", write(k=np.zeros((1, 2, 1, 4), F32)), ValueError, "k"),
        case(wr, "shape", "v", write(v=np.zeros((1, 1, 2, 4), F32)), ValueError, "v"),
        case(wr, "shape", "start", write(start=np.zeros(2, np.int32)), ValueError, "start"),
        case(wr, "dtype", "start", write(start=np.zeros(1, F32)), TypeError, "start"),
        case(wr, "type", "mesh", write(mesh="x"), TypeError, "mesh"),
        case(fw, "rank", "tokens", fwd(tokens=np.zeros(1, np.int32)), ValueError, "tokens"),
        case(fw, "dtype", "tokens", fwd(tokens=np.zeros((1, 1), F32)), TypeError, "tokens"),
        case(
            fw,
            "shape",
            "tokens-batch",
            fwd(tokens=np.zeros((2, 1), np.int32)),
            ValueError,
            "tokens",
        ),
        case(fw, "type", "attend", fwd(attend=5), TypeError, "attend"),
        case(fw, "type", "cache", fwd(cache=(1, 2)), TypeError, "cache"),
        case(fw, "type", "params", fwd(params=[1]), TypeError, "params"),
        case(
            sa,
            "range",
            "temperature",
            lambda: sa(np.zeros((1, 4), F32), key(), -1.0),
            ValueError,
            "temperature",
        ),
        case(
            sa,
            "type",
            "temperature",
            lambda: sa(np.zeros((1, 4), F32), key(), "1"),
            TypeError,
            "temperature",
        ),
        case(sa, "rank", "logits", lambda: sa(np.zeros(4, F32), key(), 0.0), ValueError, "logits"),
        case(
            sa,
            "dtype",
            "logits",
            lambda: sa(np.zeros((1, 4), np.int32), key(), 0.0),
            TypeError,
            "logits",
        ),
        case(sa, "type", "key", lambda: sa(np.zeros((1, 4), F32), 0, 1.0), TypeError, "key"),
        case(
            sa,
            "shape",
            "key-batch",
            lambda: sa(np.zeros((1, 4), F32), jax.random.split(key()), 1.0),
            ValueError,
            "key",
        ),
    ]


# --- the cost model ----------------------------------------------------------------------------

LINK = costmodel.Link(1e-6, 1e9)
TOPO = costmodel.Topology(2, 4, LINK, LINK, mem_Bps=1e12, flops=1e15)
LOCAL_DECODE = dict(
    batch=1, kv_len=64, kv_heads=2, head_dim=4, v_dim=4, q_heads=4, topo=TOPO, itemsize=2, q_len=1
)
"""Valid arguments of one device's local decode (`local_decode_time`, `fold_time`)."""
SHAPE = costmodel.ModelShape(2, 16, 4, 2, 4, 32, 64)

COST_CALLS = (
    (costmodel.reduction_steps, dict(n=16, p=4, branching=2)),
    (costmodel.tree_depth, dict(p=4, branching=2)),
    (costmodel.butterfly_rounds, dict(p=6)),
    (
        costmodel.tree_payload_bytes,
        dict(batch=1, q_len=1, q_heads=2, v_dim=4, itemsize=4, levels=1),
    ),
    (
        costmodel.ring_payload_bytes,
        dict(batch=1, kv_len=64, kv_heads=2, head_dim=4, v_dim=4, p=4, itemsize=4),
    ),
    (costmodel.paper_volume_tree, dict(b=1, n_h=2, d_h=4, p=4)),
    (costmodel.paper_volume_ring, dict(b=1, t=8, n_h=2, d_h=4, p=4)),
    (costmodel.paper_memory_tree, dict(b=1, t=8, n_h=2, d_h=4)),
    (costmodel.paper_memory_ring, dict(b=1, t=8, n_h=2, d_h=4)),
    (costmodel.peak_memory_tree, dict(batch=1, t=8, n_h=2, d_h=4, itemsize=2)),
    (costmodel.peak_memory_ring, dict(batch=1, t=8, n_h=2, d_h=4, itemsize=2)),
    (costmodel.Link, dict(alpha_s=1e-6, beta_Bps=1e9, call_s=1e-6)),
    (costmodel.Link.send, dict(self=LINK, nbytes=1e3)),
    (
        costmodel.Topology,
        dict(
            nodes=2,
            devices_per_node=4,
            intra=LINK,
            inter=LINK,
            mem_Bps=1e12,
            flops=1e15,
            overhead_s=0.0,
            overlap=True,
            ring_only=True,
            flat_ring=LINK,
        ),
    ),
    (costmodel.Topology.with_devices, dict(self=TOPO, p=4)),
    (costmodel.ring_allreduce_time, dict(nbytes=1e3, p=4, link=LINK)),
    (costmodel.gloo_segments, dict(nbytes=1e3, p=4, itemsize=4)),
    (costmodel.gloo_ring_time, dict(nbytes=1e3, p=4, link=LINK)),
    (costmodel.tree_allreduce_time, dict(nbytes=1e3, p=4, link=LINK)),
    (costmodel.allreduce_time, dict(nbytes=1e3, p=4, link=LINK)),
    (costmodel.hierarchical_allreduce_time, dict(nbytes=1e3, topo=TOPO)),
    (costmodel.slowest_link, dict(topo=TOPO)),
    (costmodel.ring_step_link, dict(topo=TOPO)),
    (costmodel.butterfly_time, dict(nbytes=1e3, topo=TOPO)),
    (costmodel.local_decode_time, LOCAL_DECODE),
    (costmodel.read_curve, dict(points=((1.0, 1e-4), (2.0, 2e-4)), nbytes=1.5, rate_after=1e9)),
    (costmodel.fold_time, {**LOCAL_DECODE, "resident": True}),
    (
        costmodel.predict_tree,
        dict(
            seq_len=1024,
            topo=TOPO,
            batch=1,
            q_heads=4,
            kv_heads=2,
            head_dim=8,
            itemsize=2,
            q_len=1,
            stat_itemsize=4,
        ),
    ),
    (
        costmodel.predict_ring,
        dict(
            seq_len=1024,
            topo=TOPO,
            batch=1,
            q_heads=4,
            kv_heads=2,
            head_dim=8,
            itemsize=2,
            q_len=1,
            overlap=True,
        ),
    ),
    (
        costmodel.kv_read_bytes,
        dict(batch=1, kv_len=64, kv_heads=2, head_dim=4, v_dim=4, itemsize=2),
    ),
    (costmodel.decode_flops, dict(batch=1, kv_len=64, q_heads=4, head_dim=4, v_dim=4, q_len=1)),
    (costmodel.decode_intensity, dict(group=4, itemsize=2, q_len=1)),
    (costmodel.paper_microbenchmark, dict(seq_len=1024, p=4, topo=TOPO)),
    (
        costmodel.ModelShape,
        dict(
            layers=2,
            dim=16,
            q_heads=4,
            kv_heads=2,
            head_dim=4,
            hidden=32,
            vocab=64,
            tie_embeddings=False,
            itemsize=2,
        ),
    ),
    (costmodel.generation_time, dict(seq_len=1024, topo=TOPO, model=SHAPE, tokens=2)),
    # merge patterns; `pattern`, `kind`, `ps`, ... have their own cases below
    (costmodel.padded_heads, dict(q_heads=4, p=8)),
    (costmodel.pass_q_heads, dict(q_heads=4, kv_heads=2, p=8)),
    (
        costmodel.ring_collectives,
        dict(batch=1, kv_len=64, kv_heads=2, head_dim=4, v_dim=4, p=4, itemsize=4),
    ),
    (
        costmodel.pass_q_collectives,
        dict(
            batch=1,
            q_len=1,
            q_heads=4,
            kv_heads=2,
            head_dim=4,
            v_dim=4,
            p=4,
            itemsize=2,
            stat_itemsize=4,
        ),
    ),
    (
        costmodel.pass_q_crossover,
        dict(
            kv_len=1024,
            batch=1,
            q_heads=4,
            kv_heads=2,
            head_dim=8,
            v_dim=8,
            p=4,
            itemsize=2,
            stat_itemsize=4,
        ),
    ),
    (costmodel.allgather_time, dict(nbytes=1e3, p=4, link=LINK)),
    (costmodel.reduce_scatter_time, dict(nbytes=1e3, p=4, link=LINK)),
    (costmodel.all_to_all_time, dict(nbytes=1e3, p=4, link=LINK)),
    (
        costmodel.predict_pass_q_ring,
        dict(
            seq_len=1024,
            topo=TOPO,
            batch=1,
            q_heads=4,
            kv_heads=2,
            head_dim=8,
            v_dim=8,
            itemsize=2,
            q_len=1,
            stat_itemsize=4,
            overlap=True,
        ),
    ),
    (
        costmodel.predict_all,
        dict(
            seq_len=1024,
            topo=TOPO,
            batch=1,
            q_heads=4,
            kv_heads=2,
            head_dim=8,
            v_dim=8,
            itemsize=2,
            q_len=1,
            stat_itemsize=4,
        ),
    ),
    (
        costmodel.best_merge,
        dict(
            seq_len=1024,
            topo=TOPO,
            batch=1,
            q_heads=4,
            kv_heads=2,
            head_dim=8,
            v_dim=8,
            itemsize=2,
            q_len=1,
            stat_itemsize=4,
        ),
    ),
)


def _bad_values(name, good) -> list[tuple[str, object, type[Exception]]]:
    """(kind, value, exception) for one argument, from the type of its good value."""
    if isinstance(good, bool):
        return [("type", "yes", TypeError)]
    if isinstance(good, int):
        low = 1 if name == "branching" else 0  # branching must be >= 2, sizes >= 1
        return [
            ("range", low, ValueError),
            ("range", -1, ValueError),
            ("range", 10**400, ValueError),  # beyond float range: the formulas divide
            ("type", 2.5, TypeError),
            ("type", str(good), TypeError),
        ]
    if isinstance(good, float):
        return [
            ("range", -1.0, ValueError),
            ("range", float("nan"), ValueError),
            ("type", str(good), TypeError),
        ]
    return [("type", "nvlink", TypeError)]  # a Link or a Topology


def costmodel_family() -> list[Case]:
    cases = []
    for fn, good in COST_CALLS:
        for name, value in good.items():
            if name == "self":
                continue
            for kind, bad, exc in _bad_values(name, value):
                kw = good | {name: bad}
                shown = "10**400" if bad == 10**400 else repr(bad)
                cases.append(
                    case(fn, kind, f"{name}={shown}", lambda fn=fn, kw=kw: fn(**kw), exc, name)
                )
    wb, sb = costmodel.wire_bytes, costmodel.sent_bytes
    cases += [
        case(wb, "range", "kind", lambda: wb("nvlink", 1e3, 4), ValueError, "kind"),
        case(wb, "type", "kind", lambda: wb(3, 1e3, 4), TypeError, "kind"),
        case(wb, "range", "nbytes", lambda: wb("all-reduce", -1.0, 4), ValueError, "nbytes"),
        case(wb, "range", "p", lambda: wb("all-reduce", 1e3, 0), ValueError, "p"),
        case(sb, "type", "collectives", lambda: sb("x", 4), TypeError, "collectives"),
        case(
            sb,
            "shape",
            "collectives-4",
            lambda: sb([("all-reduce", 10, 1, 3)], 4),
            TypeError,
            "collectives[0]",
        ),
        case(sb, "range", "kind", lambda: sb([("nv", 10, 1)], 4), ValueError, "collectives[0][0]"),
        case(sb, "range", "p", lambda: sb([("all-reduce", 10, 1)], 0), ValueError, "p"),
    ]
    for fn, good in COST_CALLS:
        if {"q_heads", "kv_heads"} <= set(good):
            kw = good | dict(q_heads=4, kv_heads=3)
            cases.append(
                case(
                    fn,
                    "shape",
                    "heads",
                    lambda fn=fn, kw=kw: fn(**kw),
                    ValueError,
                    "q_heads",
                    "kv_heads",
                )
            )
    wd = costmodel.Topology.with_devices
    cases.append(
        case(wd, "shape", "not-whole-nodes", lambda: TOPO.with_devices(6), ValueError, "p")
    )
    return cases + merge_pattern_cases()


def merge_pattern_cases() -> list[Case]:
    """The merge-pattern model's arguments that are names, lists or pairs."""
    mc, mr, pm = costmodel.merge_collectives, costmodel.merge_read_bytes, costmodel.predict_merge
    ct, cts, cm_ = costmodel.collective_time, costmodel.collectives_time, costmodel.crossover_map
    cb, bm = costmodel.collective_bytes, costmodel.best_merge
    shape = dict(batch=1, q_len=1, q_heads=4, v_dim=8, p=4)
    out = []
    for fn in (mc, mr):
        out += [
            case(
                fn,
                "range",
                "pattern-ring",
                lambda fn=fn: fn("ring", **shape),
                ValueError,
                "pattern",
            ),
            case(fn, "type", "pattern-int", lambda fn=fn: fn(3, **shape), TypeError, "pattern"),
            case(
                fn,
                "range",
                "p-0",
                lambda fn=fn: fn("allgather", **shape | dict(p=0)),
                ValueError,
                "p",
            ),
            case(
                fn,
                "type",
                "v_dim-float",
                lambda fn=fn: fn("allgather", **shape | dict(v_dim=2.5)),
                TypeError,
                "v_dim",
            ),
        ]
    out += [
        case(
            mc,
            "type",
            "fallback-int",
            lambda: mc("one_pass", **shape, fallback=1),
            TypeError,
            "fallback",
        ),
        case(pm, "range", "pattern-psum", lambda: pm("psum", 1024, TOPO), ValueError, "pattern"),
        case(pm, "type", "pattern-none", lambda: pm(None, 1024, TOPO), TypeError, "pattern"),
        case(pm, "type", "topo-link", lambda: pm("allreduce", 1024, LINK), TypeError, "topo"),
        case(pm, "range", "seq_len-0", lambda: pm("allreduce", 0, TOPO), ValueError, "seq_len"),
        case(
            pm,
            "shape",
            "heads",
            lambda: pm("allreduce", 1024, TOPO, q_heads=4, kv_heads=3),
            ValueError,
            "q_heads",
        ),
        case(
            pm,
            "range",
            "v_dim-0",
            lambda: pm("allreduce", 1024, TOPO, v_dim=0),
            ValueError,
            "v_dim",
        ),
        case(ct, "range", "kind-broadcast", lambda: ct("broadcast", 8, TOPO), ValueError, "kind"),
        case(
            ct, "range", "nbytes-negative", lambda: ct("all-gather", -1, TOPO), ValueError, "nbytes"
        ),
        case(ct, "type", "topo-str", lambda: ct("all-gather", 8, "nvlink"), TypeError, "topo"),
        case(
            cts, "range", "kind", lambda: cts([("gather", 8, 1)], TOPO), ValueError, "collectives"
        ),
        case(cts, "type", "topo", lambda: cts([("all-gather", 8, 1)], None), TypeError, "topo"),
        case(cb, "type", "collectives", lambda: cb(5), TypeError, "collectives"),
        case(
            bm,
            "range",
            "patterns-unknown",
            lambda: bm(1024, TOPO, patterns=("psum",)),
            ValueError,
            "patterns",
        ),
        case(
            bm,
            "range",
            "patterns-empty",
            lambda: bm(1024, TOPO, patterns=()),
            ValueError,
            "patterns",
        ),
        case(cm_, "type", "topo", lambda: cm_("dgx"), TypeError, "topo"),
        case(cm_, "range", "ps-0", lambda: cm_(ps=(0,)), ValueError, "ps"),
        case(cm_, "type", "ps-str", lambda: cm_(ps="8"), TypeError, "ps"),
        case(
            cm_,
            "shape",
            "batch_heads-not-multiple",
            lambda: cm_(batch_heads=(24,)),
            ValueError,
            "batch_heads",
        ),
        case(cm_, "range", "patterns", lambda: cm_(patterns=("ring",)), ValueError, "patterns"),
        case(
            costmodel.Topology,
            "type",
            "measured",
            lambda: costmodel.Topology(1, 4, LINK, LINK, 1e12, 1e15, measured=[]),
            TypeError,
            "measured",
        ),
        case(
            costmodel.Topology,
            "range",
            "measured-kind",
            lambda: costmodel.Topology(
                1, 4, LINK, LINK, 1e12, 1e15, measured=(("broadcast", LINK),)
            ),
            ValueError,
            "measured",
        ),
    ]
    return out


CASES = (
    attention_family()
    + states_family()
    + devices_family()
    + kernels_family()
    + decode_family()
    + introspect_family()
    + hopfield_family()
    + model_family()
    + costmodel_family()
)
CASES = CASES + bayes_family()


def checkpoint_family() -> list[Case]:
    """Hugging Face checkpoints: paths, dtypes, configs; nothing is read or written
    (a path that does not exist, or a check that fails before the folder is touched)."""
    ic, lc, lt, sc = (
        checkpoint.inspect_checkpoint,
        checkpoint.load_checkpoint,
        checkpoint.load_tokenizer,
        checkpoint.save_checkpoint,
    )
    cf, ct, rs = checkpoint.config_from_hf, checkpoint.config_to_hf, model.RopeScaling
    nowhere = "/nonexistent/checkpoint"
    other = model.Config(vocab=32, dim=8, layers=1, q_heads=2, kv_heads=1, head_dim=4, hidden=8)
    x4, pos = np.zeros((1, 2, 1, 4), F32), np.zeros((1, 2), np.int32)
    return [
        case(ic, "type", "path-int", lambda: ic(42), TypeError, "path"),
        case(ic, "range", "path-missing", lambda: ic(nowhere), ValueError, "path"),
        case(lc, "type", "path-none", lambda: lc(None), TypeError, "path"),
        case(lc, "range", "path-missing", lambda: lc(nowhere), ValueError, "path"),
        case(lc, "dtype", "dtype-int", lambda: lc(nowhere, dtype=np.int8), TypeError, "dtype"),
        case(lc, "type", "dtype-str", lambda: lc(nowhere, dtype="banana"), TypeError, "dtype"),
        case(lc, "type", "mesh", lambda: lc(nowhere, mesh="x"), TypeError, "mesh"),
        case(lt, "type", "path-float", lambda: lt(3.5), TypeError, "path"),
        case(lt, "range", "path-missing", lambda: lt(nowhere), ValueError, "path"),
        case(sc, "type", "path-int", lambda: sc(5, params(), CFG), TypeError, "path"),
        case(sc, "range", "path-a-file", lambda: sc(__file__, params(), CFG), ValueError, "path"),
        case(
            sc,
            "range",
            "path-unwritable",
            lambda: sc("/proc/checkpoint", params(), CFG),
            ValueError,
            "path",
        ),
        case(sc, "type", "cfg", lambda: sc(nowhere, params(), {}), TypeError, "cfg"),
        case(
            sc,
            "shape",
            "params-of-another-config",
            lambda: sc(nowhere, params(), other),
            ValueError,
            "params",
        ),
        case(
            sc,
            "dtype",
            "dtype-int",
            lambda: sc(nowhere, params(), CFG, dtype=np.int32),
            TypeError,
            "dtype",
        ),
        case(
            sc,
            "range",
            "max_shard_bytes-0",
            lambda: sc(nowhere, params(), CFG, max_shard_bytes=0),
            ValueError,
            "max_shard_bytes",
        ),
        case(
            sc,
            "type",
            "max_shard_bytes-float",
            lambda: sc(nowhere, params(), CFG, max_shard_bytes=1.5),
            TypeError,
            "max_shard_bytes",
        ),
        case(cf, "type", "config-list", lambda: cf([]), TypeError, "config"),
        case(cf, "range", "config-empty", lambda: cf({}), ValueError, "config.json"),
        case(
            cf,
            "shape",
            "heads",
            lambda: cf({"num_attention_heads": 4, "num_key_value_heads": 3, "hidden_size": 32}),
            ValueError,
            "config.json",
        ),
        case(cf, "type", "where", lambda: cf({}, 5), TypeError, "where"),
        case(ct, "type", "cfg", lambda: ct("tiny"), TypeError, "cfg"),
        case(rs, "range", "factor", lambda: rs(factor=0.5), ValueError, "factor"),
        case(
            rs,
            "range",
            "high_freq_factor",
            lambda: rs(high_freq_factor=0.5),
            ValueError,
            "high_freq_factor",
        ),
        case(
            rs,
            "type",
            "original_max_position_embeddings",
            lambda: rs(original_max_position_embeddings=1.5),
            TypeError,
            "original_max_position_embeddings",
        ),
        case(
            model.Config,
            "type",
            "rope_scaling",
            lambda: model.Config(rope_scaling=8.0),
            TypeError,
            "rope_scaling",
        ),
        case(
            model.rope,
            "type",
            "scaling",
            lambda: model.rope(x4, pos, 1e4, scaling=8.0),
            TypeError,
            "scaling",
        ),
    ]


CASES = CASES + checkpoint_family()


def perf_theory_family() -> list[Case]:
    """`theory.symbolic`, the Hopfield `beta`, the cost model's malformed lists and float
    range, `introspect`'s shape text and arguments, and the measuring tools (`benchmark`,
    `calibrate`): the cases of the hostile-input review."""
    import sympy

    from tree_attention_edu.perf import benchmark, calibrate
    from tree_attention_edu.theory import symbolic as sy

    en, st, rt = hf.hopfield_energy, hf.hopfield_step, hf.retrieve
    lu, cmc, s_mean = sy.lse_of_union, sy.combine_matches_chunks, sy.softmax_mean
    s2, v2, _ = sy.symbols(2, 1)
    cts, cb, am = costmodel.collectives_time, costmodel.collective_bytes, costmodel.auto_merge
    mp = merges.MergeProblem(1, 1, 16, 16, 128, 128, 1024, "float32", (8,))
    sb, ms, cs = introspect.shape_bytes, introspect.memory_stats, introspect.collective_stats
    prob = benchmark.Problem(seq_len=64, q_heads=2, kv_heads=2, head_dim=8)
    small = dict(q_heads=2, kv_heads=2, head_dim=8)
    bP, lr, fl, msz = (
        benchmark.Problem,
        calibrate.local_rates,
        calibrate.fit_link,
        calibrate.message_sizes,
    )
    mt, mts, mf = benchmark.median_time, benchmark.median_times, benchmark.method_fns
    return [
        # theory.symbolic: sizes are positive ints, sums are over at least one term
        case(lu, "range", "sizes-zero", lambda: lu((0, 2)), ValueError, "sizes"),
        case(lu, "range", "sizes-empty", lambda: lu(()), ValueError, "sizes"),
        case(lu, "type", "sizes-str", lambda: lu("23"), TypeError, "sizes"),
        case(sy.lse, "range", "xs-empty", lambda: sy.lse([]), ValueError, "xs"),
        case(sy.lse, "type", "xs-int", lambda: sy.lse(5), TypeError, "xs"),
        case(sy.symbols, "range", "n-negative", lambda: sy.symbols(-1, 2), ValueError, "n"),
        case(sy.symbols, "type", "d-str", lambda: sy.symbols(2, "1"), TypeError, "d"),
        case(
            sy.gradient_is_attention,
            "range",
            "n-0",
            lambda: sy.gradient_is_attention(0),
            ValueError,
            "n",
        ),
        case(
            sy.gradient_is_attention,
            "type",
            "n-float",
            lambda: sy.gradient_is_attention(2.5),
            TypeError,
            "n",
        ),
        case(cmc, "range", "sizes-zero", lambda: cmc((0, 0)), ValueError, "sizes"),
        case(cmc, "shape", "sizes-three", lambda: cmc((1, 2, 3)), ValueError, "sizes"),
        case(cmc, "type", "sizes-int", lambda: cmc(2), TypeError, "sizes"),
        case(
            sy.third_cumulant, "range", "n-negative", lambda: sy.third_cumulant(-1), ValueError, "n"
        ),
        case(sy.third_cumulant, "type", "n-float", lambda: sy.third_cumulant(1.5), TypeError, "n"),
        case(s_mean, "range", "j-out-of-range", lambda: s_mean(s2, v2, 5), ValueError, "j"),
        case(s_mean, "type", "j-float", lambda: s_mean(s2, v2, 0.5), TypeError, "j"),
        case(s_mean, "range", "s-empty", lambda: s_mean([], [], 0), ValueError, "s"),
        case(
            sy.energy_expr,
            "shape",
            "v-rows",
            lambda: sy.energy_expr(s2, v2[:1], [s2[0]]),
            ValueError,
            "v",
        ),
        case(
            sy.energy_expr,
            "type",
            "v-str",
            lambda: sy.energy_expr(s2, "v", [s2[0]]),
            TypeError,
            "v",
        ),
        # hopfield: a traced beta is refused under jit as a bad one is eagerly
        case(
            en,
            "type",
            "beta-traced-negative",
            lambda: jax.jit(lambda b: en(XI[0], MEM.keys, b))(-2.0),
            TypeError,
            "beta",
        ),
        case(
            en,
            "type",
            "beta-traced-zero",
            lambda: jax.jit(lambda b: en(XI[0], MEM.keys, b))(0.0),
            TypeError,
            "beta",
        ),
        case(
            st,
            "type",
            "beta-traced-negative",
            lambda: jax.jit(lambda b: st(XI[0], MEM.keys, b))(-1.0),
            TypeError,
            "beta",
        ),
        case(rt, "range", "beta-overflows-float32", lambda: rt(XI, MEM, 1e39), ValueError, "beta"),
        case(
            en,
            "range",
            "beta-overflows-float32",
            lambda: en(XI[0], MEM.keys, 1e39),
            ValueError,
            "beta",
        ),
        case(
            bayes.stationary_point,
            "range",
            "seed-2**70",
            lambda: bayes.stationary_point(Q, K, V, seed=2**70),
            ValueError,
            "seed",
        ),
        # the cost model
        case(
            costmodel.paper_microbenchmark,
            "range",
            "p-more-than-seq_len",
            lambda: costmodel.paper_microbenchmark(1024, 10**6),
            ValueError,
            "p",
        ),
        case(
            costmodel.predict_ring,
            "range",
            "seq_len-fewer-than-devices",
            lambda: costmodel.predict_ring(4, TOPO),
            ValueError,
            "seq_len",
        ),
        case(
            costmodel.predict_tree,
            "type",
            "seq_len-sympy",
            lambda: costmodel.predict_tree(sympy.Symbol("n", positive=True, integer=True), TOPO),
            TypeError,
            "seq_len",
        ),
        case(
            cts,
            "shape",
            "entry-short",
            lambda: cts([("all-reduce",)], TOPO),
            TypeError,
            "collectives",
        ),
        case(cb, "shape", "entry-pair", lambda: cb([("all-reduce", 10)]), TypeError, "collectives"),
        case(
            cb,
            "range",
            "entry-negative",
            lambda: cb([("all-reduce", -10, 1)]),
            ValueError,
            "collectives",
        ),
        case(cb, "range", "entry-kind", lambda: cb([("psum", 10, 1)]), ValueError, "collectives"),
        case(
            costmodel.ring_allreduce_time,
            "range",
            "nbytes=10**400",
            lambda: costmodel.ring_allreduce_time(10**400, 8, LINK),
            ValueError,
            "nbytes",
        ),
        case(
            costmodel.Link,
            "range",
            "beta_Bps=10**400",
            lambda: costmodel.Link(1e-6, 10**400),
            ValueError,
            "beta_Bps",
        ),
        case(am, "type", "problem-str", lambda: am("problem"), TypeError, "problem"),
        case(
            am,
            "dtype",
            "problem-dtype",
            lambda: am(mp._replace(dtype="floaty")),
            TypeError,
            "problem",
        ),
        case(
            am,
            "range",
            "problem-axis_sizes",
            lambda: am(mp._replace(axis_sizes=())),
            ValueError,
            "problem",
        ),
        # introspect
        case(sb, "range", "shape_text-size", lambda: sb("f32[abc]"), ValueError, "shape_text"),
        case(sb, "range", "shape_text-type", lambda: sb("floaty[8]"), ValueError, "shape_text"),
        case(sb, "range", "shape_text-not-a-shape", lambda: sb("hello"), ValueError, "shape_text"),
        case(ms, "type", "args-str", lambda: ms(lambda a: a, "x"), TypeError, "args"),
        case(cs, "type", "args-nested-str", lambda: cs(lambda a: a, {"a": "x"}), TypeError, "args"),
        # benchmark and calibrate
        case(
            benchmark.device_read_gbs,
            "range",
            "nbytes-0",
            lambda: benchmark.device_read_gbs(0),
            ValueError,
            "nbytes",
        ),
        case(
            benchmark.device_read_gbs,
            "range",
            "nbytes-negative",
            lambda: benchmark.device_read_gbs(-1),
            ValueError,
            "nbytes",
        ),
        case(
            benchmark.device_read_gbs,
            "type",
            "nbytes-float",
            lambda: benchmark.device_read_gbs(1.5),
            TypeError,
            "nbytes",
        ),
        case(
            benchmark.DeviceReader,
            "type",
            "device-str",
            lambda: benchmark.DeviceReader(4096, device="cpu"),
            TypeError,
            "device",
        ),
        case(msz, "range", "points-0", lambda: msz([1024], 0), ValueError, "points"),
        case(msz, "range", "block_bytes-empty", lambda: msz([], 6), ValueError, "block_bytes"),
        case(msz, "type", "block_bytes-int", lambda: msz(1024), TypeError, "block_bytes"),
        case(lr, "range", "kernel_s-0", lambda: lr(prob, 8, 0.0, 1.0), ValueError, "kernel_s"),
        case(lr, "range", "devices-0", lambda: lr(prob, 0, 1.0, 1.0), ValueError, "devices"),
        case(lr, "type", "problem-str", lambda: lr("p", 8, 1.0, 1.0), TypeError, "problem"),
        case(
            fl,
            "range",
            "points-negative",
            lambda: fl([(1, -1e-6), (10**6, -1e-3)]),
            ValueError,
            "points",
        ),
        case(
            fl,
            "range",
            "points-nan",
            lambda: fl([(1, float("nan")), (10**6, float("nan"))]),
            ValueError,
            "points",
        ),
        case(
            fl,
            "range",
            "points-inf",
            lambda: fl([(1, float("inf")), (10**6, float("inf"))]),
            ValueError,
            "points",
        ),
        case(
            fl,
            "shape",
            "points-triples",
            lambda: fl([(1, 1e-6, 0), (10**6, 1e-3, 0)]),
            TypeError,
            "points",
        ),
        case(fl, "type", "points-int", lambda: fl(5), TypeError, "points"),
        case(mf, "type", "names-str", lambda: mf(mesh(), 64, "tree"), TypeError, "names"),
        case(mf, "range", "names-unknown", lambda: mf(mesh(), 64, ["tre"]), ValueError, "names"),
        case(mt, "range", "repeats-0", lambda: mt(lambda: 1, repeats=0), ValueError, "repeats"),
        case(mt, "type", "fn-int", lambda: mt(42), TypeError, "fn"),
        case(mts, "type", "calls-not-callable", lambda: mts({"a": (42, ())}), TypeError, "calls"),
        case(mts, "range", "calls-empty", lambda: mts({}), ValueError, "calls"),
        case(
            bP, "range", "seq_len-negative", lambda: bP(seq_len=-1, **small), ValueError, "seq_len"
        ),
        case(
            bP,
            "type",
            "head_dim-float",
            lambda: bP(seq_len=64, q_heads=2, kv_heads=2, head_dim=1.5),
            TypeError,
            "head_dim",
        ),
        case(bP, "range", "batch-0", lambda: bP(seq_len=64, batch=0, **small), ValueError, "batch"),
        case(bP, "dtype", "dtype-unknown", lambda: bP(dtype="floaty"), TypeError, "dtype"),
        case(bP, "shape", "heads", lambda: bP(q_heads=2, kv_heads=3), ValueError, "q_heads"),
        case(
            benchmark.make_inputs,
            "range",
            "seed-2**70",
            lambda: benchmark.make_inputs(prob, 2**70),
            ValueError,
            "seed",
        ),
        case(
            benchmark.make_inputs,
            "type",
            "problem-dict",
            lambda: benchmark.make_inputs({}),
            TypeError,
            "problem",
        ),
        case(
            benchmark.run,
            "type",
            "methods-str",
            lambda: benchmark.run(mesh(), prob, methods="tree"),
            TypeError,
            "methods",
        ),
    ]


CASES = CASES + perf_theory_family()


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input_names_the_argument(c: Case):
    names = "|".join(re.escape(n) for n in c.names)
    with pytest.raises(c.exc, match=rf"`(?:{names})(?:`|\[|\.)"):
        c.call()


@pytest.mark.parametrize(
    "fn",
    [tae.attention, kernels.xla_state, tae.tree_decode, tae.ring_decode_pass_q],
    ids=lambda f: f.__name__,
)
def test_values_without_value_dims_are_refused_naming_v(fn):
    """`v [B, Tk, Hkv, 0]`: one message, naming `v` and its last axis, on every path (the
    decoders used to name `v_dim`, the internal name `kernels.resolve` checks)."""
    kw = dict(mesh=mesh()) if fn in (tae.tree_decode, tae.ring_decode_pass_q) else {}
    with pytest.raises(ValueError, match=r"^`v` has 0 value dims \(its last axis\)"):
        fn(Q, K, V[..., :0], **kw)


# --- the table is complete ---------------------------------------------------------------------

MODULES = (
    attention_module,
    states,
    merges,
    energy_module,
    bayes,
    devices,
    kernels,
    kernels.xla,
    kernels.cudnn,
    kernels.flash,
    kernels.common,
    decode,
    introspect,
    formulas,
    links,
    patterns,
    predict,
    paper,
    crossover,
    llama_config,
    llama_layers,
    llama_cache,
    llama_forward,
    llama_generator,
    hf_config,
    hf,
    checkpoint,
)

NOT_VALIDATED = {
    # The definition's pieces, only ever called on validated arrays.
    "reference": {"grouped_scores", "grouped_values", "scaled_scores"},
    "energy": {
        "energy_terms",  # unchecked by design: `energy` checks, then calls it
        "value_moments",
    },  # moments of weights the callers computed
    "states": {
        "AttentionState",  # a container; the functions that take one check it
        "from_parts",  # builds a state from a kernel's internal sums
        "lse_weight",
        "state_weight",
        "weighted_out",  # pieces of every merge
        "check_state",  # the check itself
        "combine_core",
        "identity_core",
    },  # the decoders' unchecked forms
    "merges": {
        "check_axes",
        "shared_max",
        "psum_inner_first",
        "global_lse",
        "pack",
        "unpack",
        "pad_heads",  # pieces of the merges, inside shard_map on validated states
        "MergeProblem",
        "resolve_merge",
        "default_policy",  # the auto policy's plumbing
        "allreduce_core",
        "allgather_core",
        "reduce_scatter_core",
        "all_to_all_core",
        "one_pass_core",
        "butterfly_core",
    },  # the decoders' unchecked forms
    "devices": {
        "mesh_devices",
        "axis_size",
        "shard_index",
        "ring_permutation",
        "varying_like",
        "resolve_mesh",
        "is_explicit",
        "check_seq_axes",
        "check_divisible",
    },  # helpers of make_mesh/decode, which check
    "kernels": {"check_name"},  # the check itself
    "flash": {
        "installed",
        "import_error",
        "version_reason",
        "available",
        "unsupported_reason",
        "layout_reason",
        "forward_only",  # helpers of resolve and flash_state
        "flash_core",
    },  # the decoders' unchecked form
    "cudnn": {
        "cuda_capability",
        "unsupported_reason",  # helpers of resolve
        "cudnn_core",
    },  # the decoders' unchecked form
    "common": {"default_backend", "swap_layout"},  # swap_layout: to_layout's unchecked form
    "xla": {"xla_core"},  # the decoders' unchecked form
    "decode": {
        "Plan",
        "kv_spec",
        "make_plan",  # the decoders' own planning, which checks
        "pass_q_blocks",
    },  # sizes of validated shapes
    "introspect": {"Collective", "CollectiveStats", "MemoryStats"},  # results, not inputs
    "predict": {"Prediction"},  # a result
    "paper": {"Microbenchmark"},  # a result
    "config": {"check_config", "check_params"},  # the checks themselves
    "layers": {"swiglu", "project_qkv"},  # blocks of forward, on the model's own activations
    "cache": {"KVCache", "check_mesh"},  # a container (its producers check); a check
    "forward": {
        "ShardStats",
        "attend_fn",
        "trunk",
        "read_only_step",  # trunk twice, which checks
        "forward_with_shard_stats",
        "unembed",
    },
    # ShardStats: a container; the rest: forward's pieces, on checked arrays
    "generator": {"Generation", "check_prompts"},  # a container; the check itself
    "hf_config": {"read_json", "not_hf_json"},  # the loaders' file reading and its error
    "hopfield": {"Memory"},  # a container; every function taking one checks it
    "checkpoint": {
        "TensorInfo",
        "CheckpointInfo",  # results, not inputs
        "aligned_empty",  # the loaders' allocation, of checked shapes
        "check_weight_dtype",
    },  # the check itself
}
"""Public names of the listed modules that have no cases, and why. `symbolic` (sympy, no
arrays), `plots` (figures from plain data) and the tools (`benchmark`, `calibrate`, `cli`,
`launch`) are not listed."""


def _public(obj, module: str) -> bool:
    return (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module


def test_table_covers_all_exports():
    covered = {c.target for c in CASES}
    functions = [n for n in tae.__all__ if inspect.isfunction(getattr(tae, n))]
    assert functions and [n for n in functions if getattr(tae, n) not in covered] == []


def test_table_covers_every_public_function():
    covered = {c.target for c in CASES}
    missing = []
    for mod in MODULES:
        short = mod.__name__.rsplit(".", 1)[-1]
        for name, obj in vars(mod).items():
            if name.startswith("_") or not _public(obj, mod.__name__):
                continue
            if name in NOT_VALIDATED.get(short, ()):
                assert obj not in covered, f"{short}.{name} has cases: drop it from NOT_VALIDATED"
                continue
            if obj not in covered:
                missing.append(f"{short}.{name}")
            if inspect.isclass(obj):  # and the public methods of a covered class
                missing += [
                    f"{short}.{name}.{m}"
                    for m, f in vars(obj).items()
                    if inspect.isfunction(f) and not m.startswith("_") and f not in covered
                ]
    assert missing == [], f"public functions without bad-input cases: {missing}"


FEWER_KINDS = {
    "common.to_layout": "moves any one array between layouts: no dtype, nothing to match",
    # Values are never inspected (that would differ under `jax.jit`): these functions have
    # no range to check, only shapes and dtypes.
    "states.combine": "an lse's value is data (a +inf lse gives NaN, as the sums do)",
    "hopfield.retrieved": "indices are clamped by JAX's indexing, eagerly and under jit",
    "forward.forward": "token ids are clamped by JAX's indexing; Generator checks prompts",
    "cache.write": "positions outside the cache are dropped",
    "generator.Generator.teacher_force": "token ids are not inspected, as in forward",
}


def test_array_functions_cover_every_kind():
    """Every function has a wrong-type case; one taking arrays (it has a rank case) has
    cases of each kind: rank, dtype, shape, range, type."""
    kinds: dict = {}
    for c in CASES:
        kinds.setdefault(_name(c.target), set()).add(c.kind)
    assert [t for t, k in kinds.items() if "type" not in k] == []
    partial = {
        t: sorted(set(KINDS) - k)
        for t, k in kinds.items()
        if "rank" in k and set(KINDS) - k and t not in FEWER_KINDS
    }
    assert partial == {}


def test_case_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
