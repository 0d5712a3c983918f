"""The depthwise family's window tables: which taps each output of the kernels reads, decided when
the code is generated.

A depthwise convolution (groups == input channels) filters every channel with its own KH × KW
window, so its kernels are shaped by the window alone: the specialized build writes each tap as a
multiply-add with constant offsets, the weights held in registers. The forward pass and the weight
gradient read x through the zero-padded phase planes of the direct family (a tap is a constant
offset there, for every stride and dilation); the input gradient needs the adjoint's tap sets,
which this module works out:

    dx[ih][iw] = sum over taps (i, j) of dy[oh][ow] · w[i][j],  oh·sh = ih + pt − i·dh, ow·sw = iw + pl − j·dw

Only the taps with i·dh ≡ (ih + pt) (mod sh) reach input row ih: with ih + pt = sh·u + a, tap row i
reads dy row oh = u − e where e = (i·dh − a) / sh ≥ 0, and likewise columns. The kernels read dy from
a copy padded with `row_reach` = max e zero rows above it (and `col_reach` columns left of it), so
tap i of row phase a reads padded row u + row_reach − e: a constant offset.
"""

from __future__ import annotations

import dataclasses

from .spec import Window


@dataclasses.dataclass(frozen=True)
class AdjointTaps:
    """The input gradient's taps by phase.

    rows[a] lists (i, e) for the tap rows i with i·dh ≡ a (mod sh), e = (i·dh − a) // sh; cols[b]
    lists (j, f) likewise for columns. A phase with no taps receives nothing (its dx is zero).
    """

    rows: tuple[tuple[tuple[int, int], ...], ...]
    cols: tuple[tuple[tuple[int, int], ...], ...]
    row_reach: int  # max e: (kh − 1)·dh // sh
    col_reach: int  # max f: (kw − 1)·dw // sw


def _phases(k: int, s: int, d: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    return tuple(tuple((i, (i * d - a) // s) for i in range(k) if (i * d - a) % s == 0) for a in range(s))


def adjoint_taps(window: Window) -> AdjointTaps:
    """The taps of the input gradient of a convolution with `window`, by row and column phase."""
    (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.stride, window.dilation
    return AdjointTaps(_phases(kh, sh, dh), _phases(kw, sw, dw), (kh - 1) * dh // sh, (kw - 1) * dw // sw)


def template_context(window: Window | None) -> dict:
    """What templates/depthwise/ reads besides the common context (specialized): the adjoint's taps,
    and the right padding, by which the forward pass's right border columns take their taps."""
    if window is None:
        return {"DX_ROWS": None, "DX_COLS": None}
    taps = adjoint_taps(window)
    return {"DX_ROWS": taps.rows, "DX_COLS": taps.cols, "ROW_REACH": taps.row_reach, "COL_REACH": taps.col_reach,
            "PR": str(window.padding[1][1])}


__all__ = ["AdjointTaps", "adjoint_taps", "template_context"]
