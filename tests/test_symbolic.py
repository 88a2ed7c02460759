import pytest
import sympy as sp

from tree_attention_edu import symbolic


@pytest.mark.parametrize("name", sorted(symbolic.ALL))
def test_identity_holds(name):
    for ident in symbolic.ALL[name]():
        assert sp.simplify(ident.lhs - ident.rhs) == 0, ident.name


def test_a_false_identity_is_caught():
    """The check can fail: a wrong Hessian (second moment without the mean term) is rejected."""
    s, v, zeta = symbolic.symbols(3, 1)
    F = symbolic.energy_expr(s, v, zeta)
    second = sum(sp.exp(s[a]) * v[a][0] ** 2 for a in range(3)) / sum(sp.exp(x) for x in s)
    wrong = symbolic.Identity("wrong", sp.diff(F, zeta[0], 2).subs(zeta[0], 0), second)
    assert not wrong.holds()


def test_verify_all():
    results = symbolic.verify_all()
    assert len(results) >= 15 and all(results.values())
