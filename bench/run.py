"""convgen's benchmark: forward, backward and transposed convolution on a fixed suite of layers.

Each (op, layer) row times convgen specialized (the algorithm the planner picks for the window:
direct, or Winograd F(m×m, 3×3) for 3×3 stride-1 windows; after `make tune`, what this machine's
wisdom chose where it did, named in the row's algorithm), convgen specialized forced to
algorithm="direct" (on rows where the planner picked another algorithm: what that algorithm buys
over direct code for the same window), convgen generic (always direct), NumPy (im2col by
as_strided, then matmuls on the installed BLAS) and PyTorch's CPU convolution (when torch imports),
alternated within one run (convgen.tools.timing.time_alternating: medians after warm-up; every row in
each of --rounds passes over all the rows, the median of the passes kept), float32, all threads, in
NCHW and (the 2-D layers) again in NHWC, where PyTorch gets channels_last tensors. Every result is
first checked against NumPy's, within 1e-3 relative error for direct code and within
convgen.planning.winograd.ERROR_BOUND for a Winograd kernel; a result outside its bound is marked in the
tables and makes the script exit with status 1. Writes bench/results/bench.md and
bench/results/bench.png and prints the tables.

    python bench/run.py                        # the whole suite (make bench)
    python bench/run.py --quick --layers resnet3x3,batch1_3x3 --ops forward
    python bench/run.py --algorithm direct     # every specialized kernel direct: the suite before Winograd
    python bench/run.py --layers dw3x3s1,dw5x5s2   # depthwise rows only, both layouts
    python bench/run.py --quick --layouts NCHW       # one layout only
    python bench/run.py --quick --layers odd5x5,resnet3x3 --layouts NHWC

The report keeps the suite's NCHW tables as earlier runs had them; the suite's 2-D layers in NHWC
and the layers outside the suite (EXTRA_SUITE: odd sizes, 5×5, narrow filters, batch 1 and 64;
forward and backward in both layouts) have sections of their own, with issue 11's targets for them.

Depthwise rows (DEPTHWISE_SUITE: MobileNet/EfficientNet-like layers, groups == channels) run forward
and backward in both layouts, NHWC against PyTorch's channels_last, and report GB/s (every array the
op reads or writes, counted once) against the machine's memory bandwidth (bench/bandwidth.py), which
is their limit; they are checked against NumPy's depthwise baseline (one strided view per tap).

FLOP convention: forward 2·N·F·(C/g)·KH·KW·Ho·Wo, the direct convolution's count whatever algorithm
ran, so GFLOP/s is an *effective* rate (Winograd does fewer multiplies and can pass the FMA peak);
backward counts dx and dw (2× the forward, db not counted); a transposed convolution counts as the
conv2d whose input gradient it is.

The 1-D and 3-D rows (an audio layer, a video layer) time conv1d and conv3d and their backward ops,
which run on the 2-D kernels (a unit height axis; the depth taps folded into the channels). They
have no NumPy column (an im2col of these layers would take 0.3-0.7 GB): their results are checked
against PyTorch's, and they are left out when torch is not installed. They count the FLOPs of the
convolution itself (2·N·F·(C/g)·K^rank·output positions).
"""

from __future__ import annotations

import os
import sys

# NumPy's OpenBLAS reads its environment when NumPy is imported, so it is set here, for this process only.
# OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are set on some machines of this kind for older OpenBLAS builds
# and slow the current one: unset. OPENBLAS_THREAD_TIMEOUT=4: OpenBLAS's workers go to sleep right after
# a call instead of spinning for ~0.1 s, which took a core from whichever implementation ran next in the
# alternation (PyTorch's resnet3x3 forward measured 14 ms instead of 6 ms after a NumPy call). convgen
# and PyTorch use no OpenBLAS (PyTorch has MKL/oneDNN), so only the NumPy baseline is concerned.
BLAS_ENV_CHANGES = [f"unset {var}={os.environ.pop(var)}" for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
                    if var in os.environ]
if "OPENBLAS_THREAD_TIMEOUT" not in os.environ:
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = "4"
    BLAS_ENV_CHANGES.append("set OPENBLAS_THREAD_TIMEOUT=4")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

import numpy as np  # noqa: E402

import convgen  # noqa: E402
from convgen.tools import baselines  # noqa: E402
from convgen.planning import planner, winograd  # noqa: E402
from convgen.runtime import wisdom  # noqa: E402
from convgen.runtime.kernels import with_schedule  # noqa: E402
from convgen.frontend import resolve  # noqa: E402
from convgen.planning.problem import Problem, image_shape, weight_shape  # noqa: E402
from convgen.planning.spec import ConvSpec  # noqa: E402
from convgen.tools.timing import time_alternating  # noqa: E402

import bandwidth  # noqa: E402
import peak  # noqa: E402
import report  # noqa: E402

# "direct" is convgen's specialized build forced to algorithm="direct"; timed only on rows where the
# planner chose another algorithm for "specialized" (elsewhere the two are the same kernel).
IMPLS = ("specialized", "direct", "generic", "numpy", "pytorch")
CONVGEN_IMPLS = ("specialized", "direct", "generic")
OPS = ("forward", "backward", "transposed", "transposed_backward", "conv1d", "conv1d_backward", "conv3d",
       "conv3d_backward")
ERROR_LIMIT = report.ERROR_LIMIT  # relative error against NumPy's float32 above which direct code is wrong


@dataclasses.dataclass(frozen=True)
class Layer:
    """One 2-D layer in NCHW terms (timed in either layout). For a transposed layer x is (N, C, H, W)
    and the output has F channels."""

    name: str
    n: int
    c: int
    h: int
    w: int
    f: int
    k: int
    s: int
    p: int
    transposed: bool = False

    @property
    def shape_text(self) -> str:
        return f"{self.n}×{self.c}×{self.h}×{self.w} → {self.f} ch, k{self.k}s{self.s}p{self.p}"

    @property
    def is_3x3_s1(self) -> bool:
        """A 3×3 window at stride 1 (no dilation in the suite): the windows Winograd computes."""
        return self.k == 3 and self.s == 1

    def problem(self, layout: str = "NCHW") -> Problem:
        """The resolved problem of this layer's forward (or transposed forward) call, float32, in `layout`."""
        x_shape = image_shape(self.n, self.c, self.h, self.w, layout)
        kernel = (self.k, self.k)
        if self.transposed:
            return resolve.transposed_problem(x_shape, weight_shape(self.c, self.f, kernel, layout),
                                              np.dtype(np.float32), self.s, self.p, 1, 1, layout, 0)
        return resolve.conv_problem(x_shape, weight_shape(self.f, self.c, kernel, layout), np.dtype(np.float32),
                                    self.s, self.p, 1, 1, layout)


@dataclasses.dataclass(frozen=True)
class NdLayer:
    """A 1-D or 3-D suite entry, channels-first (NCL, NCDHW): x (N, C, *sizes) -> F channels through a
    window k on every axis, at stride s with padding p."""

    name: str
    rank: int
    n: int
    c: int
    sizes: tuple
    f: int
    k: int
    s: int
    p: int
    transposed: bool = False

    @property
    def shape_text(self) -> str:
        return (f"{self.n}×{self.c}×{'×'.join(map(str, self.sizes))} → {self.f} ch, "
                f"k{'x'.join([str(self.k)] * self.rank)}s{self.s}p{self.p}")

    @property
    def is_3x3_s1(self) -> bool:
        """A 3×3 height × width window at stride 1: Winograd computes it (any depth)."""
        return self.rank == 3 and self.k == 3 and self.s == 1

    def problem(self) -> Problem:
        """The 2-D problem that computes this layer (a unit height axis; the depth taps as channels)."""
        f32 = np.dtype(np.float32)
        if self.rank == 1:
            return resolve.conv_problem((self.n, self.c, 1, self.sizes[0]), (self.f, self.c, 1, self.k), f32,
                                        (1, self.s), ((0, 0), (self.p, self.p)), 1, 1, "NCHW")
        depth = (self.sizes[0] + 2 * self.p - self.k) // self.s + 1
        return resolve.conv_problem((self.n * depth, self.c * self.k, *self.sizes[1:]),
                                    (self.f, self.c * self.k, self.k, self.k), f32, self.s, self.p, 1, 1, "NCHW")


SUITE = (
    Layer("resnet3x3", 8, 64, 56, 56, 64, 3, 1, 1),
    Layer("resnet3x3s2", 8, 128, 28, 28, 256, 3, 2, 1),
    Layer("stem7x7s2", 8, 3, 224, 224, 64, 7, 2, 3),
    Layer("pointwise1x1", 8, 256, 14, 14, 256, 1, 1, 0),
    Layer("mnist5x5", 32, 1, 28, 28, 16, 5, 1, 2),
    Layer("batch1_3x3", 1, 32, 32, 32, 32, 3, 1, 1),
    # More 3×3 stride-1 layers, where Winograd applies: wide and narrow channel counts, a spatial size
    # that is no multiple of any tile (27 = 6·4 + 3), a large batch of few channels.
    Layer("wide3x3", 8, 256, 14, 14, 256, 3, 1, 1),
    Layer("narrow3x3", 8, 16, 56, 56, 16, 3, 1, 1),
    Layer("odd3x3", 4, 96, 27, 27, 96, 3, 1, 1),
    Layer("bigbatch3x3", 32, 8, 32, 32, 8, 3, 1, 1),
    Layer("dcgan4x4s2", 8, 64, 28, 28, 32, 4, 2, 1, transposed=True),
    Layer("deconv3x3", 8, 64, 28, 28, 64, 3, 1, 1, transposed=True),
    # 1-D and 3-D (issue 12): speech/audio features, 16000 samples, k9; a video or medical volume, 3×3×3.
    NdLayer("audio_k9", 1, 8, 64, (16000,), 64, 9, 1, 4),
    NdLayer("video3x3x3", 3, 2, 64, (16, 56, 56), 64, 3, 1, 1),
)


# Layer shapes outside the suite (issue 11: "odd sizes, 5×5, narrow filters, batch 1 and 64"), timed
# forward and backward in both layouts, in a section of their own: the suite's tables stay comparable
# with earlier runs. Their windows are the suite's (kernels.toml builds them).
EXTRA_SUITE = (
    Layer("odd5x5", 4, 48, 13, 13, 48, 5, 1, 2),       # 5×5 on a small odd image, a few dozen channels
    Layer("narrowf3x3", 8, 64, 28, 28, 8, 3, 1, 1),    # few filters for many channels
    Layer("batch64_3x3", 64, 16, 16, 16, 16, 3, 1, 1),  # a large batch of few channels
    Layer("batch1_128", 1, 128, 28, 28, 128, 3, 1, 1),  # one image of a wide layer
    Layer("odd3x3s2", 8, 64, 29, 29, 96, 3, 2, 1),     # stride 2 over an odd size (15×15 outputs)
)
LAYOUTS = ("NCHW", "NHWC")  # the 2-D rows' layouts (--layouts); NHWC is timed against torch.channels_last


def ops_of(layer) -> tuple[str, ...]:
    if isinstance(layer, NdLayer):
        return (f"conv{layer.rank}d", f"conv{layer.rank}d_backward")
    return ("transposed", "transposed_backward") if layer.transposed else ("forward", "backward")


# The entry points each op calls, in order (a transposed problem runs them as its conv()).
ENTRIES = {"forward": ("fwd",), "backward": ("bwd_data", "bwd_weight"), "transposed": ("bwd_data",),
           "transposed_backward": ("fwd", "bwd_weight"), "conv1d": ("fwd",), "conv1d_backward": ("bwd_data", "bwd_weight"),
           "conv3d": ("fwd",), "conv3d_backward": ("bwd_data", "bwd_weight")}


def algorithm_text(spec: ConvSpec) -> str:
    """"direct" or "winograd F(4x4)": the algorithm a specialized kernel module computes with."""
    return f"winograd F({spec.tile}x{spec.tile})" if spec.family == "winograd" else spec.family


# The convgen op each row's op calls (1-D and 3-D rows call it on their 2-D problem): what wisdom keys.
OP_CALLED = {"forward": "conv2d", "backward": "conv2d_backward", "transposed": "conv_transpose2d",
             "transposed_backward": "conv_transpose2d_backward", "conv1d": "conv2d",
             "conv1d_backward": "conv2d_backward", "conv3d": "conv2d", "conv3d_backward": "conv2d_backward"}


def specialized_plan(problem: Problem, algorithm: str, op: str = "forward") -> planner.Plan:
    """The plan of convgen's specialized implementation of an `op` row, as the ops make it: the
    planner's choice under `algorithm`, taking this machine's wisdom (`make tune`) for "auto"."""
    active = convgen.runtime.kernels.settings()
    measured = wisdom.lookup(OP_CALLED[op], problem, active) if algorithm == "auto" else None
    return planner.plan(problem, True, active.schedule(), algorithm, measured)


def specs_of(problem: Problem, algorithm: str, op: str = "forward") -> dict:
    """The kernel module each convgen implementation calls for `problem`, as the ops plan it:
    {"specialized": `specialized_plan`'s, "direct": the specialized direct module (only when
    "specialized" is another family), "generic": the generic module}."""
    schedule = convgen.runtime.kernels.settings().schedule()
    chosen = specialized_plan(problem, algorithm, op).spec
    specs = {"specialized": chosen}
    if chosen.family != "direct":
        specs["direct"] = planner.plan(problem, True, schedule, "direct").spec
    specs["generic"] = planner.plan(problem, False, schedule).spec
    return specs


def kernels_of(specs: dict, plan: planner.Plan) -> dict:
    """The loaded kernels of each implementation in `specs`: the specialized one (`plan`'s) under the
    schedule fields of a measured variant, if wisdom chose one."""
    variant = with_schedule(convgen.runtime.kernels.settings(), plan.overrides) if plan.variant else None
    return {v: convgen.get_kernels(spec, variant if v == "specialized" else None) for v, spec in specs.items()}


def row_algorithm(op: str, spec: ConvSpec, variant: str = "") -> str:
    """What the specialized implementation of an `op` row computes with. Winograd computes a
    convolution and an input gradient, its weight gradient is direct; depthwise computes all three.
    A schedule variant wisdom chose for the direct kernels is named after them."""
    text = algorithm_text(spec)
    if spec.family == "winograd" and op.endswith("backward"):
        return f"{text} dx, direct dw"
    return f"{text}, {variant}" if variant else text


# ------------------------------------------------------------------------------------ one row
@dataclasses.dataclass
class Case:
    """Everything one (op, layer) row runs: callables per implementation and what they are measured by."""

    op: str
    layer: Layer
    flops: int               # the direct convolution's count: GFLOP/s is effective for other algorithms
    funcs: dict              # implementation -> zero-argument callable returning its result
    workspace: dict          # convgen implementation -> C workspace bytes (largest kernel call of the op)
    output_bytes: int        # the result arrays, preallocated for convgen (out=), new for the others
    algorithm: str           # what the specialized implementation computes with ("direct", "winograd F(4x4)")
    error_limits: dict       # implementation -> largest relative error against the reference that counts as right
    reference: str = "numpy"  # the implementation every result is checked against


def _relative_error(got, expected) -> float:
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    worst = 0.0
    for a, b in zip(got, expected):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            return math.inf
        worst = max(worst, float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1e-30))
    return worst


def make_case(op: str, layer: Layer, torch, algorithm: str = "auto", layout: str = "NCHW") -> Case:
    """Inputs, outputs and callables of one row; the specialized implementation runs `algorithm`.

    In NHWC convgen gets x (N, H, W, C) and weights (KH, KW, C, F) (transposed: (KH, KW, C_out, C_in)),
    PyTorch the same values as channels_last tensors; NumPy computes in NCHW and its result is compared
    through a transposed view (no copy is timed with it)."""
    if isinstance(layer, NdLayer):
        if layout != "NCHW":
            raise ValueError(f"layout: the 1-D and 3-D rows are channels-first only, got {layout!r}")
        return _make_nd_case(op, layer, torch, algorithm)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    rng = np.random.default_rng(0)
    L = layer
    stride, padding = (L.s, L.s), (L.p, L.p)
    x = rng.standard_normal((L.n, L.c, L.h, L.w), dtype=np.float32)
    w_shape = (L.c, L.f, L.k, L.k) if L.transposed else (L.f, L.c, L.k, L.k)
    w = rng.standard_normal(w_shape, dtype=np.float32) / np.float32(math.sqrt(L.c * L.k * L.k))
    problem = L.problem(layout)
    # A transposed convolution counts as the conv2d whose input gradient it is (problem.flops says so).
    fwd_flops, ho, wo = problem.flops, problem.ho, problem.wo
    nhwc = layout == "NHWC"
    # NCHW arrays in the row's layout: images (N, C, H, W) -> (N, H, W, C); both kinds of weights
    # (F, C, KH, KW) -> (KH, KW, C, F) and (C_in, C_out, KH, KW) -> (KH, KW, C_out, C_in).
    image_axes, weight_axes = (0, 2, 3, 1), (2, 3, 1, 0)

    def in_layout(a, axes):
        return np.ascontiguousarray(a.transpose(axes)) if nhwc else a

    def as_layout(dx, dw, db):  # a NumPy gradient triple, viewed in the row's layout
        return (dx.transpose(image_axes), dw.transpose(weight_axes), db) if nhwc else (dx, dw, db)

    X, W = in_layout(x, image_axes), in_layout(w, weight_axes)
    plan, specs = specialized_plan(problem, algorithm, op), specs_of(problem, algorithm, op)
    kernels = kernels_of(specs, plan)
    # Keyword arguments of each convgen implementation: the plan specs_of() describes.
    kw = {"specialized": dict(algorithm=algorithm), "direct": dict(algorithm="direct"),
          "generic": dict(specialize=False)}
    kw = {v: dict(stride=L.s, padding=L.p, layout=layout, **kw[v]) for v in specs}

    # The op's kernel calls run one after another, each with its own workspace: the peak is the largest.
    ws = {v: max(k.workspace_bytes(entry, problem) for entry in ENTRIES[op]) for v, k in kernels.items()}

    funcs, dy = {}, None
    if op in ("forward", "transposed"):
        conv_op = convgen.conv2d if op == "forward" else convgen.conv_transpose2d
        ys = {v: np.empty(problem.output_shape, np.float32) for v in specs}
        for v in specs:
            funcs[v] = (lambda v: lambda: conv_op(X, W, **kw[v], out=ys[v]))(v)
        numpy_op = baselines.numpy_conv2d if op == "forward" else baselines.numpy_conv_transpose2d
        if nhwc:
            funcs["numpy"] = lambda: numpy_op(x, w, stride, padding).transpose(image_axes)
        else:
            funcs["numpy"] = lambda: numpy_op(x, w, stride, padding)
        flops, out_bytes = fwd_flops, ys["specialized"].nbytes
    elif op in ("backward", "transposed_backward"):
        grad_op = convgen.conv2d_backward if op == "backward" else convgen.conv_transpose2d_backward
        dy = rng.standard_normal((L.n, L.f, ho, wo), dtype=np.float32)
        DY = in_layout(dy, image_axes)
        outs = {v: (np.empty_like(X), np.empty_like(W), np.empty(L.f, np.float32)) for v in specs}
        for v in specs:
            funcs[v] = (lambda v: lambda: grad_op(DY, X, W, **kw[v], out=outs[v]))(v)
        numpy_op = baselines.numpy_conv2d_backward if op == "backward" else baselines.numpy_conv_transpose2d_backward
        funcs["numpy"] = lambda: as_layout(*numpy_op(dy, x, w, stride, padding))
        flops, out_bytes = 2 * fwd_flops, sum(a.nbytes for a in outs["specialized"])
    else:
        raise ValueError(f"unknown op {op!r}")

    if torch is not None:
        funcs["pytorch"] = _torch_func(torch, op, L, x, w, dy, nhwc)
    limits = {name: ERROR_LIMIT for name in funcs}
    if specs["specialized"].family == "winograd":
        # Winograd rounds differently from direct code: its own, documented bound.
        limits["specialized"] = winograd.ERROR_BOUND["float32"]
    return Case(op, layer, flops, funcs, ws, out_bytes, row_algorithm(op, specs["specialized"], plan.variant), limits)


def _make_nd_case(op: str, layer: NdLayer, torch, algorithm: str) -> Case:
    """A 1-D or 3-D row: conv1d/conv3d (or its backward) of every convgen build and PyTorch, checked
    against PyTorch's result."""
    if torch is None:
        raise ValueError(f"the {layer.name} rows are checked against PyTorch, which is not installed")
    rng = np.random.default_rng(0)
    L, r = layer, layer.rank
    x = rng.standard_normal((L.n, L.c, *L.sizes), dtype=np.float32)
    w = rng.standard_normal((L.f, L.c) + (L.k,) * r, dtype=np.float32) / np.float32(math.sqrt(L.c * L.k ** r))
    problem = L.problem()
    plan, specs = specialized_plan(problem, algorithm, op), specs_of(problem, algorithm, op)
    kernels = kernels_of(specs, plan)
    ws = {v: max(k.workspace_bytes(entry, problem) for entry in ENTRIES[op]) for v, k in kernels.items()}
    kw = {"specialized": dict(algorithm=algorithm), "direct": dict(algorithm="direct"),
          "generic": dict(specialize=False)}
    kw = {v: dict(stride=L.s, padding=L.p, **kw[v]) for v in specs}
    out_sizes = tuple((n + 2 * L.p - L.k) // L.s + 1 for n in L.sizes)
    name, functional = f"conv{r}d", torch.nn.functional
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    funcs = {}
    if op == name:
        conv_op, ys = getattr(convgen, name), {v: np.empty((L.n, L.f, *out_sizes), np.float32) for v in specs}
        for v in specs:
            funcs[v] = (lambda v: lambda: conv_op(x, w, **kw[v], out=ys[v]))(v)
        flops, out_bytes = problem.flops, ys["specialized"].nbytes

        def run():
            with torch.no_grad():
                return getattr(functional, name)(tx, tw, stride=L.s, padding=L.p)
    else:
        grad_op = getattr(convgen, name + "_backward")
        dy = rng.standard_normal((L.n, L.f, *out_sizes), dtype=np.float32)
        tdy = torch.from_numpy(dy)
        outs = {v: (np.empty_like(x), np.empty_like(w), np.empty(L.f, np.float32)) for v in specs}
        for v in specs:
            funcs[v] = (lambda v: lambda: grad_op(dy, x, w, **kw[v], out=outs[v]))(v)
        flops, out_bytes = 2 * problem.flops, sum(a.nbytes for a in outs["specialized"])

        def run():
            with torch.no_grad():
                return torch.ops.aten.convolution_backward(tdy, tx, tw, [L.f], [L.s] * r, [L.p] * r, [1] * r, False,
                                                           [0] * r, 1, [True, True, True])

    run.as_numpy = lambda result: (tuple(t.numpy() for t in result) if isinstance(result, tuple)
                                   else result.numpy())
    funcs["pytorch"] = run
    limits = {v: ERROR_LIMIT for v in funcs}
    if specs["specialized"].family == "winograd":
        limits["specialized"] = winograd.ERROR_BOUND["float32"]
    return Case(op, layer, flops, funcs, ws, out_bytes, row_algorithm(op, specs["specialized"], plan.variant), limits,
                reference="pytorch")


def _torch_func(torch, op, L, x, w, dy, nhwc=False):
    """PyTorch's CPU path for one row: NCHW tensors, or channels_last ones for an NHWC row (results
    returned as NHWC arrays, weights as (KH, KW, inner, outer), to compare with convgen's). Gradients
    come from aten.convolution_backward, the op autograd calls for a convolution, asked for dx, dw
    and db in one call (no forward pass timed with them)."""
    memory = torch.channels_last if nhwc else torch.contiguous_format
    tx, tw = (torch.from_numpy(a).contiguous(memory_format=memory) for a in (x, w))
    tdy = torch.from_numpy(dy).contiguous(memory_format=memory) if dy is not None else None
    stride, padding = [L.s, L.s], [L.p, L.p]
    functional, backward = torch.nn.functional, torch.ops.aten.convolution_backward
    transposed = op.startswith("transposed")

    def to_numpy(t, weights=False):
        return t.permute((2, 3, 1, 0) if weights else (0, 2, 3, 1)).numpy() if nhwc else t.numpy()

    if op == "forward":
        def run():
            with torch.no_grad():
                return functional.conv2d(tx, tw, stride=stride, padding=padding)
    elif op == "transposed":
        def run():
            with torch.no_grad():
                return functional.conv_transpose2d(tx, tw, stride=stride, padding=padding)
    else:
        def run():
            with torch.no_grad():
                return backward(tdy, tx, tw, [L.f], stride, padding, [1, 1], transposed, [0, 0], 1,
                                [True, True, True])

    if op in ("forward", "transposed"):
        run.as_numpy = to_numpy
    else:
        run.as_numpy = lambda r: (to_numpy(r[0]), to_numpy(r[1], weights=True), r[2].numpy())
    return run


# ------------------------------------------------------------------------------------ depthwise rows
@dataclasses.dataclass(frozen=True)
class DepthwiseLayer:
    """A depthwise layer (groups == channels, one filter each, padding k // 2), timed in both layouts."""

    name: str
    n: int
    c: int
    h: int
    w: int
    k: int
    s: int

    @property
    def p(self) -> int:
        return self.k // 2

    @property
    def shape_text(self) -> str:
        return f"{self.n}×{self.c}×{self.h}×{self.w}, k{self.k}s{self.s}p{self.p}"

    def problem(self, layout: str) -> Problem:
        """The resolved problem of this layer's forward call, float32, in `layout`."""
        return resolve.conv_problem(image_shape(self.n, self.c, self.h, self.w, layout),
                                    weight_shape(self.c, 1, (self.k, self.k), layout), np.dtype(np.float32),
                                    self.s, self.p, 1, self.c, layout)

    def bytes(self, op: str, layout: str = "NCHW") -> int:
        """Bytes the op reads and writes, each array once: forward x, w, y; backward dy, x, w, dx, dw, db."""
        p = self.problem(layout)
        x, y, w = p.n * p.c * p.h * p.w, p.n * p.f * p.ho * p.wo, p.f * self.k * self.k
        return 4 * (x + w + y if op == "forward" else y + x + w + x + w + p.f)


# MobileNet V1/V2, MnasNet and EfficientNet depthwise layers: 3×3 and 5×5, stride 1 and 2, batch 1 and 8,
# 32 to 512 channels.
DEPTHWISE_SUITE = (
    DepthwiseLayer("dw3x3s1", 8, 144, 56, 56, 3, 1),
    DepthwiseLayer("dw3x3s2", 8, 96, 112, 112, 3, 2),
    DepthwiseLayer("dw3x3b1", 1, 512, 14, 14, 3, 1),
    DepthwiseLayer("dw5x5s1", 8, 240, 28, 28, 5, 1),
    DepthwiseLayer("dw5x5s2", 8, 240, 28, 28, 5, 2),
    DepthwiseLayer("dw3x3c32", 8, 32, 112, 112, 3, 1),
)
DEPTHWISE_OPS = ("forward", "backward")


def make_depthwise_case(op: str, layer: DepthwiseLayer, layout: str, torch, algorithm: str = "auto") -> Case:
    """One depthwise row: convgen specialized (the planner's choice: the depthwise family), specialized
    forced direct, generic, NumPy's depthwise baseline and PyTorch (channels_last for NHWC), every
    result in the row's layout."""
    rng = np.random.default_rng(0)
    L = layer
    x = rng.standard_normal((L.n, L.c, L.h, L.w), dtype=np.float32)
    w = rng.standard_normal((L.c, 1, L.k, L.k), dtype=np.float32) / np.float32(L.k)
    problem = L.problem(layout)
    dy = rng.standard_normal((L.n, L.c, problem.ho, problem.wo), dtype=np.float32)
    nhwc = layout == "NHWC"
    X = np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if nhwc else x
    W = np.ascontiguousarray(w.transpose(2, 3, 1, 0)) if nhwc else w
    DY = np.ascontiguousarray(dy.transpose(0, 2, 3, 1)) if nhwc else dy
    plan, specs = specialized_plan(problem, algorithm, op), specs_of(problem, algorithm, op)
    kernels = kernels_of(specs, plan)
    kw = {"specialized": dict(algorithm=algorithm), "direct": dict(algorithm="direct"),
          "generic": dict(specialize=False)}
    kw = {v: dict(stride=L.s, padding=L.p, groups=L.c, layout=layout, **kw[v]) for v in specs}
    ws = {v: max(k.workspace_bytes(entry, problem) for entry in ENTRIES[op]) for v, k in kernels.items()}
    stride, padding = (L.s, L.s), (L.p, L.p)

    def to_layout(a, weights=False):  # an NCHW result (weights: (C, 1, KH, KW)) in the row's layout
        return a if not nhwc else np.ascontiguousarray(a.transpose((2, 3, 1, 0) if weights else (0, 2, 3, 1)))

    funcs = {}
    if op == "forward":
        ys = {v: np.empty(problem.output_shape, np.float32) for v in specs}
        for v in specs:
            funcs[v] = (lambda v: lambda: convgen.conv2d(X, W, **kw[v], out=ys[v]))(v)
        funcs["numpy"] = lambda: to_layout(baselines.numpy_depthwise_conv2d(x, w, stride, padding))
        out_bytes = ys["specialized"].nbytes
    else:
        outs = {v: (np.empty_like(X), np.empty_like(W), np.empty(L.c, np.float32)) for v in specs}
        for v in specs:
            funcs[v] = (lambda v: lambda: convgen.conv2d_backward(DY, X, W, **kw[v], out=outs[v]))(v)

        def numpy_backward():
            dx, dw, db = baselines.numpy_depthwise_conv2d_backward(dy, x, w, stride, padding)
            return to_layout(dx), to_layout(dw, weights=True), db
        funcs["numpy"] = numpy_backward
        out_bytes = sum(a.nbytes for a in outs["specialized"])
    if torch is not None:
        funcs["pytorch"] = _torch_depthwise_func(torch, op, L, x, w, dy, nhwc)
    limits = {name: ERROR_LIMIT for name in funcs}
    flops = problem.flops * (1 if op == "forward" else 2)
    return Case(op, L, flops, funcs, ws, out_bytes, row_algorithm(op, specs["specialized"], plan.variant), limits)


def _torch_depthwise_func(torch, op, L, x, w, dy, nhwc):
    """PyTorch on one depthwise row: NCHW tensors, or channels_last ones for NHWC (results returned as
    NHWC arrays, weights as (KH, KW, 1, C), to compare with convgen's)."""
    memory = torch.channels_last if nhwc else torch.contiguous_format
    tx, tw, tdy = (torch.from_numpy(a).contiguous(memory_format=memory) for a in (x, w, dy))
    functional, backward = torch.nn.functional, torch.ops.aten.convolution_backward

    def to_numpy(t, weights=False):
        return t.permute((2, 3, 1, 0) if weights else (0, 2, 3, 1)).numpy() if nhwc else t.numpy()

    if op == "forward":
        def run():
            with torch.no_grad():
                return functional.conv2d(tx, tw, stride=L.s, padding=L.p, groups=L.c)
        run.as_numpy = to_numpy
    else:
        def run():
            with torch.no_grad():
                return backward(tdy, tx, tw, [L.c], [L.s, L.s], [L.p, L.p], [1, 1], False, [0, 0], L.c,
                                [True, True, True])
        run.as_numpy = lambda r: (to_numpy(r[0]), to_numpy(r[1], weights=True), r[2].numpy())
    return run


def python_extra_bytes(func) -> int:
    """Peak bytes NumPy/Python allocate during one call, beyond what was live before it (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        result = func()
        extra = tracemalloc.get_traced_memory()[1] - before
        del result
    finally:
        tracemalloc.stop()
    return extra


class OtherLoad:
    """The share of the machine's CPU time that other processes used while a block ran (Linux /proc/stat).

    This process's own time (all its threads, spinning OpenMP workers included) is subtracted from
    the machine's busy time; what remains is contention that slowed every implementation alike.
    """

    def __enter__(self):
        self._busy, self._own, self._wall = self._machine_busy(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self._wall
        busy, own = self._machine_busy(), time.process_time() - self._own
        if busy is None or self._busy is None or wall <= 0:
            self.share = None
        else:
            others = (busy - self._busy) - own
            self.share = min(1.0, max(0.0, others / (wall * (os.cpu_count() or 1))))
        return False

    @staticmethod
    def _machine_busy():
        """Seconds of CPU time all cores spent busy since boot (None where /proc/stat is missing)."""
        try:
            with open("/proc/stat") as stat:
                fields = [int(v) for v in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class QuietWaiter:
    """Waits for other processes to leave the CPU idle, within one budget of seconds for the whole run.

    Shared machines are busy in bursts (other people's builds and tests); a row timed between two
    bursts is worth a short wait, and the budget keeps the whole bench bounded.
    """

    NOISY = 0.1  # other processes' share of the CPU above which a row counts as disturbed

    def __init__(self, budget: float, window: float = 1.0):
        self.remaining, self.window, self.waited = max(0.0, budget), window, 0.0

    def wait(self) -> None:
        announced = False
        while self.remaining > 0:
            start = time.perf_counter()
            with OtherLoad() as load:
                time.sleep(min(self.window, self.remaining))
            spent = time.perf_counter() - start
            self.remaining -= spent
            self.waited += spent
            if load.share is None or load.share < self.NOISY:
                return
            if not announced:
                print(f"  waiting for other processes to leave the CPU ({100 * load.share:.0f}% busy; "
                      f"{self.remaining:.0f} s of waiting left)", flush=True)
                announced = True


def run_case(case: Case, repeat: int, min_time: float) -> dict:
    """Check every implementation against the reference (NumPy, or PyTorch for 1-D and 3-D rows), measure
    convgen's memory, then time them all alternated."""
    reference_func = case.funcs[case.reference]
    expected = reference_func()
    if hasattr(reference_func, "as_numpy"):
        expected = reference_func.as_numpy(expected)
    errors = {}
    for name, func in case.funcs.items():
        result = func()
        if hasattr(func, "as_numpy"):
            result = func.as_numpy(result)
        errors[name] = 0.0 if name == case.reference else _relative_error(result, expected)
    del expected
    wrong = [f"{name} {errors[name]:.1e} > {case.error_limits[name]:g}" for name in errors
             if not errors[name] <= case.error_limits[name]]
    if wrong:
        print(f"  WRONG: {case.op} {case.layer.name} disagrees with {case.reference}: {', '.join(wrong)}", file=sys.stderr,
              flush=True)
    memory = {name: python_extra_bytes(case.funcs[name]) for name in (*CONVGEN_IMPLS, "numpy") if name in case.funcs}
    with OtherLoad() as load:
        seconds = time_alternating(case.funcs, repeat=repeat, warmup=1, min_time=min_time)
    return with_rates({
        "op": case.op, "layer": case.layer, "gflop": case.flops / 1e9, "algorithm": case.algorithm,
        "seconds": seconds,
        "errors": errors, "error_limits": case.error_limits, "python_bytes": memory,
        "workspace_bytes": case.workspace, "output_bytes": case.output_bytes, "other_load": load.share,
    })


def with_rates(row: dict) -> dict:
    """`row` with the rates of its implementations' times: GFLOP/s, and GB/s when it counts its bytes."""
    row["gflops"] = {name: row["gflop"] / s for name, s in row["seconds"].items()}
    if "bytes" in row:
        row["gbs"] = {name: row["bytes"] / s / 1e9 for name, s in row["seconds"].items()}
    return row


def merge_rounds(rows: list) -> dict:
    """One row from its measurements in several passes: each implementation's median time (and the
    rates from it), the most other processes took during any pass; the rest from the first pass."""
    if len(rows) == 1:
        return rows[0]
    row = dict(rows[0])
    row["seconds"] = {name: statistics.median(r["seconds"][name] for r in rows) for name in rows[0]["seconds"]}
    loads = [r["other_load"] for r in rows if r["other_load"] is not None]
    row["other_load"] = max(loads) if loads else None
    return with_rates(row)


# ------------------------------------------------------------------------------------ machine
def blas_info() -> str:
    """Which BLAS NumPy calls and which of its kernels runs (threadpoolctl when installed, else OpenBLAS's own query)."""
    try:
        from threadpoolctl import threadpool_info
        found = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        if found:
            return "; ".join(f"{i.get('internal_api')} {i.get('version')}, kernel {i.get('architecture')}, "
                             f"{i.get('num_threads')} threads (threadpoolctl)" for i in found)
    except ImportError:
        pass
    import ctypes
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line})
    for path in paths:
        lib = ctypes.CDLL(path)
        for prefix, suffix in (("scipy_", "64_"), ("", "64_"), ("scipy_", ""), ("", "")):
            corename = getattr(lib, f"{prefix}openblas_get_corename{suffix}", None)
            config = getattr(lib, f"{prefix}openblas_get_config{suffix}", None)
            threads = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}", None)
            if corename is not None and config is not None:
                corename.restype = config.restype = ctypes.c_char_p
                return (f"{config().decode()}, kernel {corename().decode()}, "
                        f"{threads() if threads is not None else '?'} threads (OpenBLAS's own query)")
    blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    return f"{blas.get('name', 'unknown')} {blas.get('version', '')} (numpy.show_config; kernel not queried)"



def source_revision() -> str:
    """The commit the kernels were built from, and whether convgen/ or templates/ differ from it."""
    root = str(HERE.parent)
    try:
        rev = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "convgen", "templates"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if not rev:
        return "unknown (not a git checkout)"
    return f"{rev}" + (" plus uncommitted changes to convgen/ or templates/" if dirty else "")


def machine_info(torch, threads: int) -> dict:
    settings = convgen.runtime.kernels.settings()
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": peak.cpu_model(),
        "cores": os.cpu_count(),
        "threads": threads,
        "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": f"{torch.__version__} ({torch.get_num_threads()} threads)" if torch is not None
                 else "not installed (column skipped)",
        "blas": blas_info(),
        "blas_env": ", ".join(BLAS_ENV_CHANGES),
        "compiler": settings.toolchain.version,
        "revision": source_revision(),
        "schedule": repr(settings.schedule()),
    }


# ------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and a shorter peak measurement")
    parser.add_argument("--repeat", type=int, help="timed samples per implementation (default 9, --quick 3)")
    parser.add_argument("--rounds", type=int,
                        help="passes over all the rows (default 2, --quick 1): each row is timed once per pass, "
                             "minutes apart, and keeps each implementation's median time over the passes")
    parser.add_argument("--layers", help=f"comma-separated subset of: {', '.join(l.name for l in SUITE)}; "
                                         f"outside the suite: {', '.join(l.name for l in EXTRA_SUITE)}; "
                                         f"depthwise: {', '.join(l.name for l in DEPTHWISE_SUITE)}")
    parser.add_argument("--ops", help=f"comma-separated subset of: {', '.join(OPS)}")
    parser.add_argument("--layouts", help=f"comma-separated subset of: {', '.join(LAYOUTS)} (default both): the "
                                          "layouts of the 2-D rows; the 1-D and 3-D rows (channels first) run "
                                          "with NCHW")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="directory for bench.md and bench.png")
    parser.add_argument("--algorithm", default="auto", choices=("auto", "direct"),
                        help="what the specialized implementation runs: the planner's choice (default) or direct "
                             "code everywhere (the suite as it ran before Winograd)")
    parser.add_argument("--previous", type=Path, metavar="BENCH_MD",
                        help="an earlier bench.md to compare the rows Winograd does not touch with "
                             "(default: the bench.md in --out that this run replaces)")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch column")
    parser.add_argument("--no-chart", action="store_true", help="write no PNG")
    parser.add_argument("--wait-quiet", type=float, default=120.0, metavar="SECONDS",
                        help="before the run and before each row, wait for other processes to leave the CPU idle, "
                             "at most SECONDS in all; rows they still disturbed are measured once more at the end, "
                             "keeping the quieter measurement (default 120; 0: no waiting, no second measurement)")
    args = parser.parse_args(argv)
    args.layers = _subset(parser, "--layers", args.layers, [l.name for l in SUITE + EXTRA_SUITE + DEPTHWISE_SUITE])
    args.ops = _subset(parser, "--ops", args.ops, list(OPS))
    args.layouts = _subset(parser, "--layouts", args.layouts, list(LAYOUTS))
    if args.repeat is None:
        args.repeat = 3 if args.quick else 9
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def _subset(parser, flag, text, allowed):
    if not text:
        return list(allowed)
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in allowed]
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; expected some of {allowed}")
    return chosen


def row_groups(layers, ops, layouts) -> dict:
    """The (op, layer, layout) rows to time, by the report section they belong to: "suite" (the suite
    in NCHW, with the 1-D and 3-D rows), "nhwc" (the suite's 2-D layers in NHWC), "extra" (the layers
    outside the suite, in each layout) and "depthwise" (in each layout)."""
    suite = [layer for layer in SUITE if layer.name in layers]
    return {
        "suite": [(op, layer, "NCHW") for layer in suite for op in ops_of(layer) if op in ops]
        if "NCHW" in layouts else [],
        "nhwc": [(op, layer, "NHWC") for layer in suite if not isinstance(layer, NdLayer)
                 for op in ops_of(layer) if op in ops] if "NHWC" in layouts else [],
        "extra": [(op, layer, layout) for layer in EXTRA_SUITE if layer.name in layers
                  for layout in LAYOUTS if layout in layouts for op in ops_of(layer) if op in ops],
        "depthwise": [(op, layer, layout) for layer in DEPTHWISE_SUITE if layer.name in layers
                      for layout in LAYOUTS if layout in layouts for op in DEPTHWISE_OPS if op in ops],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    torch = None if args.no_torch else baselines.torch_module()
    threads = convgen.num_threads()
    if torch is not None:
        torch.set_num_threads(threads)
    groups = row_groups(args.layers, args.ops, args.layouts)
    if torch is None and any(isinstance(layer, NdLayer) for _, layer, _ in groups["suite"]):
        print("without PyTorch the 1-D and 3-D rows are skipped: they are checked against it", flush=True)
        groups["suite"] = [(op, layer, layout) for op, layer, layout in groups["suite"]
                           if not isinstance(layer, NdLayer)]
    count = sum(len(rows) for rows in groups.values())
    if not count:
        print("nothing to run: no layer of --layers has an op of --ops in a layout of --layouts", file=sys.stderr)
        return 2

    waiter = QuietWaiter(args.wait_quiet)
    waiter.wait()
    started = time.perf_counter()
    info = machine_info(torch, threads)
    info["command"] = " ".join(["bench/run.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"convgen bench: {count} rows, {threads} threads, repeat {args.repeat}", flush=True)
    meter = peak.PeakMeter(threads)
    meter.sample(3 if args.quick else 10)
    fma = meter.result()
    print(f"FMA peak ({fma['isa']}): {fma['gflops_1']:.1f} GFLOP/s on 1 thread, "
          f"{fma['gflops_all']:.1f} on {threads}", flush=True)
    stream = bandwidth.BandwidthMeter(threads) if groups["depthwise"] else None
    if stream is not None:
        stream.sample(3 if args.quick else 10)
        bw = stream.result()
        print(f"memory bandwidth: {bw['gbs_1']:.1f} GB/s on 1 thread, {bw['gbs_all']:.1f} on {threads}", flush=True)

    # Compile every kernel the rows need up front, in parallel, so no build lands inside a timing.
    specs, variants = set(), {}  # (and the specialized modules of the schedule variants wisdom chose)
    for rows in groups.values():
        for op, layer, layout in rows:
            problem = layer.problem() if isinstance(layer, NdLayer) else layer.problem(layout)
            specs.update(specs_of(problem, args.algorithm, op).values())
            plan = specialized_plan(problem, args.algorithm, op)
            if plan.variant:
                variants.setdefault(plan.overrides, set()).add(plan.spec)
    failed = {s: e for s, e in convgen.build_all(specs).items() if isinstance(e, Exception)}
    for overrides, variant_specs in variants.items():
        with convgen.configure(**dict(overrides)):
            failed.update({s: e for s, e in convgen.build_all(variant_specs).items() if isinstance(e, Exception)})
    if failed:
        for spec, exc in failed.items():
            print(f"building {spec} failed: {exc}", file=sys.stderr)
        if any(spec.family != "direct" for spec in failed):
            print("(--algorithm direct runs every specialized kernel as direct code)", file=sys.stderr)
        return 1

    min_time = 0.05 if args.quick else 0.1

    def measure(op, layer, layout, group):
        waiter.wait()
        if group == "depthwise":  # GB/s
            row = run_case(make_depthwise_case(op, layer, layout, torch, args.algorithm), args.repeat, min_time)
            row["layout"], row["bytes"] = layout, layer.bytes(op, layout)
            with_rates(row)
            rates = " ".join(f"{name} {row['gbs'][name]:6.1f} GB/s" for name in IMPLS if name in row["gbs"])
            stream.sample(1)
        else:
            row = run_case(make_case(op, layer, torch, args.algorithm, layout), args.repeat, min_time)
            if group != "suite":  # the suite's NCHW rows keep the names earlier runs gave them
                row["layout"] = layout
            rates = " ".join(f"{name} {row['gflops'][name]:7.1f}" for name in IMPLS if name in row["gflops"])
        meter.sample(1)
        print(f"  {op:<20} {report.row_name(row).split(' ', 1)[1]:<18} {row['algorithm']:<29} "
              + rates + ("" if row["other_load"] is None else f"  (other processes {100 * row['other_load']:.0f}% CPU)"),
              flush=True)
        return row

    # Every row once per pass over all the rows: the machine's state (what the shared caches hold, other
    # tenants' memory traffic) drifts over minutes, and moved single rows by 10-25 % between runs.
    passes = []
    for number in range(args.rounds):
        if args.rounds > 1:
            print(f"pass {number + 1} of {args.rounds}", flush=True)
        passes.append({group: [measure(op, layer, layout, group) for op, layer, layout in rows]
                       for group, rows in groups.items()})
    measured = {group: [merge_rounds([one[group][i] for one in passes]) for i in range(len(rows))]
                for group, rows in groups.items()}
    remeasured = []
    if args.wait_quiet > 0:
        # Rows other processes disturbed get a second chance; the quieter of the two measurements stays.
        for group, rows in measured.items():
            for i, row in enumerate(rows):
                if row["other_load"] is not None and row["other_load"] > QuietWaiter.NOISY:
                    again = measure(row["op"], row["layer"], row.get("layout", "NCHW"), group)
                    remeasured.append(report.row_name(row))
                    if again["other_load"] is not None and again["other_load"] < row["other_load"]:
                        rows[i] = again
    results, depthwise_results = measured["suite"], measured["depthwise"]

    meter.sample(3 if args.quick else 10)
    fma = meter.result()
    meter.close()
    bw = None
    if stream is not None:
        stream.sample(3 if args.quick else 10)
        bw = stream.result()
        stream.close()
    info["load_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    info["elapsed"] = time.perf_counter() - started
    info["repeat"] = args.repeat
    info["rounds"] = args.rounds
    info["waited"] = waiter.waited
    info["remeasured"] = remeasured
    everything = row_groups([l.name for l in SUITE + EXTRA_SUITE + DEPTHWISE_SUITE], list(OPS), list(LAYOUTS))
    info["partial"] = count < sum(len(rows) for rows in everything.values())
    info["algorithm"] = args.algorithm

    previous_path = args.previous or args.out / "bench.md"
    previous = report.read_previous(previous_path) if previous_path.is_file() else None
    chart = not args.no_chart and bool(results)
    text = report.markdown(results, fma, info, chart="bench.png" if chart else None, previous=previous,
                           depthwise=depthwise_results, bandwidth=bw, nhwc=measured["nhwc"],
                           extra=measured["extra"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.md").write_text(text)
    if chart:
        report.chart(results, fma, args.out / "bench.png")
    print()
    print(text)
    print(f"wrote {args.out / 'bench.md'}" + ("" if not chart else f" and {args.out / 'bench.png'}"))
    wrong = report.wrong_results([row for rows in measured.values() for row in rows])
    if wrong:
        print(f"results that disagree with NumPy beyond their bound: {', '.join(wrong)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
