"""Every instruction-set path, and the reference micro-kernel, agree with the oracle.

The schedule (and so the micro-kernel's vector width and register tile) is chosen when the C is
generated; forcing a slower path here checks the kernels a machine with only AVX2, or with no
usable SIMD, would get. Every ISA of `convgen.planning.schedule.ISAS` runs the gradient grid of
tests/grid.py (forward, dx, dW and the transposed ops, specialized for each window of the grid,
both layouts) and a call big enough for several threads; one this machine cannot run is skipped
with its name and the reason, never left out.
"""

import numpy as np
import pytest

import convgen
from convgen import reference
from convgen.runtime.kernels import settings
from convgen.planning.schedule import ISAS, supported_isas
from convgen.planning.spec import ConvSpec, Window
from grid import CONV_CASES, LAYOUTS, TRANSPOSE_CASES, grid_dtype, isa_grid_specs
from helpers import assert_close, assert_parallel, at_line_offset, seeded_rng

WINDOWS = [Window(3, 1, 1), Window((5, 2), (2, 1), ((2, 1), (0, 1)), (1, 2))]
PATHS = [dict(isa=isa) for isa in ISAS] + [dict(ukernel="reference")]
# Tiny blocks: many K blocks in every op (forward, dx, dW) and many pixel blocks per image.
PATHS.append(dict(kc=24, kc_forward=20, nc=96))


def _path_id(path):
    return "-".join(f"{k}={v}" for k, v in path.items())


def _skip_unless_supported(isa):
    """Skip, by name, an instruction set this machine's compiler does not target."""
    if isa is None:
        return
    compiler = settings().toolchain.compiler
    supported = settings().toolchain.supported_isas()
    if isa not in supported:
        pytest.skip(f"isa {isa} is not supported on this machine: `{compiler} -march=native` does not "
                    f"target it (supported here: {', '.join(supported)})")


def _build(specs):
    failures = {s: e for s, e in convgen.build_all(specs).items() if isinstance(e, Exception)}
    assert not failures, failures


@pytest.fixture(scope="module", params=PATHS, ids=_path_id)
def path(request):
    """A forced schedule (its kernels built up front); tests run under `convgen.configure(**path)`."""
    _skip_unless_supported(request.param.get("isa"))
    with convgen.configure(**request.param):
        specs = [ConvSpec(w, dtype, "NCHW") for w in WINDOWS for dtype in ("float32", "float64")]
        # the generic builds test_every_op_matches_reference and test_nhwc_generic (float64) run
        specs += [ConvSpec(None, dtype, "NCHW") for dtype in ("float32", "float64")] + [ConvSpec(None, "float64", "NHWC")]
        _build(specs)
    return request.param


# Large enough for several threads on every entry point, more (channel, tap) rows than one AVX2
# forward K block (32 × 9 = 288 > 256) and more filters than one dx block (264 > KC = 256).
THREADED = dict(n=2, c=32, h=12, w=14, f=264, window=Window(3, 1, 1))
THREADED_DTYPE = {"NCHW": "float32", "NHWC": "float64"}


@pytest.fixture(scope="module", params=ISAS)
def isa(request):
    """An instruction set, with the gradient grid's kernels built for it; tests run under configure(isa=...)."""
    _skip_unless_supported(request.param)
    with convgen.configure(isa=request.param):
        threaded = [ConvSpec(THREADED["window"], dtype, layout) for layout, dtype in THREADED_DTYPE.items()]
        depthwise = [ConvSpec(window, dtype, layout, "depthwise") for window, dtype in DEPTHWISE_ON_EVERY_ISA
                     for layout in LAYOUTS]
        _build(isa_grid_specs() + threaded + depthwise)
    return request.param


def test_the_forced_schedule_is_the_one_built(path):
    with convgen.configure(**path):
        schedule = settings().schedule()
        for key, value in path.items():
            assert getattr(schedule, key) == value
        source = convgen.get_kernels(ConvSpec(WINDOWS[0])).rendered().source
        assert f"schedule {schedule.isa}" in source and f"micro-kernel {schedule.ukernel}" in source


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: w.short())
def test_every_op_matches_reference(path, window, specialize, dtype):
    rng = np.random.default_rng(11)
    kw = dict(stride=window.stride, padding=window.padding, dilation=window.dilation)
    # 20 output channels and 13 input channels (2 groups): edge tiles in every direction.
    x = rng.standard_normal((2, 26, 15, 17)).astype(dtype)
    w = rng.standard_normal((20, 13, *window.kernel)).astype(dtype)
    b = rng.standard_normal(20).astype(dtype)
    with convgen.configure(**path):
        y = convgen.conv2d(x, w, b, groups=2, specialize=specialize, **kw)
        assert_close(y, reference.conv2d(x, w, b, groups=2, **kw), dtype, "forward")
        dy = rng.standard_normal(y.shape).astype(dtype)
        for got, want, name in zip(convgen.conv2d_backward(dy, x, w, groups=2, specialize=specialize, **kw),
                                   reference.conv2d_backward(dy, x, w, groups=2, **kw), ("dx", "dw", "db")):
            assert_close(got, want, dtype, name)
        t = convgen.conv_transpose2d(dy, w, groups=2, specialize=specialize, **kw)
        assert_close(t, reference.conv_transpose2d(dy, w, groups=2, **kw), dtype, "transposed")


def test_nhwc_generic(path):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 9, 10, 6))
    w = rng.standard_normal((3, 2, 6, 7))
    with convgen.configure(**path):
        y = convgen.conv2d(x, w, stride=2, padding=1, layout="NHWC", specialize=False)
    assert_close(y, reference.conv2d(x, w, stride=2, padding=1, layout="NHWC"), np.float64, "NHWC forward")


# ------------------------------------------------------------------ the gradient grid on every ISA
def _check(got, expected, dtype, what):
    for name, a, e in zip(("dx", "dw", "db"), got, expected):
        assert_close(a, e, dtype, f"{what} {name}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index", range(len(CONV_CASES)), ids=lambda i: CONV_CASES[i].name)
def test_gradient_grid_conv2d(isa, index, layout):
    case = CONV_CASES[index]
    dtype = grid_dtype(case.window(), layout)
    rng = seeded_rng("isa-grid", case, layout)
    x, w, b = case.arrays(rng, layout, dtype)
    kw = dict(case.kwargs(), layout=layout)
    expected = reference.conv2d(x, w, b, **kw)
    dy = rng.standard_normal(expected.shape).astype(dtype)
    with convgen.configure(isa=isa):
        assert convgen.get_kernels(ConvSpec(case.window(), dtype, layout)).rendered().schedule.isa == isa
        assert_close(convgen.conv2d(x, w, b, **kw), expected, dtype, f"{isa} conv2d")
        _check(convgen.conv2d_backward(dy, x, w, **kw), reference.conv2d_backward(dy, x, w, **kw), dtype,
               f"{isa} conv2d_backward")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index", range(len(TRANSPOSE_CASES)), ids=lambda i: TRANSPOSE_CASES[i].name)
def test_gradient_grid_conv_transpose2d(isa, index, layout):
    case = TRANSPOSE_CASES[index]
    dtype = grid_dtype(case.window(True), layout)
    rng = seeded_rng("isa-grid-transposed", case, layout)
    x, w, b = case.arrays(rng, layout, dtype, transposed=True)
    kw = dict(case.kwargs(transposed=True), layout=layout)
    expected = reference.conv_transpose2d(x, w, b, **kw)
    dy = rng.standard_normal(expected.shape).astype(dtype)
    with convgen.configure(isa=isa):
        assert_close(convgen.conv_transpose2d(x, w, b, **kw), expected, dtype, f"{isa} conv_transpose2d")
        _check(convgen.conv_transpose2d_backward(dy, x, w, **kw), reference.conv_transpose2d_backward(dy, x, w, **kw),
               dtype, f"{isa} conv_transpose2d_backward")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_op_on_several_threads(isa, layout, threads):
    """All four ops, each entry point planned on 2+ threads, dx over two filter blocks."""
    threads(3)
    n, c, h, w_, f, window = (THREADED[k] for k in ("n", "c", "h", "w", "f", "window"))
    dtype = THREADED_DTYPE[layout]
    rng = seeded_rng("isa-threads", isa, layout)
    x = rng.standard_normal((n, c, h, w_) if layout == "NCHW" else (n, h, w_, c)).astype(dtype)
    w = rng.standard_normal((f, c, 3, 3) if layout == "NCHW" else (3, 3, c, f)).astype(dtype)
    kw = dict(stride=window.stride, padding=window.padding, layout=layout)
    y = reference.conv2d(x, w, **kw)
    dy = rng.standard_normal(y.shape).astype(dtype)
    dx = rng.standard_normal(x.shape).astype(dtype)  # the transposed ops' dy: x-shaped
    with convgen.configure(isa=isa):
        for op, inp, out in (("conv2d", x, y), ("conv2d_backward", x, dy), ("conv_transpose2d", dy, x),
                             ("conv_transpose2d_backward", dy, dx)):
            assert_parallel(op, inp, out, window, 1, layout)
        assert_close(convgen.conv2d(x, w, **kw), y, dtype, f"{isa} conv2d")
        _check(convgen.conv2d_backward(dy, x, w, **kw), reference.conv2d_backward(dy, x, w, **kw), dtype,
               f"{isa} conv2d_backward")
        assert_close(convgen.conv_transpose2d(dy, w, **kw), reference.conv_transpose2d(dy, w, **kw), dtype,
                     f"{isa} conv_transpose2d")
        _check(convgen.conv_transpose2d_backward(dx, dy, w, **kw), reference.conv_transpose2d_backward(dx, dy, w, **kw),
               dtype, f"{isa} conv_transpose2d_backward")


# The depthwise family's vectors are the ISA's (NCHW: along pixels; NHWC: along filters, 19 of them
# here: full vectors and a partial one on every ISA).
DEPTHWISE_ON_EVERY_ISA = [(Window(3, 1, 1), "float32"), (Window(5, 2, 2), "float64")]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window, dtype", DEPTHWISE_ON_EVERY_ISA, ids=lambda v: v.short() if isinstance(v, Window) else v)
def test_depthwise_on_every_isa(isa, window, dtype, layout):
    from test_depthwise import check_all_ops
    with convgen.configure(isa=isa):
        for multiplier in (1, 2):
            check_all_ops(2, 19, 11, 13, multiplier, window, layout, dtype, True, seeded_rng("isa-dw", isa, window))


def test_depthwise_nhwc_forward_off_a_cache_line_on_every_isa(isa):
    """The NHWC depthwise forward pass aligns its vectors to their own size (blocks from the first
    aligned channel; at 1 or 2 vectors of channels, runs across pixels): x at every offset from a
    64-byte line, with the ISA's vector width (the block-major path, which AVX2's schedule leaves to
    the pixel-major one for so few channels)."""
    window, dtype = DEPTHWISE_ON_EVERY_ISA[0]
    with convgen.configure(isa=isa, depthwise_pixel_major_bytes=0):
        lanes = settings().schedule().vector_bytes // np.dtype(dtype).itemsize
        for c in (lanes, 2 * lanes, 8 * lanes):
            rng = seeded_rng("isa-dw-lines", isa, c)
            x = rng.standard_normal((1, 3, 41, c)).astype(dtype)
            w = rng.standard_normal((3, 3, 1, c)).astype(dtype)
            kw = dict(stride=window.stride, padding=window.padding, groups=c, layout="NHWC")
            expected = reference.conv2d(x, w, **kw)
            for offset in range(0, 64, np.dtype(dtype).itemsize):
                got = convgen.conv2d(at_line_offset(x, offset), w, algorithm="depthwise", **kw)
                assert_close(got, expected, dtype, f"{c} channels, x {offset} bytes past a line")


# ------------------------------------------------------------------------------------ refusals
def test_unsupported_isa_is_refused(monkeypatch):
    """On a machine whose compiler reports only AVX2, asking for AVX-512 is an error, not a crash later."""
    from convgen.planning import schedule
    from convgen.runtime import build
    monkeypatch.setattr(build, "supported_isas", lambda macros: ("avx2", "portable"))
    with pytest.raises(ValueError, match="not supported"):
        with convgen.configure(isa="avx512"):
            pass
    monkeypatch.delenv("CONVGEN_ISA", raising=False)
    assert schedule.get_schedule(("avx2", "portable")).isa == "avx2"  # the best the machine has is the default


def test_supported_isas_read_the_compilers_native_macros():
    avx2 = ["#define __AVX2__ 1", "#define __FMA__ 1", "#define __SSE2__ 1"]
    assert supported_isas(avx2) == ("avx2", "portable")
    assert supported_isas(avx2 + ["#define __AVX512F__ 1"]) == ("avx512", "avx2", "portable")
    assert supported_isas(["#define __AVX2__ 1"]) == ("portable",)  # AVX2 without FMA: no avx2 schedule
    assert supported_isas([]) == ("portable",)


def test_unknown_isa_and_schedule_field_are_refused():
    with pytest.raises(ValueError, match="isa must be one of"):
        with convgen.configure(isa="sse9"):
            pass
    with pytest.raises(TypeError, match="unknown schedule fields"):
        with convgen.configure(mc=3):
            pass
    with pytest.raises(ValueError, match="mr must be a positive int"):
        with convgen.configure(mr=0):
            pass
    for bad in (-1, True, 512.0):
        with pytest.raises(ValueError, match="depthwise_pixel_major_bytes must be an int >= 0"):
            with convgen.configure(depthwise_pixel_major_bytes=bad):
                pass
