"""Property tests: all four ops agree with convgen.reference on random convolutions.

hypothesis draws the op, layout, dtype, variant, batch (0 included), channels and groups (depthwise
included), image size, padding form, output_padding and how the arrays are stored. Specialized
calls draw their window from the windows tests/grid.py prebuilds, so no draw costs a compile;
generic calls draw any window (kernel 1-5, stride 1-3, per-side padding 0-3, dilation 1-3) and
any padding form ("same" and "valid" included), since one generic module serves them all.

Examples are derandomized so `make test` is reproducible; CONVGEN_HYPOTHESIS=explore runs many
more, randomly, to look for new failures. CONVGEN_PROPERTY_WINDOWS="k3s2p1 k1" narrows the
specialized windows (the quick sanitizer run builds only those).
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import convgen
from convgen import reference
from convgen.spec import Window
from grid import FORWARD_WINDOWS, GRADIENT_WINDOWS
from helpers import assert_close

settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("CONVGEN_HYPOTHESIS", "ci")

if os.environ.get("CONVGEN_PROPERTY_WINDOWS"):
    PREBUILT = [Window.parse(text) for text in os.environ["CONVGEN_PROPERTY_WINDOWS"].split()]
else:
    PREBUILT = sorted(set(FORWARD_WINDOWS + GRADIENT_WINDOWS), key=Window.short)


@st.composite
def windows(draw, specialize):
    """(kernel, stride, padding argument, dilation): a prebuilt window, or any window if generic."""
    if specialize:
        window = draw(st.sampled_from(PREBUILT))
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
    return array


@st.composite
def cases(draw, op):
    transposed = op.startswith("conv_transpose2d")
    specialize = draw(st.booleans())
    layout = draw(st.sampled_from(["NCHW", "NHWC"]))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    kernel, stride, padding, dilation = draw(windows(specialize))
    groups = draw(st.integers(1, 3))
    c_in, c_out = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    n = draw(st.integers(0, 3))
    extent = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, layout=layout,
                  specialize=specialize)
    if transposed:
        h, w = draw(st.integers(1, 7)), draw(st.integers(1, 7))
        if padding != "same":
            kwargs["output_padding"] = tuple(draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
        weight_shape = (c_in, c_out // groups, *kernel)
    else:
        explicit = Window.resolve(kernel, stride, padding, dilation, (1, 1)).padding if padding != "same" \
            else ((0, 0), (0, 0))
        # large enough for the dilated kernel after padding ("same" pads whatever it needs)
        h, w = (draw(st.integers(max(e - sum(p), 0), max(e - sum(p), 0) + 8)) for e, p in zip(extent, explicit))
        weight_shape = (c_out, c_in // groups, *kernel)
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c_in, h, w))
    weight = rng.standard_normal(weight_shape)
    if layout == "NHWC":
        x, weight = x.transpose(0, 2, 3, 1), weight.transpose(2, 3, 1, 0)
    bias = rng.standard_normal(c_out)
    return dict(x=x.astype(dtype), w=weight.astype(dtype), bias=bias.astype(dtype), kwargs=kwargs,
                stored=draw(st.sampled_from(["C", "fortran", "strided"])), rng=rng, dtype=dtype)


def _geometry_is_valid(op, case):
    """Whether the reference accepts the drawn sizes (transposed outputs can come out empty)."""
    forward = "conv_transpose2d" if op.startswith("conv_transpose2d") else "conv2d"
    ref_kwargs = {k: v for k, v in case["kwargs"].items() if k != "specialize"}
    try:
        return getattr(reference, forward)(case["x"], case["w"], **ref_kwargs).shape
    except ValueError:
        return None


def check(op, case):
    ref_kwargs = {k: v for k, v in case["kwargs"].items() if k != "specialize"}
    out_shape = _geometry_is_valid(op, case)
    if out_shape is None:
        # sizes the reference refuses must be refused by convgen too, never computed
        with pytest.raises(ValueError):
            getattr(convgen, op.replace("_backward", ""))(case["x"], case["w"], **case["kwargs"])
        return
    stored = case["stored"]
    x, w = _stored(case["x"], stored), _stored(case["w"], stored)
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
