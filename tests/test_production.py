"""Production-sized calls of all four ops against convgen.reference, on several threads.

The grids elsewhere prove the arithmetic on small arrays, which the kernels' planner runs on one
thread and in one block. The cases here (tests/grid.py PRODUCTION_CASES) are each over 100 MFLOP:
the kernels' thread query must plan at least two threads for every entry point they run, and
between them they split dx over 256-filter blocks, the forward pass over 1024-row K blocks, and
run windows of 64 and 81 taps (the looped micro-kernel, and packing loops above 64 taps), in both
layouts and both dtypes, specialized and generic.

The transposed ops run the adjoint of each convolution: conv_transpose2d takes an input shaped like
the convolution's output, with the same weight array, and gives one shaped like its input, so their
kernels see the same sizes (filters per group, rows, taps) as the convolution's.
"""

import pytest

import convgen
from convgen import reference
from grid import PRODUCTION_CASES
from helpers import assert_close, assert_parallel, seeded_rng

VARIANTS = (True, False)  # specialized, generic


@pytest.fixture(scope="module", params=PRODUCTION_CASES, ids=str)
def production(request):
    """The case, its arrays and the reference's results for all four ops (computed once per case)."""
    case, layout, dtype = request.param.case, request.param.layout, request.param.dtype
    assert case.flops() >= 100e6, f"{case}: {case.flops() / 1e6:.0f} MFLOP is not production-sized"
    rng = seeded_rng("production", request.param)
    x, w, b = case.arrays(rng, layout, dtype)
    kw = dict(case.kwargs(), layout=layout)
    window = case.window()
    # conv_transpose2d's output_padding that gives back x's size exactly
    output_padding = tuple((n + before + after - extent) % s for n, (before, after), extent, s in zip(
        (case.h, case.w), window.padding, window.effective_kernel, window.stride))
    y_ref = reference.conv2d(x, w, b, **kw)
    dy = rng.standard_normal(y_ref.shape).astype(dtype)
    t = rng.standard_normal(y_ref.shape).astype(dtype)      # the transposed ops' input, shaped like y
    tb = rng.standard_normal(case.c).astype(dtype)
    tkw = dict(kw, output_padding=output_padding)
    t_ref = reference.conv_transpose2d(t, w, tb, **tkw)
    dt = rng.standard_normal(t_ref.shape).astype(dtype)
    return dict(
        name=str(request.param), window=window, layout=layout, dtype=dtype, groups=case.groups, kw=kw, tkw=tkw,
        x=x, w=w, b=b, dy=dy, t=t, tb=tb, dt=dt,
        expected={
            "conv2d": (y_ref,),
            "conv2d_backward": reference.conv2d_backward(dy, x, w, **kw),
            "conv_transpose2d": (t_ref,),
            "conv_transpose2d_backward": reference.conv_transpose2d_backward(dt, t, w, **tkw),
        })


def _run(op, p, specialize):
    """(results, input, output) of one op on the case's arrays."""
    x, w, kw, tkw = p["x"], p["w"], p["kw"], p["tkw"]
    if op == "conv2d":
        return (convgen.conv2d(x, w, p["b"], specialize=specialize, **kw),), x, p["dy"]
    if op == "conv2d_backward":
        return convgen.conv2d_backward(p["dy"], x, w, specialize=specialize, **kw), x, p["dy"]
    if op == "conv_transpose2d":
        return (convgen.conv_transpose2d(p["t"], w, p["tb"], specialize=specialize, **tkw),), p["t"], p["dt"]
    return convgen.conv_transpose2d_backward(p["dt"], p["t"], w, specialize=specialize, **tkw), p["t"], p["dt"]


@pytest.mark.parametrize("op", ["conv2d", "conv2d_backward", "conv_transpose2d", "conv_transpose2d_backward"])
def test_production_sized_call_matches_reference(production, op, threads):
    threads(2)
    p = production
    for specialize in VARIANTS:
        got, x, y = _run(op, p, specialize)
        assert_parallel(op, x, y, p["window"], p["groups"], p["layout"], specialize)
        names = ("y",) if len(got) == 1 else ("dx", "dw", "db")
        for name, a, e in zip(names, got, p["expected"][op]):
            assert_close(a, e, p["dtype"], f"{p['name']} {op} {name} ({'specialized' if specialize else 'generic'})")


def test_the_cases_reach_every_block():
    """What the cases are for, checked on their sizes: a case that stops reaching a block fails here."""
    rows = [p.case.c // p.case.groups * p.case.kernel[0] * p.case.kernel[1] for p in PRODUCTION_CASES]
    filters = [p.case.f // p.case.groups for p in PRODUCTION_CASES]
    taps = {p.case.kernel[0] * p.case.kernel[1] for p in PRODUCTION_CASES}
    assert max(rows) > 1024, "no case has more (channel, tap) rows than one AVX-512 forward K block"
    assert max(filters) > 256, "no case has more filters per group than one dx block (KC = 256)"
    assert {64, 81} <= taps, "the 8x8 and 9x9 windows are missing"
    assert {p.layout for p in PRODUCTION_CASES} == {"NCHW", "NHWC"}
    assert {p.dtype for p in PRODUCTION_CASES} == {"float32", "float64"}
    assert min(p.case.n for p in PRODUCTION_CASES) == 1 and max(p.case.n for p in PRODUCTION_CASES) >= 4
    assert any(p.case.groups > 1 for p in PRODUCTION_CASES)
