"""Winograd minimal filtering F(m, r), built exactly from interpolation points (Toom–Cook).

One output row of a correlation, y[i] = sum_k d[i + k] g[k] for i < m, from α = m + r − 1 inputs,
is computed as y = Aᵀ[(G g) ⊙ (Bᵀ d)] with α multiplies instead of m·r; in 2-D,
Y = Aᵀ[(G g Gᵀ) ⊙ (Bᵀ d B)]A takes α² multiplies for an m × m tile instead of m²·r².

The matrices come from evaluating polynomials at α − 1 finite points and ∞: a correlation is the
transpose of a polynomial product, which evaluation, pointwise multiplication and interpolation
compute exactly. With V the α × α evaluation matrix (rows (1, a, a², …) and, for ∞, (0, …, 0, 1))
and E_n its first n columns (∞'s row keeps the leading coefficient):

    Aᵀ = E_mᵀ,  G = E_r,  Bᵀ = V⁻ᵀ,

then each row j of Bᵀ is scaled to small integers and row j of G by the inverse, which changes no
product. Everything is `fractions.Fraction`, so `correlate_exactly` proves the identity with no
rounding; the kernels get the coefficients as C constants (`c_coefficient`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction

# Finite interpolation points, in the order they are taken: small magnitudes first (they keep the
# transforms' coefficients, and so the rounding error, small), each with its negative and inverse.
POINTS = (Fraction(0), Fraction(1), Fraction(-1), Fraction(2), Fraction(-2), Fraction(1, 2), Fraction(-1, 2),
          Fraction(3), Fraction(-3), Fraction(1, 3), Fraction(-1, 3), Fraction(4), Fraction(-4))

Matrix = tuple[tuple[Fraction, ...], ...]

# The output tiles m of F(m×m, 3×3) the kernels are built for (spec.WINOGRAD_TILES), and the error
# bound a tile must meet to be chosen by the planner: max |Δ| / max |y| against a float64 reference.
TILES = (2, 4, 6)
ERROR_BOUND = {"float32": 1e-4, "float64": 1e-11}
# Stated error of each tile: max |Δ| / max |y| against the float64 reference, the worst measured
# over N(0, 1) data and data with a common offset of 100, 1 to 512 input channels, 20 × 20 images
# (tests/test_winograd.py repeats the measurement and holds every tile to its figure), rounded up
# by about 2× for other CPUs' blocking and rounding. Measured on an AMD EPYC (Zen 4, AVX-512):
#   float32: F(2×2) 4.4e-7, F(4×4) 4.3e-6, F(6×6) 6.8e-6
#   float64: F(2×2) 2.1e-15, F(4×4) 1.5e-14, F(6×6) 9.4e-15
MEASURED_ERROR = {
    (2, "float32"): 1e-6, (4, "float32"): 1e-5, (6, "float32"): 2e-5,
    (2, "float64"): 5e-15, (4, "float64"): 5e-14, (6, "float64"): 5e-14,
}


def within_bound(tile: int, dtype: str) -> bool:
    """Whether F(tile×tile, 3×3) in `dtype` is accurate enough for the planner to choose."""
    return MEASURED_ERROR[(tile, dtype)] <= ERROR_BOUND[dtype]


@dataclasses.dataclass(frozen=True)
class Transforms:
    """The matrices of F(m, r): AT (m × α), G (α × r), BT (α × α)."""

    m: int
    r: int
    points: tuple[Fraction, ...]  # the α − 1 finite points (∞ is the last)
    AT: Matrix
    G: Matrix
    BT: Matrix

    @property
    def alpha(self) -> int:
        return self.m + self.r - 1


def _inverse(matrix: list[list[Fraction]]) -> list[list[Fraction]]:
    """Exact inverse by Gauss–Jordan elimination (the matrix is a small nonsingular Vandermonde)."""
    n = len(matrix)
    rows = [list(row) + [Fraction(int(i == j)) for j in range(n)] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = next(i for i in range(col, n) if rows[i][col] != 0)
        rows[col], rows[pivot] = rows[pivot], rows[col]
        scale = rows[col][col]
        rows[col] = [v / scale for v in rows[col]]
        for i in range(n):
            if i != col and rows[i][col] != 0:
                factor = rows[i][col]
                rows[i] = [a - factor * b for a, b in zip(rows[i], rows[col])]
    return [row[n:] for row in rows]


def _evaluation(points, alpha: int, degree: int) -> list[list[Fraction]]:
    """α × degree: a polynomial of `degree` coefficients evaluated at the points and at ∞."""
    rows = [[a ** k for k in range(degree)] for a in points]
    rows.append([Fraction(int(k == degree - 1)) for k in range(degree)])
    return rows


@functools.lru_cache(maxsize=None)
def transforms(m: int, r: int) -> Transforms:
    """The Winograd matrices of F(m, r), exact."""
    if not (isinstance(m, int) and isinstance(r, int) and m >= 1 and r >= 1):
        raise ValueError(f"F(m, r) needs positive integers, got m={m!r}, r={r!r}")
    alpha = m + r - 1
    if alpha - 1 > len(POINTS):
        raise ValueError(f"F({m}, {r}) needs {alpha - 1} interpolation points; at most {len(POINTS)} are known")
    points = POINTS[:alpha - 1]
    vandermonde = _evaluation(points, alpha, alpha)
    bt = [list(row) for row in zip(*_inverse(vandermonde))]  # Bᵀ = V⁻ᵀ
    g = _evaluation(points, alpha, r)
    at = [list(row) for row in zip(*_evaluation(points, alpha, m))]
    # Scale row j of Bᵀ to coprime integers (a scalar per row), and row j of G by its inverse.
    for j, row in enumerate(bt):
        denominators = math.lcm(*(v.denominator for v in row))
        numerators = math.gcd(*(int(v * denominators) for v in row)) or 1
        scale = Fraction(denominators, numerators)
        bt[j] = [v * scale for v in row]
        g[j] = [v / scale for v in g[j]]
    freeze = lambda rows: tuple(tuple(row) for row in rows)  # noqa: E731
    return Transforms(m, r, tuple(points), freeze(at), freeze(g), freeze(bt))


def _matmul(a, b):
    return [[sum((a[i][k] * b[k][j] for k in range(len(b))), Fraction(0)) for j in range(len(b[0]))]
            for i in range(len(a))]


def _transpose(a):
    return [list(row) for row in zip(*a)]


def correlate_exactly(t: Transforms, d, g):
    """Aᵀ[(G g Gᵀ) ⊙ (Bᵀ d B)]A for one α × α input tile d and r × r filter g, in rationals."""
    u = _matmul(_matmul(t.G, g), _transpose(t.G))
    v = _matmul(_matmul(t.BT, d), _transpose(t.BT))
    product = [[u[i][j] * v[i][j] for j in range(t.alpha)] for i in range(t.alpha)]
    return _matmul(_matmul(t.AT, product), _transpose(t.AT))


def c_coefficient(value: Fraction) -> str:
    """A rational coefficient as a C constant of type `real`: exact for integers and powers of two,
    folded by the compiler otherwise ((real)1 / 6 is 1/6 rounded once)."""
    if value.denominator == 1:
        return f"(real){value.numerator}"
    return f"((real){value.numerator} / {value.denominator})"


def linear_combination(row, names) -> str:
    """The C expression sum_j row[j] * names[j], zeros dropped and ±1 folded, e.g. "d0 - (real)5 * d2 + d4"."""
    terms = []
    for value, name in zip(row, names):
        if value == 0:
            continue
        sign = "-" if value < 0 else "+"
        magnitude = abs(value)
        term = name if magnitude == 1 else f"{c_coefficient(magnitude)} * {name}"
        terms.append((sign, term))
    if not terms:
        return "(real)0"
    first_sign, first = terms[0]
    text = f"-{first}" if first_sign == "-" else first
    return text + "".join(f" {sign} {term}" for sign, term in terms[1:])


__all__ = ["TILES", "ERROR_BOUND", "MEASURED_ERROR", "within_bound", "POINTS", "Transforms", "transforms", "correlate_exactly", "c_coefficient", "linear_combination"]
