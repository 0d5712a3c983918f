"""The direct family's native NHWC kernels (templates/direct/nhwc.c.j2) against convgen.reference.

In NHWC the direct family computes every op as a GEMM with pixels as rows and channels in the vector
lanes, reading x (forward, dW) and dy (dx) in place through tables of row pointers. The cases reach
every path of those kernels: channel counts that pick each tile width (1 to 4 vectors on AVX-512, 1 to
3 on AVX2) with full and partial last tiles; windows inside the image (one pointer per pixel, and one
run per window row when DW = 1) and at its border (a pointer per tap, the padding's from a row of zeros
or the pixel the padding mode copies); strides whose phases have different numbers of taps, phases
with no taps at all (stride > kernel) and dilations; groups; images smaller than the window; tiles
cut by the end of a block; the weight gradient split into parts of the pixels. Also: the same bits on
1, 2 and 3 threads, the plain-loop micro-kernels, the AVX2 and portable schedules, and that the NHWC
module is the native one.
"""

import numpy as np
import pytest

import convgen
from convgen import reference
from convgen.kernels import settings
from convgen.render import render
from convgen.spec import ConvSpec, Window
from helpers import assert_close, seeded_rng, to_layout

DIRECT = dict(algorithm="direct", layout="NHWC")
# The native kernels on every layer, however few its channels (by default those keep the phase planes).
NATIVE = dict(nhwc_min_work=1, nhwc_dx_vector_share=64)

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
    (2, 10, 13, 13, 20, Window((4, 3), (2, 1), ((1, 2), (0, 1)), 1), 1),  # asymmetric padding
    (4, 32, 14, 14, 48, Window((3, 3), 1, 1), 1),        # a block of 96 output pixels and more
]
VARIANTS = pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])


def _ids(case):
    n, c, h, w, f, window, groups = case
    return f"{n}x{c}x{h}x{w}-{f}-{window.short()}-g{groups}"


def _arrays(rng, case, dtype):
    n, c, h, w, f, window, groups = case
    x, weight = to_layout(rng.standard_normal((n, c, h, w)), rng.standard_normal((f, c // groups, *window.kernel)),
                          "NHWC")
    return x.astype(dtype), weight.astype(dtype), rng.standard_normal(f).astype(dtype)


def _kwargs(case):
    window, groups = case[5], case[6]
    return dict(stride=window.stride, padding=window.padding, dilation=window.dilation, groups=groups)


def _all_ops(x, weight, bias, dy, case, module, **options):
    """conv2d, its gradients, and the transposed pair (whose kernels are the same three) on dy."""
    kw = dict(_kwargs(case), layout="NHWC", **options)
    results = {"conv2d": (module.conv2d(x, weight, bias, **kw),),
               "conv2d_backward": module.conv2d_backward(dy, x, weight, **kw)}
    window, (h, w) = case[5], x.shape[1:3]
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


# Every case in the generic build (one module per dtype); specialized, every case in float64 and a few
# in float32 (each window is a module of its own, compiled for this test).
GRID = [(case, dtype, False) for case in CASES for dtype in ("float32", "float64")] + \
    [(case, "float64", True) for case in CASES] + [(case, "float32", True) for case in CASES[2:6]]


@pytest.mark.parametrize("case, dtype, specialize", GRID,
                         ids=lambda v: _ids(v) if isinstance(v, tuple) else ("specialized" if v is True else
                                                                              "generic" if v is False else v))
def test_every_op_matches_the_reference(case, dtype, specialize):
    rng = seeded_rng("nhwc", case, dtype)
    x, weight, bias = _arrays(rng, case, dtype)
    y = reference.conv2d(x, weight, bias, **_kwargs(case), layout="NHWC")
    dy = rng.standard_normal(y.shape).astype(dtype)
    expected = _all_ops(x, weight, bias, dy, case, reference)
    with convgen.configure(**NATIVE):
        got = _all_ops(x, weight, bias, dy, case, convgen, specialize=specialize, algorithm="direct")
    _check(got, expected, dtype)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@VARIANTS
def test_padding_modes(mode, specialize):
    """The forward pass and dW read the padding from the pixels it copies; dx (which must add the
    padding's gradient back into them) runs the scatter of the phase-plane kernels."""
    rng = seeded_rng("nhwc modes", mode, specialize)
    x = rng.standard_normal((2, 9, 8, 17))
    weight = rng.standard_normal((3, 3, 17, 20))
    kw = dict(stride=(2, 1), padding=((2, 1), (1, 2)), padding_mode=mode, layout="NHWC")
    dy = rng.standard_normal(reference.conv2d(x, weight, **kw).shape)
    with convgen.configure(**NATIVE):
        y = convgen.conv2d(x, weight, specialize=specialize, algorithm="direct", **kw)
        grads = convgen.conv2d_backward(dy, x, weight, specialize=specialize, algorithm="direct", **kw)
    assert_close(y, reference.conv2d(x, weight, **kw), np.float64, "forward")
    for name, got, want in zip(("dx", "dw", "db"), grads, reference.conv2d_backward(dy, x, weight, **kw)):
        assert_close(got, want, np.float64, name)


@pytest.mark.parametrize("case", [CASES[2], CASES[5], CASES[7]], ids=_ids)
def test_adjoint_identities(case):
    """<conv2d(x), dy> = <x, dx> and = <w, dW> (no bias): the input and weight gradients are the
    forward pass's adjoints, whatever path each of the three kernels took."""
    rng = seeded_rng("nhwc adjoint", case)
    x, weight, _ = _arrays(rng, case, "float64")
    kw = dict(_kwargs(case), **DIRECT)
    with convgen.configure(**NATIVE):
        y = convgen.conv2d(x, weight, **kw)
        dy = rng.standard_normal(y.shape)
        dx, dw, _ = convgen.conv2d_backward(dy, x, weight, **kw)
    inner = float(np.vdot(y, dy))
    assert abs(inner - float(np.vdot(x, dx))) <= 1e-10 * max(1.0, abs(inner))
    assert abs(inner - float(np.vdot(weight, dw))) <= 1e-10 * max(1.0, abs(inner))


@pytest.mark.parametrize("case", [CASES[4], CASES[5], CASES[13]], ids=_ids)
def test_every_thread_count_gives_the_same_bits(case, threads):
    """Each output is summed by one work item in a fixed order, and the weight gradient's split of the
    pixels into parts (one-channel and few-row layers) depends on the sizes only: 1, 2 and 3 threads
    give identical results."""
    rng = seeded_rng("nhwc threads", case)
    x, weight, bias = _arrays(rng, case, "float32")
    dy = rng.standard_normal(reference.conv2d(x, weight, **_kwargs(case), layout="NHWC").shape).astype(np.float32)
    results = {}
    for count in (1, 2, 3):
        threads(count)
        with convgen.configure(**NATIVE):
            results[count] = _all_ops(x, weight, bias, dy, case, convgen, algorithm="direct")
    for count in (2, 3):
        for op, arrays in results[count].items():
            for got, one in zip(arrays, results[1][op]):
                np.testing.assert_array_equal(got, one, err_msg=f"{op} on {count} threads")


@pytest.mark.parametrize("path", [dict(ukernel="reference"), dict(isa="avx2"), dict(isa="portable")],
                         ids=["reference-microkernels", "avx2", "portable"])
@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[7], CASES[11]], ids=_ids)
def test_other_schedules(case, path):
    """The plain-loop micro-kernels, and the tile widths of the AVX2 and portable schedules (generic
    builds: one module each)."""
    rng = seeded_rng("nhwc schedules", case)
    x, weight, bias = _arrays(rng, case, "float32")
    y = reference.conv2d(x, weight, bias, **_kwargs(case), layout="NHWC")
    dy = rng.standard_normal(y.shape).astype(np.float32)
    expected = _all_ops(x, weight, bias, dy, case, reference)
    with convgen.configure(**path, **NATIVE):
        got = _all_ops(x, weight, bias, dy, case, convgen, algorithm="direct", specialize=False)
    _check(got, expected, "float32")


@pytest.mark.parametrize("case", [CASES[0], CASES[5], CASES[7]], ids=_ids)
def test_few_channels_keep_the_phase_planes(case):
    """By default the layers with very few channels run the phase-plane kernels, whose results the
    native ones must match (both against the reference)."""
    rng = seeded_rng("nhwc routing", case)
    x, weight, bias = _arrays(rng, case, "float64")
    dy = rng.standard_normal(reference.conv2d(x, weight, **_kwargs(case), layout="NHWC").shape)
    expected = _all_ops(x, weight, bias, dy, case, reference)
    _check(_all_ops(x, weight, bias, dy, case, convgen, algorithm="direct"), expected, "float64")


def test_the_nhwc_module_is_the_native_one():
    """NHWC modules carry the native kernels (and call them); NCHW modules do not."""
    window = Window((3, 3), 2, 1)
    schedule = settings().schedule()
    nhwc = render(ConvSpec(window, "float32", "NHWC"), schedule).source
    nchw = render(ConvSpec(window, "float32", "NCHW"), schedule).source
    for name in ("nhwc_forward(g,", "nhwc_backward_data(g,", "nhwc_backward_weight(g,"):
        assert name in nhwc and name not in nchw
