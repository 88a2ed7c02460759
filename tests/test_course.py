"""`course.printing`: how the notebooks print small numbers (bounds and constants)."""

import math

import pytest

from tree_attention_edu.course.printing import power_of_ten, sci


@pytest.mark.parametrize(
    ("x", "digits", "want"),
    [
        (2.951e-7, 2, "2.95·10^-7"),
        (1e-14, 0, "10^-14"),
        (-1e-6, 0, "-10^-6"),
        (1.2775e-6, 3, "1.278·10^-6"),  # rounds, as format does
        (9.96e-8, 1, "1.0·10^-7"),  # the carry moves the exponent
        (3.4028235e38, 1, "3.4·10^38"),
        (0.0, 2, "0"),
        (math.inf, 2, "inf"),
    ],
)
def test_sci(x, digits, want):
    assert sci(x, digits) == want


@pytest.mark.parametrize(
    ("x", "want"), [(1.5e-8, "10^-7"), (1e-7, "10^-7"), (1.0000001e-7, "10^-6"), (-3e-15, "10^-14")]
)
def test_power_of_ten_bounds_from_above(x, want):
    assert power_of_ten(x) == want
    assert abs(x) <= 10.0 ** int(want.removeprefix("10^"))


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_sci_refuses_a_bad_digit_count(bad):
    with pytest.raises(ValueError, match="`digits` must be an int >= 0"):
        sci(1e-7, bad)


@pytest.mark.parametrize("bad", [0.0, math.nan, math.inf])
def test_power_of_ten_refuses_what_it_cannot_bound(bad):
    with pytest.raises(ValueError, match="`x` must be finite and nonzero"):
        power_of_ten(bad)
