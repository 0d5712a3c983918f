"""padding_mode: what the padding of conv2d holds ("zeros", "reflect", "replicate", "circular").

Oracles: the reference against PyTorch (F.pad with the mode, then F.conv2d, and autograd for the
gradients) and against central differences; the kernels against the reference over the cases of
tests/grid.py (every mode with strides 1-3, dilation, groups, every padding form) in both layouts,
dtypes and builds, and over random windows in the generic build; the adjoint identities
<conv2d(x, w), dy> = <x, dx> = <w, dw>, which hold only if dx takes back every value the padding
copied from x.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import convgen
from convgen.planning import planner
from convgen import reference
from convgen.runtime.kernels import settings as kernel_settings
from convgen.frontend.resolve import conv_problem
from convgen.planning.spec import PADDING_MODES, ConvSpec, Window
from grid import DTYPES, LAYOUTS, PADDING_MODE_CASES, PADDING_MODE_WINDOWS, Case, all_specs
from helpers import assert_close, numerical_gradient, planned_threads, relative_error, seeded_rng

VARIANTS = pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])
MODES = pytest.mark.parametrize("mode", PADDING_MODES)
TORCH_PAD = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


def _torch():
    try:
        import torch
    except ImportError:
        pytest.fail("torch is not installed: it is part of the test extra (make setup)")
    return torch


def _case_in_mode(case: Case, mode: str) -> Case:
    return Case(f"{case.name}-{mode}", case.n, case.c, case.h, case.w, case.f, case.kernel, case.stride, case.padding,
                case.dilation, case.groups, padding_mode=mode)


def _with_mode(case, mode):
    """case.kwargs() with padding_mode given explicitly (also "zeros")."""
    return dict(case.kwargs(), padding_mode=mode)


def _dy(case, layout, dtype, rng):
    x, w, _ = case.arrays(np.random.default_rng(0), layout, np.float64)
    shape = reference.conv2d(x, w, layout=layout, **case.kwargs()).shape
    return rng.standard_normal(shape).astype(dtype)


# Every case in every mode, for the reference against torch: the grid's cases with their own modes
# and each one's window in the other modes too (reflect and circular where the sizes allow).
def _fits(case, mode):
    pads = case.window().padding
    limit = {"reflect": lambda p, n: p < n, "circular": lambda p, n: p <= n}.get(mode, lambda p, n: True)
    return all(limit(max(p), n) for p, n in zip(pads, (case.h, case.w)))


REFERENCE_CASES = [_case_in_mode(case, mode) for case in PADDING_MODE_CASES for mode in PADDING_MODES
                   if _fits(case, mode)]


# ----------------------------------------------------------------------------------- the reference
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", REFERENCE_CASES, ids=str)
def test_reference_matches_torch_pad_then_conv(case, layout):
    """reference.conv2d(padding_mode=m) = F.conv2d(F.pad(x, mode=m)); its gradients = torch's autograd."""
    torch = _torch()
    F = torch.nn.functional
    rng = seeded_rng("torch", case, layout)
    x, w, b = case.arrays(rng, "NCHW", np.float64)
    (pt, pb), (pl, pr) = case.window().padding
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    ty = F.conv2d(F.pad(tx, (pl, pr, pt, pb), mode=TORCH_PAD[case.padding_mode]), tw, tb, stride=case.stride,
                  dilation=case.dilation, groups=case.groups)
    dy = rng.standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(dy))
    expected = [t.detach().numpy() for t in (ty, tx.grad, tw.grad, tb.grad)]

    def nhwc(a):
        return np.ascontiguousarray(a.transpose(0, 2, 3, 1))

    if layout == "NHWC":  # moved to NHWC for the reference, its results moved back
        x, w, dy = nhwc(x), np.ascontiguousarray(w.transpose(2, 3, 1, 0)), nhwc(dy)
    y = reference.conv2d(x, w, b, layout=layout, **case.kwargs())
    dx, dw, db = reference.conv2d_backward(dy, x, w, layout=layout, **case.kwargs())
    if layout == "NHWC":
        y, dx, dw = y.transpose(0, 3, 1, 2), dx.transpose(0, 3, 1, 2), dw.transpose(3, 2, 0, 1)
    for name, got, want in zip(("y", "dx", "dw", "db"), (y, dx, dw, db), expected):
        assert_close(np.ascontiguousarray(got), want, np.float64, name)


@MODES
def test_reference_gradients_match_central_differences(mode):
    case = Case("numeric", 1, 2, 4, 5, 2, (3, 2), (1, 2), ((2, 1), (1, 2)), (1, 2), padding_mode=mode)
    rng = seeded_rng("numeric", mode)
    x, w, b = case.arrays(rng, "NCHW", np.float64)
    dy = _dy(case, "NCHW", np.float64, rng)

    def loss():
        return float(np.sum(reference.conv2d(x, w, b, **case.kwargs()) * dy))

    dx, dw, db = reference.conv2d_backward(dy, x, w, **case.kwargs())
    for name, got, array in (("dx", dx, x), ("dw", dw, w), ("db", db, b)):
        assert relative_error(got, numerical_gradient(loss, array, 1e-6)) < 1e-7, name


@MODES
def test_reference_pad_adjoint_is_the_adjoint_of_pad(mode):
    """<pad(x), z> = <x, pad_adjoint(z)> for every z: the fold puts back exactly what pad copied."""
    rng = seeded_rng("pad adjoint", mode)
    pads = ((2, 1), (0, 3))
    x = rng.standard_normal((2, 3, 4, 3))
    z = rng.standard_normal((2, 3, 7, 6))
    padded = reference.pad(x, pads, mode)
    assert padded.shape == z.shape
    folded = reference.pad_adjoint(z, pads, (4, 3), mode)
    assert np.isclose(np.vdot(padded, z), np.vdot(x, folded), rtol=1e-12)


def test_reference_pad_by_hand():
    row = np.array([[[[1.0, 2.0, 3.0]]]])
    hand = {"zeros": [0, 0, 1, 2, 3, 0], "reflect": [3, 2, 1, 2, 3, 2], "replicate": [1, 1, 1, 2, 3, 3],
            "circular": [2, 3, 1, 2, 3, 1]}
    for mode, expected in hand.items():
        assert reference.pad(row, ((0, 0), (2, 1)), mode)[0, 0, 0].tolist() == expected, mode
    # the adjoint of reflect: column 1 (2.0) was copied twice and column 2 (3.0) once more
    ones = np.ones((1, 1, 1, 6))
    assert reference.pad_adjoint(ones, ((0, 0), (2, 1)), (1, 3), "reflect")[0, 0, 0].tolist() == [1, 3, 2]


@pytest.mark.parametrize("mode, padding, match", [
    ("reflect", 3, "smaller than the input size 3"),
    ("reflect", ((0, 0), (0, 4)), "smaller than the input size 4"),
    ("circular", (4, 0), "at most the input size 3"),
    ("mirror", 1, "padding_mode"),
])
def test_reference_refuses_what_torch_refuses(mode, padding, match):
    x, w = np.ones((1, 1, 3, 4)), np.ones((1, 1, 2, 2))
    with pytest.raises(ValueError, match=match):
        reference.conv2d(x, w, padding=padding, padding_mode=mode)
    with pytest.raises(ValueError, match=match):
        reference.conv2d_backward(np.ones((1, 1, 1, 1)), x, w, padding=padding, padding_mode=mode)


# ------------------------------------------------------------------------------------ the kernels
@VARIANTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", PADDING_MODE_CASES, ids=str)
def test_kernels_match_the_reference(case, layout, dtype, specialize):
    rng = seeded_rng(case, layout, dtype)
    x, w, b = case.arrays(rng, layout, dtype)
    dy = _dy(case, layout, dtype, rng)
    kw = dict(layout=layout, **case.kwargs())
    y = convgen.conv2d(x, w, b, specialize=specialize, **kw)
    assert_close(y, reference.conv2d(x, w, b, **kw), dtype, "y")
    got = convgen.conv2d_backward(dy, x, w, specialize=specialize, **kw)
    for name, actual, expected in zip(("dx", "dw", "db"), got, reference.conv2d_backward(dy, x, w, **kw)):
        assert_close(actual, expected, dtype, name)


@VARIANTS
@MODES
@pytest.mark.parametrize("layout", LAYOUTS)
def test_adjoint_identities_hold_in_every_mode(mode, layout, specialize):
    """<conv2d(x, w), dy> = <x, dx> = <w, dw>: conv2d is linear in x and in w, and dx is its adjoint
    in x only if every value the padding copied from x is added back into that pixel."""
    cases = [case for case in PADDING_MODE_CASES if case.padding_mode == mode and case.padding != "valid"]
    cases = cases or [_case_in_mode(PADDING_MODE_CASES[0], mode)]  # zeros: the first case's window
    for case in cases:
        rng = seeded_rng("adjoint", case, layout)
        x, w, _ = case.arrays(rng, layout, np.float64)
        dy = _dy(case, layout, np.float64, rng)
        kw = dict(layout=layout, specialize=specialize, **_with_mode(case, mode))
        y = convgen.conv2d(x, w, **kw)
        dx, dw, _ = convgen.conv2d_backward(dy, x, w, **kw)
        forward = np.vdot(y, dy)
        assert np.isclose(forward, np.vdot(x, dx), rtol=1e-12, atol=0), f"{case}: <x, dx>"
        assert np.isclose(forward, np.vdot(w, dw), rtol=1e-12, atol=0), f"{case}: <w, dw>"


def test_dx_takes_back_what_the_padding_copied():
    """By hand: a 1x1 kernel of weight 1 over a 1x3 row padded by 2 on the left and 1 on the right
    reads x[2], x[1], x[0], x[1], x[2], x[1] (reflect): dy = 1 everywhere gives dx = (1, 3, 2)."""
    x, w, dy = np.array([[[[1.0, 2.0, 3.0]]]]), np.ones((1, 1, 1, 1)), np.ones((1, 1, 1, 6))
    expected = {"zeros": [1, 1, 1], "reflect": [1, 3, 2], "replicate": [3, 1, 2], "circular": [2, 2, 2]}
    for specialize in (True, False):
        for mode, want in expected.items():
            kw = dict(padding=((0, 0), (2, 1)), padding_mode=mode, specialize=specialize)
            dx, _, _ = convgen.conv2d_backward(dy, x, w, **kw)
            assert dx[0, 0, 0].tolist() == want, (mode, specialize)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_threads_split_the_work_in_every_mode(layout, threads):
    """Calls big enough for several threads: the forward pass's two ways of sharing an image's phase
    planes (one image: both threads split it; four: each takes whole images), dx split by channel,
    each work item adding its border values into its own channels only, and dW over the images."""
    threads(2)
    for n in (1, 4):
        case = Case(f"threads-n{n}", n, 32, 24, 22, 32, (3, 3), 1, ((2, 1), (1, 2)))
        for mode in PADDING_MODES[1:]:
            case_m = _case_in_mode(case, mode)
            rng = seeded_rng("threads", n, mode, layout)
            x, w, b = case_m.arrays(rng, layout, np.float64)
            dy = _dy(case_m, layout, np.float64, rng)
            kw = dict(layout=layout, specialize=False, **case_m.kwargs())
            y = convgen.conv2d(x, w, b, **kw)
            planned = planned_threads("conv2d", x, dy, case_m.window(), 1, layout, specialize=False)
            planned.update(planned_threads("conv2d_backward", x, dy, case_m.window(), 1, layout, specialize=False))
            if n == 1:  # dW of one small image: its own planner may keep it on one thread
                del planned["bwd_weight"]
            assert min(planned.values()) >= 2, planned
            assert_close(y, reference.conv2d(x, w, b, **case_m.kwargs(), layout=layout), np.float64, "y")
            got = convgen.conv2d_backward(dy, x, w, **kw)
            want = reference.conv2d_backward(dy, x, w, **case_m.kwargs(), layout=layout)
            for name, a, e in zip(("dx", "dw", "db"), got, want):
                assert_close(a, e, np.float64, f"{mode} n={n} {name}")


@st.composite
def generic_calls(draw):
    """A random conv2d in a random mode, padded within what the mode allows: the generic build."""
    mode = draw(st.sampled_from(PADDING_MODES))
    h, w = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    kernel = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    most = {"reflect": (h - 1, w - 1), "circular": (h, w)}.get(mode, (4, 4))
    pads = tuple((draw(st.integers(0, m)), draw(st.integers(0, m))) for m in most)
    for n, (before, after), k, d in zip((h, w), pads, kernel, dilation):
        if n + before + after < d * (k - 1) + 1:
            pads = None
    groups = draw(st.sampled_from([1, 2]))
    layout = draw(st.sampled_from(LAYOUTS))
    return Case("random", 2, 2 * groups, h, w, 2 * groups, kernel, stride, pads, dilation, groups,
                padding_mode=mode) if pads else None, layout


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(generic_calls())
def test_generic_build_matches_the_reference_on_random_windows(call):
    case, layout = call
    if case is None:  # the kernel does not fit the padded input: a ValueError test elsewhere
        return
    rng = seeded_rng(case.kwargs(), case.h, case.w, layout)
    x, w, b = case.arrays(rng, layout, np.float64)
    dy = _dy(case, layout, np.float64, rng)
    kw = dict(layout=layout, **case.kwargs())
    assert_close(convgen.conv2d(x, w, b, specialize=False, **kw), reference.conv2d(x, w, b, **kw), np.float64, "y")
    got = convgen.conv2d_backward(dy, x, w, specialize=False, **kw)
    for name, actual, expected in zip(("dx", "dw", "db"), got, reference.conv2d_backward(dy, x, w, **kw)):
        assert_close(actual, expected, np.float64, name)


def test_every_padding_mode_window_is_prebuilt():
    prebuilt = {spec.window for spec in all_specs()}
    assert all(case.window() in prebuilt for case in PADDING_MODE_CASES)
    assert {window.padding_mode for window in PADDING_MODE_WINDOWS} == set(PADDING_MODES)


# ----------------------------------------------------------------------------------- what is refused
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(padding=1, padding_mode="mirror"), ValueError, "padding_mode must be one of 'zeros', 'reflect'"),
    (dict(padding=1, padding_mode=None), ValueError, "padding_mode must be one of .* got None"),
    (dict(padding=1, padding_mode=1), ValueError, "padding_mode must be one of .* got 1"),
    (dict(padding=3, padding_mode="reflect"), ValueError,
     r"padding_mode='reflect' needs padding smaller than the input: padding \(3, 3\) along the height is not "
     r"smaller than x's height 3 \(x has shape \(1, 2, 3, 5\)\)"),
    (dict(padding=((0, 0), (5, 0)), padding_mode="reflect"), ValueError, "along the width .* width 5"),
    (dict(padding=(0, 6), padding_mode="circular"), ValueError,
     r"padding_mode='circular' needs padding at most the input: padding \(6, 6\) along the width is more than "
     r"x's width 5"),
])
@pytest.mark.parametrize("op", ["conv2d", "conv2d_backward"])
def test_bad_padding_modes_are_refused(op, kwargs, error, match):
    x, w = np.ones((1, 2, 3, 5)), np.ones((2, 2, 3, 3))
    args = (x, w) if op == "conv2d" else (np.ones((1, 2, 3, 5)), x, w)
    with pytest.raises(error, match=match):
        getattr(convgen, op)(*args, **kwargs)


@pytest.mark.parametrize("mode, padding", [("reflect", (1, 2)), ("circular", (2, 3)), ("replicate", (5, 7)),
                                           ("Reflect", (1, 1))])
def test_sizes_torch_allows_are_allowed(mode, padding):
    """reflect up to the input − 1, circular up to the input, replicate any padding; the mode in any case.
    A 1x1 kernel of weight 1 returns the padded image itself."""
    x, w = np.arange(6.0).reshape(1, 1, 2, 3), np.ones((1, 1, 1, 1))
    y = convgen.conv2d(x, w, padding=padding, padding_mode=mode, specialize=False)
    (ph, pw) = padding
    assert np.array_equal(y, reference.pad(x, ((ph, ph), (pw, pw)), mode.lower()))


@pytest.mark.parametrize("op", ["conv_transpose2d", "conv_transpose2d_backward"])
def test_transposed_convolution_takes_only_zeros(op):
    x, w = np.ones((1, 2, 3, 3)), np.ones((2, 2, 3, 3))
    args = (x, w) if op == "conv_transpose2d" else (np.ones((1, 2, 5, 5)), x, w)
    getattr(convgen, op)(*args, padding_mode="zeros", specialize=False)
    with pytest.raises(ValueError, match="padding_mode must be 'zeros' for a transposed convolution .* got 'reflect'"):
        getattr(convgen, op)(*args, padding=1, padding_mode="reflect")


def test_winograd_pads_with_zeros_only():
    """algorithm="auto" runs the direct kernels in another mode; "winograd" says why it cannot."""
    x, w = np.ones((1, 16, 8, 8), np.float32), np.ones((16, 16, 3, 3), np.float32)
    schedule = kernel_settings().schedule()
    problem = conv_problem(x.shape, w.shape, x.dtype, 1, 1, 1, 1, "NCHW", "reflect")
    assert planner.plan(problem, True, schedule).family == "direct"
    assert planner.plan(problem, True, schedule).spec.window.padding_mode == "reflect"
    zeros = conv_problem(x.shape, w.shape, x.dtype, 1, 1, 1, 1, "NCHW")
    assert planner.plan(zeros, True, schedule, "winograd").family == "winograd"  # the same layer, zero-padded
    for op, args in (("conv2d", (x, w)), ("conv2d_backward", (np.ones((1, 16, 8, 8), np.float32), x, w))):
        with pytest.raises(ValueError, match="input transform pads with zeros, not padding_mode='circular'"):
            getattr(convgen, op)(*args, padding=1, padding_mode="circular", algorithm="winograd")


# ------------------------------------------------------------------------------------ the spec text
@pytest.mark.parametrize("text, window", [
    ("k3s1p1reflect", Window(3, 1, 1, 1, "reflect")),
    ("k5x3s2p2x1circular", Window((5, 3), 2, (2, 1), 1, "circular")),
    ("k3s3p6x4d2replicate", Window(3, 3, (6, 4), 2, "replicate")),
    ("k3s1p0_1x2_2d2x1circular", Window(3, 1, ((0, 1), (2, 2)), (2, 1), "circular")),
    ("k3s1p1zeros", Window(3, 1, 1)),
])
def test_window_text_carries_the_mode(text, window):
    assert Window.parse(text) == window
    assert Window.parse(window.short()) == window
    spec = ConvSpec(window, "float64", "NHWC")
    assert spec.name.isidentifier()
    assert ConvSpec.from_symbol(spec.symbol("bwd_data")) == spec


def test_modes_are_distinct_kernels_but_unpadded_windows_are_one():
    specs = {ConvSpec(Window(3, 1, 1, 1, mode)) for mode in PADDING_MODES}
    assert len({spec.symbol("fwd") for spec in specs}) == len(PADDING_MODES)
    assert Window(3, 1, 0, 1, "reflect") == Window(3, 1, 0) and Window(3, 1, 0, 1, "circular").short() == "k3s1p0"
    with pytest.raises(ValueError, match="padding_mode must be one of"):
        Window(3, 1, 1, 1, "mirror")
    with pytest.raises(ValueError, match="cannot read 'k3s1p1mirror'"):
        Window.parse("k3s1p1mirror")
    with pytest.raises(ValueError, match="the winograd family takes .* zero-padded, got k3s1p1reflect"):
        ConvSpec(Window(3, 1, 1, 1, "reflect"), family="winograd", tile=4)


def test_rendered_border_code_follows_the_mode():
    """Specialized: only the mode's own index arithmetic, no branch on a mode; generic: pm at run time."""
    from convgen.codegen.render import render
    schedule = kernel_settings().schedule()
    sources = {mode: render(ConvSpec(Window(3, 1, 1, 1, mode)), schedule).source for mode in PADDING_MODES}
    assert "return i < 0 ? -i : 2 * (n - 1) - i;" in sources["reflect"]
    assert "return i < 0 ? 0 : n - 1;" in sources["replicate"]
    assert "return i < 0 ? i + n : i - n;" in sources["circular"]
    for source in sources.values():
        assert "g->pm" not in source and "switch" not in source
    generic = render(ConvSpec(None), schedule).source
    assert "switch (g->pm)" in generic and "int64_t pm, int64_t act, int64_t res, int nthreads" in generic


def test_command_line_reads_the_mode(capsys, tmp_path):
    from convgen.tools.cli import main
    from convgen.tools.specfile import load_spec_file

    assert main(["show", "k3s1p1reflect", "--op", "forward"]) == 0
    out = capsys.readouterr().out
    assert "specialized for k3s1p1reflect_nchw_float32" in out and "return i < 0 ? -i : 2 * (n - 1) - i;" in out
    with pytest.raises(SystemExit) as exit_info:  # a usage error: Winograd pads with zeros only
        main(["show", "k3s1p1circular", "--algorithm", "winograd"])
    assert exit_info.value.code == 2
    assert "zero-padded, got k3s1p1circular" in capsys.readouterr().err
    specs = tmp_path / "kernels.toml"
    specs.write_text('[[set]]\nwindows = ["k3s1p1replicate", "k3s1p1"]\ngeneric = false\n')
    found = load_spec_file(specs)  # both algorithms by default: Winograd only for the zero-padded window
    assert [(spec.short(), spec.family) for spec in found] == [
        ("k3s1p1replicate", "direct"), ("k3s1p1", "direct"), ("k3s1p1", "winograd")]
