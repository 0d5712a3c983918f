"""How the kernels are blocked and vectorized on each instruction set: a table, not code.

A `Schedule` is handed to the templates beside the spec. The micro-kernel keeps an MR × NR tile of
the output in registers (NR = vectors × lanes, along output pixels, which are contiguous in NCHW);
KC is the depth of one packed panel (B's KC × NR micro-panel should sit in L1), NC the number of
output pixels one thread works on at a time. The instruction set is detected from what the compiler
targets with -march=native, and can be forced (CONVGEN_ISA or `isa=`) to test the slower paths.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from . import winograd

ISAS = ("avx512", "avx2", "portable")


@dataclasses.dataclass(frozen=True)
class Schedule:
    isa: str
    vector_bytes: int      # width of one SIMD register
    mr: int                # micro-tile rows (output channels / kernel rows), broadcast from packed A
    nr_vectors: int        # micro-tile columns, in vectors (NR = nr_vectors × lanes)
    kc: int                # depth of one packed panel in the gradients (dx: filters; dW: kc / 2 pixels)
    nc: int                # output pixels per work item (rounded to a multiple of NR)
    kc_forward: int = 256  # forward: (channel, tap) rows per K block; fewer blocks, fewer passes over y
    ukernel: str = "simd"  # "simd", or "reference": the plain scalar micro-kernel, kept for tests
    # The forward micro-kernel unrolls the window's taps up to this many (every kernel up to 7x7);
    # larger windows keep a loop over taps there. Re-measured one-threaded on the 7x7 stem (AMD EPYC
    # Zen 4, medians of alternated runs): the unrolled 49-tap body is 0.4-1.3 % slower than the tap
    # loop (25) with AVX-512 and AVX2, and 5x5 does not care either way. That is within the noise
    # of a shared machine, so 49 stays: every window up to 7x7 is straight-line code, which is
    # what `convgen show` and the render tests promise.
    max_unrolled_taps: int = 49
    arch_flags: tuple[str, ...] = ()
    # Winograd F(m×m, 3×3): the output tile m (the planner takes the largest tile up to this one whose
    # measured error is within the bound of the dtype, see convgen/planning/winograd.py), the most bytes its
    # transformed filters may take, and the smallest channel counts at which `algorithm="auto"` takes
    # it (below them the transforms cost more than the multiplies they save).
    winograd_tile: int = 4
    winograd_max_filter_bytes: int = 16 << 20
    winograd_min_channels: int = 8
    # A training step's calls (algorithm "auto-training") take Winograd at most at this tile, and only
    # on images of at least this many output pixels. F(4×4)'s rounding in the forward pass compounds
    # through the step: ResNet-18's parameter gradients came 3.3× further from float64 than PyTorch's;
    # F(2×2)'s, in the forward pass and the input gradient, as far as PyTorch's (docs/algorithms.md).
    # F(2×2) against the direct kernels (batch 8, 2 threads, AVX-512 Xeon, forward and input gradient,
    # NCHW and NHWC): 64 × 56² 1.35-1.8×, 64 × 28² 1.35-1.7×, 128 × 14² 1.35-1.5×, 256 × 7² 0.7-0.85×.
    training_winograd_tile: int = 2
    training_winograd_min_pixels: int = 14 * 14
    # ... and the micro-tile of its modules, rows × vectors (0, 0: mr × nr_vectors). The columns of its
    # batched multiplies are a call's output tiles, few in deep layers at small batch (16 at 14×14,
    # batch 1), where AVX-512's 8 × 3 vectors left two thirds of each 48-column tile padding. Measured
    # on Zen 4 (float32, 2 threads, prepared weights, alternated medians), against 8 × 3: 8 × 2
    # 1.13× geomean over 18 layers, 1.15-1.5× at batch 1 from 32×32 to 14×14, 0.97-1.04× with 8
    # filters; fused ResNet-18 at batch 1 1.11×. 16 × 1 was 1.18× geomean but 0.81× with 8 filters
    # (half of each tile's rows padding), and on AVX2, 12 × 1 against 6 × 2 0.92×.
    winograd_mr: int = 0
    winograd_nr_vectors: int = 0
    # The weight gradient of layers with few filters per group (up to dw_dot_max_filters) multiplies
    # along the pixels instead: dot_filters × dot_columns vector sums in registers, the operands copied
    # as rows, never transposed into panels (the transposition dominates when filters are few).
    dw_dot_max_filters: int = 32
    dot_filters: int = 4
    dot_columns: int = 6
    # Depthwise (groups == input channels): output pixels per register block of the NHWC kernels
    # (filters in the vector lanes, one accumulator per pixel, each weight register shared by the
    # block), and output vectors per step of the NCHW kernels (independent accumulator chains).
    depthwise_pixels: int = 4
    depthwise_vectors: int = 2
    # Output rows per step of the specialized NCHW forward pass: each loaded input vector serves
    # every row whose taps read it (fewer when rows × vectors accumulators would not fit in registers).
    depthwise_rows: int = 4
    # `algorithm="auto"` takes the depthwise family from this many channels up. Depthwise layers
    # have tens to hundreds; below it the direct modules keep computing small grouped convolutions
    # (the tests have many, across dozens of windows), which would otherwise each build a second
    # module. The depthwise kernels are faster there too (AVX-512, 3-8 channels: forward 3x,
    # backward 10-20x): algorithm="depthwise", or configure(depthwise_min_channels=1), takes them.
    depthwise_min_channels: int = 8
    # The NHWC depthwise forward pass streams its output past the caches (non-temporal stores) when
    # x and y together take more bytes than this; 0 (get_schedule): the machine's last-level cache.
    depthwise_stream_bytes: int = 0
    # The NHWC depthwise forward pass of a window of at most 3x3 reads x pixel-major (a few pixels over
    # every channel at a time) also on rows long enough for its block-major path, when one pixel's
    # channels take at most this many bytes: there the block-major rows pass over x's lines once per
    # vector of channels. 0: never (pixel-major on narrow rows only). Measured on AVX2 and AVX-512 (the
    # table; templates/depthwise/plan.c.j2 has the figures).
    depthwise_pixel_major_bytes: int = 0
    # Pixel-row kernels (templates/direct/rows/; every NHWC op, NCHW forward and dx of small
    # images): rows (pixels, or channels in the weight gradient) of a tile 1, 2, ... vectors of
    # channels wide; each call takes the width that wastes the fewest lanes on its channel count. Rows
    # x vectors accumulators, the vectors of B and a broadcast fit the register file, and the rows'
    # pointers the general registers.
    pixel_rows: tuple[int, ...] = (12, 6, 4)
    # ... and the rows of the weight gradient's tiles that read x and dy in place (one per tile width,
    # as many widths as pixel_rows): no row pointers, so the accumulators may take more registers.
    # AVX-512 16 rows x 1 vector: 16 channels x 16 filters in one tile (measured 1.2-1.3x faster than
    # 12 rows on batch64_3x3 and narrow3x3, whose 16 channels took a second, overlapping tile of 12).
    pixel_rows_dw: tuple[int, ...] = (12, 6, 4)
    # Layers with very few channels keep the phase-plane kernels (pixels in the lanes): the forward
    # pass and dW below pixel_rows_min_work = cg × fg multiply-adds per tap and pixel, the input
    # gradient when its channels fill less than 1 / pixel_rows_dx_vector_share of a vector (not the NHWC
    # forward pass of at most 4 channels whose filters fill a vector: it reads padded bands); in NCHW,
    # also the forward pass of images of more than pixel_rows_nchw_max_pixels output pixels. Measured on AVX-512, float32,
    # 2 threads, pixel rows against phase planes in NCHW: 14x14 outputs (ResNet's stride-2 3x3 and
    # 1x1 layers) 1.16-1.47x and 28x28 (DCGAN's forward) 1.56x faster, 32x32 (batch1_3x3) 0.74x and
    # 56x56 0.81x: where most tiles of 12 pixels touch a border column, NCHW gathers them.
    # configure(pixel_rows_min_work=1, pixel_rows_dx_vector_share=64, pixel_rows_nchw_max_pixels=10**9)
    # forces the pixel rows on every layer (the tests do).
    pixel_rows_min_work: int = 128
    pixel_rows_dx_vector_share: int = 2
    pixel_rows_nchw_max_pixels: int = 800
    # NCHW dW takes the pixel rows (on layers its own rules admit) for every window, or with False only
    # for stride-1 windows of more than one tap and outputs of fewer than 32 pixels: their
    # channels-last copies of x and dy cost the most per multiply-add for 1x1 and strided windows.
    # Measured on AVX2 (AMD EPYC Zen 1, 2 threads, float32, batch 8), phase planes against pixel rows:
    # 1x1 1.28-2.25x (MobileNetV2's 16 -> 96 at 56x56, ResNet's 256 -> 256 at 14x14 1.43x, 128 -> 256
    # at stride 2 1.39-1.63x), 3x3 stride 2 0.97-1.44x; but 3x3 stride 1 0.86-1.06x and 4x4 outputs
    # 0.72-0.98x, which keep the rows. (On AVX-512 the rows measured 1.12-1.39x on 1x1 and stride-2
    # layers too: see templates/direct/rows/plan.c.j2.)
    pixel_rows_nchw_dw_all_windows: bool = True
    # NCHW dW of more than 64 filters a group takes the pixel rows (on layers its other rules admit)
    # only below this many weights a group (KH x KW x C/g x F/g; 0: never). Measured on AVX-512 (Zen 5,
    # 2 threads, float32), the rows against the phase planes: 1.12-1.39x with 96-256 filters of 32K-147K
    # weights, 0.96-1.04x from 262K up. On AVX2 (AMD EPYC Zen 3, 2 threads, float32, batch 8 unless
    # said, ResNet-like 3x3 stride-1 layers) the planes won every such layer instead: 1.07-1.19x with
    # 96-160 filters of 69K-230K weights at 7x7 to 28x28 (128 -> 128 at 14x14 1.19-1.30x, batch 1
    # 1.18x), 0.99-1.01x at 96 -> 96 over 14x14; 64 filters or fewer keep the rows there (the planes
    # 0.60-0.92x with 16-32 filters, 1.03-1.09x with 64).
    pixel_rows_nchw_dw_max_weights: int = 1 << 18
    # The NHWC input gradient of a grouped convolution over images of at least this many pixels takes
    # the pixel rows however few channels its groups have (0: only by pixel_rows_dx_vector_share):
    # the phase planes scatter each group's few channels value by value. Measured on AVX2 (AMD EPYC
    # Zen 1, 2 threads, float32, batch 8, 3x3 and 5x5), the backward pass with the rows against the
    # planes: 2 and 3 channels per group at 56x56 and 112x112 1.36-2.45x, at 28x28 1.0-1.24x, at 14x14
    # 0.67x (and ungrouped layers of 2-3 channels 0.62-0.79x, which keep the planes).
    pixel_rows_nhwc_dx_grouped_pixels: int = 0

    def for_family(self, family: str) -> "Schedule":
        """The schedule a module of `family` is generated with: Winograd's own micro-tile, if it has one."""
        if family == "winograd" and self.winograd_mr:
            return dataclasses.replace(self, mr=self.winograd_mr, nr_vectors=self.winograd_nr_vectors)
        return self

    def lanes(self, dtype: str) -> int:
        return self.vector_bytes // (4 if dtype == "float32" else 8)

    def nr(self, dtype: str) -> int:
        return self.nr_vectors * self.lanes(dtype)

    def prefers_winograd(self, conv) -> bool:
        """The cost model of `algorithm="auto"` for a convolution Winograd can compute (a Problem)."""
        return min(conv.c // conv.groups, conv.f // conv.groups) >= self.winograd_min_channels

    def prefers_training_winograd(self, conv) -> bool:
        """Whether "auto-training" takes Winograd (at `training_winograd_tile`) for a convolution
        "auto" takes it for (a Problem's conv())."""
        return conv.ho * conv.wo >= self.training_winograd_min_pixels

    def prefers_depthwise(self, conv) -> bool:
        """The cost model of `algorithm="auto"` for a depthwise convolution (a Problem's conv()).

        From depthwise_min_channels channels up; in NHWC, whose vectors run along filters, also only
        when the filters fill at least half a vector (measured on AVX-512, float32, 3×3: with 3 or 4
        filters the direct forward pass was 1.4-2× faster, with 8 the depthwise one 1.4× faster).
        """
        if conv.c < self.depthwise_min_channels:
            return False
        return conv.layout == "NCHW" or 2 * conv.f >= self.lanes(conv.dtype)


# Register budget: MR × nr_vectors accumulators + nr_vectors loaded B vectors + 1 broadcast must fit
# (AVX-512: 32 zmm; AVX2: 16 ymm; SSE-class: 16 xmm); so must dot_filters × dot_columns sums +
# dot_filters + 1 loaded vectors.
_TABLE = {
    # kc_forward 1024 measured 3-7 % faster than 256 on the bench's 3x3 layers (one thread, AVX-512).
    "avx512": dict(vector_bytes=64, mr=8, nr_vectors=3, kc=256, kc_forward=1024, nc=384, depthwise_pixels=8,
                   winograd_mr=8, winograd_nr_vectors=2, depthwise_pixel_major_bytes=1024,
                   pixel_rows=(12, 12, 8, 6), pixel_rows_dw=(16, 12, 8, 6), arch_flags=("-march=native",)),
    "avx2": dict(vector_bytes=32, mr=6, nr_vectors=2, kc=256, nc=384, depthwise_pixels=4, dot_filters=3,
                 dot_columns=3, pixel_rows_nchw_dw_all_windows=False, pixel_rows_nchw_dw_max_weights=0,
                 pixel_rows_nhwc_dx_grouped_pixels=1024,
                 depthwise_pixel_major_bytes=512, arch_flags=("-mavx2", "-mfma")),
    "portable": dict(vector_bytes=16, mr=4, nr_vectors=2, kc=256, nc=256, dot_filters=3, dot_columns=3, arch_flags=()),
}


@functools.lru_cache(maxsize=1)
def last_level_cache_bytes() -> int:
    """The size of the largest cache Linux lists for CPU 0 (/sys/devices/system/cpu/cpu0/cache), 8 MiB
    where it lists none. (Not the C library's sysconf(_SC_LEVEL3_CACHE_SIZE): in a virtual machine it
    can be far off, 320 MiB for a 32 MiB L3.)"""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    root, largest = "/sys/devices/system/cpu/cpu0/cache", 0
    try:
        for entry in os.listdir(root):
            try:
                with open(os.path.join(root, entry, "size")) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text[:-1].isdigit() and text[-1] in units:
                largest = max(largest, int(text[:-1]) * units[text[-1]])
            elif text.isdigit():
                largest = max(largest, int(text))
    except OSError:
        pass
    return largest or 8 << 20


def supported_isas(native_macros) -> tuple[str, ...]:
    """The instruction sets a machine can run, best first, from the `#define` lines its compiler
    predefines under -march=native (`convgen.runtime.toolchain.native_macros`)."""
    macros = {line.split()[1] for line in native_macros}  # "#define __AVX2__ 1" -> __AVX2__
    found = []
    if "__AVX512F__" in macros:
        found.append("avx512")
    if "__AVX2__" in macros and "__FMA__" in macros:
        found.append("avx2")
    found.append("portable")
    return tuple(found)


def get_schedule(supported: tuple[str, ...], isa: str | None = None, **overrides) -> Schedule:
    """The schedule for `isa` (default: CONVGEN_ISA, else the best of `supported`, the instruction
    sets the machine runs as `supported_isas` lists them).

    Any field can be overridden, e.g. get_schedule(supported, mr=6, kc=128).
    """
    isa = isa or os.environ.get("CONVGEN_ISA") or supported[0]
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    if isa not in supported:
        raise ValueError(f"isa {isa!r} is not supported by this machine (it runs {', '.join(supported)})")
    fields = dict(_TABLE[isa], isa=isa)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Schedule)}
    if unknown:
        raise TypeError(f"unknown schedule fields: {sorted(unknown)}")
    fields.update(overrides)
    requested = fields.get("depthwise_stream_bytes", 0)
    if requested == 0 and not isinstance(requested, bool):   # 0: the machine's last-level cache (False is refused below)
        fields["depthwise_stream_bytes"] = last_level_cache_bytes()
    schedule = Schedule(**fields)
    for name in ("mr", "nr_vectors", "kc", "kc_forward", "nc", "max_unrolled_taps", "winograd_tile",
                 "winograd_max_filter_bytes", "winograd_min_channels", "dw_dot_max_filters", "dot_filters",
                 "dot_columns", "depthwise_pixels", "depthwise_vectors", "depthwise_rows",
                 "depthwise_min_channels", "pixel_rows_min_work", "pixel_rows_dx_vector_share",
                 "pixel_rows_nchw_max_pixels", "training_winograd_min_pixels"):
        value = getattr(schedule, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"schedule {name} must be a positive int, got {value!r}")
    if schedule.training_winograd_tile not in winograd.TILES:
        raise ValueError(f"schedule training_winograd_tile must be one of Winograd's tiles {winograd.TILES}, "
                         f"got {schedule.training_winograd_tile!r}")
    for name in ("winograd_mr", "winograd_nr_vectors"):
        value = getattr(schedule, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"schedule {name} must be an int >= 0 (0: the direct micro-tile), got {value!r}")
    if (schedule.winograd_mr == 0) != (schedule.winograd_nr_vectors == 0):
        raise ValueError(f"schedule winograd_mr and winograd_nr_vectors are both 0 (the direct micro-tile) or both "
                         f"set, got {schedule.winograd_mr} and {schedule.winograd_nr_vectors}")
    if not isinstance(schedule.pixel_rows_nchw_dw_all_windows, bool):
        raise ValueError(f"schedule pixel_rows_nchw_dw_all_windows must be True or False, "
                         f"got {schedule.pixel_rows_nchw_dw_all_windows!r}")
    for name, zero_means in (("pixel_rows_nhwc_dx_grouped_pixels", "never"),
                             ("pixel_rows_nchw_dw_max_weights", "by the filters only"),
                             ("depthwise_stream_bytes", "the last-level cache"),
                             ("depthwise_pixel_major_bytes", "narrow rows only")):
        value = getattr(schedule, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"schedule {name} must be an int >= 0 (0: {zero_means}), got {value!r}")
    for name in ("pixel_rows", "pixel_rows_dw"):
        rows = getattr(schedule, name)
        if not isinstance(rows, tuple) or not rows or not all(isinstance(r, int) and not isinstance(r, bool)
                                                              and 1 <= r <= 16 for r in rows):
            raise ValueError(f"schedule {name} must be a non-empty tuple of ints from 1 to 16, got {rows!r}")
    if len(schedule.pixel_rows_dw) != len(schedule.pixel_rows):
        raise ValueError(f"schedule pixel_rows_dw must have one entry per tile width, as many as pixel_rows "
                         f"({len(schedule.pixel_rows)}), got {schedule.pixel_rows_dw!r}")
    if schedule.ukernel not in ("simd", "reference"):
        raise ValueError(f"schedule ukernel must be 'simd' or 'reference', got {schedule.ukernel!r}")
    return schedule
