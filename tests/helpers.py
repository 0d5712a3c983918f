"""Shared test helpers: seeded generators, random arrays in either layout, tolerance checks against the
reference, and the thread counts the kernels plan for a call."""

import zlib

import numpy as np

import convgen
from convgen.frontend import ops
from convgen.planning import planner
from convgen.runtime.kernels import settings
from convgen.planning.problem import Problem

TOLERANCE = {np.float64: 1e-10, np.float32: 1e-4}


def seeded_rng(*key):
    """A generator seeded by `key` (the same in every run and process, unlike hash() of strings)."""
    return np.random.default_rng(zlib.crc32(repr(tuple(str(k) for k in key)).encode()))


def to_layout(x_nchw, w_oihw, layout, transposed=False):
    """Arrays made in NCHW / PyTorch weight order, moved to `layout`'s conventions."""
    if layout == "NCHW":
        return np.ascontiguousarray(x_nchw), np.ascontiguousarray(w_oihw)
    # NHWC: images (N, H, W, C); conv2d weights (KH, KW, C/g, F); transposed weights (KH, KW, C_out/g, C_in).
    return (np.ascontiguousarray(x_nchw.transpose(0, 2, 3, 1)), np.ascontiguousarray(w_oihw.transpose(2, 3, 1, 0)))


def at_line_offset(array, offset, line=64):
    """A C-contiguous copy of `array` that starts `offset` bytes past a multiple of `line` bytes (NumPy
    places arrays wherever its allocator does: kernels that align their vectors must see every offset)."""
    buffer = np.empty(array.nbytes + line, np.uint8)
    skip = (offset - buffer.ctypes.data) % line
    copy = buffer[skip:skip + array.nbytes].view(array.dtype).reshape(array.shape)
    copy[...] = array
    assert copy.ctypes.data % line == offset % line and copy.flags.c_contiguous
    return copy


def assert_close(actual, expected, dtype, what=""):
    """Relative agreement, scaled by the largest expected magnitude (so near-zero entries are not over-weighted)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == np.dtype(dtype), f"{what}: dtype {actual.dtype} != {np.dtype(dtype)}"
    scale = max(float(np.abs(expected).max()), 1e-30) if expected.size else 1.0
    err = float(np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max()) / scale if expected.size else 0.0
    assert err <= TOLERANCE[np.dtype(dtype).type], f"{what}: relative error {err:.3g}"


def random_case(rng, n, c, h, w, f, cg, kh, kw, dtype):
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    weight = rng.standard_normal((f, cg, kh, kw)).astype(dtype)
    bias = rng.standard_normal(f).astype(dtype)
    return x, weight, bias


def numerical_gradient(loss, array, h):
    """Central differences of the scalar loss() with respect to each element of `array` (perturbed in place)."""
    grad = np.zeros_like(array)
    flat, flat_grad = array.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        saved = flat[i]
        flat[i] = saved + h
        up = loss()
        flat[i] = saved - h
        down = loss()
        flat[i] = saved
        flat_grad[i] = (up - down) / (2 * h)
    return grad


def relative_error(a, b):
    """Largest absolute difference, relative to the larger of the two arrays' magnitudes."""
    scale = max(float(np.abs(a).max()), float(np.abs(b).max()), 1e-30)
    return float(np.abs(a - b).max()) / scale


# ------------------------------------------------------------------------------------ threads
def _nchw_dims(shape, layout):
    n, a, b, c = shape
    return (n, a, b, c) if layout == "NCHW" else (n, c, a, b)


def call_problem(op, x, y, window, groups=1, layout="NCHW"):
    """The Problem of one call of `op` whose input (x, or for a backward op the forward input) and
    output (y, or dy) have these shapes: the call's own sizes, `transpose` for conv_transpose2d."""
    n, c, h, w = _nchw_dims(np.shape(x), layout)
    _, f, ho, wo = _nchw_dims(np.shape(y), layout)
    return Problem(n, c, h, w, f, ho, wo, groups, window, np.dtype(x.dtype).name, layout,
                   transpose=op.startswith("conv_transpose2d"))


def kernels_for(problem, specialize=True, algorithm="auto"):
    """The kernels the ops pick for `problem` under the active settings."""
    return convgen.get_kernels(planner.plan(problem, specialize, settings().schedule(), algorithm).spec)


def planned_threads(op, x, y, window, groups=1, layout="NCHW", specialize=True, nthreads=None, algorithm="auto"):
    """{entry: threads} the kernels the ops pick plan for each entry point `op` runs."""
    problem = call_problem(op, x, y, window, groups, layout)
    kernels = kernels_for(problem, specialize, algorithm)
    return {entry: kernels.threads(entry, problem, nthreads) for entry in ops.OP_ENTRIES[op]}


def assert_parallel(op, x, y, window, groups=1, layout="NCHW", specialize=True, at_least=2):
    """Every entry point of `op` on these sizes runs on `at_least` threads: the call is big enough
    that the kernels' planner does not fall back to one thread (it gives each thread ≥ 2 MFLOP)."""
    threads = planned_threads(op, x, y, window, groups, layout, specialize)
    assert all(t >= at_least for t in threads.values()), (
        f"{op} {window.short()} {layout} x{np.shape(x)} -> {np.shape(y)}: planned threads {threads}, "
        f"expected at least {at_least} each (convgen.num_threads() = {convgen.num_threads()})")
    return threads
