"""Winograd F(m×m, 3×3): the transforms are exact, the kernels agree with the reference within the
tile's stated error bound, and the planner picks Winograd only where it applies.

The transforms are checked in rationals (no rounding at all); the kernels against the float64
reference over paddings, odd sizes, groups, layouts, dtypes and tiles, for all four ops with
algorithm="winograd" forced; the accuracy of each tile against `winograd.MEASURED_ERROR`.
"""

import dataclasses
import random
from fractions import Fraction

import numpy as np
import pytest

import convgen
from convgen.planning import planner, winograd
from convgen import reference
from convgen.runtime.kernels import settings
from convgen.frontend.resolve import conv_problem
from convgen.planning.spec import ConvSpec, Window
from helpers import planned_threads, seeded_rng, to_layout

ALL_OPS = ("conv2d", "conv2d_backward", "conv_transpose2d", "conv_transpose2d_backward")


# ------------------------------------------------------------------------------------ transforms
@pytest.mark.parametrize("m, r", [(2, 3), (4, 3), (6, 3), (2, 2), (3, 2), (4, 5), (1, 3), (3, 1)])
def test_transforms_compute_the_correlation_exactly(m, r):
    """Aᵀ[(G g Gᵀ) ⊙ (Bᵀ d B)]A equals direct correlation, in rationals, for random tiles and filters."""
    t = winograd.transforms(m, r)
    assert (len(t.AT), len(t.AT[0]), len(t.G), len(t.G[0]), len(t.BT)) == (m, t.alpha, t.alpha, r, t.alpha)
    rnd = random.Random(m * 100 + r)
    for _ in range(5):
        d = [[Fraction(rnd.randint(-50, 50), rnd.randint(1, 7)) for _ in range(t.alpha)] for _ in range(t.alpha)]
        g = [[Fraction(rnd.randint(-50, 50), rnd.randint(1, 7)) for _ in range(r)] for _ in range(r)]
        direct = [[sum(d[i + k][j + l] * g[k][l] for k in range(r) for l in range(r)) for j in range(m)]
                  for i in range(m)]
        assert winograd.correlate_exactly(t, d, g) == direct


def test_f4x4_3x3_has_lavins_input_transform():
    """With points 0, ±1, ±2 and ∞, Bᵀ is the integer matrix of Lavin & Gray's F(4×4, 3×3) (up to row signs)."""
    expected = [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
                [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]]
    bt = winograd.transforms(4, 3).BT
    for row, want in zip(bt, expected):
        assert [abs(v) for v in row] == [abs(v) for v in want]
        assert all(v.denominator == 1 for v in row)


def test_linear_combination_folds_zeros_and_ones():
    row = (Fraction(4), Fraction(0), Fraction(-5), Fraction(0), Fraction(1), Fraction(-1, 6))
    names = [f"d{i}" for i in range(6)]
    assert winograd.linear_combination(row, names) == "(real)4 * d0 - (real)5 * d2 + d4 - ((real)1 / 6) * d5"
    assert winograd.linear_combination((Fraction(-1), Fraction(0)), names) == "-d0"
    assert winograd.linear_combination((Fraction(0),), names) == "(real)0"


def test_the_rendered_source_has_straight_line_transforms():
    """The specialized Winograd module spells its transforms out with constant coefficients: Bᵀ's
    first row of F(4×4, 3×3) (4·d0 − 5·d2 + d4) appears as code, and no coefficient table."""
    from convgen.codegen.render import render
    source = render(ConvSpec(Window(3, 1, 1), "float32", "NCHW", "winograd", 4), settings().schedule()).source
    assert "(real)4 * " in source and "(real)5 * " in source
    assert "F(4x4, 3x3)" in source or "F(4×4, 3×3)" in source


# --------------------------------------------------------------------------------------- planner
def _problem(c, f, window, h=12, w=12, groups=1, dtype=np.float32):
    return conv_problem((2, c, h, w), (f, c // groups, *window.kernel), np.dtype(dtype), window.stride,
                        window.padding, window.dilation, groups, "NCHW")


def test_auto_takes_winograd_for_3x3_stride_1_with_enough_channels():
    schedule = settings().schedule()
    plan = planner.plan(_problem(64, 64, Window(3, 1, 1)), True, schedule)
    assert plan.spec.family == "winograd" and plan.spec.tile == planner.winograd_tile("float32", schedule)
    assert plan.spec.name == f"k3s1p1_winograd{plan.spec.tile}_nchw_float32"


@pytest.mark.parametrize("window", [Window(3, 2, 1), Window(3, 1, 1, 2), Window(5, 1, 2), Window((3, 1), 1, 0)],
                         ids=lambda w: w.short())
def test_auto_stays_direct_where_winograd_does_not_apply(window):
    assert planner.plan(_problem(64, 64, window), True, settings().schedule()).spec.family == "direct"


def test_auto_stays_direct_with_few_channels_and_for_the_generic_build():
    schedule = settings().schedule()
    assert planner.plan(_problem(2, 64, Window(3, 1, 1)), True, schedule).spec.family == "direct"
    assert planner.plan(_problem(64, 64, Window(3, 1, 1)), False, schedule).spec == ConvSpec(None)


def test_training_takes_only_the_accurate_tile_and_only_on_large_enough_images():
    """"auto-training" (a training step's calls): Winograd at F(2×2) where "auto" takes Winograd on
    images of 14×14 outputs or more, the direct kernels on smaller ones; its other choices as "auto"'s."""
    schedule = settings().schedule()
    assert planner.winograd_tile("float32", schedule) > 2  # (else this test would prove nothing)
    for size, family, tile in ((14, "winograd", 2), (28, "winograd", 2), (13, "direct", 0), (7, "direct", 0)):
        for dtype in (np.float32, np.float64):
            spec = planner.plan(_problem(64, 64, Window(3, 1, 1), size, size, dtype=dtype), True, schedule,
                                "auto-training").spec
            assert (spec.family, spec.tile) == (family, tile), (size, dtype)
    assert planner.plan(_problem(64, 64, Window(3, 1, 1), 7, 28), True, schedule, "auto-training").spec.tile == 2
    assert planner.plan(_problem(2, 64, Window(3, 1, 1), 28, 28), True, schedule, "auto-training").spec.family == \
        "direct"
    assert planner.plan(_problem(64, 64, Window(3, 1, 1), 28, 28, groups=64), True, schedule,
                        "auto-training").spec.family == "depthwise"
    assert planner.plan(_problem(64, 64, Window(3, 1, 1), 28, 28), False, schedule, "auto-training").spec == \
        ConvSpec(None)
    with convgen.configure(training_winograd_tile=4, training_winograd_min_pixels=1):
        spec = planner.plan(_problem(64, 64, Window(3, 1, 1), 7, 7), True, settings().schedule(), "auto-training").spec
        assert (spec.family, spec.tile) == ("winograd", 4)
    with pytest.raises(ValueError, match=r"training_winograd_tile must be one of Winograd's tiles \(2, 4, 6\)"):
        with convgen.configure(training_winograd_tile=3):
            pass


def test_forced_winograd_where_it_cannot_apply_is_a_clear_error():
    x, w = np.ones((1, 4, 8, 8)), np.ones((4, 4, 3, 3))
    with pytest.raises(ValueError, match=r"algorithm='winograd' cannot compute this convolution: .* not k3s2p1"):
        convgen.conv2d(x, w, stride=2, padding=1, algorithm="winograd")
    with pytest.raises(ValueError, match=r"algorithm='winograd' needs specialize=True"):
        convgen.conv2d(x, w, padding=1, specialize=False, algorithm="winograd")
    with pytest.raises(ValueError, match=r"algorithm must be one of 'auto', 'direct', 'winograd', 'depthwise', "
                                         r"'auto-training', got 'fft'"):
        convgen.conv2d(x, w, algorithm="fft")
    with pytest.raises(ValueError, match=r"algorithm must be one of"):
        convgen.Conv2d(4, 4, 3, algorithm=3)


def test_the_planner_never_picks_a_tile_outside_the_error_bound():
    for dtype in ("float32", "float64"):
        for largest in winograd.TILES:
            with convgen.configure(winograd_tile=largest):
                tile = planner.winograd_tile(dtype, settings().schedule())
            assert tile <= largest and winograd.within_bound(tile, dtype)
    with pytest.MonkeyPatch.context() as patch:  # a tile measured outside the bound is never chosen
        patch.setitem(winograd.MEASURED_ERROR, (6, "float32"), 1e-3)
        with convgen.configure(winograd_tile=6):
            assert planner.winograd_tile("float32", settings().schedule()) == 4


def test_filters_too_large_to_transform_stay_direct():
    with convgen.configure(winograd_max_filter_bytes=1024):
        problem = _problem(64, 64, Window(3, 1, 1))
        assert planner.plan(problem, True, settings().schedule()).spec.family == "direct"
        with pytest.raises(ValueError, match="transformed filters would take"):
            planner.plan(problem, True, settings().schedule(), "winograd")


# ------------------------------------------------------------------------------- against the oracle
CASES = [  # (n, c, f, h, w, padding, groups)
    (2, 5, 7, 9, 11, 1, 1),                  # odd sizes: partial tiles on both edges
    (1, 3, 4, 5, 7, 0, 1),                   # valid: fewer outputs than one tile along H
    (2, 8, 6, 13, 9, ((0, 1), (2, 0)), 2),   # asymmetric padding, groups
    (1, 4, 4, 1, 1, 1, 1),                   # a 1 × 1 image
    (3, 6, 6, 8, 8, "same", 6),              # depthwise
    (1, 130, 20, 6, 10, 2, 1),               # more channels than one channel block
]


def _case_id(case):
    return "n{}c{}f{}_{}x{}_p{}_g{}".format(*case).replace(" ", "")


def _run(op, arrays, kwargs, **extra):
    funcs = {"conv2d": (convgen.conv2d, reference.conv2d),
             "conv2d_backward": (convgen.conv2d_backward, reference.conv2d_backward),
             "conv_transpose2d": (convgen.conv_transpose2d, reference.conv_transpose2d),
             "conv_transpose2d_backward": (convgen.conv_transpose2d_backward, reference.conv_transpose2d_backward)}
    fast, slow = funcs[op]
    got = fast(*arrays, **kwargs, **extra)
    want = slow(*[None if a is None else a.astype(np.float64) for a in arrays], **kwargs)
    return got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)


def _error(got, want):
    return max(float(np.abs(g.astype(np.float64) - v).max()) / max(float(np.abs(v).max()), 1e-30)
               for g, v in zip(got, want) if v.size)


@pytest.mark.parametrize("tile", winograd.TILES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_op_with_winograd_forced_matches_the_reference(case, layout, dtype, tile):
    n, c, f, h, w, padding, groups = case
    rng = seeded_rng("winograd", case, layout, dtype, tile)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    weight = rng.standard_normal((f, c // groups, 3, 3)).astype(dtype)
    bias = rng.standard_normal(f).astype(dtype)
    x, weight = to_layout(x, weight, layout)
    kwargs = dict(padding=padding, groups=groups, layout=layout)
    bound = winograd.MEASURED_ERROR[(tile, dtype)]
    with convgen.configure(winograd_tile=tile):
        if not winograd.within_bound(tile, dtype):
            # A tile outside the bound is never chosen: the planner takes the largest one within it.
            tile = planner.winograd_tile(dtype, settings().schedule())
            bound = winograd.MEASURED_ERROR[(tile, dtype)]
        y, y_ref = _run("conv2d", (x, weight, bias), kwargs, algorithm="winograd")
        assert _error(y, y_ref) <= bound, "conv2d"
        dy = rng.standard_normal(y[0].shape).astype(dtype)
        got, want = _run("conv2d_backward", (dy, x, weight), kwargs, algorithm="winograd")
        assert _error(got, want) <= max(bound, 10 * np.finfo(dtype).eps), "conv2d_backward"
        # The transposed convolution of the same window maps y's shape back to x's.
        wt = weight if layout == "NCHW" else np.ascontiguousarray(weight)
        got, want = _run("conv_transpose2d", (dy, wt, None), kwargs, algorithm="winograd")
        assert _error(got, want) <= bound, "conv_transpose2d"
        got, want = _run("conv_transpose2d_backward", (x, dy, wt), kwargs, algorithm="winograd")
        assert _error(got, want) <= max(bound, 10 * np.finfo(dtype).eps), "conv_transpose2d_backward"


# Winograd's own micro-tile (Schedule.winograd_mr × winograd_nr_vectors, AVX-512's 16 × 1 vector) and
# a narrow one of several vectors, on any machine: full and partial tiles of filters and of image tiles.
@pytest.mark.parametrize("micro_tile", [(16, 1), (4, 2)], ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("layout, dtype", [("NCHW", "float32"), ("NHWC", "float64")])
@pytest.mark.parametrize("case", [CASES[0], CASES[5]], ids=_case_id)
def test_every_op_on_each_winograd_micro_tile(case, layout, dtype, micro_tile):
    n, c, f, h, w, padding, groups = case
    rng = seeded_rng("winograd-micro-tile", case, layout, micro_tile)
    x, weight = to_layout(rng.standard_normal((n, c, h, w)).astype(dtype),
                          rng.standard_normal((f, c // groups, 3, 3)).astype(dtype), layout)
    bias = rng.standard_normal(f).astype(dtype)
    kwargs = dict(padding=padding, groups=groups, layout=layout)
    mr, vectors = micro_tile
    with convgen.configure(winograd_mr=mr, winograd_nr_vectors=vectors):
        spec = ConvSpec(Window(3, 1, padding), dtype, layout, "winograd", planner.winograd_tile(dtype, settings().schedule()))
        assert f"MR={mr}," in convgen.get_kernels(spec).rendered().source
        bound = winograd.MEASURED_ERROR[(spec.tile, dtype)]
        y, y_ref = _run("conv2d", (x, weight, bias), kwargs, algorithm="winograd")
        assert _error(y, y_ref) <= bound, "conv2d"
        dy = rng.standard_normal(y[0].shape).astype(dtype)
        got, want = _run("conv2d_backward", (dy, x, weight), kwargs, algorithm="winograd")
        assert _error(got, want) <= max(bound, 10 * np.finfo(dtype).eps), "conv2d_backward"


def test_only_winograd_modules_take_its_micro_tile():
    schedule = settings().schedule()
    narrow = dataclasses.replace(schedule, winograd_mr=5, winograd_nr_vectors=2)
    assert narrow.for_family("winograd").mr == 5 and narrow.for_family("winograd").nr_vectors == 2
    assert narrow.for_family("direct") == narrow and narrow.for_family("depthwise") == narrow
    plain = dataclasses.replace(schedule, winograd_mr=0, winograd_nr_vectors=0)
    assert plain.for_family("winograd") == plain
    for bad in (dict(winograd_mr=-1, winograd_nr_vectors=1), dict(winograd_mr=8, winograd_nr_vectors=0),
                dict(winograd_mr=True, winograd_nr_vectors=1)):
        with pytest.raises(ValueError, match="winograd_"):
            with convgen.configure(**bad):
                pass


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("count", [1, 2])
def test_nhwc_transposes_of_channels_match_the_reference(dtype, count, threads):
    """NHWC moves each pixel's channels (one vector) into the transforms' rows of pixels and the
    outputs back by transposes of whole vectors: 19 channels and filters are one full vector and a
    partial one in both dtypes, 37 columns several vectors of pixels with a partial last one, padding
    zeros on both edges; forward and input gradient, on one thread and on two."""
    n, c, f, h, w = 2, 19, 19, 10, 37
    rng = seeded_rng("winograd nhwc", dtype, count)
    x, weight = to_layout(rng.standard_normal((n, c, h, w)).astype(dtype),
                          rng.standard_normal((f, c, 3, 3)).astype(dtype), "NHWC")
    bias = rng.standard_normal(f).astype(dtype)
    dy = rng.standard_normal((n, h, w, f)).astype(dtype)
    threads(count)
    for op, inp, out in (("conv2d", x, dy), ("conv2d_backward", x, dy)):
        assert set(planned_threads(op, inp, out, Window(3, 1, 1), layout="NHWC", algorithm="winograd").values()) == {count}
    bound = winograd.MEASURED_ERROR[(planner.winograd_tile(dtype, settings().schedule()), dtype)]
    kwargs = dict(padding=1, layout="NHWC")
    y, y_ref = _run("conv2d", (x, weight, bias), kwargs, algorithm="winograd")
    assert _error(y, y_ref) <= bound, "conv2d"
    got, want = _run("conv2d_backward", (dy, x, weight), kwargs, algorithm="winograd")
    assert _error(got, want) <= max(bound, 10 * np.finfo(dtype).eps), "conv2d_backward"


# -------------------------------------------------------------------------------------- accuracy
def _measured_error(tile, dtype, c, offset, h=20, w=20, f=8):
    rng = seeded_rng("accuracy", tile, dtype, c, offset)
    x = (rng.standard_normal((1, c, h, w)) + offset).astype(dtype)
    weight = rng.standard_normal((f, c, 3, 3)).astype(dtype)
    with convgen.configure(winograd_tile=tile):
        spec = ConvSpec(Window(3, 1, 1), dtype, "NCHW", "winograd", tile)
        kernels = convgen.get_kernels(spec)
        problem = conv_problem(x.shape, weight.shape, x.dtype, 1, 1, 1, 1, "NCHW")
        y = np.empty(problem.output_shape, dtype)
        kernels.call("fwd", problem, (x, weight, None, None, None, y))
    expected = reference.conv2d(x.astype(np.float64), weight.astype(np.float64), padding=1)
    return float(np.abs(y - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tile", winograd.TILES)
def test_each_tile_meets_its_stated_error(tile, dtype):
    """The table in convgen.planning.winograd (and docs/algorithms.md) is what the kernels do: N(0, 1) data and data
    with a large common offset, 1 to 512 channels."""
    worst = max(_measured_error(tile, dtype, c, offset) for c in (1, 16, 128, 512) for offset in (0.0, 100.0))
    assert worst <= winograd.MEASURED_ERROR[(tile, dtype)], f"F({tile}x{tile}) {dtype}: {worst:.3g}"
