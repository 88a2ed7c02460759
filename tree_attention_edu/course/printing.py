"""How the notebooks print small numbers.

A committed output must read the same on every CPU (XLA's and NumPy's kernels round
differently on AVX2, AVX-512 and ARM), so a notebook prints a bound it has asserted, a
constant, or a value to a few significant figures, never a rounding error's last digits.
`sci` writes such a number as a reader writes it, `2.95·10^-7`, and `power_of_ten` the
bound `10^-7` above a measured error: the notebooks' tests refuse Python's own exponent
format (`2.95e-07`) for numbers below 10^-5 in an output, because that is how a rounding
residue printed by accident looks.
"""

from __future__ import annotations

import math

__all__ = ["power_of_ten", "sci"]


def sci(x: float, digits: int = 2) -> str:
    """`x` in scientific notation with `digits` decimals: `sci(2.951e-7) == "2.95·10^-7"`;
    an exact power of ten with `digits=0` is written bare: `sci(1e-14, 0) == "10^-14"`."""
    if not isinstance(digits, int) or isinstance(digits, bool) or digits < 0:
        raise ValueError(f"`digits` must be an int >= 0, got {digits!r}")
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    mantissa, exponent = f"{x:.{digits}e}".split("e")
    if mantissa in ("1", "-1"):
        return f"{mantissa[:-1]}10^{int(exponent)}"
    return f"{mantissa}·10^{int(exponent)}"


def power_of_ten(x: float) -> str:
    """The smallest power of ten at or above `|x|`, as a bound to print:
    `power_of_ten(1.5e-8) == "10^-7"`, `power_of_ten(1e-7) == "10^-7"`."""
    x = abs(float(x))
    if not math.isfinite(x) or x == 0:
        raise ValueError(f"`x` must be finite and nonzero to bound it by a power of ten, got {x!r}")
    return f"10^{math.ceil(round(math.log10(x), 12))}"
