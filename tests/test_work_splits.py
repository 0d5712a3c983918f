"""The ways the direct kernels share a call among threads and lay out its operands, each against the
reference on the shapes that take it (the broad grids elsewhere pick their shapes for other reasons):

- the NCHW pixel-row forward pass of deep layers on small images, whose threads split the column tiles
  (filters) of one block of pixels, its padded rows copied once for all of them;
- the weight gradient through panels of several small images in one unit, their pixels one depth,
  and split by filters when the pixels are fewer than the filters; in NCHW with a 1x1 window of
  stride 1 over the whole image, x and dy read where they lie (no phase planes, no dy rows);
- the NHWC phase planes split 16 channels at a time, every padding mode, and a per-image forward pass
  of small groups that splits an image once for all of its groups;
- the NHWC forward pass of a 1x1 window over many channels and few filters (pixel rows);
- the NHWC pixel-row forward pass of a shallow layer whose panels fit in the L1 cache, each tile of
  pixels taking every column tile in turn (the last one partial, as the last tile of pixels).

Every window here is one the test grid builds anyway (tests/grid.py).
"""

import numpy as np
import pytest

import convgen
from convgen import reference
from convgen.frontend import resolve
from helpers import seeded_rng, to_layout

TOLERANCE = {np.float32: 2e-5, np.float64: 1e-12}

# (n, c, h, w, f, kernel, stride, padding, dilation, groups, padding_mode, layout)
CASES = {
    "nchw deep, small image": (1, 96, 5, 5, 160, 3, 1, 1, 1, 1, "zeros", "NCHW"),
    "nchw deep, batch of tiny images": (6, 64, 3, 4, 130, 3, 2, 1, 1, 1, "zeros", "NCHW"),
    "nchw deep, grouped": (2, 64, 4, 4, 192, 3, 1, 1, 1, 2, "zeros", "NCHW"),
    # (the pixel rows take the weight gradient of fewer weights: these are 3 x 3 x 64 x 512 and x 480)
    "dW units of several images": (6, 64, 4, 4, 512, 3, 1, 1, 1, 1, "zeros", "NCHW"),
    "dW units of several images, dilated": (5, 64, 7, 7, 480, 3, 1, 1, 2, 1, "zeros", "NCHW"),
    "nchw 1x1 dW in place, two images a unit": (3, 20, 9, 7, 40, 1, 1, 0, 1, 1, "zeros", "NCHW"),
    "nchw 1x1 dW in place, grouped": (2, 24, 8, 6, 72, 1, 1, 0, 1, 2, "zeros", "NCHW"),
    "nchw 1x1 dW in place, pixel blocks": (2, 8, 20, 19, 48, 1, 1, 0, 1, 1, "zeros", "NCHW"),
    "nchw 1x1 dW in place, split by filters": (1, 16, 6, 6, 96, 1, 1, 0, 1, 1, "zeros", "NCHW"),
    "nhwc small groups, per image": (5, 48, 9, 8, 48, 3, 1, 1, 1, 24, "zeros", "NHWC"),
    "nhwc small groups, strided": (4, 20, 10, 9, 10, 3, 2, 1, 1, 5, "zeros", "NHWC"),
    "nhwc planes in blocks, reflect": (2, 37, 8, 9, 3, 3, 1, 1, 1, 1, "reflect", "NHWC"),
    "nhwc planes in blocks, circular": (1, 18, 9, 8, 2, (5, 3), 2, ((2, 2), (1, 1)), 1, 1, "circular", "NHWC"),
    "nhwc 1x1, many channels to few": (3, 40, 7, 6, 3, 1, 1, 0, 1, 1, "zeros", "NHWC"),
    "nhwc 1x1, to one filter": (2, 16, 5, 9, 1, 1, 1, 0, 1, 1, "zeros", "NHWC"),
    "nhwc 1x1 shallow, column tiles inner": (3, 20, 7, 9, 150, 1, 1, 0, 1, 1, "zeros", "NHWC"),
    "nhwc 1x1 shallow, column tiles inner, grouped": (2, 40, 5, 7, 100, 1, 1, 0, 1, 2, "zeros", "NHWC"),
}


@pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_the_reference(name, dtype, specialize):
    n, c, h, w, f, kernel, stride, padding, dilation, groups, mode, layout = CASES[name]
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    rng = seeded_rng("work splits", name, dtype)
    x = rng.standard_normal((n, c, h, w))
    weight = rng.standard_normal((f, c // groups, kh, kw))
    bias = rng.standard_normal(f)
    kwargs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, padding_mode=mode)
    want = reference.conv2d(x, weight, bias, **kwargs)
    dy = rng.standard_normal(want.shape)
    want_dx, want_dw, _ = reference.conv2d_backward(dy, x, weight, **kwargs)
    xl, wl = to_layout(x.astype(dtype), weight.astype(dtype), layout)
    dyl = to_layout(dy.astype(dtype), weight, layout)[0]
    options = dict(kwargs, layout=layout, algorithm="direct", specialize=specialize)
    y = convgen.conv2d(xl, wl, bias.astype(dtype), **options)
    dx, dw, _ = convgen.conv2d_backward(dyl, xl, wl, **options)
    if layout == "NHWC":  # back to NCHW and PyTorch's weight order for the comparison
        y, dx, dw = y.transpose(0, 3, 1, 2), dx.transpose(0, 3, 1, 2), dw.transpose(3, 2, 0, 1)
    for label, got, expected in (("y", y, want), ("dx", dx, want_dx), ("dw", dw, want_dw)):
        error = np.abs(got - expected).max() / np.abs(expected).max()
        assert error <= TOLERANCE[dtype], f"{label}: {error:.2e}"


# Problems beside CASES whose plans take the other paths: the NCHW phase planes (few channels), a
# pixel-row NHWC forward pass of padded bands, dilation, and NCHW threads sharing one image.
PLAN_CASES = dict(CASES, **{
    "nchw planes, few channels": (2, 3, 9, 8, 4, 3, 2, 1, 1, 1, "zeros", "NCHW"),
    "nchw planes, dilated, grouped": (2, 4, 11, 10, 6, 3, 2, 2, 3, 2, "zeros", "NCHW"),
    "nhwc padded bands, few channels": (2, 3, 16, 15, 16, 5, 1, 2, 1, 1, "zeros", "NHWC"),
    "nchw one large image": (1, 16, 40, 36, 32, 5, 1, 2, 1, 1, "zeros", "NCHW"),
})


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_specialized_and_generic_builds_plan_every_call_alike(name):
    """A specialized module's plans (blocks, work items, threads, memory) come from the core object,
    where they are compiled from the generic build, window values read at run time: the plans of
    both builds are one, as their workspace, threads and prepared weights show for every op. (The
    specialized input gradient of a 1x1 window of stride 1 without padding, and in NCHW of a window
    with its zero padding centred, is the forward pass over dy with c and f swapped,
    render.dx_is_forward: its plans are the generic forward pass's of that problem, a 1x1 window's
    with a turned copy of the weights in its workspace (but where NHWC's pixel rows read them where
    they lie); a larger window's, where that forward pass takes the
    pixel rows, with room in its prepared weights for the input gradient's own panels too, which
    weights holding inf or NaN take.)"""
    from convgen.codegen.render import dx_is_forward
    from convgen.frontend import resolve
    from convgen.planning.spec import ConvSpec
    from convgen.runtime.kernels import get_kernels

    n, c, h, w, f, kernel, stride, padding, dilation, groups, mode, layout = PLAN_CASES[name]
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    x_shape = (n, c, h, w) if layout == "NCHW" else (n, h, w, c)
    w_shape = (f, c // groups, kh, kw) if layout == "NCHW" else (kh, kw, c // groups, f)
    for dtype in ("float32", "float64"):
        problem = resolve.conv_problem(x_shape, w_shape, np.dtype(dtype), stride, padding, dilation, groups, layout,
                                       mode)
        specialized, generic = (get_kernels(ConvSpec(window, dtype, layout)) for window in (problem.window, None))
        turned = None
        if dx_is_forward(specialized.spec):
            y_shape = (n, f, h, w) if layout == "NCHW" else (n, h, w, f)
            turned_w = (c, f // groups, kh, kw) if layout == "NCHW" else (kh, kw, f // groups, c)
            turned = resolve.conv_problem(y_shape, turned_w, np.dtype(dtype), 1, padding, dilation, groups, layout)
        for op in ("fwd", "bwd_data", "bwd_weight"):
            for threads in (1, 2, 7):
                got = (specialized.workspace_bytes(op, problem, threads), specialized.threads(op, problem, threads),
                       specialized.prepared_size(op, problem))
                own = (generic.workspace_bytes(op, problem, threads), generic.threads(op, problem, threads),
                       generic.prepared_size(op, problem))
                if op == "bwd_data" and turned is not None and kh * kw == 1:
                    # the forward pass's, with a turned copy of the weights, or (NHWC's pixel rows,
                    # which read the weights where they lie: test_gradients.py pins where) without
                    turned_weights = c * (f // groups) * np.dtype(dtype).itemsize
                    as_forward = (generic.workspace_bytes("fwd", turned, threads),
                                  generic.threads("fwd", turned, threads), generic.prepared_size("fwd", turned))
                    with_copy = (as_forward[0] + turned_weights, *as_forward[1:])
                    expected = as_forward if layout == "NHWC" and got == as_forward else with_copy
                elif op == "bwd_data" and turned is not None:
                    # where the forward pass over dy takes its pixel rows (small planes: test_gradients.py
                    # pins which), else the input gradient's own kernels
                    as_forward = (generic.workspace_bytes("fwd", turned, threads),
                                  generic.threads("fwd", turned, threads), max(generic.prepared_size("fwd", turned), own[2]))
                    expected = as_forward if got == as_forward else own
                else:
                    expected = own
                assert got == expected, (op, threads, got, expected)


# The NCHW phase-plane forward pass stores a tile of MR filters x NR pixels of the planes' grid
# straight from its registers into y: NR pixels cross rows of the grid (wq columns, of which only
# the first wo exist), so each vector lands in up to two runs of y, masked. Shapes with few channels
# (phase planes, not pixel rows) and outputs at least a vector wide; filters not a multiple of MR
# leave a last block of fewer rows; an epilogue sends every tile through the tile path. Under
# test_isa's schedule of tiny blocks (several K blocks: the later ones add onto y) the generic build
# runs, and the AVX2 code each window in the dtype the gradient grid builds it in there, so that no
# module is compiled for this test alone.
TILE_STORE_CASES = {
    "3x3 dilated, rows crossed, partial filter block": ((2, 6, 19, 37, 20), (3, 3), dict(padding=1, dilation=2)),
    "3x5 strided and dilated": ((2, 3, 40, 45, 16), (3, 5), dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2))),
    "4x4 stride 2, grouped": ((2, 4, 36, 40, 32), (4, 4), dict(stride=2, padding=1, groups=2)),
    "3x3, fewer filters than a block": ((3, 5, 17, 30, 3), (3, 3), dict(padding=1)),
}
TINY_BLOCKS = dict(kc=24, kc_forward=20, nc=96)  # test_isa.PATHS' last


@pytest.mark.parametrize("path", ["native", "several K blocks", "avx2"])
@pytest.mark.parametrize("name", list(TILE_STORE_CASES))
def test_nchw_forward_tiles_stored_from_the_registers_match_the_reference(name, path):
    from convgen.runtime.kernels import settings
    from grid import grid_dtype

    (n, c, h, w, f), (kh, kw), kwargs = TILE_STORE_CASES[name]
    window = resolve.conv_problem((n, c, h, w), (f, c // kwargs.get("groups", 1), kh, kw), np.dtype("float32"),
                                  kwargs.get("stride", 1), kwargs.get("padding", 0), kwargs.get("dilation", 1),
                                  kwargs.get("groups", 1), "NCHW").window
    runs = {"native": ({}, (True, False), (np.float32, np.float64)),
            "several K blocks": (TINY_BLOCKS, (False,), (np.float32, np.float64)),
            "avx2": (dict(isa="avx2"), (True,), (np.dtype(grid_dtype(window, "NCHW")).type,))}
    overrides, builds, dtypes = runs[path]
    if path == "avx2" and "avx2" not in settings().toolchain.supported_isas():
        pytest.skip("isa avx2 is not supported on this machine")
    for dtype in dtypes:
        rng = seeded_rng("tile store", name, dtype)
        x = rng.standard_normal((n, c, h, w))
        weight = rng.standard_normal((f, c // kwargs.get("groups", 1), kh, kw))
        bias = rng.standard_normal(f)
        residual = rng.standard_normal(reference.conv2d(x, weight, **kwargs).shape)
        for epilogue in ({}, dict(activation="relu", residual=residual)):
            want = reference.conv2d(x, weight, bias, **kwargs, **epilogue)
            cast = {key: value.astype(dtype) if isinstance(value, np.ndarray) else value for key, value in epilogue.items()}
            for specialize in builds:
                with convgen.configure(**overrides):
                    y = convgen.conv2d(x.astype(dtype), weight.astype(dtype), bias.astype(dtype), algorithm="direct",
                                       specialize=specialize, **kwargs, **cast)
                error = np.abs(y - want).max() / np.abs(want).max()
                assert error <= TOLERANCE[dtype], (dtype.__name__, specialize, sorted(epilogue), f"{error:.2e}")
