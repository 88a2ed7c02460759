"""`make unit` compiles most tests cheaply (LLVM at -O0, XLA:CPU's elemental emitters) and
the tests marked `codegen` with XLA's defaults (tests/conftest.py says why). These tests
keep that split honest: the cheap compilation computes the same program, and every test
that compares floating-point results bit for bit is marked, or named here with the reason
its bits cannot depend on the machine code."""

from __future__ import annotations

import ast
import hashlib
import re
from collections import Counter
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tree_attention_edu as tae

TESTS = Path(__file__).resolve().parent
BITS = re.compile(
    r"assert_array_equal|array_equal\(|assert_equal\(|\.view\(np\.u?int|bit for bit|same bits"
    r"|float\([^\n]*\)\s*==\s*float\(|rtol=2\*\*-"
    # a tolerance of a few units in the last place: as close to bits as a tolerance gets
    r"|(?<![\w.)])\d{1,2}\s*\*\s*(?:float\()?\s*j?np\.finfo\([^)]*\)\.eps"
)

# Tests that compare arrays exactly, but whose bits no choice of LLVM's can change: integers,
# tokens, masks, selected or moved values, numpy on both sides, or one program on two inputs.
EXACT_WITHOUT_ROUNDING = {
    "test_attention.py::test_zero_length_sequence_gives_zeros_and_no_nan": "a selected 0",
    "test_bayes.py::test_sample_means_draw_only_visible_keys_with_posterior_frequencies": (
        "a selected 0"
    ),
    "test_bayes.py::test_hard_attention_is_the_value_of_the_map_memory": "a gathered value",
    "test_bayes.py::test_attention_converges_to_hard_attention_as_beta_grows": ("gathered values"),
    "test_bayes.py::test_posterior_is_normalised_and_its_mean_is_attention": "a selected 0",
    "test_checkpoint.py::test_every_method_gives_the_same_tokens": "tokens",
    "test_checkpoint.py::test_save_writes_the_hugging_face_layout": "weights moved, not computed",
    "test_gguf.py::test_unpermute_recovers_the_hugging_face_rows": "a permutation, in numpy",
    "test_kernels.py::test_xla_state_matches_reference": "the mask of empty rows",
    "test_kernels.py::test_finite_padding_matches_the_reference": "the mask of empty rows",
    # Tokens of different methods: their logits round differently at every level; what is
    # compared is an argmax, far from a tie, not bits.
    "test_model.py::test_identical_tokens_across_methods": "tokens",
    "test_model.py::test_generators_of_one_model_share_their_programs": "tokens",
    "test_model.py::test_sampling_is_reproducible": "tokens",
    "test_model.py::test_cache_writes_at_shard_boundaries": "values written, not computed",
    "test_model.py::test_read_then_append_is_the_write_then_attend_step": "lengths",
    "test_model.py::test_packed_projections_compute_the_same_model": "weights moved",
    # One program on two inputs: masked values are selected away, whatever the code rounds.
    "test_reliability.py::test_garbage_beyond_lengths_never_reaches_the_output": "one program",
    "test_reliability.py::test_garbage_beyond_lengths_keeps_the_energy_and_its_gradients_finite": (
        "one program"
    ),
    "test_reliability.py::test_garbage_in_the_models_cache_is_never_read": "one program",
    # A bound 16 times the bracketing's own error, (1 + L)·eps·max|out|, on both sides of
    # one comparison compiled alike: an FMA moves either side by an ulp, far inside it.
    "test_states.py::test_combine_associative": "a bound, not bits",
    # One device's merged lse is its shard's: log(e^0) is exactly 0 in any code.
    "test_shard_stats.py::test_lse_profile_is_the_same_on_eight_devices_and_on_one": "exact",
}


def _marked(fn: ast.FunctionDef) -> bool:
    return any(ast.unparse(d) == "pytest.mark.codegen" for d in fn.decorator_list)


def unmarked_bit_comparisons(name: str, source: str) -> list[str]:
    """The tests of one test file (`name`, its `source`) that compare bits, are not marked
    `codegen` and are not in `EXACT_WITHOUT_ROUNDING`."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            test = f"{name}::{node.name}"
            if BITS.search(ast.get_source_segment(source, node) or ""):
                if not _marked(node) and test not in EXACT_WITHOUT_ROUNDING:
                    found.append(test)
    return found


def test_every_bit_comparison_runs_as_users_compile():
    missing = []
    for path in sorted(TESTS.glob("test_*.py")):
        if path.name != Path(__file__).name:  # its own rule test holds an example
            missing += unmarked_bit_comparisons(path.name, path.read_text())
    assert missing == [], "mark these @pytest.mark.codegen (tests/conftest.py says why)"


def test_the_list_of_exact_tests_names_real_tests():
    names = set()
    for path in TESTS.glob("test_*.py"):
        names |= {
            f"{path.name}::{n.name}"
            for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.FunctionDef)
        }
    assert set(EXACT_WITHOUT_ROUNDING) - names == set()


def test_the_mark_rule_can_fail():
    source = (
        "def test_a(x):\n    np.testing.assert_array_equal(f(x), g(x))\n\n"
        "@pytest.mark.codegen\ndef test_b(x):\n    assert (x.view(np.uint32) == 1).all()\n\n"
        "def test_c(x):\n    np.testing.assert_allclose(f(x), g(x))\n\n"
        "def test_d(x):\n    assert float(f(x)) == float(g(x))\n\n"
        "def test_e(x):\n    assert_allclose(f(x), g(x), rtol=4 * float(np.finfo(d).eps))\n\n"
        "def test_f(x):\n    assert_allclose(f(x), g(x), atol=(p + 4) * np.finfo(d).eps * c)\n"
    )
    assert unmarked_bit_comparisons("t.py", source) == [
        "t.py::test_a",
        "t.py::test_d",
        "t.py::test_e",
    ]


def test_codegen_tests_refuse_to_run_at_low_optimisation(monkeypatch):
    """Selected under -O0, a `codegen` test fails, naming the fix; others run."""
    marked = SimpleNamespace(get_closest_marker=lambda m: m == "codegen")
    plain = SimpleNamespace(get_closest_marker=lambda m: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    with pytest.raises(pytest.fail.Exception, match="-m 'not codegen'"):
        conftest.pytest_runtest_setup(marked)
    conftest.pytest_runtest_setup(plain)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")
    with pytest.raises(pytest.fail.Exception, match="-m 'not codegen'"):
        conftest.pytest_runtest_setup(marked)
    monkeypatch.setenv("XLA_FLAGS", "")
    conftest.pytest_runtest_setup(marked)


_HEAD = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$")
_INS = re.compile(r"^(?:ROOT )?%([\w.\-]+) = (.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
_META = re.compile(r", metadata=\{[^}]*\}")


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def program_instructions(hlo: str) -> Counter:
    """What a compiled program (`Compiled.as_text()`) computes, blind to names, metadata and
    the order its instructions are printed in: every instruction of every computation, its
    operands and called computations replaced by digests of what they compute (a Merkle
    hash of the dataflow graph; two programs agree only where every instruction has the same
    shape, layout, attributes and operands, in order). The fusion emitters need an op that
    fuses with nothing wrapped in a one-op loop fusion (`%wrapped_reduce_computation`); the
    elemental emitters take the op as it is: each wrapper counts as the op it wraps."""
    blocks: dict[str, list[str]] = {}
    order: list[str] = []
    name = None
    for line in hlo.splitlines():
        head = _HEAD.match(line)
        if head:
            name = head.group(1)
            blocks[name] = []
            order.append(name)
        elif line == "}":
            name = None
        elif name is not None and line.strip():
            blocks[name].append(line.strip())
    computations: dict[str, str] = {}  # name -> digest of its instructions
    wrapped: dict[str, str] = {}  # wrapper computation -> the op it wraps, operands as $i
    found: Counter = Counter()
    for comp in order:  # HLO text prints callees before callers
        digests: dict[str, str] = {}  # instruction -> digest of what it computes
        params: dict[str, str] = {}
        mine = []
        for ins in blocks[comp]:
            m = _INS.match(ins)
            if m is None:
                continue
            var, rhs = m.groups()
            rhs = _META.sub("", rhs)
            p = re.search(r" parameter\((\d+)\)", rhs)
            if p:
                params[var] = f"${p.group(1)}"
            call = re.search(r"fusion\((.*?)\), kind=kLoop, calls=%([\w.\-]+)$", rhs)
            if call and call.group(2) in wrapped:
                args = [a.strip() for a in call.group(1).split(",")]
                rhs = re.sub(
                    r"\$(\d+)", lambda k, args=args: args[int(k.group(1))], wrapped[call.group(2)]
                )

            def ref(k, digests=digests):
                n = k.group(1)
                return digests.get(n) or computations.get(n) or k.group(0)

            text = _NAME.sub(ref, rhs)
            digests[var] = _digest(text)
            mine.append(text)
        if comp.startswith("wrapped_"):
            root = _META.sub("", _INS.match(blocks[comp][-1]).group(2))
            wrapped[comp] = _NAME.sub(
                lambda k, params=params: params.get(k.group(1), k.group(0)), root
            )
            continue
        computations[comp] = _digest("\n".join(sorted(mine)))
        found.update(mine)
    return found


@pytest.mark.codegen
def test_low_optimisation_compiles_the_same_program(mesh8):
    """What `make unit`'s cheap compilation (`conftest.LOW_OPT_OPTIONS`: LLVM at -O0, the
    elemental emitters) compiles for the decoders computes what the default compiles: the
    same instructions on the same operands, for decodes whose HLO differs in every way the
    suite exercises (a one-pass, an all-gather and a butterfly merge, the ring's loop, a
    gradient; causal, ragged lengths). The comparison tells two programs apart that differ
    only in which operand feeds which op, and the results differ by a few units of roundoff
    at most (which `codegen` tests are for)."""
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s)) for s in ((2, 3, 4, 8), (2, 40, 2, 8), (2, 40, 2, 6))
    )
    n = jnp.array([40, 17])
    programs = {
        merge: partial(tae.tree_decode, mesh=mesh8, merge=merge, causal=True, kv_lengths=n)
        for merge in ("one_pass", "allgather", "butterfly")
    }
    programs["ring"] = partial(tae.ring_decode, mesh=mesh8, causal=True, kv_lengths=n)
    programs["gradient"] = lambda q, k, v: jax.grad(
        lambda q: tae.tree_decode(q, k, v, mesh=mesh8, kv_lengths=n).sum()
    )(q)
    wrapped = []
    for name, fn in programs.items():
        lowered = jax.jit(fn).lower(q, k, v)
        default = lowered.compile()
        low = lowered.compile(compiler_options=conftest.LOW_OPT_OPTIONS)
        a, b = program_instructions(default.as_text()), program_instructions(low.as_text())
        assert a == b, (name, list((a - b).items())[:3], list((b - a).items())[:3])
        x, y = (np.asarray(c(q, k, v)) for c in (default, low))
        np.testing.assert_allclose(x, y, rtol=0, atol=64 * np.finfo(np.float64).eps, err_msg=name)
        if "calls=%wrapped_" in default.as_text() and "calls=%wrapped_" not in low.as_text():
            wrapped.append(name)
    assert wrapped  # the texts differ, in the way the comparison looks through
    swapped = (
        program_instructions(jax.jit(f).lower(q).compile().as_text())
        for f in (lambda x: jnp.exp(x) - jnp.sin(2 * x), lambda x: jnp.exp(2 * x) - jnp.sin(x))
    )
    assert len(set(map(repr, swapped))) == 2  # it can fail


def test_make_unit_compiles_as_the_outline_test_checks():
    """The Makefile's cheap lane (and nbval's, for most notebooks) passes the flags
    `conftest.LOW_OPT_OPTIONS` names, and `conftest.LOW_OPT` recognises each of them."""
    lines = (TESTS.parent / "Makefile").read_text().splitlines()
    cheap = next(x for x in lines if x.startswith("CHEAP_COMPILE :="))
    flags = [f"--{k}={str(v).lower()}" for k, v in conftest.LOW_OPT_OPTIONS.items()]
    assert cheap.split(":=")[1].split() == flags, (cheap, flags)
    assert all(conftest.LOW_OPT.search(f) for f in flags)
    for name in ("LOW_OPT :=", "NBVAL_LANES :="):
        assert "$(CHEAP_COMPILE)" in next(x for x in lines if x.startswith(name)), name


def test_heavy_files_are_scheduled_first():
    """conftest.HEAVY_FIRST names real test files, and `schedule_order` puts them first and
    the rest by their number of tests, each file's tests together and in order."""
    assert all((TESTS / name).exists() for name in conftest.HEAVY_FIRST)

    def item(path, n):
        return SimpleNamespace(path=Path(path), n=n)

    heavy = conftest.HEAVY_FIRST[0]
    items = [item("a.py", 0), item("b.py", 0), item("b.py", 1), item(heavy, 0), item("a.py", 1)]
    items.append(item("b.py", 2))
    order = [(i.path.name, i.n) for i in conftest.schedule_order(items)]
    assert order == [(heavy, 0), ("b.py", 0), ("b.py", 1), ("b.py", 2), ("a.py", 0), ("a.py", 1)]
