"""`make unit` compiles most tests with LLVM at -O0 and the tests marked `codegen` at XLA's
default level (tests/conftest.py says why). These tests keep that split honest: -O0 leaves
the optimised program unchanged, and every test that compares floating-point results bit
for bit is marked, or named here with the reason its bits cannot depend on LLVM."""

from __future__ import annotations

import ast
import re
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
        "def test_d(x):\n    assert float(f(x)) == float(g(x))\n"
    )
    assert unmarked_bit_comparisons("t.py", source) == ["t.py::test_a", "t.py::test_d"]


def test_codegen_tests_refuse_to_run_at_low_optimisation(monkeypatch):
    """Selected under -O0, a `codegen` test fails, naming the fix; others run."""
    marked = SimpleNamespace(get_closest_marker=lambda m: m == "codegen")
    plain = SimpleNamespace(get_closest_marker=lambda m: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    with pytest.raises(pytest.fail.Exception, match="-m 'not codegen'"):
        conftest.pytest_runtest_setup(marked)
    conftest.pytest_runtest_setup(plain)
    monkeypatch.setenv("XLA_FLAGS", "")
    conftest.pytest_runtest_setup(marked)


@pytest.mark.codegen
def test_low_optimisation_compiles_the_same_program(mesh8):
    """The optimised HLO of a decode (one-pass merge, causal, ragged lengths) is the same
    text at LLVM -O0 as at the default level: only LLVM's code differs, and with it the last
    bits (a few units of roundoff here, which `codegen` tests are for)."""
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s)) for s in ((2, 3, 4, 8), (2, 40, 2, 8), (2, 40, 2, 6))
    )
    n = jnp.array([40, 17])

    def decode(q, k, v):
        return tae.tree_decode(q, k, v, mesh=mesh8, merge="one_pass", causal=True, kv_lengths=n)

    lowered = jax.jit(decode).lower(q, k, v)
    default = lowered.compile()
    low = lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
    assert default.as_text() == low.as_text()
    a, b = (np.asarray(c(q, k, v)) for c in (default, low))
    np.testing.assert_allclose(a, b, rtol=0, atol=64 * np.finfo(np.float64).eps)
