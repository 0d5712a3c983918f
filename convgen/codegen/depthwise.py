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

The specialized NCHW forward pass computes several output rows per step (`row_block`): output row r
of the block and tap row i read plane row r + (i·dh) // sh, so one load of a plane row serves every
(r, i) pair that meets there, and a 5×5 window's 25 loads per output vector fall to 10 with 4 rows.
"""

from __future__ import annotations

import dataclasses

from ..planning.spec import Window


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


@dataclasses.dataclass(frozen=True)
class RowBlock:
    """The loads of one step of the NCHW forward pass over `rows` output rows.

    bases lists the (plane, row) pairs read, row counted from the block's first output row in
    the plane's grid; loads lists (base, column, uses) with uses the (output row r, tap t) pairs
    the loaded vector is multiplied into, each load once, in the order of bases.
    """

    rows: int
    bases: tuple[tuple[int, int], ...]
    loads: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]


def row_block(window: Window, rows: int) -> RowBlock:
    """The loads of `rows` output rows of the phase-plane forward pass, each plane vector once."""
    (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.stride, window.dilation
    uses: dict = {}
    for r in range(rows):
        for i in range(kh):
            for j in range(kw):
                plane = ((i * dh) % sh) * sw + (j * dw) % sw
                uses.setdefault((plane, r + (i * dh) // sh, (j * dw) // sw), []).append((r, i * kw + j))
    bases = sorted({(plane, row) for plane, row, _ in uses})
    index = {base: k for k, base in enumerate(bases)}
    loads = tuple((index[(plane, row)], column, tuple(found))
                  for (plane, row, column), found in sorted(uses.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])))
    return RowBlock(rows, tuple(bases), loads)


def row_block_shape(taps: int, registers: int, rows: int, vectors: int) -> tuple[int, int]:
    """Output rows and vectors per step of the NCHW forward pass: `rows` × `vectors` accumulators
    when they fit the `registers` beside the taps' weights and a loaded vector, else fewer vectors,
    then fewer rows (a window whose weights do not fit reads them from memory: its budget is the
    rows × vectors asked for)."""
    spare = registers - taps - 2
    if spare < 1:
        return rows, vectors
    while vectors > 1 and rows * vectors > spare:
        vectors -= 1
    return max(1, min(rows, spare // vectors)), vectors


def template_context(window: Window | None, registers: int = 16, rows: int = 1, vectors: int = 1) -> dict:
    """What templates/depthwise/ reads besides the common context (specialized): the adjoint's taps,
    the right padding, by which the forward pass's right border columns take their taps, and the
    NCHW forward pass's row blocks (`registers` vector registers, at most `rows` × `vectors`
    accumulators): DW_ROW_BLOCKS[r - 1] for r rows, DW_BLOCK_VECTORS vectors per step."""
    if window is None:
        return {"DX_ROWS": None, "DX_COLS": None}
    taps = adjoint_taps(window)
    block_rows, block_vectors = row_block_shape(window.kernel[0] * window.kernel[1], registers, rows, vectors)
    return {"DX_ROWS": taps.rows, "DX_COLS": taps.cols, "ROW_REACH": taps.row_reach, "COL_REACH": taps.col_reach,
            "PR": str(window.padding[1][1]),
            "DW_ROW_BLOCKS": [row_block(window, r) for r in range(1, block_rows + 1)],
            "DW_BLOCK_VECTORS": block_vectors}


def flat_run_vectors(window: Window | None, registers: int, unrolled: bool) -> list[int]:
    """The channel counts, in vectors, whose NHWC forward pass reads a row's interior pixels as one flat
    run of reals (templates/depthwise/forward_nhwc_rows.c.j2): a specialized, unrolled stride-1 window
    whose weights for m vectors of channels (m taps + biases each) stay in registers with 4 to spare
    (`unrolled`: the build is specialized and unrolls the window's taps)."""
    if not unrolled or window.stride[1] != 1:
        return []
    taps = window.kernel[0] * window.kernel[1]
    return [m for m in (1, 2) if m * (taps + 1) + 4 <= registers]


__all__ = ["AdjointTaps", "RowBlock", "adjoint_taps", "flat_run_vectors", "row_block", "row_block_shape", "template_context"]
