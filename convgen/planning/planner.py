"""The planner: which algorithm family, built how, computes a problem.

Between the resolved `Problem` and the kernels sits one decision: the family of templates
(templates/<family>/) that computes it, and the schedule it is built with. `algorithm="direct"`,
`"winograd"` and `"depthwise"` name the family; `"auto"` takes depthwise for a depthwise convolution
(groups == input channels, `Schedule.prefers_depthwise`), else asks the schedule's cost model
(`Schedule.prefers_winograd`), which only ever picks Winograd where it applies and within its
accuracy bound. `"auto-training"` is "auto" for the calls of a training step, whose rounding
compounds through the step: Winograd only with its most accurate tile, F(2×2), and only where that
beats the direct kernels (`Schedule.prefers_training_winograd`). Winograd's generic build is direct:
only a window known when the code is generated can choose it; depthwise is chosen by the channels
and has a generic build of its own.
Adding an algorithm is a template folder, a rule here and its tests.
"""

from __future__ import annotations

import dataclasses

from . import winograd
from .epilogue import NO_EPILOGUE
from .problem import Problem
from .schedule import Schedule
from .spec import WINOGRAD_WINDOW_TEXT, ConvSpec, winograd_computes

ALGORITHMS = ("auto", "direct", "winograd", "depthwise", "auto-training")
AUTOMATIC = ("auto", "auto-training")  # the algorithms the planner chooses a family for


# Schedule variants of the direct family that `convgen tune` measures beside its rule (which picks,
# per op and call, the pixel rows or the phase planes by channels, pixels and layout; the thresholds
# were measured on a few machines): the pixel rows wherever their kernels apply (what the tests force
# to check them), or the phase planes wherever the rule lets them. Schedule fields and values.
VARIANTS = {
    "pixel rows": (("pixel_rows_dx_vector_share", 64), ("pixel_rows_min_work", 1),
                   ("pixel_rows_nchw_max_pixels", 10**9)),
    "phase planes": (("pixel_rows_dx_vector_share", 1), ("pixel_rows_min_work", 10**9),
                     ("pixel_rows_nchw_max_pixels", 1)),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What computes one problem: the kernel module's spec (which names the family) and its schedule;
    `variant`, the schedule variant of the direct kernels a measurement chose ("": the rule's)."""

    spec: ConvSpec
    schedule: Schedule
    variant: str = ""

    @property
    def overrides(self) -> tuple:
        """The schedule fields the variant sets (its kernels are built with them); () for none."""
        return VARIANTS.get(self.variant, ())

    @property
    def family(self) -> str:
        return self.spec.family


def as_algorithm(value) -> str:
    if not isinstance(value, str) or value.lower() not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(repr(a) for a in ALGORITHMS)}, got {value!r}")
    return value.lower()


def winograd_refusal(problem: Problem, schedule: Schedule) -> str | None:
    """Why Winograd cannot compute `problem` under `schedule`, or None when it can."""
    w = problem.window
    if w.padding_mode != "zeros":
        return (f"its input transform pads with zeros, not padding_mode={w.padding_mode!r} (the direct kernels "
                f"compute every padding mode)")
    if not winograd_computes(w):
        return f"Winograd computes {WINOGRAD_WINDOW_TEXT}, not {w.short()}"
    tile = winograd_tile(problem.dtype, schedule)
    alpha = tile + w.kernel[0] - 1
    conv = problem.conv()
    filter_bytes = alpha * alpha * conv.f * (conv.c // conv.groups) * (4 if problem.dtype == "float32" else 8)
    if filter_bytes > schedule.winograd_max_filter_bytes:
        return (f"its transformed filters would take {filter_bytes} bytes, more than the "
                f"{schedule.winograd_max_filter_bytes} a Winograd call may hold")
    return None


def depthwise_refusal(problem: Problem) -> str | None:
    """Why the depthwise family cannot compute `problem`, or None when it can: it computes the
    convolutions whose every group has one input channel (groups == input channels, any number of
    filters per group); a transposed call qualifies when its conv() does (groups == its output channels)."""
    if problem.window.padding_mode != "zeros":
        return (f"its kernels pad with zeros, not padding_mode={problem.window.padding_mode!r} (the direct "
                f"kernels compute every padding mode)")
    conv = problem.conv()
    if conv.c == conv.groups:
        return None
    if problem.transpose:
        return (f"the depthwise family computes transposed convolutions with groups == output channels, "
                f"got groups={conv.groups} and {conv.c} output channels")
    return f"the depthwise family computes groups == input channels, got groups={conv.groups} and {conv.c} input channels"


def winograd_tile(dtype: str, schedule: Schedule, training: bool = False) -> int:
    """The schedule's Winograd tile for `dtype` (for a training step's calls, its training tile if
    smaller), or the largest smaller one within the accuracy bound."""
    largest = schedule.winograd_tile if not training else min(schedule.winograd_tile,
                                                               schedule.training_winograd_tile)
    return max(m for m in winograd.TILES if m <= largest and winograd.within_bound(m, dtype))


def plan(problem: Problem, specialize: bool, schedule: Schedule, algorithm: str = "auto",
         measured=None) -> Plan:
    """The plan for `problem`: its family, specialized for its window or generic, under `schedule`.

    `measured`, for "auto" and "auto-training": the algorithm (and Winograd tile) measured fastest
    for the problem's class on this machine (convgen.runtime.wisdom.Choice), taken where it can
    compute the problem and Winograd's tile is within its accuracy bound (for "auto-training": is
    the training tile or smaller), else the rule below decides."""
    algorithm = as_algorithm(algorithm)
    training = algorithm == "auto-training"
    if algorithm in AUTOMATIC and specialize and measured is not None:
        chosen = _measured_plan(problem, schedule, measured)
        if chosen is not None and not (training and chosen.spec.tile > schedule.training_winograd_tile):
            return chosen
    window = problem.window if specialize else None
    # A specialized module is generated for the epilogue's kind; the generic one takes it at run time.
    epilogue = problem.epilogue if specialize else NO_EPILOGUE
    direct = Plan(ConvSpec(window, problem.dtype, problem.layout, epilogue=epilogue), schedule)
    if algorithm == "direct":
        return direct
    if algorithm in (*AUTOMATIC, "depthwise"):
        refusal = depthwise_refusal(problem)
        if algorithm == "depthwise" and refusal is not None:
            raise ValueError(f"algorithm='depthwise' cannot compute this convolution: {refusal}; use 'auto' or 'direct'")
        if refusal is None and (algorithm == "depthwise" or schedule.prefers_depthwise(problem.conv())):
            return Plan(ConvSpec(window, problem.dtype, problem.layout, "depthwise", epilogue=epilogue), schedule)
    if not specialize:
        if algorithm == "winograd":
            raise ValueError("algorithm='winograd' needs specialize=True: the generic build cannot know the window, "
                             "so it is always direct")
        return direct
    refusal = winograd_refusal(problem, schedule)
    if algorithm == "winograd" and refusal is not None:
        raise ValueError(f"algorithm='winograd' cannot compute this convolution: {refusal}; use 'auto' or 'direct'")
    if algorithm in AUTOMATIC and (refusal is not None or not schedule.prefers_winograd(problem.conv())):
        return direct
    if training and not schedule.prefers_training_winograd(problem.conv()):
        return direct
    spec = ConvSpec(problem.window, problem.dtype, problem.layout, "winograd",
                    winograd_tile(problem.dtype, schedule, training), epilogue)
    return Plan(spec, schedule)


# The most input channels or filters a group may have for its input gradient to run as the adjoint
# forward convolution (`adjoint_forward`).
ADJOINT_MAX_GROUP_CHANNELS = 16


def adjoint_forward(problem: Problem, plan: Plan) -> Problem | None:
    """The forward convolution that computes the input gradient of `problem`'s conv() (conv2d's dx,
    or a transposed call's output) where it is faster than the direct family's input-gradient
    kernels, else None.

    At stride 1 with zero padding centred in the window (d·(k − 1)/2 on each side), the input
    gradient is conv2d of dy over the same window with each group's filters and channels exchanged
    and the window flipped (`convgen.frontend.ops.adjoint_weights`): the forward kernels of the same
    module. Those win where a group has few channels: the input-gradient kernels put a group's
    channels in their vector lanes and fill a few of them. Measured on Zen 3 (AVX2), 2 threads, dx
    of 8 images, float32, input-gradient kernels against the adjoint forward: 3×3 over 64 channels
    @56² in 32 groups 4.9× (NCHW) and 6.0× (NHWC), in 8 groups 1.27× and 2.22×, in 4 groups 1.12×
    and 1.04×, in 2 groups (32 channels a group) 0.97× and 1.07×; 5×5 over 32 channels in 16 groups
    6.7× and 3.2×.
    """
    if plan.family != "direct":
        return None
    conv = problem.conv()
    window = conv.window
    if window.padding_mode != "zeros" or window.stride != (1, 1):
        return None
    for k, d, (before, after) in zip(window.kernel, window.dilation, window.padding):
        if before != after or 2 * before != d * (k - 1):
            return None
    if conv.groups == 1 or max(conv.c, conv.f) // conv.groups > ADJOINT_MAX_GROUP_CHANNELS:
        return None
    return dataclasses.replace(conv.transposed(), transpose=False)


def _measured_plan(problem: Problem, schedule: Schedule, measured) -> Plan | None:
    """The specialized plan of the measured choice, or None where it does not apply to `problem`."""
    epilogue = problem.epilogue
    if measured.variant and (measured.algorithm != "direct" or measured.variant not in VARIANTS):
        return None
    if measured.algorithm == "direct":
        fields = dict(VARIANTS.get(measured.variant, ()))
        return Plan(ConvSpec(problem.window, problem.dtype, problem.layout, epilogue=epilogue),
                    dataclasses.replace(schedule, **fields), measured.variant)
    if measured.algorithm == "depthwise" and depthwise_refusal(problem) is None:
        return Plan(ConvSpec(problem.window, problem.dtype, problem.layout, "depthwise", epilogue=epilogue), schedule)
    if (measured.algorithm == "winograd" and winograd_refusal(problem, schedule) is None
            and measured.tile in winograd.TILES and winograd.within_bound(measured.tile, problem.dtype)):
        return Plan(ConvSpec(problem.window, problem.dtype, problem.layout, "winograd", measured.tile, epilogue),
                    schedule)
    return None


def candidates(problem: Problem, schedule: Schedule) -> list:
    """Every (algorithm, Winograd tile or None, variant or "") that `auto` may take for `problem`,
    specialized: direct, by its rule and in each of its VARIANTS; depthwise where it computes the
    problem; Winograd at each tile within its accuracy bound where it computes the problem, unless
    its groups have one channel or one filter (its batched multiplies would be 1 wide: on MobileNet's
    depthwise 3x3 layers it measured 3-40x slower than the depthwise kernels, on AVX2). What
    `convgen tune` measures."""
    found = [("direct", None, "")] + [("direct", None, variant) for variant in VARIANTS]
    if depthwise_refusal(problem) is None:
        found.append(("depthwise", None, ""))
    conv = problem.conv()
    if winograd_refusal(problem, schedule) is None and min(conv.c, conv.f) > conv.groups:
        found += [("winograd", m, "") for m in winograd.TILES if winograd.within_bound(m, problem.dtype)]
    return found


__all__ = ["ADJOINT_MAX_GROUP_CHANNELS", "ALGORITHMS", "AUTOMATIC", "VARIANTS", "Plan", "adjoint_forward",
           "as_algorithm", "plan", "candidates", "depthwise_refusal", "winograd_refusal", "winograd_tile"]
