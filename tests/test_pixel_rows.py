"""The direct family's pixel-row kernels (templates/direct/rows/) against convgen.reference.

They compute every NHWC op, and in NCHW the forward pass of small images, the input gradient and
the weight gradient of few filters or weights, as GEMMs with pixels as rows and channels in the vector lanes,
reading x (forward) and dy (dx) in place through tables of row pointers. The tests force them on
every layer (by default the layers with very few channels, large NCHW forward passes and NCHW weight
gradients of many filters and weights keep the phase-plane kernels) on cases that reach every path:
channel counts that pick each tile width (1 to 4 vectors on AVX-512, 1 to 3 on AVX2) with full and
partial last tiles; windows inside the image (one pointer per pixel, and in NHWC one run per window
row when DW = 1) and at its border (a pointer per tap, the padding's from a row of zeros or the pixel
the padding mode copies; NCHW gathers border rows, or, forward with many taps, copies padded rows);
the NHWC 1x1 forward pass over runs of whole pixel tiles (x's pixels as the rows of one matrix) and
its fused epilogue; strides whose phases have different numbers of taps, phases with no taps at all (stride > kernel)
and dilations; groups; images smaller than the window; tiles cut by the end of a block; in the NCHW
forward pass through padded rows, blocks read in place or not, and tiles across two images; the weight
gradient split into parts of the pixels, and
(NHWC, zero padding) read in place with filters or channels in the lanes, its last tiles overlapping
the ones before, over boxes of whole images or of rows of one, the lanes' operand copied contiguous
where a work item has many row blocks, and work items of every lane tile over a share of the rows. Also:
the same bits on 1, 2 and 3 threads, the plain-loop micro-kernels, the AVX2 and portable schedules,
the default routing, and that the modules carry the kernels.
"""

import numpy as np
import pytest

import convgen
from convgen import reference
from convgen.runtime.kernels import settings
from convgen.codegen.render import render
from convgen.planning.spec import ConvSpec, Window
from helpers import assert_close, seeded_rng, to_layout

LAYOUTS = ("NHWC", "NCHW")
# The pixel rows on every layer, however few its channels or large its NCHW images.
NATIVE = dict(pixel_rows_min_work=1, pixel_rows_dx_vector_share=64, pixel_rows_nchw_max_pixels=10**9,
              pixel_rows_nchw_dw_all_windows=True, pixel_rows_nchw_dw_max_weights=1 << 40)

# (n, c, h, w, f, window, groups): every op of each runs specialized and generic, float32 and float64.
CASES = [
    (2, 5, 7, 8, 6, Window((3, 3), 1, 1), 1),            # few channels and filters, borders everywhere
    (2, 16, 9, 9, 16, Window((3, 3), 1, 1), 1),          # one whole vector of columns (AVX-512 float32)
    (1, 17, 11, 10, 40, Window((3, 3), 2, 1), 1),        # partial tiles; stride-2 phases of 4, 2, 2, 1 taps
    (2, 40, 6, 7, 70, Window((1, 1), 1, 0), 1),          # 1x1: one tap, every pixel inside
    (2, 3, 15, 14, 64, Window((7, 7), 2, 3), 1),         # a stem: 3 channels, 7x7, rows as runs of 21 reals
    (3, 1, 12, 12, 16, Window((5, 5), 1, 2), 1),         # one channel
    (2, 8, 9, 11, 8, Window((3, 3), 1, 1, 2), 1),        # dilation 2
    (2, 6, 11, 10, 4, Window((3, 3), 2, 1, 2), 2),       # groups, dilation and stride
    (2, 12, 10, 9, 36, Window((2, 5), (1, 3), (1, 2)), 3),  # rectangular window, three groups
    (1, 7, 9, 9, 11, Window((1, 1), 3, 0), 1),           # stride > kernel: phases without taps
    (2, 9, 4, 3, 13, Window((5, 5), 1, 2), 1),           # an image smaller than the window
    (1, 24, 1, 1, 130, Window((3, 3), 1, 1), 1),         # a 1x1 image; 130 filters = 2 x 64 + 2
    # Weights larger than the image: forward items are chunks of column tiles of one block, or, where
    # the column tiles share out evenly over the threads, one column tile over every block
    (1, 16, 5, 6, 150, Window((3, 3), 1, 1), 2),         # ... of each group, the tiles uneven over chunks
    (1, 32, 9, 10, 200, Window((3, 3), 1, 1), 1),        # ... of several pixel tiles
    (2, 10, 13, 13, 20, Window((4, 3), (2, 1), ((1, 2), (0, 1)), 1), 1),  # asymmetric padding
    (4, 32, 14, 14, 48, Window((3, 3), 1, 1), 1),        # a block of 96 output pixels and more
    (1, 6, 17, 17, 64, Window((3, 3), 1, 1), 1),         # NHWC dW in place: boxes of output rows
    (2, 40, 7, 6, 12, Window((3, 3), 1, 1), 1),          # NHWC dW in place, channels in the lanes
    (3, 20, 5, 7, 48, Window((1, 1), 1, 0), 2),          # NHWC 1x1 forward: runs of whole tiles, then the last pixels
    (2, 128, 3, 3, 128, Window((3, 3), 1, 1), 1),        # weights larger than the images: a column tile over both
    # NCHW tiles of the pixels whose windows' top (or bottom) rows lie in the zero padding skip them
    (2, 16, 7, 8, 24, Window((3, 3), 1, 2, 2), 1),       # ... one or two rows, at dilation 2
    (3, 16, 9, 9, 20, Window((5, 5), 2, (3, 1)), 1),     # ... at stride 2, three rows above, one below
]
VARIANTS = pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])


def _ids(case):
    n, c, h, w, f, window, groups = case
    return f"{n}x{c}x{h}x{w}-{f}-{window.short()}-g{groups}"


def _arrays(rng, case, dtype, layout):
    n, c, h, w, f, window, groups = case
    x, weight = to_layout(rng.standard_normal((n, c, h, w)), rng.standard_normal((f, c // groups, *window.kernel)),
                          layout)
    return x.astype(dtype), weight.astype(dtype), rng.standard_normal(f).astype(dtype)


def _kwargs(case):
    window, groups = case[5], case[6]
    return dict(stride=window.stride, padding=window.padding, dilation=window.dilation, groups=groups)


def _all_ops(x, weight, bias, dy, case, module, layout, **options):
    """conv2d, its gradients, and the transposed pair (whose kernels are the same three) on dy."""
    kw = dict(_kwargs(case), layout=layout, **options)
    results = {"conv2d": (module.conv2d(x, weight, bias, **kw),),
               "conv2d_backward": module.conv2d_backward(dy, x, weight, **kw)}
    window, (h, w) = case[5], case[2:4]
    output_padding = tuple((size + sum(pads) - extent) % s for size, pads, extent, s in zip(
        (h, w), window.padding, window.effective_kernel, window.stride))
    results["conv_transpose2d"] = (module.conv_transpose2d(dy, weight, output_padding=output_padding, **kw),)
    results["conv_transpose2d_backward"] = module.conv_transpose2d_backward(x, dy, weight, output_padding=output_padding,
                                                                            **kw)
    return results


def _check(got, expected, dtype):
    for op, arrays in expected.items():
        for name, a, e in zip(("", "dx", "dw", "db") if len(arrays) == 1 else ("dx", "dw", "db"), got[op], arrays):
            assert_close(a, e, dtype, f"{op} {name}".strip())


# Every case in the generic build (one module per dtype and layout); specialized, every case in NHWC
# float64, half of them in NCHW float64, a few in NHWC float32 (each window is a module of its own).
GRID = [(case, layout, dtype, False) for case in CASES for layout in LAYOUTS for dtype in ("float32", "float64")] + \
    [(case, "NHWC", "float64", True) for case in CASES] + [(case, "NCHW", "float64", True) for case in CASES[1::2]] + \
    [(case, "NHWC", "float32", True) for case in CASES[2:6]]


@pytest.mark.parametrize("case, layout, dtype, specialize", GRID,
                         ids=lambda v: _ids(v) if isinstance(v, tuple) else ("specialized" if v is True else
                                                                              "generic" if v is False else v))
def test_every_op_matches_the_reference(case, layout, dtype, specialize):
    rng = seeded_rng("pixel rows", case, layout, dtype)
    x, weight, bias = _arrays(rng, case, dtype, layout)
    y = reference.conv2d(x, weight, bias, **_kwargs(case), layout=layout)
    dy = rng.standard_normal(y.shape).astype(dtype)
    expected = _all_ops(x, weight, bias, dy, case, reference, layout)
    with convgen.configure(**NATIVE):
        got = _all_ops(x, weight, bias, dy, case, convgen, layout, specialize=specialize, algorithm="direct")
    _check(got, expected, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@VARIANTS
def test_padding_modes(mode, specialize, layout):
    """The forward pass and dW read the padding from the pixels it copies; dx (which must add the
    padding's gradient back into them) runs the scatter of the phase-plane kernels."""
    rng = seeded_rng("pixel rows modes", mode, specialize, layout)
    x, weight = to_layout(rng.standard_normal((2, 17, 9, 8)), rng.standard_normal((20, 17, 3, 3)), layout)
    kw = dict(stride=(2, 1), padding=((2, 1), (1, 2)), padding_mode=mode, layout=layout)
    dy = rng.standard_normal(reference.conv2d(x, weight, **kw).shape)
    with convgen.configure(**NATIVE):
        y = convgen.conv2d(x, weight, specialize=specialize, algorithm="direct", **kw)
        grads = convgen.conv2d_backward(dy, x, weight, specialize=specialize, algorithm="direct", **kw)
    assert_close(y, reference.conv2d(x, weight, **kw), np.float64, "forward")
    for name, got, want in zip(("dx", "dw", "db"), grads, reference.conv2d_backward(dy, x, weight, **kw)):
        assert_close(got, want, np.float64, name)


# NHWC forward passes through padded bands: of few channels (at most 4), and of windows of 25 taps or
# more at stride 1 over at most 64 channels a group. Each item copies the input rows its run of tiles
# reads; runs start and end inside output rows. Groups, dilation, stride and asymmetric padding; padding
# wider than a stride of the window; several column tiles, the last one partial.
PADDED_BANDS = [
    (2, 4, 11, 10, 12, Window((3, 3), 2, ((1, 2), (0, 1)), 2), 2),
    (3, 2, 6, 9, 20, Window((2, 3), (1, 2), ((2, 0), (3, 1))), 1),
    (3, 20, 9, 11, 70, Window((5, 5), 1, 2), 1),
    (2, 12, 8, 13, 18, Window((5, 7), 1, ((2, 1), (3, 4))), 2),
    (1, 9, 12, 10, 16, Window((5, 5), 1, 4, 2), 1),
]


@pytest.mark.parametrize("mode", ["zeros", "reflect", "circular"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", PADDED_BANDS, ids=_ids)
def test_forward_in_padded_bands(case, dtype, mode, threads):
    """Each band's padding holds the values its mode copies there; 1, 2 and 3 threads split the tiles
    into different runs, with the same bits."""
    rng = seeded_rng("pixel rows padded bands", case, dtype, mode)
    x, weight, bias = _arrays(rng, case, dtype, "NHWC")
    kw = dict(_kwargs(case), padding_mode=mode, layout="NHWC")
    expected = reference.conv2d(x, weight, bias, **kw)
    results = {}
    for count in (1, 2, 3):
        threads(count)
        with convgen.configure(**NATIVE):
            results[count] = convgen.conv2d(x, weight, bias, specialize=False, algorithm="direct", **kw)
        assert_close(results[count], expected, dtype, f"forward on {count} threads")
    for count in (2, 3):
        np.testing.assert_array_equal(results[count], results[1], err_msg=f"forward on {count} threads")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", [CASES[2], CASES[5], CASES[7]], ids=_ids)
def test_adjoint_identities(case, layout):
    """<conv2d(x), dy> = <x, dx> and = <w, dW> (no bias): the input and weight gradients are the
    forward pass's adjoints, whatever path each of the three kernels took."""
    rng = seeded_rng("pixel rows adjoint", case, layout)
    x, weight, _ = _arrays(rng, case, "float64", layout)
    kw = dict(_kwargs(case), algorithm="direct", layout=layout, specialize=False)
    with convgen.configure(**NATIVE):
        y = convgen.conv2d(x, weight, **kw)
        dy = rng.standard_normal(y.shape)
        dx, dw, _ = convgen.conv2d_backward(dy, x, weight, **kw)
    inner = float(np.vdot(y, dy))
    assert abs(inner - float(np.vdot(x, dx))) <= 1e-10 * max(1.0, abs(inner))
    assert abs(inner - float(np.vdot(weight, dw))) <= 1e-10 * max(1.0, abs(inner))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", [CASES[4], CASES[5], CASES[13], CASES[18]], ids=_ids)
def test_every_thread_count_gives_the_same_bits(case, layout, threads):
    """Each output of the pixel-row kernels is summed by one work item in a fixed order, and the weight
    gradient's split of the pixels into parts (few-row layers) depends on the sizes only: 1, 2 and 3
    threads give identical results. (An NCHW weight gradient the phase-plane kernel computes sums per
    thread: it agrees within rounding.)"""
    rng = seeded_rng("pixel rows threads", case, layout)
    x, weight, bias = _arrays(rng, case, "float32", layout)
    dy = rng.standard_normal(reference.conv2d(x, weight, **_kwargs(case), layout=layout).shape).astype(np.float32)
    results = {}
    for count in (1, 2, 3):
        threads(count)
        with convgen.configure(**NATIVE):
            results[count] = _all_ops(x, weight, bias, dy, case, convgen, layout, algorithm="direct", specialize=False)
    for count in (2, 3):
        for op, arrays in results[count].items():
            for name, got, one in zip(("dx", "dw", "db") if len(arrays) == 3 else ("y",), arrays, results[1][op]):
                if layout == "NCHW" and (op, name) in (("conv2d_backward", "dw"), ("conv_transpose2d_backward", "dw")):
                    assert_close(got, one, np.float32, f"{op} {name} on {count} threads")
                else:
                    np.testing.assert_array_equal(got, one, err_msg=f"{op} {name} on {count} threads")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", [
    (1, 64, 40, 40, 192, Window((3, 3), 1, 1), 1),   # filters in the lanes, boxes of rows of one image
    (3, 64, 6, 7, 192, Window((3, 3), 2, 1), 1),     # ... boxes of whole images, at stride 2
    (1, 32, 30, 30, 200, Window((3, 3), 1, 1), 1),   # channels in the lanes (AVX2), filters as rows
], ids=_ids)
def test_nhwc_weight_gradient_in_place_with_its_lanes_copied(case, dtype, threads):
    """Work items of many row blocks (these layers take 4 or more on AVX2 and AVX-512): each box's
    lanes' operand (dy, or x with channels in the lanes), cut to the pixels whose tap lies inside the
    image, is copied contiguous once and read by every row block from there. The reference's dW, and
    the same bits on 1 and 2 threads."""
    rng = seeded_rng("pixel rows dW copied lanes", case, dtype)
    x, weight, _ = _arrays(rng, case, dtype, "NHWC")
    kw = dict(_kwargs(case), layout="NHWC")
    dy = rng.standard_normal(reference.conv2d(x, weight, **kw).shape).astype(dtype)
    expected = reference.conv2d_backward(dy, x, weight, **kw)[1]
    results = []
    for count in (1, 2):
        threads(count)
        with convgen.configure(**NATIVE):
            results.append(convgen.conv2d_backward(dy, x, weight, **kw, algorithm="direct", specialize=False)[1])
        assert_close(results[-1], expected, dtype, f"dw on {count} threads")
    np.testing.assert_array_equal(results[1], results[0])


def _check_nhwc_weight_gradient(rng, case, dtype, specialize, threads, schedule):
    """The NHWC dW of `case` under the schedule overrides `schedule`: the reference's, and the same
    bits on 1, 2 and 3 threads."""
    x, weight, _ = _arrays(rng, case, dtype, "NHWC")
    kw = dict(_kwargs(case), layout="NHWC")
    dy = rng.standard_normal(reference.conv2d(x, weight, **kw).shape).astype(dtype)
    expected = reference.conv2d_backward(dy, x, weight, **kw)[1]
    results = []
    for count in (1, 2, 3):
        threads(count)
        with convgen.configure(**schedule):
            results.append(convgen.conv2d_backward(dy, x, weight, **kw, algorithm="direct", specialize=specialize)[1])
        assert_close(results[-1], expected, dtype, f"dw on {count} threads")
    for count, result in zip((2, 3), results[1:]):
        np.testing.assert_array_equal(result, results[0], err_msg=f"dw on {count} threads")


@pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", [
    (2, 16, 27, 29, 96, Window((1, 1), 1, 0), 1),    # filters in the lanes, parts across two images
    (22, 32, 10, 10, 100, Window((1, 1), 1, 0), 2),  # channels in the lanes (AVX2), boxes of whole images
    (2, 24, 40, 41, 40, Window((3, 3), 1, 1), 1),    # every tap, those at the border cut short
], ids=_ids)
def test_nhwc_weight_gradient_items_of_every_lane_tile(case, dtype, specialize, threads):
    """Layers whose x and dy outweigh their weights many times (few channels or filters over many
    pixels): each work item takes every lane tile and row block of its group for a share of the
    output rows (its part, which may start and end inside an image), the parts summed in part order.
    The reference's dW, and the same bits on 1, 2 and 3 threads."""
    _check_nhwc_weight_gradient(seeded_rng("pixel rows dW whole lane tiles", case, dtype), case, dtype, specialize,
                                threads, NATIVE)


@pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", [
    (2, 32, 17, 18, 3, Window((1, 1), 1, 0), 1),     # 3 filters: fewer than any tile's rows
    (3, 16, 9, 11, 4, Window((1, 1), 1, 0), 1),
    (2, 64, 8, 9, 6, Window((1, 1), 1, 0), 2),       # two groups of 32 -> 3
], ids=_ids)
def test_nhwc_1x1_weight_gradient_of_few_filters(case, dtype, specialize, threads):
    """A 1x1 window over many channels to fewer filters than any tile's rows: by default the pixel
    rows read x in place, each box's dy copied with zeros after its filters (not the phase planes;
    4 filters of float64 fill a tile of 4 rows on AVX2, and take it). The reference's dW, and the
    same bits on 1, 2 and 3 threads."""
    _check_nhwc_weight_gradient(seeded_rng("pixel rows dW padded rows", case, dtype), case, dtype, specialize,
                                threads, {})


# (n, c, h, w, f, window, groups) of groups with as many filters as channels, 1 to 8 of them
SMALL_GROUPS = [
    (2, 64, 9, 11, 64, Window((3, 3), 1, 1), 32),              # 2 a group: both diagonals in one pass (AVX-512)
    (3, 64, 10, 7, 64, Window((5, 5), 2, 2), 16),              # 4 a group, stride 2
    (2, 32, 12, 12, 32, Window((3, 3), 1, 2, 2), 4),           # 8 a group, dilation 2
    (2, 32, 7, 9, 32, Window((2, 3), (2, 1), ((1, 0), (2, 1))), 16),  # rectangular window, asymmetric padding
    (2, 16, 3, 4, 16, Window((5, 5), 1, 4), 8),                # every tap at the border; fewer rows than items
    (2, 32, 8, 8, 32, Window((1, 1), 1, 0), 32),               # one a group (depthwise, taken as direct)
    (1, 16, 6, 5, 16, Window((7, 7), 1, 3), 8),                # 49 taps: too many to unroll
    (2, 24, 6, 6, 24, Window((3, 3), 1, 1), 12),               # 24 channels: a partial vector on AVX-512
    (2, 32, 6, 20, 32, Window((3, 3), 1, 1), 16),              # rows of more pixels than a register block
]


@pytest.mark.parametrize("specialize, dtype", [(True, "float32"), (False, "float32"), (False, "float64")],
                         ids=["specialized-float32", "generic-float32", "generic-float64"])
@pytest.mark.parametrize("case", SMALL_GROUPS, ids=_ids)
def test_nhwc_weight_gradient_of_small_groups_by_diagonals(case, dtype, specialize, threads):
    """Groups of at most 8 channels and as many filters (zero padding, whole vectors of channels)
    take the weight gradient by diagonals: filter m of a group against its channel (m + d) % cg is a
    depthwise weight gradient of x against dy rotated by d within each group (rows_dw_diagonal).
    The reference's dW, and the same bits on 1, 2 and 3 threads (the items' parts of the rows depend
    on the sizes only)."""
    _check_nhwc_weight_gradient(seeded_rng("pixel rows dW diagonals", case, dtype), case, dtype, specialize,
                                threads, {})


@pytest.mark.parametrize("specialize, dtype", [(True, "float32"), (False, "float64")],
                         ids=["specialized-float32", "generic-float64"])
@pytest.mark.parametrize("case", SMALL_GROUPS, ids=_ids)
def test_nhwc_small_groups_forward_and_input_gradient_by_diagonals(case, dtype, specialize, threads):
    """The forward pass of groups of 2, 4 or 8 channels and as many filters (zero padding, whole
    vectors of channels) by diagonals: the sums of each diagonal d, x against the weights of filter
    m of a group and its channel (m + d) % cg in lane m + d, rotated by d into the filters' lanes.
    With the bias and a fused activation and residual (applied once a row is whole). The input
    gradient: at stride 1 with centred padding that forward pass over dy (planner.adjoint_forward),
    else gathered from dy by diagonals the same way, each pixel taking the taps that land on an
    output pixel (strides, uncentred padding; also the transposed convolution's output). The
    reference's y and dx, and the same bits on 1, 2 and 3 threads."""
    rng = seeded_rng("pixel rows diagonal forward", case, dtype)
    x, weight, bias = _arrays(rng, case, dtype, "NHWC")
    kw = dict(_kwargs(case), layout="NHWC")
    y = reference.conv2d(x, weight, bias, **kw)
    residual = rng.standard_normal(y.shape).astype(dtype)
    want = np.maximum(y + residual, 0)
    dy = rng.standard_normal(y.shape).astype(dtype)
    dx_expected = reference.conv2d_backward(dy, x, weight, **kw)[0]
    results = []
    for count in (1, 2, 3):
        threads(count)
        got = convgen.conv2d(x, weight, bias, **kw, activation="relu", residual=residual, algorithm="direct",
                             specialize=specialize)
        dx = convgen.conv2d_backward(dy, x, weight, **kw, algorithm="direct", specialize=specialize)[0]
        assert_close(got, want, dtype, f"y on {count} threads")
        assert_close(dx, dx_expected, dtype, f"dx on {count} threads")
        results.append((got, dx))
    # conv_transpose2d(dy) with these weights is conv2d's input gradient, output_padding aside
    window, (h, w) = case[5], case[2:4]
    output_padding = tuple((size + sum(pads) - extent) % s for size, pads, extent, s in zip(
        (h, w), window.padding, window.effective_kernel, window.stride))
    transposed = convgen.conv_transpose2d(dy, weight, **kw, output_padding=output_padding, algorithm="direct",
                                          specialize=specialize)
    assert_close(transposed, dx_expected, dtype, "conv_transpose2d")
    for count, (got, dx) in zip((2, 3), results[1:]):
        np.testing.assert_array_equal(got, results[0][0], err_msg=f"y on {count} threads")
        np.testing.assert_array_equal(dx, results[0][1], err_msg=f"dx on {count} threads")


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("channels", [3, 20])
@pytest.mark.parametrize("mode, dtype", [("zeros", "float32"), ("zeros", "float64"), ("reflect", "float64"),
                                         ("replicate", "float32"), ("circular", "float64")])
def test_nchw_forward_padded_rows(mode, dtype, channels, count, threads):
    """NCHW forward: every block of pixels reads a copy of the input rows its windows read, channels
    last, with their padding (zeros, or the pixels the mode copies), a run of rows per image it
    touches (its tiles may hold the end of one image and the start of the next). 20 channels over 19
    columns: whole blocks of a vector of channels by a vector of columns transposed in registers (the
    last of a row overlapping the one before it) and the rest a value at a time, for vectors of 4 to
    16 lanes; 3 channels: a plane each. Zero padding above and below only; the other modes pad every
    side. 1 and 2 threads."""
    rng = seeded_rng("pixel rows NCHW padded rows", mode, dtype, channels)
    x = rng.standard_normal((2, channels, 24, 19)).astype(dtype)
    weight, bias = rng.standard_normal((16, channels, 3, 5)).astype(dtype), rng.standard_normal(16).astype(dtype)
    padding = ((1, 1), (0, 0)) if mode == "zeros" else ((2, 1), (1, 2))
    kw = dict(padding=padding, padding_mode=mode, layout="NCHW")
    threads(count)
    with convgen.configure(**NATIVE):
        y = convgen.conv2d(x, weight, bias, algorithm="direct", specialize=False, **kw)
    assert_close(y, reference.conv2d(x, weight, bias, **kw), dtype, "forward")


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [
    dict(x=(2, 16, 23, 9), w=(8, 16, 4, 4), stride=2, padding=1),                    # 4 phases, DCGAN-like
    dict(x=(1, 8, 17, 10), w=(12, 4, 2, 3), stride=3, padding=((1, 0), (2, 1)), groups=2),  # phases without taps
    dict(x=(3, 8, 11, 13), w=(8, 8, 3, 3), padding=3, dilation=2),                   # dy smaller than the halo
    dict(x=(1, 4, 6, 37), w=(20, 4, 3, 3), padding=1),   # 20 filters over 37 columns: transposed in blocks
], ids=["k4s2", "k2x3s3-groups", "k3d2p3", "f20"])
def test_nchw_input_gradient_through_padded_dy(shape, dtype, count, threads):
    """NCHW input gradient (and the transposed convolution, which is one): each item copies the dy rows
    its band of phase rows reads, zero-padded and filters last, and every stride phase reads them with
    no border tiles.
    Bands split tall images, phases may have no taps (dx zero there), dilation reaches past small dy."""
    rng = seeded_rng("pixel rows NCHW dx padded", str(shape), dtype)
    kw = {k: v for k, v in shape.items() if k not in ("x", "w")}
    x = rng.standard_normal(shape["x"]).astype(dtype)
    weight = rng.standard_normal(shape["w"]).astype(dtype)
    dy = rng.standard_normal(reference.conv2d(x, weight, **kw).shape).astype(dtype)
    threads(count)
    with convgen.configure(**NATIVE):
        dx = convgen.conv2d_backward(dy, x, weight, algorithm="direct", specialize=False, **kw)[0]
    expected = reference.conv2d_backward(dy, x, weight, **kw)[0]
    assert_close(dx, expected, dtype, "dx")
    if "groups" not in kw:   # the transposed convolution of dy: dx again, its last rows and columns by output_padding
        s = kw.get("stride", 1)
        d, p = kw.get("dilation", 1), kw["padding"]
        extra = [n - ((m - 1) * s - 2 * p + d * (k - 1) + 1) for n, m, k in zip(x.shape[2:], dy.shape[2:], weight.shape[2:])]
        with convgen.configure(**NATIVE):
            y = convgen.conv_transpose2d(dy, weight, algorithm="direct", specialize=False,
                                         output_padding=tuple(extra), **kw)
        assert_close(y, expected, dtype, "conv_transpose2d")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [
    dict(x=(3, 70, 9, 11), w=(20, 70, 5, 5), padding=2),                    # 70 channels: a partial column tile
    dict(x=(2, 12, 8, 13), w=(18, 6, 5, 7), padding=((2, 1), (3, 4)), groups=2),  # groups, asymmetric padding
    dict(x=(1, 9, 6, 5), w=(16, 9, 5, 5), padding=4, dilation=2),           # dy smaller than the halo
], ids=["c70", "k5x7-groups", "k5d2p4"])
def test_nhwc_input_gradient_through_padded_dy(shape, dtype, threads):
    """NHWC input gradient of a window of 25 taps or more at stride 1 (and the transposed convolution,
    which is one): each item copies the dy rows its band reads, zero-padded, and no tile is a border
    tile. 1, 2 and 3 threads split the rows into different bands, with the same bits."""
    rng = seeded_rng("pixel rows NHWC dx padded", str(shape), dtype)
    kw = {k: v for k, v in shape.items() if k not in ("x", "w")}
    x, weight = to_layout(rng.standard_normal(shape["x"]).astype(dtype), rng.standard_normal(shape["w"]).astype(dtype), "NHWC")
    kw["layout"] = "NHWC"
    dy = rng.standard_normal(reference.conv2d(x, weight, **kw).shape).astype(dtype)
    expected = reference.conv2d_backward(dy, x, weight, **kw)[0]
    results = {}
    for count in (1, 2, 3):
        threads(count)
        with convgen.configure(**NATIVE):
            results[count] = convgen.conv2d_backward(dy, x, weight, algorithm="direct", specialize=False, **kw)[0]
        assert_close(results[count], expected, dtype, f"dx on {count} threads")
        np.testing.assert_array_equal(results[count], results[1], err_msg=f"dx on {count} threads")
    if "groups" not in kw:   # the transposed convolution of dy ((KH, KW, C, F) weights are its (KH, KW, C_out, C_in))
        with convgen.configure(**NATIVE):
            y = convgen.conv_transpose2d(dy, weight, algorithm="direct", specialize=False, **kw)
        assert_close(y, expected, dtype, "conv_transpose2d")


@pytest.mark.parametrize("window", [Window((5, 5), 1, 2), Window((3, 3), 2, 1)], ids=lambda w: w.short())
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_weights_packed_by_every_thread(layout, dtype, window, threads):
    """The forward passes pack the weights inside their parallel region, each thread a share of B's
    rows (group, column tile, channel), every tap of a row at once: two groups of 8 channels and 70
    filters (several column tiles, the last one partial), through padded rows (NCHW 5x5) or in place
    (the rest), on 1 and 2 threads."""
    rng = seeded_rng("pixel rows packed by the threads", layout, dtype, window.short())
    case = (4, 16, 16, 16, 140, window, 2)
    x, weight, bias = _arrays(rng, case, dtype, layout)
    kw = dict(_kwargs(case), layout=layout)
    expected = reference.conv2d(x, weight, bias, **kw)
    for count in (1, 2):
        threads(count)
        with convgen.configure(**NATIVE):
            got = convgen.conv2d(x, weight, bias, algorithm="direct", specialize=False, **kw)
        assert_close(got, expected, dtype, f"forward on {count} threads")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("path", [dict(ukernel="reference"), dict(isa="avx2"), dict(isa="portable")],
                         ids=["reference-microkernels", "avx2", "portable"])
@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[7], CASES[11], CASES[18]], ids=_ids)
def test_other_schedules(case, path, layout):
    """The plain-loop micro-kernels, and the tile widths of the AVX2 and portable schedules (generic
    builds: one module each)."""
    rng = seeded_rng("pixel rows schedules", case, layout)
    x, weight, bias = _arrays(rng, case, "float32", layout)
    y = reference.conv2d(x, weight, bias, **_kwargs(case), layout=layout)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    expected = _all_ops(x, weight, bias, dy, case, reference, layout)
    with convgen.configure(**path, **NATIVE):
        got = _all_ops(x, weight, bias, dy, case, convgen, layout, algorithm="direct", specialize=False)
    _check(got, expected, "float32")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", [CASES[0], CASES[5], CASES[7]], ids=_ids)
def test_the_default_routing(case, layout):
    """By default the layers with very few channels run the phase-plane kernels (but the NHWC forward
    pass of 1 to 4 channels the pixel rows' padded bands), others the pixel rows: either way, the
    reference's results."""
    rng = seeded_rng("pixel rows routing", case, layout)
    x, weight, bias = _arrays(rng, case, "float64", layout)
    dy = rng.standard_normal(reference.conv2d(x, weight, **_kwargs(case), layout=layout).shape)
    expected = _all_ops(x, weight, bias, dy, case, reference, layout)
    _check(_all_ops(x, weight, bias, dy, case, convgen, layout, algorithm="direct", specialize=False), expected,
           "float64")


def test_the_modules_carry_the_pixel_rows():
    """The direct modules call the pixel-row kernels for every op in both layouts; the Winograd
    modules for the weight gradient (theirs is the direct family's)."""
    schedule = settings().schedule()
    for layout in LAYOUTS:
        direct = render(ConvSpec(Window((3, 3), 2, 1), "float32", layout), schedule).source
        for name in ("rows_forward(g,", "rows_backward_data(g,", "rows_backward_weight(g,"):
            assert name in direct
        winograd = render(ConvSpec(Window((3, 3), 1, 1), "float32", layout, family="winograd", tile=4), schedule).source
        assert "return rows_backward_weight(g," in winograd


@pytest.mark.parametrize("window, size, moves", [
    (Window((1, 1), 1, 0), 11, True), (Window((3, 3), 2, 1), 11, True), (Window((3, 3), 1, 1), 11, False),
    (Window((1, 1), 2, 0), 8, False)], ids=["1x1", "3x3s2", "3x3s1", "1x1s2-4x4-outputs"])
def test_nchw_weight_gradient_of_1x1_and_strided_windows_can_keep_the_phase_planes(window, size, moves):
    """pixel_rows_nchw_dw_all_windows=False (AVX2's default) moves the NCHW weight gradient of 1x1
    and strided windows to the phase planes (the workspace it asks for changes to theirs), but leaves
    stride-1 windows of several taps and outputs of fewer than 32 pixels on the pixel rows (the same
    workspace); the reference's results either way."""
    from convgen.frontend import ops

    case = (2, 16, size + 1, size, 32, window, 1)
    rng = seeded_rng("nchw dw routing", window.short())
    x, weight, _ = _arrays(rng, case, "float64", "NCHW")
    dy = rng.standard_normal(reference.conv2d(x, weight, **_kwargs(case)).shape)
    _, dw_expected, _ = reference.conv2d_backward(dy, x, weight, **_kwargs(case))
    workspace = {}
    for all_windows in (True, False):
        with convgen.configure(pixel_rows_nchw_dw_all_windows=all_windows):
            _, call = ops._prepare("conv2d_backward", (dy, x, weight), False, "direct", window.stride,
                                   window.padding, 1, 1, "NCHW", padding_mode="zeros")
            workspace[all_windows] = call.kernels().workspace_bytes("bwd_weight", call.problem, 2)
            _, dw, _ = convgen.conv2d_backward(dy, x, weight, specialize=False, algorithm="direct", **_kwargs(case))
            assert_close(dw, dw_expected, "float64", f"all_windows={all_windows}")
    assert (workspace[True] != workspace[False]) == moves


@pytest.mark.parametrize("filters, moves", [(72, True), (64, False)])
def test_nchw_weight_gradient_of_many_filters_takes_the_rows_below_the_weight_bound(filters, moves):
    """pixel_rows_nchw_dw_max_weights: the NCHW weight gradient of more than 64 filters a group takes
    the pixel rows below that many weights a group, else the phase planes (0, AVX2's default: never);
    64 filters or fewer take the rows either way. The workspace it asks for says which; the
    reference's results either way."""
    from convgen.frontend import ops

    case = (2, 16, 9, 8, filters, Window((3, 3), 1, 1), 1)
    rng = seeded_rng("nchw dw weight bound", filters)
    x, weight, _ = _arrays(rng, case, "float64", "NCHW")
    dy = rng.standard_normal(reference.conv2d(x, weight, **_kwargs(case)).shape)
    _, dw_expected, _ = reference.conv2d_backward(dy, x, weight, **_kwargs(case))
    workspace = {}
    for bound in (0, 1 << 18):
        with convgen.configure(pixel_rows_nchw_dw_max_weights=bound):
            _, call = ops._prepare("conv2d_backward", (dy, x, weight), False, "direct", 1, 1, 1, 1, "NCHW",
                                   padding_mode="zeros")
            workspace[bound] = call.kernels().workspace_bytes("bwd_weight", call.problem, 2)
            _, dw, _ = convgen.conv2d_backward(dy, x, weight, specialize=False, algorithm="direct", **_kwargs(case))
            assert_close(dw, dw_expected, "float64", f"pixel_rows_nchw_dw_max_weights={bound}")
    assert (workspace[0] != workspace[1 << 18]) == moves


@pytest.mark.parametrize("layout", LAYOUTS)
def test_input_gradient_rounding_does_not_grow_with_the_filters(layout):
    """A 1x1 input gradient sums over every filter: 2048 products a pixel here. The pixel rows sum them
    in blocks of 64 whose partial sums join a running sum, so float32's error stays near that of one
    block (measured 1.8e-7 relative, as PyTorch's; one running sum measured 7.8-8.1e-7)."""
    rng = np.random.default_rng(5)
    x, dy = rng.standard_normal((2, 32, 6, 6)), rng.standard_normal((2, 2048, 6, 6))
    weight = rng.standard_normal((2048, 32, 1, 1))
    dy = to_layout(dy, weight, layout)[0]
    x, weight = to_layout(x, weight, layout)
    want = reference.conv2d_backward(dy, x, weight, layout=layout)[0]
    for specialize in (True, False):
        dx = convgen.conv2d_backward(*(a.astype(np.float32) for a in (dy, x, weight)), layout=layout,
                                     specialize=specialize)[0]
        error = np.linalg.norm(dx - want) / np.linalg.norm(want)
        assert error <= 3.5e-7, (specialize, error)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_rounding_does_not_grow_with_the_channels(layout):
    """A 3x3 forward pass over 512 channels sums 4608 products a pixel. The pixel rows sum them in
    blocks of 64 whose partial sums join a running sum: float32's error stays near PyTorch's
    (measured 2.3e-7 relative here in blocks of 128; one running sum measured 1.06e-6)."""
    rng = np.random.default_rng(6)
    x, weight = to_layout(rng.standard_normal((2, 512, 4, 4)), rng.standard_normal((32, 512, 3, 3)), layout)
    want = reference.conv2d(x, weight, padding=1, layout=layout)
    for specialize in (True, False):
        y = convgen.conv2d(x.astype(np.float32), weight.astype(np.float32), padding=1, layout=layout,
                           specialize=specialize, algorithm="direct")
        error = np.linalg.norm(y - want) / np.linalg.norm(want)
        assert error <= 3.5e-7, (specialize, error)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_short_sums_run_in_blocks_too(layout):
    """MobileNetV2's 1x1 projections sum 144-192 products a pixel, over non-negative activations: in
    blocks of 64 float32's error is PyTorch's (measured 1.5-1.7e-7 relative here, PyTorch 1.6-1.7e-7
    on the model's own layers); summed in one block it was 2.4-2.7e-7."""
    rng = np.random.default_rng(7)
    x, weight = to_layout(rng.random((8, 192, 14, 14)) * 3, rng.standard_normal((32, 192, 1, 1)) / 14, layout)
    want = reference.conv2d(x, weight, layout=layout)
    for specialize in (True, False):
        y = convgen.conv2d(x.astype(np.float32), weight.astype(np.float32), layout=layout, specialize=specialize,
                           algorithm="direct")
        error = np.linalg.norm(y - want) / np.linalg.norm(want)
        assert error <= 2.0e-7, (specialize, error)


@pytest.mark.parametrize("groups, size, moves", [(3, 9, True), (1, 9, False), (3, 7, False)],
                         ids=["grouped", "ungrouped", "grouped-small-image"])
def test_nhwc_input_gradient_of_few_channels_per_group_can_take_the_pixel_rows(groups, size, moves):
    """pixel_rows_nhwc_dx_grouped_pixels (AVX2's default 1024) moves the NHWC input gradient of a
    grouped convolution over images of at least that many pixels to the pixel rows, whatever few
    channels its groups have (the workspace it asks for changes to theirs), but not an ungrouped one
    or a smaller image; the reference's dx either way."""
    from convgen.frontend import ops

    rng = seeded_rng("nhwc grouped dx routing", groups, size)
    c = 2 * groups  # (two channels a group: less than a float32 vector on every ISA; share 1 below)
    x, weight = (a.astype(np.float32) for a in to_layout(rng.standard_normal((2, c, size, size)),
                                                          rng.standard_normal((6, 2, 3, 3)), "NHWC"))
    dy = rng.standard_normal(reference.conv2d(x, weight, padding=1, groups=groups, layout="NHWC").shape)
    dy = dy.astype(np.float32)
    dx_expected = reference.conv2d_backward(dy, x, weight, padding=1, groups=groups, layout="NHWC")[0]
    workspace = {}
    for pixels in (0, 64):
        with convgen.configure(pixel_rows_nhwc_dx_grouped_pixels=pixels, pixel_rows_dx_vector_share=1):
            _, call = ops._prepare("conv2d_backward", (dy, x, weight), True, "direct", 1, 1, 1, groups, "NHWC",
                                   padding_mode="zeros")
            workspace[pixels] = call.kernels().workspace_bytes("bwd_data", call.problem, 2)
            dx = convgen.conv2d_backward(dy, x, weight, padding=1, groups=groups, layout="NHWC", algorithm="direct")[0]
            assert_close(dx, dx_expected, "float32", f"pixels={pixels}")
    assert (workspace[0] != workspace[64]) == moves


@pytest.mark.parametrize("residual_position", ["before", "after"])
def test_nhwc_1x1_forward_runs_its_epilogue_over_whole_runs_and_the_last_pixels(residual_position):
    """The NHWC 1x1 stride-1 forward pass (rows_gemm_run over a block's whole tiles, then a tile at a
    time) applies a fused activation and residual to every output: whole and partial column tiles
    (50 filters), whole pixel tiles and the last few pixels (35 per image), generic build."""
    rng = seeded_rng("pixel rows linear epilogue", residual_position)
    x, weight = to_layout(rng.standard_normal((3, 20, 5, 7)), rng.standard_normal((50, 20, 1, 1)), "NHWC")
    bias, residual = rng.standard_normal(50), rng.standard_normal((3, 5, 7, 50))
    y = reference.conv2d(x, weight, bias, layout="NHWC")
    want = np.maximum(y + residual, 0) if residual_position == "before" else np.maximum(y, 0) + residual
    got = convgen.conv2d(x, weight, bias, layout="NHWC", activation="relu", residual=residual,
                         residual_position=residual_position, specialize=False, algorithm="direct")
    assert_close(got, want, "float64", "y")
