"""Property tests: all four ops agree with convgen.reference on random convolutions.

hypothesis draws the op, layout, dtype, variant, algorithm (Winograd forced wherever it applies, the
depthwise family forced on half the calls with one channel per group on its prebuilt windows),
batch (0 included), channels and groups (depthwise
included), image size, padding form, output_padding and how the arrays are stored. Specialized
calls draw their window from the windows tests/grid.py prebuilds, so no draw costs a compile;
generic calls draw any window (kernel 1-5, stride 1-3, per-side padding 0-3, dilation 1-3) and
any padding form ("same" and "valid" included), since one generic module serves them all.

About one example in eight is large: channels chosen so the call is over 6 MFLOP, which the
kernels plan on several threads (asserted through their thread query) and split into several
pixel, K or filter blocks. Sizes the reference refuses (about one example in ten) must be refused
with a ValueError by each of the four ops, forward and backward.

Examples are derandomized so `make test` is reproducible; CONVGEN_HYPOTHESIS=explore runs many
more, randomly, to look for new failures. CONVGEN_PROPERTY_WINDOWS="k3s2p1 k1" narrows the
specialized windows (the quick sanitizer run builds only those).
"""

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import convgen
from convgen import reference
from convgen.planning.spec import Window, winograd_computes
from grid import DEPTHWISE_WINDOWS, FORWARD_WINDOWS, GRADIENT_WINDOWS
from helpers import assert_close, planned_threads

settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("CONVGEN_HYPOTHESIS", "ci")

if os.environ.get("CONVGEN_PROPERTY_WINDOWS"):
    PREBUILT = [Window.parse(text) for text in os.environ["CONVGEN_PROPERTY_WINDOWS"].split()]
else:
    PREBUILT = sorted(set(FORWARD_WINDOWS + GRADIENT_WINDOWS), key=Window.short)
# The prebuilt windows Winograd computes: drawn one time in four, so forced Winograd gets examples.
WINOGRAD_PREBUILT = [w for w in PREBUILT if winograd_computes(w)]
# The prebuilt windows the depthwise family is built for too (tests/grid.py, every dtype and layout):
# drawn one time in four; a call with one channel per group then forces the family half the time.
DEPTHWISE_PREBUILT = [w for w in PREBUILT if w in DEPTHWISE_WINDOWS]


@st.composite
def windows(draw, specialize):
    """(kernel, stride, padding argument, dilation): a prebuilt window, or any window if generic."""
    if specialize:
        pool = draw(st.integers(0, 3))
        window = draw(st.sampled_from(WINOGRAD_PREBUILT if pool == 3 and WINOGRAD_PREBUILT else
                                      DEPTHWISE_PREBUILT if pool == 2 and DEPTHWISE_PREBUILT else PREBUILT))
        padding = window.padding
        (pt, pb), (pl, pr) = padding
        if pt == pb and pl == pr:  # the same window, written in the other forms
            padding = draw(st.sampled_from([padding, (pt, pl)] + ([pt] if pt == pl else [])))
        return window.kernel, window.stride, padding, window.dilation
    kernel = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    pads = st.integers(0, 3)
    padding = draw(st.one_of(
        st.tuples(st.tuples(pads, pads), st.tuples(pads, pads)),
        st.tuples(pads, pads),
        pads,
        st.sampled_from(["same", "valid"])))
    return kernel, stride, padding, dilation


def _stored(array, how):
    if how == "fortran":
        return np.asfortranarray(array)
    if how == "strided":
        big = np.zeros(array.shape + (2,), array.dtype)
        big[..., 0] = array
        return big[..., 0]
    assert array.flags.c_contiguous, "a case's arrays are made C-contiguous in either layout"
    return array


# Large examples are at least this many FLOPs: the kernels give each thread 2 MFLOP or more.
LARGE_FLOPS = 6_000_000


@st.composite
def cases(draw, op):
    transposed = op.startswith("conv_transpose2d")
    specialize = draw(st.booleans())
    layout = draw(st.sampled_from(["NCHW", "NHWC"]))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    kernel, stride, padding, dilation = draw(windows(specialize))
    groups = draw(st.integers(1, 3))
    large = draw(st.integers(0, 7)) == 7  # about one example in eight
    n = draw(st.integers(1, 3) if large else st.integers(0, 3))
    more = 12 if large else 0  # larger images for the large examples
    extent = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    # Winograd forced wherever it applies (a specialized 3x3 window at stride 1 without dilation).
    winograd_applies = specialize and winograd_computes(Window(kernel, stride, 0, dilation))
    algorithm = draw(st.sampled_from(["auto", "direct", "winograd"] if winograd_applies else ["auto", "direct"]))
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, layout=layout,
                  specialize=specialize, algorithm=algorithm)
    if transposed:
        h, w = draw(st.integers(1, 7 + more)), draw(st.integers(1, 7 + more))
        if padding != "same":
            kwargs["output_padding"] = tuple(draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
        pixels = h * w  # the transposed call's input is the output of the convolution its kernels run
    else:
        explicit = Window.resolve(kernel, stride, padding, dilation, (1, 1)).padding if padding != "same" \
            else ((0, 0), (0, 0))
        # large enough for the dilated kernel after padding ("same" pads whatever it needs) ...
        fits = [max(e - sum(p), 0) for e, p in zip(extent, explicit)]
        h, w = (draw(st.integers(low + more, low + 8 + 2 * more)) for low in fits)
        if not large and draw(st.sampled_from(["fits"] * 7 + ["too short"])) == "too short":
            # ... but about one in eight rows is 1 or 2 short (when padding does not cover it): sizes
            # every op must refuse
            h = draw(st.integers(max(fits[0] - 2, 0), max(fits[0] - 1, 0)))
        try:
            pixels = math.prod(Window.resolve(kernel, stride, padding, dilation, (h, w)).output_size((h, w)))
        except ValueError:
            pixels = 0  # the reference refuses these sizes; so must convgen
    per_group_in, per_group_out = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    if large:
        per_group_out = draw(st.integers(4, 16))
        if pixels > 0:  # enough input channels for LARGE_FLOPS (at most 256 per group)
            per_group_in = min(256, max(per_group_in, math.ceil(
                LARGE_FLOPS / (2 * n * groups * per_group_out * kernel[0] * kernel[1] * pixels))))
    c_in, c_out = groups * per_group_in, groups * per_group_out
    # One channel per group of the convolution the kernels run (a transposed call's output): the
    # depthwise family computes it, specialized for its prebuilt windows or generic.
    if (per_group_out if transposed else per_group_in) == 1 and draw(st.booleans()) and (
            not specialize or Window(kernel, stride, padding, dilation) in DEPTHWISE_PREBUILT):
        kwargs["algorithm"] = "depthwise"
    weight_shape = (c_in, c_out // groups, *kernel) if transposed else (c_out, c_in // groups, *kernel)
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c_in, h, w))
    weight = rng.standard_normal(weight_shape)
    if layout == "NHWC":  # C-contiguous in NHWC too: the "C" storage below is what it claims to be
        x, weight = np.ascontiguousarray(x.transpose(0, 2, 3, 1)), np.ascontiguousarray(weight.transpose(2, 3, 1, 0))
    bias = rng.standard_normal(c_out)
    flops = 2 * n * groups * per_group_in * per_group_out * kernel[0] * kernel[1] * pixels
    return dict(x=x.astype(dtype), w=weight.astype(dtype), bias=bias.astype(dtype), kwargs=kwargs,
                stored=draw(st.sampled_from(["C", "fortran", "strided"])), rng=rng, dtype=dtype,
                kernel=kernel, stride=stride, padding=padding, dilation=dilation, flops=flops)


def _geometry_is_valid(op, case):
    """Whether the reference accepts the drawn sizes (transposed outputs can come out empty)."""
    forward = "conv_transpose2d" if op.startswith("conv_transpose2d") else "conv2d"
    ref_kwargs = {k: v for k, v in case["kwargs"].items() if k not in ("specialize", "algorithm")}
    try:
        return getattr(reference, forward)(case["x"], case["w"], **ref_kwargs).shape
    except ValueError:
        return None


def _refused(module, op, case, kwargs):
    """`op` of `module` refuses the case's sizes with a ValueError (dy is x-shaped: no shape fits)."""
    x, w = case["x"], case["w"]
    args = (np.zeros_like(x), x, w) if op.endswith("backward") else (x, w)
    with pytest.raises(ValueError):
        getattr(module, op)(*args, **kwargs)


def check(op, case):
    ref_kwargs = {k: v for k, v in case["kwargs"].items() if k not in ("specialize", "algorithm")}
    out_shape = _geometry_is_valid(op, case)
    event("refused" if out_shape is None else "several threads" if case["flops"] >= LARGE_FLOPS else "small")
    event(f"algorithm={case['kwargs']['algorithm']}")
    if out_shape is None:
        # sizes the reference refuses must be refused by convgen too, never computed, by every op
        _refused(reference, op, case, ref_kwargs)
        _refused(convgen, op, case, case["kwargs"])
        return
    stored = case["stored"]
    x, w = _stored(case["x"], stored), _stored(case["w"], stored)
    if case["flops"] >= LARGE_FLOPS:
        window = Window.resolve(case["kernel"], case["stride"], case["padding"], case["dilation"],
                                case["x"].shape[2:] if case["kwargs"]["layout"] == "NCHW" else case["x"].shape[1:3],
                                op.startswith("conv_transpose2d"))
        planned = planned_threads(op, case["x"], np.empty(out_shape, case["dtype"]), window, case["kwargs"]["groups"],
                                  case["kwargs"]["layout"], case["kwargs"]["specialize"],
                                  algorithm=case["kwargs"]["algorithm"])
        # The call runs on several threads. (Not every entry need: dW splits (image, group, 128
        # output pixels) units, so one image of at most 128 pixels is one unit, one thread.)
        assert max(planned.values()) >= 2, f"{op}: {case['flops']} FLOPs planned on {planned} threads"
    if op.endswith("backward"):
        dy = case["rng"].standard_normal(out_shape).astype(case["dtype"])
        got = getattr(convgen, op)(_stored(dy, stored), x, w, **case["kwargs"])
        expected = getattr(reference, op)(dy, case["x"], case["w"], **ref_kwargs)
        for name, a, e in zip(("dx", "dw", "db"), got, expected):
            assert_close(a, e, case["dtype"], f"{op} {name}")
    else:
        got = getattr(convgen, op)(x, w, _stored(case["bias"], stored), **case["kwargs"])
        expected = getattr(reference, op)(case["x"], case["w"], case["bias"], **ref_kwargs)
        assert_close(got, expected, case["dtype"], op)


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """Two threads whatever the machine: the large examples are planned on both."""
    previous = convgen.num_threads()
    convgen.set_num_threads(2)
    yield
    convgen.set_num_threads(previous)


@settings(settings.get_profile(PROFILE))
@given(case=cases("conv2d"))
def test_conv2d_matches_reference(case):
    check("conv2d", case)


@settings(settings.get_profile(PROFILE))
@given(case=cases("conv2d_backward"))
def test_conv2d_backward_matches_reference(case):
    check("conv2d_backward", case)


@settings(settings.get_profile(PROFILE))
@given(case=cases("conv_transpose2d"))
def test_conv_transpose2d_matches_reference(case):
    check("conv_transpose2d", case)


@settings(settings.get_profile(PROFILE))
@given(case=cases("conv_transpose2d_backward"))
def test_conv_transpose2d_backward_matches_reference(case):
    check("conv_transpose2d_backward", case)
