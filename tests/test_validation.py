"""Bad input never reaches C; unusual but valid input gives the reference's answer.

Every bad argument must raise ValueError or TypeError naming the argument, before any kernel is
loaded: the `no_kernels` fixture makes every kernel build fail (an unbuildable compiler flag and
an empty cache), so an op that got as far as loading C would raise BuildError instead.
Valid arrays of every unusual kind (strided, Fortran-order, byte-swapped, read-only, Python
lists, empty batches, NaN and inf) are checked against convgen.reference, and every input is
checked to be unchanged afterwards.
"""

import numpy as np
import pytest

import convgen
from convgen import reference
from convgen.frontend import resolve
from convgen.planning.spec import ConvSpec
from helpers import assert_close

OPS = ("conv2d", "conv2d_backward", "conv_transpose2d", "conv_transpose2d_backward")
FORWARD_OPS = ("conv2d", "conv_transpose2d")
TRANSPOSED_OPS = ("conv_transpose2d", "conv_transpose2d_backward")
VARIANTS = pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])


def base_case(op, rng=None, dtype=np.float64, layout="NCHW"):
    """Valid arguments of `op`: a k3s2p1 window (in tests/grid.py), groups=2, batch 2.

    conv2d: x (2, 4, 7, 6) -> y (2, 6, 4, 3); conv_transpose2d: x (2, 4, 4, 3) -> y (2, 6, 8, 6).
    Returns (arrays, keywords), arrays in the op's positional order.
    """
    rng = rng or np.random.default_rng(0)
    transposed = op in TRANSPOSED_OPS
    if transposed:
        x, w, y = (2, 4, 4, 3), (4, 3, 3, 3), (2, 6, 8, 6)
        kwargs = dict(stride=2, padding=1, output_padding=1, groups=2)
    else:
        x, w, y = (2, 4, 7, 6), (6, 2, 3, 3), (2, 6, 4, 3)
        kwargs = dict(stride=2, padding=1, groups=2)
    arrays = {"x": rng.standard_normal(x), "w": rng.standard_normal(w), "bias": rng.standard_normal(6),
              "dy": rng.standard_normal(y)}
    if layout == "NHWC":
        arrays = {"x": arrays["x"].transpose(0, 2, 3, 1), "w": arrays["w"].transpose(2, 3, 1, 0),
                  "bias": arrays["bias"], "dy": arrays["dy"].transpose(0, 2, 3, 1)}
        kwargs["layout"] = "NHWC"
    arrays = {k: np.ascontiguousarray(v, dtype=dtype) for k, v in arrays.items()}
    names = ("dy", "x", "w") if op.endswith("backward") else ("x", "w", "bias")
    return {name: arrays[name] for name in names}, kwargs


def call(op, arrays, kwargs, module=convgen):
    return getattr(module, op)(*arrays.values(), **kwargs)


def call_reference(op, arrays, kwargs):
    """The reference on native float64 copies (what convgen must match whatever it was given)."""
    native = {k: None if v is None else np.array(v, dtype=np.float64) for k, v in arrays.items()}
    kwargs = {k: v for k, v in kwargs.items() if k not in ("specialize", "out")}
    return call(op, native, kwargs, module=reference)


def check_against_reference(op, actual, arrays, kwargs, dtype=np.float64):
    expected = call_reference(op, arrays, kwargs)
    if isinstance(expected, tuple):
        for name, a, e in zip(("dx", "dw", "db"), actual, expected):
            assert_close(a, e, dtype, f"{op} {name}")
    else:
        assert_close(actual, expected, dtype, op)


# ------------------------------------------------------------------------------- bad arguments
@pytest.fixture
def no_kernels(tmp_path, monkeypatch):
    """Any kernel load fails with BuildError: an empty cache and a flag no compiler accepts."""
    cache = tmp_path / "empty-cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("CONVGEN_CACHE_DIR", str(cache))
    with convgen.configure(cflags=("--no-such-flag-convgen-must-not-compile",)):
        yield
    assert not any(cache.glob("*.so")), "a kernel was built"


def _set(name, value):
    def mutate(arrays, kwargs):
        if name in arrays:
            arrays[name] = value(arrays[name]) if callable(value) else value
        else:
            kwargs[name] = value
    return mutate


def _shape(name, shape):
    return _set(name, lambda _: np.ones(shape))


def _dtype(name, dtype):
    return _set(name, lambda a: a.astype(dtype))


def _drop_array_rank(a):
    return a[0]


# (id, ops it applies to, mutation, exception type, message pattern); shapes are those of base_case.
ALL, FWD, BWD, CONV, TRANS = OPS, FORWARD_OPS, ("conv2d_backward", "conv_transpose2d_backward"), \
    ("conv2d", "conv2d_backward"), TRANSPOSED_OPS
BAD = [
    # wrong ndim, None, strings, unreadable lists
    ("x-2d", ALL, _set("x", lambda a: a[0, 0]), ValueError, r"x must have 4 dimensions, got shape \(\d, \d\)"),
    ("x-unbatched-dy-batched", BWD, _set("x", _drop_array_rank), ValueError,
     r"dy and x must both be batched \(4 dimensions\) or both unbatched \(3\); got dy with 4 and x with 3"),
    ("x-5d", ALL, _set("x", lambda a: a[None]), ValueError, r"x must have 4 dimensions"),
    ("x-scalar", ALL, _set("x", 1.0), ValueError, r"x must have 4 dimensions, got shape \(\)"),
    ("w-3d", ALL, _set("w", _drop_array_rank), ValueError, r"w must have 4 dimensions"),
    ("dy-3d", BWD, _set("dy", _drop_array_rank), ValueError, r"dy and x must both be batched"),
    ("dy-2d", BWD, _set("dy", lambda a: a[0, 0]), ValueError, r"dy must have 4 dimensions"),
    ("bias-2d", FWD, _set("bias", lambda b: b[:, None]), ValueError, r"bias must have 1 dimensions"),
    ("x-none", ALL, _set("x", None), TypeError, r"x must be an array.*NoneType"),
    ("w-none", ALL, _set("w", None), TypeError, r"w must be an array.*NoneType"),
    ("dy-none", BWD, _set("dy", None), TypeError, r"dy must be an array.*NoneType"),
    ("x-string", ALL, _set("x", "x"), TypeError, r"x must be an array.*str"),
    ("w-bytes", ALL, _set("w", b"w"), TypeError, r"w must be an array.*bytes"),
    ("bias-string", FWD, _set("bias", "bias"), TypeError, r"bias must be an array.*str"),
    ("x-list-of-strings", ALL, _set("x", [[[["1.0", "2.0"]]]]), TypeError, r"x must be an array of floats.*strings"),
    ("x-ragged-list", ALL, _set("x", [[[[1.0, 2.0], [3.0]]]]), TypeError, r"x must be an array of floats"),
    ("w-list-of-bools", ALL, _set("w", [[[[True]]]]), TypeError, r"w must be an array of floats.*booleans"),
    ("bias-list-of-complex", FWD, _set("bias", [1j] * 6), TypeError, r"bias must be an array of floats.*complex"),
    # dtypes: integer, complex, object, half, bool, mixed
    ("x-int32", ALL, _dtype("x", np.int32), TypeError, r"x must have dtype float32 or float64, got int32"),
    ("w-int64", ALL, _dtype("w", np.int64), TypeError, r"w must have dtype float32 or float64, got int64"),
    ("x-uint8", ALL, _dtype("x", np.uint8), TypeError, r"x must have dtype.*uint8"),
    ("w-complex", ALL, _dtype("w", np.complex128), TypeError, r"w must have dtype.*complex128"),
    ("x-object", ALL, _dtype("x", object), TypeError, r"x must have dtype.*object"),
    ("x-float16", ALL, _dtype("x", np.float16), TypeError, r"x must have dtype.*float16"),
    ("w-bool", ALL, _dtype("w", bool), TypeError, r"w must have dtype.*bool"),
    ("dy-int", BWD, _dtype("dy", np.int16), TypeError, r"dy must have dtype.*int16"),
    ("bias-int", FWD, _dtype("bias", np.int64), TypeError, r"bias must have dtype.*int64"),
    ("x-float32-w-float64", ALL, _dtype("x", np.float32), TypeError, r"must share one dtype.*x is float32.*w is float64"),
    ("bias-float32", FWD, _dtype("bias", np.float32), TypeError, r"must share one dtype.*bias is float32"),
    ("dy-float32", BWD, _dtype("dy", np.float32), TypeError, r"must share one dtype.*dy is float32"),
    # channels and groups
    ("conv-channel-mismatch", CONV, _shape("w", (6, 3, 3, 3)), ValueError,
     r"w expects 3 input channels per group \(6 in all with groups=2\), but x has 4"),
    ("transposed-channel-mismatch", TRANS, _shape("w", (5, 3, 3, 3)), ValueError, r"w has 5 input channels.*x has 4"),
    ("groups-not-dividing-c", ALL, _set("groups", 3), ValueError, r"groups=3 must divide"),
    ("groups-not-dividing-f", CONV, _shape("w", (5, 2, 3, 3)), ValueError,
     r"groups=2 must divide both input channels \(4\) and output channels \(5\)"),
    ("groups-zero", ALL, _set("groups", 0), ValueError, r"groups must be >= 1, got 0"),
    ("groups-negative", ALL, _set("groups", -2), ValueError, r"groups must be >= 1, got -2"),
    ("groups-float", ALL, _set("groups", 2.0), TypeError, r"groups must be an integer, got 2\.0"),
    ("groups-bool", ALL, _set("groups", True), TypeError, r"groups must be an integer, got True"),
    ("groups-string", ALL, _set("groups", "2"), TypeError, r"groups must be an integer"),
    # kernel larger than the padded (dilated) input
    ("kernel-larger-than-padded-input", CONV, lambda a, k: (a.update(x=np.ones((2, 4, 2, 6))), k.update(padding=0)),
     ValueError, r"kernel extent 3 along h .*is larger than the padded input 2"),
    ("dilated-kernel-larger", CONV, _set("dilation", (1, 4)), ValueError,
     r"kernel extent 9 along w.*larger than the padded input 8"),
    ("transposed-padding-too-large", TRANS, _set("padding", 5), ValueError, r"output along h would be 0: padding too large"),
    # stride, dilation, padding values and forms
    ("stride-zero", ALL, _set("stride", 0), ValueError, r"stride must be >= 1, got 0"),
    ("stride-negative", ALL, _set("stride", (2, -1)), ValueError, r"stride\[1\] must be >= 1, got -1"),
    ("stride-three", ALL, _set("stride", (1, 2, 3)), ValueError, r"stride must be an int or an \(h, w\) pair"),
    ("stride-float", ALL, _set("stride", 2.0), TypeError, r"stride must be an integer, got 2\.0"),
    ("stride-numpy-float", ALL, _set("stride", (np.float64(2), 2)), TypeError, r"stride\[0\] must be an integer"),
    ("stride-bool", ALL, _set("stride", True), TypeError, r"stride must be an integer, got True"),
    ("stride-none", ALL, _set("stride", None), TypeError, r"stride must be an integer, got None"),
    ("stride-string", ALL, _set("stride", "2"), TypeError, r"stride must be an integer, got '2'"),
    ("dilation-zero", ALL, _set("dilation", 0), ValueError, r"dilation must be >= 1, got 0"),
    ("dilation-negative", ALL, _set("dilation", (-1, 1)), ValueError, r"dilation\[0\] must be >= 1"),
    ("dilation-float", ALL, _set("dilation", 1.5), TypeError, r"dilation must be an integer, got 1\.5"),
    ("dilation-bool", ALL, _set("dilation", (1, False)), TypeError, r"dilation\[1\] must be an integer, got False"),
    ("padding-negative", ALL, _set("padding", -1), ValueError, r"padding must be >= 0, got -1"),
    ("padding-negative-side", ALL, _set("padding", ((0, -1), (1, 1))), ValueError, r"padding\[h\]\[1\] must be >= 0"),
    ("padding-three", ALL, _set("padding", (1, 1, 1)), ValueError, r"padding must be an int, \(h, w\) or"),
    ("padding-empty", ALL, _set("padding", ()), ValueError, r"padding must be an int, \(h, w\) or"),
    ("padding-inner-three", ALL, _set("padding", ((1, 1, 1), (1, 1))), ValueError, r"padding for h must be"),
    ("padding-unknown-string", ALL, _set("padding", "full"), ValueError, r"padding must be .*'same' or 'valid'; got 'full'"),
    ("padding-float", ALL, _set("padding", 1.0), TypeError, r"padding must be an integer, got 1\.0"),
    ("padding-bool", ALL, _set("padding", (True, 1)), TypeError, r"padding\[h\] must be an integer, got True"),
    ("padding-none", ALL, _set("padding", None), TypeError, r"padding must be an integer, got None"),
    # output_padding (transposed only)
    ("output-padding-too-large", TRANS, _set("output_padding", 2), ValueError,
     r"output_padding along h must be smaller than max\(stride, dilation\) = 2, got 2"),
    ("output-padding-dilation", TRANS, lambda a, k: k.update(stride=1, dilation=2, output_padding=(0, 2)), ValueError,
     r"output_padding along w must be smaller than max\(stride, dilation\) = 2, got 2"),
    ("output-padding-negative", TRANS, _set("output_padding", -1), ValueError, r"output_padding must be >= 0"),
    ("output-padding-three", TRANS, _set("output_padding", (1, 1, 1)), ValueError, r"output_padding must be an int or"),
    ("output-padding-float", TRANS, _set("output_padding", 1.0), TypeError, r"output_padding must be an integer"),
    ("output-padding-with-same", TRANS, _set("padding", "same"), ValueError, r"output_padding must be 0 with padding='same'"),
    # bias and dy shapes
    ("bias-length", FWD, _shape("bias", (5,)), ValueError, r"bias must have shape \(6,\).*got \(5,\)"),
    ("dy-shape", ("conv2d_backward",), _shape("dy", (2, 6, 4, 4)), ValueError,
     r"dy must have shape \(2, 6, 4, 3\) \(the output of conv2d\), got \(2, 6, 4, 4\)"),
    ("dy-shape-transposed", ("conv_transpose2d_backward",), _shape("dy", (2, 6, 8, 5)), ValueError,
     r"dy must have shape \(2, 6, 8, 6\) \(the output of conv_transpose2d\)"),
    ("dy-channels", BWD, _set("dy", lambda d: d[:, :5]), ValueError, r"dy must have shape"),
    # layout and variant
    ("layout-unknown", ALL, _set("layout", "NCWH"), ValueError, r"layout must be 'NCHW' or 'NHWC', got 'NCWH'"),
    ("layout-none", ALL, _set("layout", None), ValueError, r"layout must be 'NCHW' or 'NHWC', got None"),
    ("layout-int", ALL, _set("layout", 0), ValueError, r"layout must be 'NCHW' or 'NHWC', got 0"),
    ("specialize-string", ALL, _set("specialize", "yes"), TypeError, r"specialize must be True or False, got 'yes'"),
    ("specialize-none", ALL, _set("specialize", None), TypeError, r"specialize must be True or False"),
    # sizes: window values that do not fit the kernels' arithmetic, outputs larger than memory or 2**62
    ("stride-huge", ALL, _set("stride", 2 ** 70), ValueError, r"stride must be at most 2147483647"),
    ("padding-huge", ALL, _set("padding", ((0, 2 ** 40), (1, 1))), ValueError, r"padding(\[h\]\[1\])? must be at most 2147483647"),
    ("dilation-huge", ALL, _set("dilation", 2 ** 31), ValueError, r"dilation must be at most 2147483647"),
    ("output-beyond-memory", ("conv2d",), _set("padding", 2 ** 20), ValueError,
     r"the result would have shape \(2, 6, 1048579, 1048578\) and need \d+ bytes, more than this machine's memory"),
    ("output-beyond-indexing", ("conv2d",), _set("padding", 2 ** 31 - 1), ValueError,
     r"the result would have shape .*elements: more than the 2\*\*62"),
    ("transposed-output-beyond-memory", ("conv_transpose2d",), lambda a, k: k.update(stride=2 ** 20, output_padding=0),
     ValueError, r"the result would have shape \(2, 6, \d+, \d+\) and need \d+ bytes, more than this machine"),
    ("broadcast-input-beyond-memory", ALL, _set("x", lambda a: np.broadcast_to(a[:1, :1, :1, :1], (2 ** 20, 4, 2 ** 20, 6))),
     ValueError, r"a contiguous copy of x would have shape \(1048576, 4, 1048576, 6\) and need \d+ bytes"),
    # out=
    ("out-wrong-shape", FWD, _set("out", np.empty((1, 1, 1, 1))), ValueError, r"out must have shape \(2, 6, \d, \d\) and dtype float64"),
    ("out-wrong-dtype", ("conv2d",), _set("out", np.empty((2, 6, 4, 3), np.float32)), ValueError, r"out must have .*dtype float64, got .*float32"),
    ("out-not-contiguous", ("conv2d",), _set("out", np.empty((2, 6, 4, 6))[..., ::2]), ValueError, r"out must be a writeable C-contiguous"),
    ("out-read-only", ("conv2d",), _set("out", np.lib.stride_tricks.as_strided(np.empty((2, 6, 4, 3)), writeable=False)),
     ValueError, r"out must be a writeable C-contiguous"),
    ("out-list", FWD, _set("out", [[0.0]]), TypeError, r"out must be a NumPy array, got list"),
    ("out-tuple-length", BWD, _set("out", (None, None)), TypeError, r"out must be a \(dx, dw, db\) tuple"),
    ("out-not-tuple", BWD, _set("out", np.empty(3)), TypeError, r"out must be a \(dx, dw, db\) tuple"),
    ("out-dw-shape", BWD, _set("out", (None, np.empty((1,)), None)), ValueError, r"out\[1\] \(dw\) must have shape"),
    ("out-db-dtype", BWD, _set("out", (None, None, np.empty(6, np.float32))), ValueError, r"out\[2\] \(db\) must have.*float64"),
]
BAD_CASES = [pytest.param(op, mutate, exc, match, id=f"{op}-{name}")
             for name, applies, mutate, exc, match in BAD for op in applies]


@pytest.mark.parametrize("op, mutate, exc, match", BAD_CASES)
def test_bad_argument_is_refused_before_any_kernel(op, mutate, exc, match, no_kernels):
    arrays, kwargs = base_case(op)
    mutate(arrays, kwargs)
    with pytest.raises(exc, match=match):
        call(op, arrays, kwargs)


@pytest.mark.parametrize("op", OPS)
def test_the_unchanged_base_case_needs_a_kernel(op, no_kernels):
    """The table's base case is valid: it gets as far as loading a kernel (which no_kernels forbids)."""
    arrays, kwargs = base_case(op)
    with pytest.raises(convgen.BuildError, match="no-such-flag"):
        call(op, arrays, kwargs)


def test_overlapping_out_is_refused(no_kernels):
    buffer = np.zeros(2 * 6 * 4 * 3)
    x, y = buffer[:2 * 4 * 4 * 3].reshape(2, 4, 4, 3), buffer.reshape(2, 6, 4, 3)  # both contiguous
    with pytest.raises(ValueError, match="out must not overlap an input array"):
        convgen.conv2d(x, np.ones((6, 2, 1, 1)), groups=2, out=y)
    arrays, kwargs = base_case("conv2d_backward")
    with pytest.raises(ValueError, match=r"out\[0\] \(dx\) must not overlap"):
        call("conv2d_backward", arrays, dict(kwargs, out=(arrays["x"], None, None)))


def test_nhwc_messages_name_the_nhwc_dimension(no_kernels):
    arrays, kwargs = base_case("conv_transpose2d", layout="NHWC")
    arrays["w"] = np.ones((3, 3, 3, 5))
    with pytest.raises(ValueError, match=r"w has 5 input channels \(its last dimension\) but x has 4"):
        call("conv_transpose2d", arrays, kwargs)
    arrays, kwargs = base_case("conv2d", layout="NHWC")
    arrays["w"] = np.ones((3, 3, 3, 6))
    with pytest.raises(ValueError, match=r"w expects 3 input channels per group.*but x has 4"):
        call("conv2d", arrays, kwargs)


@VARIANTS
def test_workspace_beyond_memory_is_refused(monkeypatch, specialize):
    """The kernels' own workspace is checked against the machine's memory before the call: with
    the memory limit one byte below what the kernel asks for, the call is refused; at it, it runs."""
    x, w = np.ones((1, 64, 1, 1)), np.ones((64, 64, 1, 1))
    problem = resolve.conv_problem(x.shape, w.shape, x.dtype, 1, 0, 1, 1, "NCHW")
    kernels = convgen.get_kernels(ConvSpec(problem.window if specialize else None, "float64"))
    monkeypatch.setattr(resolve.LIMITS, "workspace_query_bytes", 0)
    for op, entries in (("conv2d", ("fwd",)), ("conv2d_backward", ("bwd_data", "bwd_weight"))):
        needed = max(kernels.workspace_bytes(entry, problem) for entry in entries)
        results = (x,) if op == "conv2d" else (x, w)  # y has x's shape here; dx and dw have x's and w's
        assert needed > max(r.nbytes for r in results), \
            "the workspace must be the call's largest allocation for this test to mean anything"
        arrays = {"x": x, "w": w} if op == "conv2d" else {"dy": x, "x": x, "w": w}
        monkeypatch.setattr(resolve.LIMITS, "memory_bytes", needed - 1)
        with pytest.raises(ValueError, match=rf"{op} would need a workspace of {needed} bytes .*\(64, 64, 1, 1\)"):
            call(op, arrays, dict(specialize=specialize))
        monkeypatch.setattr(resolve.LIMITS, "memory_bytes", needed)
        check_against_reference(op, call(op, arrays, dict(specialize=specialize)), arrays, {})


# ------------------------------------------------------------------------- unusual valid arrays
def _unusual(kind, array):
    """`array`'s values in an unusual but valid container."""
    if kind == "strided":          # every other element of a larger buffer
        big = np.zeros(array.shape[:-1] + (2 * array.shape[-1],), array.dtype)
        big[..., ::2] = array
        return big[..., ::2]
    if kind == "fortran":
        return np.asfortranarray(array)
    if kind == "reversed-view":    # negative strides
        return np.ascontiguousarray(array[..., ::-1])[..., ::-1]
    if kind == "byteswapped":
        return array.astype(array.dtype.newbyteorder(">" if np.little_endian else "<"))
    if kind == "read-only":
        copy = array.copy()
        copy.flags.writeable = False
        return copy
    if kind == "list":
        return array.tolist()
    raise AssertionError(kind)


UNUSUAL = ("strided", "fortran", "reversed-view", "byteswapped", "read-only", "list")


@VARIANTS
@pytest.mark.parametrize("kind", UNUSUAL)
@pytest.mark.parametrize("op", OPS)
def test_unusual_arrays_give_the_reference_result(op, kind, specialize):
    dtype = np.float32 if kind == "byteswapped" else np.float64
    for layout in ("NCHW", "NHWC"):
        arrays, kwargs = base_case(op, np.random.default_rng(len(kind)), dtype, layout)
        unusual = {name: _unusual(kind, a) for name, a in arrays.items()}
        result = call(op, unusual, dict(kwargs, specialize=specialize))
        expected_dtype = np.float64 if kind == "list" else dtype  # lists alone are float64
        check_against_reference(op, result, arrays, kwargs, expected_dtype)


@VARIANTS
@pytest.mark.parametrize("op", FORWARD_OPS)
def test_nhwc_views_of_nchw_buffers(op, specialize):
    """NHWC arguments that are transposed views (not copies) of NCHW data."""
    arrays, kwargs = base_case(op, np.random.default_rng(5))
    views = {"x": arrays["x"].transpose(0, 2, 3, 1), "w": arrays["w"].transpose(2, 3, 1, 0), "bias": arrays["bias"]}
    y = call(op, views, dict(kwargs, layout="NHWC", specialize=specialize))
    check_against_reference(op, y, views, dict(kwargs, layout="NHWC"))


@VARIANTS
@pytest.mark.parametrize("op", OPS)
def test_inputs_are_never_modified(op, specialize):
    for layout in ("NCHW", "NHWC"):
        arrays, kwargs = base_case(op, np.random.default_rng(11), np.float64, layout)
        before = {k: v.copy() for k, v in arrays.items()}
        result = call(op, arrays, dict(kwargs, specialize=specialize))
        # and once more with preallocated outputs
        out = tuple(np.empty_like(r) for r in result) if isinstance(result, tuple) else np.empty_like(result)
        call(op, arrays, dict(kwargs, specialize=specialize, out=out))
        for name, value in arrays.items():
            np.testing.assert_array_equal(value, before[name], err_msg=f"{op} modified {name}")


@VARIANTS
@pytest.mark.parametrize("op", OPS)
def test_out_is_overwritten_not_accumulated(op, specialize):
    """Preallocated outputs full of NaN: every element is written, none read."""
    arrays, kwargs = base_case(op, np.random.default_rng(13))
    shapes = call_reference(op, arrays, kwargs)
    out = tuple(np.full(r.shape, np.nan) for r in shapes) if isinstance(shapes, tuple) else np.full(shapes.shape, np.nan)
    result = call(op, arrays, dict(kwargs, specialize=specialize, out=out))
    assert result is out or all(a is b for a, b in zip(result, out))
    check_against_reference(op, result, arrays, kwargs)


# ----------------------------------------------------------------------------------- empty sizes
def _empty_case(op, sizes):
    """Arrays of `op` with batch n, input channels c and height h, some of them zero.
    conv2d: k3s2, padding 2 (so that h = 0 still has outputs), groups 2, 6 filters;
    conv_transpose2d: k3s2, no padding, 3 output channels."""
    n, c, h = sizes
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, c, h, 5))
    if op in TRANSPOSED_OPS:
        w, bias, kwargs = rng.standard_normal((c, 3, 3, 3)), rng.standard_normal(3), dict(stride=2)
    else:
        w, bias, kwargs = rng.standard_normal((6, c // 2, 3, 3)), rng.standard_normal(6), dict(stride=2, padding=2, groups=2)
    if op.endswith("backward"):
        dy = rng.standard_normal(call_reference(op.replace("_backward", ""), {"x": x, "w": w}, kwargs).shape)
        return {"dy": dy, "x": x, "w": w}, kwargs
    return {"x": x, "w": w, "bias": bias}, kwargs


@VARIANTS
@pytest.mark.parametrize("sizes", [(0, 4, 7), (2, 0, 7), (2, 4, 0), (0, 0, 0), (2, 4, 7)],
                         ids=["n0", "c0", "h0", "all0", "none0"])
@pytest.mark.parametrize("op", OPS)
def test_empty_sizes_give_results_of_the_right_shape(op, sizes, specialize):
    """Zero batch, channels or height: right shapes; sums over nothing are zeros (plus the bias)."""
    arrays, kwargs = _empty_case(op, sizes)
    expected = call_reference(op, arrays, kwargs)
    out = tuple(np.full(e.shape, 7.0) for e in expected) if isinstance(expected, tuple) else None
    result = call(op, arrays, dict(kwargs, specialize=specialize, out=out))
    if isinstance(expected, tuple):
        for name, a, e in zip(("dx", "dw", "db"), result, expected):
            assert a.shape == e.shape, name
            np.testing.assert_allclose(a, e, atol=1e-12, err_msg=f"{op} {name}")
    else:
        assert result.shape == expected.shape
        np.testing.assert_allclose(result, expected, atol=1e-12)


def test_empty_batch_gradients_are_zero():
    """N = 0: dx is empty, dw and db are zeros even when the outputs held other values."""
    dy, x, w = np.ones((0, 6, 4, 3)), np.ones((0, 4, 7, 6)), np.ones((6, 2, 3, 3))
    out = (np.empty((0, 4, 7, 6)), np.full((6, 2, 3, 3), 5.0), np.full(6, 5.0))
    dx, dw, db = convgen.conv2d_backward(dy, x, w, stride=2, padding=1, groups=2, out=out)
    assert dx.shape == (0, 4, 7, 6) and not dw.any() and not db.any()
    y = convgen.conv2d(x, w, np.arange(6.0), stride=2, padding=1, groups=2)
    assert y.shape == (0, 6, 4, 3)


# ------------------------------------------------------------------------------ NaN and infinity
def _poison(array, rng, count=3):
    """A copy of `array` with NaN, +inf and -inf at a few random positions."""
    array = array.copy()
    flat = array.reshape(-1)
    for value in (np.nan, np.inf, -np.inf):
        flat[rng.choice(flat.size, count, replace=False)] = value
    return array


def _assert_same_specials(actual, expected, what):
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.isposinf(actual), np.isposinf(expected), err_msg=f"{what}: +inf positions")
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected), err_msg=f"{what}: -inf positions")
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=1e-10, atol=1e-10, err_msg=what)


@VARIANTS
@pytest.mark.parametrize("poisoned", ["data", "weights"])
@pytest.mark.parametrize("op", OPS)
def test_nan_and_inf_propagate_as_ieee_says(op, poisoned, specialize):
    """NaN and ±inf in the data (x or dy) or in the weights reach exactly the outputs the reference's
    dense sums reach (the order of finite sums cannot change where NaN/inf appear). Padding is
    zeros that multiply like any other value: 0·inf at a padded tap is NaN, as in PyTorch."""
    rng = np.random.default_rng(17)
    for layout in ("NCHW", "NHWC"):
        arrays, kwargs = base_case(op, rng, np.float64, layout)
        if poisoned == "weights":
            arrays["w"] = _poison(arrays["w"], rng, 1)
        else:
            name = "dy" if "dy" in arrays else "x"
            arrays[name] = _poison(arrays[name], rng)
        with np.errstate(invalid="ignore"):  # inf - inf in NumPy's sums (db, and the reference)
            result = call(op, arrays, dict(kwargs, specialize=specialize))
            expected = call_reference(op, arrays, kwargs)
        if isinstance(expected, tuple):
            for name, a, e in zip(("dx", "dw", "db"), result, expected):
                _assert_same_specials(a, e, f"{op} {layout} {name}")
        else:
            _assert_same_specials(result, expected, f"{op} {layout}")
        values = np.concatenate([np.ravel(r) for r in (result if isinstance(result, tuple) else (result,))])
        assert np.isnan(values).any(), "the poison reached no output: the test would check nothing"


# --------------------------------------------------------------------- what reaches the C source
def test_only_validated_integers_and_fixed_names_reach_the_c_source():
    """Every template value is an int, a bool, a string of digits, a fixed table entry, or a field name."""
    from fractions import Fraction

    from convgen.codegen import abi, render
    from convgen.planning import winograd
    from convgen.runtime.kernels import settings
    from convgen.planning.spec import DTYPES, FAMILIES, LAYOUTS, PADDING_MODES, ConvSpec, Window

    schedule = settings().schedule()
    window = Window((np.int64(3), 2), (np.int32(2), 1), ((1, np.int16(0)), (2, 1)), (1, np.uint8(2)), "reflect")
    from convgen.planning.epilogue import ACTIVATIONS, RESIDUALS, Epilogue

    fixed = (set(DTYPES) | set(DTYPES.values()) | set(LAYOUTS) | set(FAMILIES) | set(PADDING_MODES)
             | set(abi.OPS) | set(render.PARTS) | set(ACTIVATIONS) | set(RESIDUALS)
             | {schedule.isa, schedule.ukernel, convgen.__version__})
    winograd_spec = ConvSpec(Window((np.int64(3), 3), 1, ((np.int8(1), 0), (0, 2))), "float32", "NCHW", "winograd", 4,
                             Epilogue("leaky_relu", "after", 0.5))
    for spec in (ConvSpec(window, "float32", "nhwc"), ConvSpec(None, np.float64, "NCHW"), winograd_spec):
        context = render.template_context(spec, schedule)
        def allowed(value):
            if isinstance(value, (list, tuple)):
                return all(allowed(v) for v in value)
            if isinstance(value, dict):
                return all(allowed(v) for v in value.values())
            if isinstance(value, str):
                return (value.isdigit() or value in fixed or value == str(spec) or value in symbols
                        or (value.startswith("g->") and value[3:].isidentifier()))
            # Winograd's coefficients are exact rationals it computes itself; `combine` writes them as C.
            # (None: the generic build's padding mode, chosen at run time.)
            return type(value) in (int, bool, Fraction) or value is winograd.linear_combination or value is None

        symbols = {spec.symbol(op) for op in abi.ENTRY_POINTS} | set(abi.signatures(spec).values())
        for key, value in context.items():
            assert allowed(value), f"template value {key}={value!r} ({type(value).__name__})"
    for bad in (dict(kernel=(3.0, 3)), dict(kernel=(3, 3), stride=True), dict(kernel="3"),
                dict(kernel=(3, 3), padding="1; system(1)"), dict(kernel=(3, 3), padding=1, padding_mode="zeros; f()")):
        with pytest.raises((TypeError, ValueError)):
            Window(**bad)
    for dtype, layout in (("float16", "NCHW"), ("float32); abort(", "NCHW"), ("float32", "NCHW */")):
        with pytest.raises((TypeError, ValueError)):
            ConvSpec(None, dtype, layout)
