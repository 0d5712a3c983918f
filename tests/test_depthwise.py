"""The depthwise family (groups == input channels) against convgen.reference.

Every op (forward; dx and dW through conv2d_backward; the transposed pair, whose kernels are the
same three) over the windows of tests/grid.py, specialized and generic, one and two filters per
channel, on sizes that reach every path: channels past one vector and not a multiple of it, fewer
channels than one vector, rows no multiple of the vector width, images smaller than the window,
1×1 images; the NCHW forward pass's row blocks on every height and width remainder, and inputs
large enough to be prefetched. Also: which family the planner picks, adjoint identities, central-difference
gradients, the same bits on 1, 2 and 3 threads, the spec's text and the spec files.
"""

import contextlib

import numpy as np
import pytest

import convgen
from convgen.tools import cli
from convgen.codegen import depthwise
from convgen.planning import planner
from convgen import reference
from convgen.runtime.kernels import settings
from convgen.codegen.render import render
from convgen.frontend.resolve import conv_problem, transposed_problem
from convgen.planning.spec import ConvSpec, Window
from convgen.tools.specfile import load_spec_file
from grid import DEPTHWISE_MORE_WINDOWS, DEPTHWISE_WINDOWS, DTYPES, LAYOUTS, depthwise_dtypes
from helpers import assert_close, at_line_offset, kernels_for, numerical_gradient, relative_error, seeded_rng, to_layout

GRID = [(window, layout, dtype) for window in DEPTHWISE_WINDOWS + DEPTHWISE_MORE_WINDOWS for layout in LAYOUTS
        for dtype in depthwise_dtypes(window, layout)]
VARIANTS = pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])
DEPTHWISE = dict(algorithm="depthwise")


def _arrays(rng, n, c, h, w, multiplier, window, layout, dtype, transposed=False):
    """x (n, c, h, w in NCHW terms), the depthwise weights and a bias, in `layout`. A transposed
    call's x has c * multiplier channels and its output c (groups == output channels)."""
    weight = rng.standard_normal((c * multiplier, 1, *window.kernel))
    x = rng.standard_normal((n, c * multiplier if transposed else c, h, w))
    x, weight = to_layout(x, weight, layout)
    return x.astype(dtype), weight.astype(dtype), rng.standard_normal(c if transposed else c * multiplier).astype(dtype)


def _window_kwargs(window, c, layout):
    return dict(stride=window.stride, padding=window.padding, dilation=window.dilation, groups=c, layout=layout)


def _output_padding(window, h, w):
    """The output_padding that brings a transposed call back to the h × w its input came from."""
    return tuple((n + sum(pads) - extent) % s for n, pads, extent, s in zip(
        (h, w), window.padding, window.effective_kernel, window.stride))


def check_all_ops(n, c, h, w, multiplier, window, layout, dtype, specialize, rng):
    """conv2d, conv2d_backward, conv_transpose2d and its backward on a depthwise convolution, all
    through the depthwise family, against the reference."""
    kw = _window_kwargs(window, c, layout)
    x, weight, bias = _arrays(rng, n, c, h, w, multiplier, window, layout, dtype)
    problem = conv_problem(x.shape, weight.shape, x.dtype, **{k: kw[k] for k in ("stride", "padding", "dilation")},
                           groups=c, layout=layout)
    assert kernels_for(problem, specialize, "depthwise").spec.family == "depthwise"
    expected = reference.conv2d(x, weight, bias, **kw)
    assert_close(convgen.conv2d(x, weight, bias, specialize=specialize, **kw, **DEPTHWISE), expected, dtype, "forward")
    dy = rng.standard_normal(expected.shape).astype(dtype)
    got = convgen.conv2d_backward(dy, x, weight, specialize=specialize, **kw, **DEPTHWISE)
    for name, a, e in zip(("dx", "dw", "db"), got, reference.conv2d_backward(dy, x, weight, **kw)):
        assert_close(a, e, dtype, name)
    # The transposed convolution of the same weights: input shaped as y, output as x.
    tkw = dict(kw, output_padding=_output_padding(window, h, w))
    t = convgen.conv_transpose2d(dy, weight, bias[:c], specialize=specialize, **tkw, **DEPTHWISE)
    assert_close(t, reference.conv_transpose2d(dy, weight, bias[:c], **tkw), dtype, "transposed")
    dt = rng.standard_normal(x.shape).astype(dtype)
    got = convgen.conv_transpose2d_backward(dt, dy, weight, specialize=specialize, **tkw, **DEPTHWISE)
    for name, a, e in zip(("dx", "dw", "db"), got, reference.conv_transpose2d_backward(dt, dy, weight, **tkw)):
        assert_close(a, e, dtype, f"transposed {name}")


# ------------------------------------------------------------------------------ against the reference
@VARIANTS
@pytest.mark.parametrize("multiplier", [1, 2])
@pytest.mark.parametrize("window, layout, dtype", GRID, ids=lambda v: v.short() if isinstance(v, Window) else v)
def test_ops_match_reference(window, layout, dtype, multiplier, specialize):
    """19 channels: a full block of LANES and a partial one (NHWC), rows of 13 (NCHW: no multiple of LANES)."""
    rng = seeded_rng("depthwise", window, layout, dtype, multiplier)
    check_all_ops(2, 19, 11, 13, multiplier, window, layout, dtype, specialize, rng)


# n, c, h, w, multiplier, window: what the common paths do not reach.
ODD_SIZES = [
    (1, 1, 1, 1, 1, Window(3, 1, 1)),      # a 1×1 image, one channel: every tap but the centre in the padding
    (2, 3, 2, 2, 2, Window(3, 2, 1)),      # smaller than the window, stride 2, two filters per channel
    (1, 5, 3, 40, 1, Window(3, 1, 1)),     # long rows: several vectors and an overlapping last one
    (3, 16, 5, 4, 1, Window(3, 1, 1)),     # exactly 16 channels (one AVX-512 float32 vector)
    (1, 33, 7, 9, 1, Window(3, 2, 1)),     # 33 channels: 2 full AVX-512 vectors and 1 channel
    (2, 4, 1, 17, 3, Window(3, 2, 1)),     # one row, an odd width, three filters per channel
    (1, 2, 18, 1, 1, Window(3, 1, 1)),     # one column
    (1, 20, 4, 25, 1, Window(3, 1, 1)),    # NHWC forward straight from x: 20 channels, one vector and a part
    (2, 17, 5, 39, 1, Window(3, 2, 1)),    # the same at stride 2, both right-border residues (w 39, 38 below)
    (1, 18, 3, 38, 1, Window(3, 2, 1)),    # (block-major; pixel-major where the schedule says few channels are)
    (1, 132, 4, 25, 1, Window(3, 1, 1)),   # ... block-major on every ISA: more than 512 bytes of channels a pixel
    (2, 136, 5, 39, 1, Window(3, 2, 1)),
    (1, 20, 3, 2, 1, Window(3, 1, 1)),     # NHWC pixel-major (narrow rows): no interior column, every tap checked
    (2, 17, 4, 12, 1, Window(3, 2, 1)),    # ... at stride 2, the right-border residue the 13-wide grid rows miss
]


@VARIANTS
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ODD_SIZES, ids=lambda c: "x".join(map(str, c[:5])) + "-" + c[5].short())
def test_odd_sizes(case, layout, specialize):
    n, c, h, w, multiplier, window = case
    for dtype in DTYPES:
        check_all_ops(n, c, h, w, multiplier, window, layout, dtype, specialize, seeded_rng("odd", case, layout, dtype))


# ------------------------------------------------------------------ the NCHW forward pass's row blocks
@pytest.mark.parametrize("window", [Window(3, 1, 1), Window(5, 1, 2), Window(5, 2, 2), Window(3, 1, 2, 2),
                                    Window((2, 5), (1, 3), ((1, 0), (2, 1)), (2, 1))], ids=lambda w: w.short())
def test_row_block_loads_each_plane_vector_once(window):
    """Every (output row, tap) pair of a step is served by exactly one load, at the plane, row and
    column the tap reads; no two loads read the same place."""
    (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.stride, window.dilation
    for rows in (1, 2, 4):
        block = depthwise.row_block(window, rows)
        places = [(block.bases[base], column) for base, column, _ in block.loads]
        assert len(set(places)) == len(places)
        served = {}
        for ((plane, row), column), (_, _, uses) in zip(places, block.loads):
            for r, tap in uses:
                assert (r, tap) not in served
                served[(r, tap)] = (plane, row, column)
        i_j = [(i, j) for i in range(kh) for j in range(kw)]
        assert served == {(r, t): (((i * dh) % sh) * sw + (j * dw) % sw, r + (i * dh) // sh, (j * dw) // sw)
                          for r in range(rows) for t, (i, j) in enumerate(i_j)}
    # 5×5 at stride 1, 4 rows: 8 plane rows of 5 columns each, 40 loads for 100 multiply-adds.
    assert len(depthwise.row_block(Window(5, 1, 2), 4).loads) == 40


def test_row_block_shape_fits_the_registers():
    assert depthwise.row_block_shape(9, 32, 4, 2) == (4, 2)    # 3×3, AVX-512: 9 weights + 8 sums
    assert depthwise.row_block_shape(25, 32, 4, 2) == (4, 1)   # 5×5: 25 weights + 4 sums + 1 loaded
    assert depthwise.row_block_shape(9, 16, 4, 2) == (4, 1)    # 3×3, 16 registers
    assert depthwise.row_block_shape(12, 16, 4, 2) == (2, 1)
    assert depthwise.row_block_shape(49, 32, 4, 2) == (4, 2)   # weights from memory: as asked


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [Window(3, 1, 1), Window(5, 2, 2), Window(3, 2, 0)], ids=lambda w: w.short())
def test_nchw_forward_every_row_and_column_remainder(window, dtype):
    """Heights that leave every number of rows after the last full step, widths below one vector,
    of exactly one, and past two (a step of several vectors, then single ones), batch 1; stride 2
    with even and odd left padding (which column phase the even input columns go to), its column
    split by scalars, by half vectors (25: overlapping ones) and by whole vectors."""
    rng = seeded_rng("depthwise-rows", window, dtype)
    for h in range(1, 11):
        for w in (1, 5, 16, 17, 25, 45):
            if any(n + sum(pads) < extent for n, pads, extent in zip((h, w), window.padding, window.effective_kernel)):
                continue  # no output: the window does not fit
            x, weight, bias = _arrays(rng, 1, 3, h, w, 1, window, "NCHW", dtype)
            kw = _window_kwargs(window, 3, "NCHW")
            assert_close(convgen.conv2d(x, weight, bias, **kw, **DEPTHWISE), reference.conv2d(x, weight, bias, **kw),
                         dtype, f"forward {h}x{w}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nhwc_forward_with_pixels_a_multiple_of_2_kib_apart(dtype):
    """512 float32 or 256 float64 channels, rows long enough for the block-major path straight from
    x, which such a pixel stride sends to the pixel-major one instead (every tap's line in two L1
    sets)."""
    window, c = Window(3, 1, 1), 2048 // np.dtype(dtype).itemsize
    x, weight, bias = _arrays(seeded_rng("depthwise-aliased", dtype), 1, c, 3, 20, 1, window, "NHWC", dtype)
    kw = _window_kwargs(window, c, "NHWC")
    assert_close(convgen.conv2d(x, weight, bias, **kw, **DEPTHWISE), reference.conv2d(x, weight, bias, **kw), dtype,
                 "forward")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [Window(3, 1, 1), Window(3, 2, 1), Window(3, 1, 1, 2)], ids=Window.short)
@pytest.mark.parametrize("c", [1, 2, 8, 9])
def test_nhwc_forward_of_an_input_off_a_cache_line(c, window, dtype):
    """x and y at every 4-byte (float64: 8-byte) offset from a 64-byte line, the path straight from x.
    With pixels a whole number of vectors apart (c vectors of channels), its blocks of channels
    start from the first channel whose vectors are aligned in x, after a first block that overlaps
    them (8 vectors); at stride 1 with 1 or 2 vectors, the interior pixels of a row run as one run of
    reals, vectors across pixels. With 9 vectors plus a fraction of one they cannot, and run from
    channel 0. (The block-major path on every ISA: AVX2's schedule reads so few channels pixel-major.)"""
    dtype = np.dtype(dtype)
    lanes = settings().schedule().vector_bytes // dtype.itemsize
    c = c * lanes + (lanes // 2 if c == 9 else 0)
    x, weight, bias = _arrays(seeded_rng("depthwise-lines", c, dtype), 2, c, 4, 41, 1, window, "NHWC", dtype)
    kw = _window_kwargs(window, c, "NHWC")
    expected = reference.conv2d(x, weight, bias, **kw)
    with convgen.configure(depthwise_pixel_major_bytes=0):
        for offset in range(0, 64, dtype.itemsize):
            y = at_line_offset(np.zeros(expected.shape, dtype), (offset * 5) % 64)
            convgen.conv2d(at_line_offset(x, offset), weight, bias, out=y, **kw, **DEPTHWISE)
            assert_close(y, expected, dtype, f"x {offset} bytes past a line")


@pytest.mark.parametrize("c", [40, 72])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_of_an_input_past_the_caches(layout, c, threads):
    """An input of more than 1 MiB: the forward pass prefetches each next work item's input. NHWC
    with 72 channels computes row after row, with 40 (fewer than 4 vectors) block after block (the
    block-major path on every ISA)."""
    window = Window(3, 1, 1)
    x, weight, bias = _arrays(seeded_rng("depthwise-large", layout), 2, c, 60, 61, 1, window, layout, np.float32)
    kw = _window_kwargs(window, c, layout)
    expected = reference.conv2d(x, weight, bias, **kw)
    block_major = convgen.configure(depthwise_pixel_major_bytes=0) if layout == "NHWC" else contextlib.nullcontext()
    with block_major:
        for count in (1, 2):
            threads(count)
            assert_close(convgen.conv2d(x, weight, bias, **kw, **DEPTHWISE), expected, np.float32, f"{count} threads")


@pytest.mark.parametrize("c", [40, 80])
def test_nhwc_forward_of_an_output_past_the_caches(threads, c):
    """x and y larger than the schedule's depthwise_stream_bytes (1 MiB here; by default the last-level
    cache): the forward pass makes each row in a buffer and streams it to y, whose rows start at every
    offset from a cache line (40 channels: a row of 230 pixels is not a multiple of one); 40 channels
    also end in a block that overlaps the one before. 80 channels, x 16 bytes past a line: the blocks
    start from the first channel aligned in x, in the buffer too."""
    window, stream_bytes = Window(3, 1, 1), 1 << 20
    x, weight, bias = _arrays(seeded_rng("depthwise-stream", c), 1, c, 32 * 40 // c, 230, 1, window, "NHWC",
                              np.float32)
    x = at_line_offset(x, 16) if c == 80 else x
    kw = _window_kwargs(window, c, "NHWC")
    expected = reference.conv2d(x, weight, bias, **kw)
    assert x.nbytes + expected.nbytes > stream_bytes
    with convgen.configure(depthwise_stream_bytes=stream_bytes, depthwise_pixel_major_bytes=0):  # (block-major)
        for count in (1, 2):
            threads(count)
            assert_close(convgen.conv2d(x, weight, bias, **kw, **DEPTHWISE), expected, np.float32,
                         f"{count} threads")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [Window(3, 1, 1), Window(5, 1, 2), Window(3, 1, 2, 2), Window((3, 5), 1, (1, 2))],
                         ids=Window.short)
def test_nhwc_input_gradient_as_the_forward_pass_of_dy(window, dtype, threads):
    """Stride 1, "same" padding, one filter per channel: the NHWC input gradient (and the transposed
    convolution, the same kernel) runs the forward pass over dy with the window turned round, reading
    dy in place. 20 channels (float32: one vector and a part) and 40, dy 16 bytes past a line, on 1
    and 2 threads, writing through the caches and streaming past them; its workspace is the forward
    pass's and the turned weights."""
    dtype = np.dtype(dtype)
    kh, kw = window.kernel
    for c in (20, 40):
        rng = seeded_rng("depthwise-dx-forward", window, dtype, c)
        kwargs = _window_kwargs(window, c, "NHWC")
        x, weight, bias = _arrays(rng, 2, c, 6, 41, 1, window, "NHWC", dtype)
        dy = at_line_offset(rng.standard_normal(x.shape).astype(dtype), 16)
        expected_dx = reference.conv2d_backward(dy, x, weight, **kwargs)[0]
        expected_t = reference.conv_transpose2d(dy, weight, bias, **kwargs)
        problem = conv_problem(x.shape, weight.shape, x.dtype, window.stride, window.padding, window.dilation, c, "NHWC")
        extra = kernels_for(problem, True, "depthwise").workspace_bytes("bwd_data", problem, 1) \
            - kernels_for(problem, True, "depthwise").workspace_bytes("fwd", problem, 1)
        assert 0 < extra <= (kh * kw * c + 16) * dtype.itemsize, extra
        # the schedule's own path (AVX2: pixel-major), then block-major rows streamed past the caches
        for schedule in ({}, dict(depthwise_stream_bytes=1 << 12, depthwise_pixel_major_bytes=0)):
            with convgen.configure(**schedule):
                for count in (1, 2):
                    threads(count)
                    where = f"{c} channels, {count} threads, schedule {schedule}"
                    dx = convgen.conv2d_backward(dy, x, weight, **kwargs, **DEPTHWISE)[0]
                    assert_close(dx, expected_dx, dtype, f"dx, {where}")
                    t = convgen.conv_transpose2d(dy, weight, bias, **kwargs, **DEPTHWISE)
                    assert_close(t, expected_t, dtype, f"transposed, {where}")


@pytest.mark.parametrize("window", [Window(3, 1, 1), Window(3, 2, 1), Window(5, 1, 2)], ids=Window.short)
def test_nhwc_weight_gradient_straight_from_x_in_row_blocks(window, threads):
    """One filter per channel: the NHWC weight gradient reads x and dy in place, each block of
    channels over as many rows as fit in L2 before the next block. Rows of 480 pixels of 44 float64
    channels (AVX-512: 5 vectors and an overlapping last one) leave room for one row at a time, fewer
    than a work item's 2: an item takes several row blocks. 1 and 2 threads give the same bits."""
    c, h, w = 44, 17 * window.stride[0] + 1, 480
    x, weight, _ = _arrays(seeded_rng("depthwise-dw-direct", window), 1, c, h, w, 1, window, "NHWC", np.float64)
    kw = _window_kwargs(window, c, "NHWC")
    ho, wo = ((n + 2 * p - k) // s + 1 for n, p, k, s in zip((h, w), (window.padding[0][0], window.padding[1][0]),
                                                              window.kernel, window.stride))
    dy = seeded_rng("depthwise-dw-direct-dy", window).standard_normal((1, ho, wo, c))
    expected = reference.conv2d_backward(dy, x, weight, **kw)[1]
    results = []
    for count in (1, 2):
        threads(count)
        results.append(convgen.conv2d_backward(dy, x, weight, **kw, **DEPTHWISE)[1])
        assert_close(results[-1], expected, np.float64, f"dw, {count} threads")
    np.testing.assert_array_equal(results[0], results[1])


def test_stream_bytes_must_be_a_count_of_bytes():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="depthwise_stream_bytes"):
            with convgen.configure(depthwise_stream_bytes=bad):
                pass


# ------------------------------------------------------------------------------------ the planner
def _plan(shape, layout, groups, per_group=1, transposed=False, specialize=True, algorithm="auto", dtype="float32"):
    """The family the planner picks for a depthwise-shaped call: x (N, C, H, W) in NCHW terms."""
    n, c, h, w = shape
    x_shape = shape if layout == "NCHW" else (n, h, w, c)
    outer, inner = (c, per_group) if transposed else (groups * per_group, c // groups)
    w_shape = (outer, inner, 3, 3) if layout == "NCHW" else (3, 3, inner, outer)
    if transposed:
        problem = transposed_problem(x_shape, w_shape, np.dtype(dtype), 2, 1, 1, groups, layout, 1)
    else:
        problem = conv_problem(x_shape, w_shape, np.dtype(dtype), 1, 1, 1, groups, layout)
    return planner.plan(problem, specialize, settings().schedule(), algorithm).spec


def test_auto_takes_depthwise_for_groups_equal_to_input_channels():
    schedule = settings().schedule()
    enough = schedule.depthwise_min_channels
    assert _plan((2, enough, 9, 9), "NCHW", enough).family == "depthwise"
    assert _plan((2, enough, 9, 9), "NCHW", enough, per_group=3).family == "depthwise"      # 3 filters per channel
    assert _plan((2, enough, 9, 9), "NCHW", enough, specialize=False) == ConvSpec(None, "float32", "NCHW", "depthwise")
    assert _plan((2, 2 * enough, 9, 9), "NCHW", enough).family == "direct"                  # 2 channels per group
    assert _plan((2, enough - 1, 9, 9), "NCHW", enough - 1).family == "direct"              # too few channels
    # NHWC runs its vectors along the filters: it takes depthwise once they fill half a vector.
    lanes = schedule.lanes("float32")
    filled = max(enough, lanes // 2)
    assert _plan((2, filled, 9, 9), "NHWC", filled).family == "depthwise"
    if lanes // 2 > enough:
        assert _plan((2, lanes // 2 - 1, 9, 9), "NHWC", lanes // 2 - 1).family == "direct"
    # A transposed call runs the input gradient of the convolution from its output back: depthwise
    # when groups == its output channels (its input may have several channels per group).
    assert _plan((2, 2 * enough, 9, 9), "NCHW", 2 * enough, transposed=True).family == "depthwise"
    assert _plan((2, 2 * enough, 9, 9), "NCHW", enough, transposed=True).family == "depthwise"
    assert _plan((2, enough, 9, 9), "NCHW", enough, per_group=2, transposed=True).family == "direct"
    assert _plan((2, enough, 9, 9), "NCHW", enough, algorithm="direct").family == "direct"


def test_algorithm_depthwise_says_why_it_cannot_compute_a_convolution():
    assert _plan((1, 2, 5, 5), "NHWC", 2, algorithm="depthwise").family == "depthwise"   # forced: any size
    with pytest.raises(ValueError, match=r"groups == input channels, got groups=2 and 4 input channels"):
        _plan((1, 4, 5, 5), "NCHW", 2, algorithm="depthwise")
    with pytest.raises(ValueError, match=r"groups == output channels, got groups=3 and 6 output channels"):
        _plan((1, 3, 5, 5), "NCHW", 3, per_group=2, transposed=True, algorithm="depthwise")
    x, w = np.zeros((1, 4, 5, 5), np.float32), np.zeros((4, 2, 3, 3), np.float32)
    with pytest.raises(ValueError, match="algorithm='depthwise' cannot compute"):
        convgen.conv2d(x, w, groups=2, algorithm="depthwise")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        convgen.conv2d(x, w, groups=2, algorithm="depthwize")


# ---------------------------------------------------------------------------- identities, gradients
@VARIANTS
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window", DEPTHWISE_WINDOWS, ids=Window.short)
def test_adjoint_identities(window, layout, specialize):
    """<conv2d(x, w), y> = <x, conv_transpose2d(y, w)> = <w, dW(y, x)>: the three kernels are adjoint."""
    rng = seeded_rng("depthwise-adjoint", window, layout)
    n, c, h, w, multiplier = 2, 5, 9, 12, 2
    kw = _window_kwargs(window, c, layout)
    x, weight, _ = _arrays(rng, n, c, h, w, multiplier, window, layout, np.float64)
    conv = convgen.conv2d(x, weight, specialize=specialize, **kw, **DEPTHWISE)
    y = rng.standard_normal(conv.shape)
    transposed = convgen.conv_transpose2d(y, weight, output_padding=_output_padding(window, h, w),
                                          specialize=specialize, **kw, **DEPTHWISE)
    _, dw, _ = convgen.conv2d_backward(y, x, weight, specialize=specialize, **kw, **DEPTHWISE)
    lhs, by_input, by_weight = float(np.sum(conv * y)), float(np.sum(x * transposed)), float(np.sum(weight * dw))
    bound = float(np.linalg.norm(conv) * np.linalg.norm(y))
    assert abs(lhs - by_input) <= 1e-12 * bound, (lhs, by_input)
    assert abs(lhs - by_weight) <= 1e-12 * bound, (lhs, by_weight)


@VARIANTS
@pytest.mark.parametrize("layout", LAYOUTS)
def test_numerical_gradients(layout, specialize, threads):
    """Central differences of L = <r, y> + |y|²/2 through convgen's own forward pass."""
    threads(1)
    window = Window(3, 2, 1)
    rng = seeded_rng("depthwise-numeric", layout)
    c = 3
    kw = dict(_window_kwargs(window, c, layout), specialize=specialize, **DEPTHWISE)
    x, weight, bias = _arrays(rng, 1, c, 5, 6, 2, window, layout, np.float64)
    r = rng.standard_normal(convgen.conv2d(x, weight, bias, **kw).shape)

    def loss():
        y = convgen.conv2d(x, weight, bias, **kw)
        return float(np.sum(r * y) + 0.5 * np.sum(y * y))

    dx, dw, db = convgen.conv2d_backward(r + convgen.conv2d(x, weight, bias, **kw), x, weight, **kw)
    for name, array, analytic in (("dx", x, dx), ("dw", weight, dw), ("db", bias, db)):
        err = relative_error(numerical_gradient(loss, array, h=1e-3), analytic)
        assert err < 1e-6, f"{name}: relative error {err:.3g} against central differences"


# ---------------------------------------------------------------------------------------- threads
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_thread_count_gives_the_same_bits(layout, threads):
    """Work items and the order of the weight gradient's partial sums depend on the sizes only."""
    rng = seeded_rng("depthwise-threads", layout)
    window, c = Window(3, 2, 1), 24
    kw = dict(_window_kwargs(window, c, layout), **DEPTHWISE)
    x, weight, bias = _arrays(rng, 4, c, 64, 59, 1, window, layout, np.float32)
    problem = conv_problem(x.shape, weight.shape, x.dtype, window.stride, window.padding, window.dilation, c, layout)
    kernels = kernels_for(problem, True, "depthwise")
    results = []
    for count in (1, 2, 3):
        threads(count)
        planned = {entry: kernels.threads(entry, problem) for entry in ("fwd", "bwd_data", "bwd_weight")}
        assert all(t >= 2 for t in planned.values()) if count > 1 else set(planned.values()) == {1}, planned
        y = convgen.conv2d(x, weight, bias, **kw)
        results.append((y, *convgen.conv2d_backward(np.cos(y), x, weight, **kw)))
    for name, first, *others in zip(("y", "dx", "dw", "db"), *results):
        for other in others:
            np.testing.assert_array_equal(first, other, err_msg=f"{name} differs between thread counts")
    expected = reference.conv2d(x, weight, bias, **{k: v for k, v in kw.items() if k != "algorithm"})
    assert_close(results[0][0], expected, np.float32, "forward")


# ------------------------------------------------------------------------------- names and files
def test_the_family_is_in_the_spec_text_and_symbols():
    spec = ConvSpec(Window(3, 2, 1), "float32", "NHWC", "depthwise")
    assert spec.name == "k3s2p1_depthwise_nhwc_float32"
    generic = spec.generic()
    assert generic == ConvSpec(None, "float32", "NHWC", "depthwise") and generic.name == "generic_depthwise_nhwc_float32"
    for one in (spec, generic, ConvSpec(Window((3, 5), 1, ((0, 1), (2, 1)), 2), "float64", "NCHW", "depthwise")):
        for entry in ("fwd", "bwd_data", "bwd_weight", "workspace", "threads"):
            assert ConvSpec.from_symbol(one.symbol(entry)) == one
    with pytest.raises(ValueError, match="tile is a Winograd parameter"):
        ConvSpec(Window(3, 1, 1), family="depthwise", tile=4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_specialized_source_has_the_taps_written_out(layout):
    """No window loop and no run-time window value: each tap a multiply-add with a weight register."""
    source = render(ConvSpec(Window(3, 2, 1), "float32", layout, "depthwise"), settings().schedule()).source
    for field in ("kh", "kw", "sh", "sw", "pt", "pl", "dh", "dw"):
        assert f"g->{field}" not in source
    assert "for (int64_t i = 0; i <" not in source and "for (int64_t j = 0; j <" not in source
    if layout == "NCHW":  # the filter in broadcast registers, tap 8 of 9 the last
        assert "const vec_t w8 = vsplat(wf[8]);" in source and "w8 * x;" in source
    else:  # tap 8's weight vector of each block, at a constant offset
        assert f"vload(wb + {8 * settings().schedule().lanes('float32')})" in source
    generic = render(ConvSpec(None, "float32", layout, "depthwise"), settings().schedule()).source
    assert "g->kh" in generic and "g->dw" in generic


def test_spec_files_build_the_depthwise_family_when_listed(tmp_path):
    path = tmp_path / "set.toml"
    path.write_text('[[set]]\nwindows = ["k3s1p1", "k5s2p2"]\nlayouts = ["NHWC"]\nalgorithms = ["depthwise"]\n')
    assert load_spec_file(path) == [ConvSpec.parse("k3s1p1", layout="NHWC", family="depthwise"),
                                    ConvSpec.parse("k5s2p2", layout="NHWC", family="depthwise"),
                                    ConvSpec(None, layout="NHWC"), ConvSpec(None, layout="NHWC", family="depthwise")]
    path.write_text('[[set]]\nwindows = ["k3s1p1"]\n')  # not among the defaults
    assert all(spec.family != "depthwise" for spec in load_spec_file(path))


def test_show_prints_the_depthwise_module(capsys):
    assert cli.main(["show", "k5s2p2", "--algorithm", "depthwise", "--op", "backward", "--layout", "NHWC"]) == 0
    out = capsys.readouterr().out
    assert "cg_conv2d_bwd_data_k5s2p2_depthwise_nhwc_float32(" in out and "depthwise 2-D convolution" in out
    assert "cg_conv2d_fwd_" not in out
    assert cli.main(["show", "generic", "--algorithm", "depthwise", "--op", "forward"]) == 0
    assert "cg_conv2d_fwd_generic_depthwise_nchw_float32(" in capsys.readouterr().out
