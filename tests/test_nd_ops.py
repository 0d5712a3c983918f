"""The 1-D and 3-D ops (convgen.conv1d, conv3d, their transposed and backward ops) against the reference.

A grid of windows (kernel, stride, every padding form, dilation, groups, output padding) runs in both
layouts and dtypes, specialized and generic; 3-D with Winograd forced where its height × width window
allows it; padding modes on every axis (depth: the fold's; the others: the 2-D kernels'); unbatched
input; out=; and the arguments each op must refuse, with a message naming them. The 1-D cases lower to 2-D windows of one row (compiled up front by a fixture);
the 3-D cases' height × width windows are windows of tests/grid.py, which conftest prebuilds.
"""

import dataclasses

import numpy as np
import pytest

import convgen
from convgen import reference
from convgen.planning.ndspec import NdWindow
from convgen.planning.spec import ConvSpec
from helpers import assert_close, seeded_rng

DTYPES = ("float32", "float64")


@dataclasses.dataclass(frozen=True)
class NdCase:
    """One 1-D or 3-D call: x (n, c, *sizes) channels-first; f output channels (C_out when transposed)."""

    name: str
    n: int
    c: int
    sizes: tuple
    f: int
    kernel: tuple
    stride: object = 1
    padding: object = 0
    dilation: object = 1
    groups: int = 1
    output_padding: object = 0  # transposed only

    @property
    def rank(self):
        return len(self.sizes)

    def kwargs(self, transposed):
        kw = dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups)
        return dict(kw, output_padding=self.output_padding) if transposed else kw

    def arrays(self, rng, layout, dtype, transposed):
        """x, w, bias in `layout`, and dy shaped as the op's output."""
        w_shape = ((self.c, self.f // self.groups) if transposed else (self.f, self.c // self.groups)) + self.kernel
        x, w = rng.standard_normal((self.n, self.c) + self.sizes), rng.standard_normal(w_shape)
        if layout in ("NLC", "NDHWC"):
            r = self.rank
            x, w = x.transpose(0, *range(2, r + 2), 1), w.transpose(*range(2, r + 2), 1, 0)
        return (np.ascontiguousarray(x, dtype), np.ascontiguousarray(w, dtype),
                rng.standard_normal(self.f).astype(dtype))

    def planar_window(self, transposed):
        """The 2-D window the op's kernels are specialized for."""
        window = NdWindow.resolve(self.kernel, self.stride, self.padding, self.dilation, self.sizes, transposed)
        return window.lower()[1]

    def __str__(self):
        return self.name


CONV1D = [
    NdCase("k3-s1-p1", 2, 3, (11,), 4, (3,), 1, 1),
    NdCase("k5-s2-sides-d2-g2", 2, 4, (13,), 6, (5,), 2, ((1, 2),), 2, 2),
    NdCase("k4-same-depthwise-x2", 1, 3, (9,), 6, (4,), 1, "same", 1, 3),
    NdCase("k1-valid-s3", 2, 3, (10,), 2, (1,), (3,), "valid"),
]
TRANSPOSE1D = [
    NdCase("k4-s2-p1", 2, 3, (5,), 2, (4,), 2, 1),
    NdCase("k3-s3-d2-op2-g2", 1, 4, (4,), 6, (3,), 3, ((0, 1),), 2, 2, output_padding=2),
    NdCase("same-s2", 2, 2, (5,), 3, (3,), 2, "same"),
]
# 3-D: every height × width window is one of tests/grid.py's (k3s1p1, k3s2p1, k1s1p0, k4s2p1).
CONV3D = [
    NdCase("k3x3x3-p1", 2, 3, (4, 5, 6), 4, (3, 3, 3), 1, 1),
    NdCase("k2x3x3-s2-g2", 2, 4, (5, 7, 6), 6, (2, 3, 3), 2, (0, 1, 1), 1, 2),
    NdCase("depth-d2-sides", 1, 2, (6, 4, 5), 3, (3, 3, 3), 1, ((2, 1), 1, 1), (2, 1, 1)),
    NdCase("same-depth-even", 2, 3, (4, 5, 4), 2, (2, 3, 3), 1, "same"),
    NdCase("1x1x1-depth-s2-depthwise", 1, 4, (5, 3, 4), 4, (1, 1, 1), (2, 1, 1), 0, 1, 4),
]
TRANSPOSE3D = [
    NdCase("k3x3x3-p1", 1, 3, (3, 4, 3), 2, (3, 3, 3), 1, 1),
    NdCase("k2x4x4-s2-op-g2", 2, 4, (3, 3, 4), 6, (2, 4, 4), 2, (0, 1, 1), 1, 2, output_padding=(1, 0, 0)),
    NdCase("same-depth-s2", 1, 2, (3, 4, 3), 3, (3, 3, 3), (2, 1, 1), "same"),
    NdCase("depth-d3-op2", 2, 2, (2, 3, 4), 2, (3, 3, 3), (2, 1, 1), 1, (3, 1, 1), output_padding=(2, 0, 0)),
]

LAYOUTS = {1: ("NCL", "NLC"), 3: ("NCDHW", "NDHWC")}
GRID = ([(case, False) for case in CONV1D + CONV3D] + [(case, True) for case in TRANSPOSE1D + TRANSPOSE3D])


def _specialized_dtype(case, layout):
    """The one dtype a 1-D case runs specialized in each layout (alternating, so both dtypes meet both
    layouts): each 1 × K window is a kernel compiled for these tests alone. 3-D cases run both."""
    return DTYPES[(GRID.index(next(g for g in GRID if g[0] is case)) + LAYOUTS[1].index(layout)) % 2]


def _grid():
    found = []
    for case, transposed in GRID:
        for layout in LAYOUTS[case.rank]:
            for dtype in DTYPES:
                for specialize in (True, False):
                    if specialize and case.rank == 1 and dtype != _specialized_dtype(case, layout):
                        continue
                    op = f"{'conv_transpose' if transposed else 'conv'}{case.rank}d"
                    found.append(pytest.param(case, transposed, layout, dtype, specialize,
                                              id=f"{op}-{case}-{layout}-{dtype}-{'specialized' if specialize else 'generic'}"))
    return found


@pytest.fixture(scope="module", autouse=True)
def row_windows():
    """The 1-D cases' specialized kernels (1 × K windows) built up front, in parallel."""
    specs = {ConvSpec(case.planar_window(transposed), _specialized_dtype(case, layout),
                      "NCHW" if layout == "NCL" else "NHWC")
             for case, transposed in GRID if case.rank == 1 for layout in LAYOUTS[1]}
    failures = {s: e for s, e in convgen.build_all(specs).items() if isinstance(e, Exception)}
    assert not failures


def _ops(module, rank, transposed):
    prefix = "conv_transpose" if transposed else "conv"
    return getattr(module, f"{prefix}{rank}d"), getattr(module, f"{prefix}{rank}d_backward")


def _run_both(case, transposed, layout, dtype, rng, **options):
    """(convgen's y, dx, dw, db; the reference's) for one case."""
    x, w, b = case.arrays(rng, layout, dtype, transposed)
    kw = dict(case.kwargs(transposed), layout=layout)
    forward, backward = _ops(convgen, case.rank, transposed)
    ref_forward, ref_backward = _ops(reference, case.rank, transposed)
    y = forward(x, w, b, **kw, **options)
    dy = rng.standard_normal(y.shape).astype(dtype)
    mode = {"padding_mode": options["padding_mode"]} if "padding_mode" in options else {}
    return ((y, *backward(dy, x, w, **kw, **options)),
            (ref_forward(x, w, b, **kw, **mode), *ref_backward(dy, x, w, **kw, **mode)))


def _assert_all_close(got, expected, dtype, what):
    for name, a, e in zip(("y", "dx", "dw", "db"), got, expected):
        assert_close(a, e, dtype, f"{what} {name}")


@pytest.mark.parametrize("case, transposed, layout, dtype, specialize", _grid())
def test_matches_reference(case, transposed, layout, dtype, specialize):
    rng = seeded_rng(case.name, transposed, layout, dtype)
    got, expected = _run_both(case, transposed, layout, dtype, rng, specialize=specialize)
    _assert_all_close(got, expected, dtype, f"{case} {layout} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS[3])
@pytest.mark.parametrize("case, transposed", [(c, t) for c, t in GRID if c.rank == 3 and c.kernel[1:] == (3, 3)
                                              and set(c.planar_window(t).stride) == {1}], ids=str)
def test_3d_winograd_matches_reference(case, transposed, layout, dtype):
    """A 3×3 height × width window at stride 1 runs on Winograd F(m×m, 3×3), whatever its depth window."""
    rng = seeded_rng("winograd", case.name, transposed, layout, dtype)
    got, expected = _run_both(case, transposed, layout, dtype, rng, algorithm="winograd")
    _assert_all_close(got, expected, dtype, f"{case} {layout} {dtype} winograd")


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular", "zeros"])
@pytest.mark.parametrize("layout", LAYOUTS[3])
def test_3d_depth_padding_modes(layout, mode):
    """The fold reads the reflected, replicated or wrapped depth slice, and adds its gradient back there."""
    case = NdCase("depth-modes", 2, 4, (5, 4, 6), 6, (3, 2, 3), (2, 1, 2), ((2, 1), 0, 0), (2, 1, 1), 2)
    rng = seeded_rng("modes", layout, mode)
    got, expected = _run_both(case, False, layout, "float64", rng, padding_mode=mode)
    _assert_all_close(got, expected, "float64", f"{mode} {layout}")


MODE_CASES = [NdCase("modes-1d", 2, 4, (9,), 6, (3,), 2, ((2, 1),), 2, 2),
              NdCase("modes-3d", 2, 4, (5, 6, 5), 6, (3, 3, 2), (1, 2, 1), ((2, 1), 1, (0, 1)), (2, 1, 1), 2)]


def _mode_grid():
    found = []
    for case in MODE_CASES:
        for i, mode in enumerate(("reflect", "replicate", "circular")):
            for j, layout in enumerate(LAYOUTS[case.rank]):
                for dtype in DTYPES:
                    # Each mode is a kernel of its own: specialized in one layout and dtype per mode.
                    for specialize in (False, True) if (i + j + DTYPES.index(dtype)) % 4 == 0 else (False,):
                        found.append(pytest.param(case, mode, layout, dtype, specialize,
                                                  id=f"{case}-{mode}-{layout}-{dtype}-{'spec' if specialize else 'gen'}"))
    return found


@pytest.mark.parametrize("case, mode, layout, dtype, specialize", _mode_grid())
def test_padding_modes_match_reference(case, mode, layout, dtype, specialize):
    """Every axis reads the reflected, replicated or wrapped border: along length, height and width
    the 2-D kernels' padding, along depth the fold's; gradients go back where the border came from."""
    rng = seeded_rng("modes", case.name, mode, layout, dtype)
    got, expected = _run_both(case, False, layout, dtype, rng, padding_mode=mode, specialize=specialize)
    _assert_all_close(got, expected, dtype, f"{case} {mode} {layout} {dtype}")


def test_winograd_takes_a_depth_padding_mode_but_not_a_planar_one():
    """The fold pads depth itself, so a 3×3 height × width window without padding there still runs on
    Winograd with any depth padding mode; with height and width padded it is direct code (as in 2-D)."""
    case = NdCase("wino-modes", 1, 4, (5, 6, 6), 4, (3, 3, 3), 1, ((1, 1), 0, 0))
    rng = seeded_rng("wino-modes")
    got, expected = _run_both(case, False, "NCDHW", "float64", rng, padding_mode="reflect", algorithm="winograd")
    _assert_all_close(got, expected, "float64", "winograd, reflect in depth")
    x, w, _ = case.arrays(rng, "NCDHW", "float64", False)
    with pytest.raises(ValueError, match=r"algorithm='winograd' cannot compute conv3d with window "
                                         r"k3x3x3s1p1reflect: Winograd computes 3-D windows"):
        convgen.conv3d(x, w, padding=1, padding_mode="reflect", algorithm="winograd")
    auto = convgen.conv3d(x, w, padding=1, padding_mode="reflect")
    assert_close(auto, reference.conv3d(x, w, padding=1, padding_mode="reflect"), "float64", "auto: direct")


# ------------------------------------------------------------------------------- PyTorch itself
@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
def test_matches_torch(rank, transposed):
    torch = pytest.importorskip("torch")
    case = {(1, False): CONV1D[1], (1, True): TRANSPOSE1D[0], (3, False): CONV3D[1], (3, True): TRANSPOSE3D[1]}[
        rank, transposed]
    rng = seeded_rng("torch", rank, transposed)
    x, w, b = case.arrays(rng, LAYOUTS[rank][0], "float64", transposed)
    kw = case.kwargs(transposed)
    if isinstance(kw["padding"], tuple) and isinstance(kw["padding"][0], tuple):  # torch pads symmetrically
        kw["padding"] = tuple(p[0] if isinstance(p, tuple) else p for p in kw["padding"])
    ours = dict(kw, specialize=rank == 3)  # (a 1 × K window compiled for this test alone would cost a build)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    name = f"{'conv_transpose' if transposed else 'conv'}{rank}d"
    ty = getattr(torch.nn.functional, name)(tx, tw, tb, **kw)
    dy = rng.standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(dy))
    got = (getattr(convgen, name)(x, w, b, **ours), *getattr(convgen, name + "_backward")(dy, x, w, **ours))
    _assert_all_close(got, (ty.detach().numpy(), tx.grad.numpy(), tw.grad.numpy(), tb.grad.numpy()), "float64",
                      f"{name} vs torch")


# ---------------------------------------------------------------------------------- unbatched
UNBATCHED = [(1, False, CONV1D[1]), (1, True, TRANSPOSE1D[1]), (3, False, CONV3D[1]), (3, True, TRANSPOSE3D[1])]


@pytest.mark.parametrize("rank, transposed, case", UNBATCHED, ids=lambda v: str(v))
@pytest.mark.parametrize("channels_last", [False, True], ids=["channels-first", "channels-last"])
def test_unbatched_input_gives_unbatched_results(rank, transposed, case, channels_last):
    layout = LAYOUTS[rank][channels_last]
    rng = seeded_rng("unbatched", rank, transposed, layout)
    x, w, b = case.arrays(rng, layout, "float64", transposed)
    kw = dict(case.kwargs(transposed), layout=layout)
    forward, backward = _ops(convgen, rank, transposed)
    batched = forward(x[:1], w, b, **kw)
    y = forward(x[0], w, b, **kw)
    assert y.shape == batched.shape[1:]
    np.testing.assert_array_equal(y, batched[0])
    out = np.empty_like(y)
    assert forward(x[0], w, b, out=out, **kw) is out
    np.testing.assert_array_equal(out, y)
    dy = rng.standard_normal(y.shape)
    dx, dw, db = backward(dy, x[0], w, **kw)
    expected = backward(dy[None], x[:1], w, **kw)
    assert dx.shape == x.shape[1:]
    for got, want in zip((dx[None], dw, db), expected):
        np.testing.assert_array_equal(got, want)
    out_dx = np.empty_like(dx)
    assert backward(dy, x[0], w, out=(out_dx, None, None), **kw)[0] is out_dx
    with pytest.raises(ValueError, match="dy and x must both be batched"):
        backward(dy[None], x[0], w, **kw)
    with pytest.raises(ValueError, match="dy and x must both be batched"):
        backward(dy, x[:1], w, **kw)
    with pytest.raises(ValueError, match="out must be unbatched like x"):
        forward(x[0], w, b, out=np.empty((1,) + y.shape), **kw)


@pytest.mark.parametrize("op, x_shape, w_shape", [
    ("conv2d", (3, 7, 6), (4, 3, 3, 3)), ("conv_transpose2d", (3, 5, 4), (3, 2, 3, 3))])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_2d_unbatched_input(op, x_shape, w_shape, layout):
    """conv2d and friends take (C, H, W) / (H, W, C) too, with an unbatched out."""
    rng = seeded_rng("unbatched-2d", op, layout)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    if layout == "NHWC":
        x, w = np.ascontiguousarray(x.transpose(1, 2, 0)), np.ascontiguousarray(w.transpose(2, 3, 1, 0))
    forward, backward = getattr(convgen, op), getattr(convgen, op + "_backward")
    y = forward(x, w, padding=1, layout=layout)
    np.testing.assert_array_equal(y, forward(x[None], w, padding=1, layout=layout)[0])
    out = np.empty_like(y)
    assert forward(x, w, padding=1, layout=layout, out=out) is out
    dy = rng.standard_normal(y.shape)
    dx, dw, db = backward(dy, x, w, padding=1, layout=layout)
    for got, want in zip((dx[None], dw, db), backward(dy[None], x[None], w, padding=1, layout=layout)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="dy and x must both be batched"):
        backward(dy[None], x, w, padding=1, layout=layout)
    with pytest.raises(ValueError, match=r"x must have 4 dimensions"):
        forward(x[0], w, padding=1, layout=layout)


def test_unbatched_lists_adopt_the_weights_dtype():
    w = np.ones((2, 1, 3), np.float32)
    y = convgen.conv1d([[1.0, 2.0, 3.0, 4.0]], w, padding=1)
    assert y.shape == (2, 4) and y.dtype == np.float32


# ------------------------------------------------------------------------------------- out=
@pytest.mark.parametrize("rank, transposed, case", UNBATCHED, ids=lambda v: str(v))
def test_out_is_written_and_checked(rank, transposed, case):
    layout = LAYOUTS[rank][1]
    rng = seeded_rng("out", rank, transposed)
    x, w, b = case.arrays(rng, layout, "float64", transposed)
    kw = dict(case.kwargs(transposed), layout=layout)
    forward, backward = _ops(convgen, rank, transposed)
    y = forward(x, w, b, **kw)
    out = np.full_like(y, np.nan)
    assert forward(x, w, b, out=out, **kw) is out
    np.testing.assert_array_equal(out, y)
    dy = rng.standard_normal(y.shape)
    expected = backward(dy, x, w, **kw)
    outs = tuple(np.full_like(a, np.nan) for a in expected)
    got = backward(dy, x, w, out=outs, **kw)
    for g, o, e in zip(got, outs, expected):
        assert g is o
        np.testing.assert_array_equal(o, e)
    with pytest.raises(ValueError, match=r"out must have shape"):
        forward(x, w, b, out=np.empty(y.shape[:-1] + (y.shape[-1] + 1,)), **kw)
    with pytest.raises(ValueError, match=r"out\[0\] \(dx\) must not overlap"):
        backward(dy, x, w, out=(x, None, None), **kw)


# ------------------------------------------------------------------------------ bad arguments
def _base(op):
    """Valid arguments of a 1-D or 3-D op (float64, channels-first, groups 2)."""
    rank = 1 if "1d" in op else 3
    transposed = "transpose" in op
    case = (TRANSPOSE1D[1] if rank == 1 else TRANSPOSE3D[1]) if transposed else (CONV1D[1] if rank == 1 else CONV3D[1])
    x, w, b = case.arrays(np.random.default_rng(0), LAYOUTS[rank][0], "float64", transposed)
    kw = case.kwargs(transposed)
    if op.endswith("_backward"):
        y = getattr(convgen, op[:-9])(x, w, **kw)
        return [np.ones_like(y), x, w], kw
    return [x, w, b], kw


ND_OPS = ["conv1d", "conv1d_backward", "conv_transpose1d", "conv_transpose1d_backward", "conv3d", "conv3d_backward",
          "conv_transpose3d", "conv_transpose3d_backward"]


def _with(**changes):
    return lambda arrays, kw: kw.update(changes)


BAD = [
    (ND_OPS, _with(layout="NCHW"), ValueError, r"layout must be 'NC"),
    (ND_OPS, _with(stride=0), ValueError, r"stride must be >= 1"),
    (ND_OPS, _with(stride=(1, 2)), ValueError, r"stride must be an int or a sequence of \d ints"),
    (ND_OPS, _with(dilation=1.5), TypeError, r"dilation must be an integer"),
    (ND_OPS, _with(padding=-1), ValueError, r"padding must be >= 0"),
    (ND_OPS, _with(padding="full"), ValueError, r"padding must be an int, a sequence, 'same' or 'valid'"),
    (ND_OPS, _with(groups=3), ValueError, r"groups=3 must divide"),
    (ND_OPS, _with(padding_mode="mirror"), ValueError, r"padding_mode must be one of"),
    (ND_OPS, _with(algorithm="fast"), ValueError, r"algorithm must be one of"),
    (ND_OPS, _with(specialize="yes"), TypeError, r"specialize must be True or False"),
]


def _bad_cases():
    for ops, mutate, exc, match in BAD:
        for op in ops:
            yield pytest.param(op, mutate, exc, match, id=f"{op}-{match[:30]}")
    more = [
        ("conv1d", _with(padding=(1, 2)), ValueError, r"per-side padding of a 1-D convolution is \(\(before, after\),\)"),
        ("conv1d", _with(padding=13, padding_mode="reflect"), ValueError,
         r"padding_mode='reflect' needs padding smaller than the input along l \(13\)"),
        ("conv3d", _with(padding=(0, 8, 0), padding_mode="circular"), ValueError,
         r"padding_mode='circular' needs padding at most the input along h \(7\)"),
        ("conv1d", lambda a, kw: a.__setitem__(1, a[1][:, :1]), ValueError, r"w expects 1 input channels per group"),
        ("conv1d", _with(padding=0, dilation=9), ValueError, r"kernel extent 37 along l"),
        ("conv3d", _with(stride=(1, 1, 0)), ValueError, r"stride\[2\] must be >= 1"),
        ("conv3d", lambda a, kw: a.__setitem__(2, a[2][:3]), ValueError, r"bias must have shape \(6,\)"),
        ("conv3d", lambda a, kw: a.__setitem__(1, a[1].astype(np.float32)), TypeError, r"must share one dtype"),
        ("conv3d", lambda a, kw: a.__setitem__(0, a[0][:, :, :1]), ValueError, r"kernel extent 2 along d"),
        ("conv3d", _with(padding=((5, 5), 0, 0), padding_mode="reflect"), ValueError,
         r"padding_mode='reflect' needs padding smaller than the input along d \(5\)"),
        ("conv3d", _with(padding=((6, 0), 0, 0), padding_mode="circular"), ValueError,
         r"padding_mode='circular' needs padding at most the input along d"),
        ("conv3d", _with(algorithm="winograd", stride=2), ValueError,
         r"algorithm='winograd' cannot compute conv3d with window k2x3x3s2p0x1x1"),
        ("conv1d", _with(algorithm="winograd"), ValueError, r"Winograd computes 2-D and 3-D windows only"),
        ("conv3d_backward", lambda a, kw: a.__setitem__(0, a[0][:, :, :-1]), ValueError,
         r"dy must have shape \(2, 6, 2, 4, 3\) \(the output of conv3d\)"),
        ("conv3d", lambda a, kw: a.__setitem__(0, a[0][None]), ValueError, r"x must have 5 dimensions"),
        ("conv_transpose1d", _with(output_padding=3), ValueError,
         r"output_padding along l must be smaller than max\(stride, dilation\) = 3"),
        ("conv_transpose3d", _with(output_padding=(2, 0, 0)), ValueError, r"output_padding along d must be smaller"),
        ("conv_transpose3d", _with(padding="same", output_padding=1), ValueError,
         r"output_padding must be 0 with padding='same'"),
        ("conv_transpose3d", lambda a, kw: a.__setitem__(1, a[1][:2]), ValueError,
         r"w has 2 input channels \(its first dimension\) but x has 4"),
        ("conv_transpose1d", _with(stride=(2, 2)), ValueError, r"stride must be an int or a sequence of 1 ints"),
        ("conv_transpose3d", _with(padding_mode="reflect"), ValueError,
         r"padding_mode must be 'zeros' for a transposed convolution \(as for torch's ConvTranspose3d\)"),
        ("conv_transpose1d_backward", _with(padding_mode="circular"), ValueError, r"ConvTranspose1d\), got 'circular'"),
    ]
    for op, mutate, exc, match in more:
        yield pytest.param(op, mutate, exc, match, id=f"{op}-{match[:30]}")


@pytest.mark.parametrize("op, mutate, exc, match", list(_bad_cases()))
def test_bad_arguments_are_refused_by_name(op, mutate, exc, match):
    arrays, kw = _base(op)
    kept = [a.copy() for a in arrays]
    mutate(arrays, kw)
    with pytest.raises(exc, match=match):
        getattr(convgen, op)(*arrays, **kw)
    for before, after in zip(kept, _base(op)[0]):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("op", ND_OPS)
def test_one_values_are_expanded_as_torch_does(op):
    """stride=(2,), dilation=[1] and padding=(1,) mean 2, 1 and 1 on every axis (torch expands them)."""
    arrays, kw = _base(op)
    kw = dict(kw, stride=2, dilation=1, padding=1, specialize="3d" in op)  # 3-D: windows of tests/grid.py
    if "transpose" in op:
        kw["output_padding"] = 1
    expected = getattr(convgen, op)(*arrays, **kw) if not op.endswith("_backward") else None
    if expected is None:
        y = getattr(convgen, op[:-9])(*arrays[1:], **kw)
        arrays[0] = np.ones_like(y)
        expected = getattr(convgen, op)(*arrays, **kw)
    got = getattr(convgen, op)(*arrays, **dict(kw, stride=(2,), dilation=[1], padding=(1,),
                                               **({"output_padding": (1,)} if "transpose" in op else {})))
    for a, b in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
        np.testing.assert_array_equal(a, b)


def test_empty_batches_give_empty_results():
    x, w = np.zeros((0, 2, 5, 4, 4)), np.ones((3, 2, 3, 3, 3))
    assert convgen.conv3d(x, w, padding=1).shape == (0, 3, 5, 4, 4)
    dx, dw, db = convgen.conv3d_backward(np.zeros((0, 3, 5, 4, 4)), x, w, padding=1)
    assert dx.shape == x.shape and not dw.any() and not db.any()
    assert convgen.conv_transpose1d(np.zeros((0, 2, 5)), np.ones((2, 3, 3))).shape == (0, 3, 7)
