"""`convgen tune`: measure the algorithms `auto` may take for some layers and remember the winners.

For each layer and op, every candidate the planner allows (`planner.candidates`: direct, by its
rule and in each schedule variant of `planner.VARIANTS`; depthwise where it computes the layer;
Winograd at each tile within its accuracy bound) is timed side by side
(`time_alternating`: candidates in turn, medians), and the fastest is written to this machine's
wisdom (convgen.runtime.wisdom), which `algorithm="auto"` consults from then on, in this process and
every later one. A layer with one candidate has nothing to choose and is not measured. The modes
are FFTW's: "estimate" measures nothing (it shows what the planner's rule takes), "measure" takes
the median of 5 rounds, "patient" of 15. The planner's own choice is kept unless another candidate
is more than 3 % faster (`TIE`): a tie is noise, and the rule knows about accuracy. A time budget
stops the run between layers; the layers left are reported, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..frontend import ops
from ..frontend.resolve import conv_problem
from ..planning import planner
from ..planning.spec import Window
from ..runtime import wisdom
from ..runtime.kernels import settings
from .timing import time_alternating

MODES = {"estimate": 0, "measure": 5, "patient": 15}  # rounds each candidate is timed
OPS = ("conv2d", "conv2d_backward")
TIE = 0.03  # a candidate must beat the planner's own choice by more than this fraction to replace it


@dataclasses.dataclass(frozen=True)
class Layer:
    """One convolution layer to tune: its window and sizes (input n x c x h x w, f filters)."""

    window: Window
    n: int
    c: int
    h: int
    w: int
    f: int
    groups: int = 1
    layout: str = "NCHW"
    dtype: str = "float32"

    def text(self) -> str:
        groups = f" groups {self.groups}" if self.groups > 1 else ""
        return (f"{self.window.short()} {self.n}x{self.c}x{self.h}x{self.w} -> {self.f}{groups} "
                f"{self.layout} {self.dtype}")

    def shapes(self) -> tuple[tuple, tuple]:
        """x's and w's shapes in the layer's layout."""
        per_group, kernel = self.c // self.groups, self.window.kernel
        if self.layout == "NCHW":
            return (self.n, self.c, self.h, self.w), (self.f, per_group, *kernel)
        return (self.n, self.h, self.w, self.c), (*kernel, per_group, self.f)

    def problem(self):
        x_shape, w_shape = self.shapes()
        return conv_problem(x_shape, w_shape, np.dtype(self.dtype), self.window.stride, self.window.padding,
                            self.window.dilation, self.groups, self.layout)

    def arrays(self, op: str, rng):
        """The op's three arrays (x, w, bias or dy, x, w) in the layer's layout."""
        x_shape, w_shape = self.shapes()
        x = rng.standard_normal(x_shape).astype(self.dtype)
        w = rng.standard_normal(w_shape).astype(self.dtype)
        if op == "conv2d":
            return x, w, None
        return rng.standard_normal(self.problem().output_shape).astype(self.dtype), x, w

    def kwargs(self) -> dict:
        return dict(stride=self.window.stride, padding=self.window.padding, dilation=self.window.dilation,
                    groups=self.groups, layout=self.layout)


def _layers(window, sizes, depthwise=False):
    """Layers of c channels at hw x hw (sizes: (c, hw), or (c, hw, f) for f filters, else c), at batch
    1 and 8, in both layouts."""
    return [Layer(Window.parse(window), n, c, hw, hw, f[0] if f else c, c if depthwise else 1, layout)
            for n in (1, 8) for c, hw, *f in sizes for layout in ("NCHW", "NHWC")]


# `make tune`: layers of the benchmark's networks, at batch 1 and 8, in both layouts, float32:
# ResNet's 3x3 stride-1 layers (direct by its rule or variants, or Winograd's tiles), its stride-2
# 3x3 and 1x1 (the direct kernels' variants), MobileNet's depthwise 3x3 (depthwise or direct) and its
# 1x1 expansions and projections (the direct kernels' variants: in NCHW at batch 8 on an AVX-512
# Xeon the phase planes ran their backward pass 1.1-1.9x faster than the rule's choice).
DEFAULT_LAYERS = (_layers("k3s1p1", [(64, 56), (128, 28), (256, 14), (512, 7)])
                  + _layers("k3s2p1", [(64, 56, 128), (128, 28, 256), (256, 14, 512)])
                  + _layers("k1s2p0", [(64, 56, 128), (128, 28, 256), (256, 14, 512)])
                  + _layers("k3s1p1", [(32, 112), (144, 56), (576, 14)], depthwise=True)
                  + _layers("k1s1p0", [(32, 28, 192), (192, 28, 32), (96, 14, 576), (576, 14, 96), (160, 7, 960),
                                       (960, 7, 160)]))


@dataclasses.dataclass
class Outcome:
    """What tuning one layer's op found: each candidate's median seconds, and the choice."""

    layer: Layer
    op: str
    key: str
    seconds: dict          # candidate text -> median seconds per call (empty: estimated)
    choice: wisdom.Choice

    def line(self) -> str:
        timed = ", ".join(f"{name} {t * 1e3:.3f} ms" for name, t in self.seconds.items())
        return f"{self.op} {self.layer.text()}: {timed or 'not measured'} -> {self.choice.text()}"


def tune(layers, ops_to_tune=OPS, mode: str = "measure", budget: float | None = None, report=print,
         seed: int = 0) -> tuple[list[Outcome], int]:
    """Measure each layer's candidates for each op and record the fastest as wisdom.

    Returns (outcomes, how many (layer, op) pairs the budget left untuned). `report(text)` is called
    with a progress line per pair. In "estimate" mode nothing is timed or recorded: each outcome is
    the planner's own choice."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if budget is not None and budget <= 0:
        raise ValueError(f"budget must be a positive number of seconds, got {budget!r}")
    for op in ops_to_tune:
        if op not in OPS:
            raise ValueError(f"ops must be among {', '.join(OPS)}, got {op!r}")
    active = settings()
    rng = np.random.default_rng(seed)
    pairs = [(layer, op) for layer in layers for op in ops_to_tune]
    outcomes, start = [], time.perf_counter()
    for index, (layer, op) in enumerate(pairs):
        if budget is not None and time.perf_counter() - start > budget:
            report(f"budget of {budget:g} s spent: {len(pairs) - index} of {len(pairs)} left untuned")
            return outcomes, len(pairs) - index
        problem = layer.problem()
        choices = [wisdom.Choice(*candidate) for candidate in planner.candidates(problem, active.schedule())]
        ruled = planner.plan(problem, True, active.schedule(), "auto")  # the rule's own choice, without wisdom
        own = wisdom.Choice(ruled.family, ruled.spec.tile if ruled.family == "winograd" else None)
        if MODES[mode] == 0 or len(choices) == 1:
            outcome = Outcome(layer, op, wisdom.problem_class(op, problem), {}, own)
        else:
            arrays = layer.arrays(op, rng)
            runners = {choice.text(): ops.runner(op, arrays, choice, **layer.kwargs()) for choice in choices}
            seconds = time_alternating(runners, repeat=MODES[mode])
            fastest = min(choices, key=lambda choice: seconds[choice.text()])
            # the rule's choice stands unless another is clearly faster: a tie is noise
            if own in choices and seconds[own.text()] <= (1 + TIE) * seconds[fastest.text()]:
                fastest = own
            outcome = Outcome(layer, op, wisdom.problem_class(op, problem), seconds, fastest)
            entry = {"algorithm": fastest.algorithm, "tile": fastest.tile, "variant": fastest.variant,
                     "seconds": {name: float(f"{t:.4g}") for name, t in seconds.items()}, "layer": layer.text(),
                     "mode": mode}
            wisdom.record({outcome.key: entry}, active)
        outcomes.append(outcome)
        report(f"[{index + 1}/{len(pairs)}] {outcome.line()}")
    return outcomes, 0


__all__ = ["Layer", "Outcome", "tune", "DEFAULT_LAYERS", "MODES", "OPS"]
