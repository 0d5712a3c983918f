"""Render a spec's C source from the Jinja templates in templates/, and its cffi cdef from convgen.codegen.abi.

One render per module: templates/<family>/module.c.j2 includes the shared code of templates/common/
and the family's own files. The same templates render both variants: a window value is written as
a literal ("3") in the specialized build and as a field of the run-time geometry ("g->kh") in the
generic one, and the loops over the kernel window are unrolled only where the window is known. The
entry points' declarators and op ids come from convgen.codegen.abi, so the C, the cdef and the Python
calls agree by construction.

A module is one translation unit, or, as the runtime compiles a direct module (specialized or
generic) or a specialized Winograd one (`render(..., split=True)`), two: the functions the templates
mark `CG_CORE` (the micro-kernels, the weight gradient's dot products, the workspace: code that reads
no window value) are rendered once, from the direct family's generic build of every op, into a *core*
source, compiled once per dtype, layout and schedule, and linked into every window's module, which
keeps only their declarations. About half of a direct module's code, so a new window compiles in
about two thirds of the time; the generic module links the same core, and a Winograd module (whose
weight gradient is the direct family's) the core of its own micro-tile's schedule. The core compiles
in parts (`CORE_PARTS`: a common part, and the weight gradient's kernels), each an object, and a
module links the common part and those whose functions it calls: a first forward call does not
compile the weight gradient's kernels.
tests/test_render.py checks that every core function renders, macros expanded, exactly as in the
specialized build of each window it is linked into: the split costs no specialization. The plans
(`CG_PLAN`: blocks, work items, threads and memory, decided once per call) go to the core object too,
compiled from the generic build, where they read the window from the call's geometry:
tests/test_work_splits.py checks that both builds plan every call alike.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import jinja2

from . import abi, depthwise
from .csource import extract
from ..planning import winograd
from .._version import __version__
from ..planning.schedule import Schedule
from ..planning.spec import ConvSpec

# The Jinja templates: convgen/templates in an installed wheel (pyproject.toml ships the source tree's
# templates/ there as package data), else templates/ beside the package (a checkout, an editable install).
_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # convgen/
TEMPLATE_DIR = next((d for d in (_PACKAGE_DIR / "templates", _PACKAGE_DIR.parent / "templates") if d.is_dir()),
                    _PACKAGE_DIR / "templates")

# Windows larger than this keep their tap loops in the packing code: 7x7 and 8x8 are unrolled,
# a 31x31 window would be 961 copies of each loop body for no measurable gain.
MAX_UNROLLED_WINDOW = 64

# What one render writes: a module of one unit, or the two units of a split module.
PARTS = ("whole", "window", "core")

# Names of the window values in the templates, and the geometry field each reads when generic.
_WINDOW_FIELDS = {"KH": "kh", "KW": "kw", "SH": "sh", "SW": "sw", "PT": "pt", "PL": "pl", "DH": "dh", "DW": "dw",
                  "PM": "pm"}


@dataclasses.dataclass(frozen=True)
class Rendered:
    """The C source of one kernel module, its cffi cdef, and its entry points' C symbols by entry name.

    `ops` are the ops whose entry points it carries (`abi.OPS` order); the queries are always there.
    `cores` are the C sources of the parts of the core object it links, if split (the `CG_CORE` and
    `CG_PLAN` functions `source` declares are defined there: the common part first, then those of
    `CORE_PARTS` it calls), else empty: `source` is the whole module.
    """

    spec: ConvSpec
    schedule: Schedule
    source: str
    cdef: str
    symbols: dict
    ops: tuple = abi.OPS
    cores: tuple = ()


@functools.lru_cache(maxsize=4)
def _environment(directory: Path) -> jinja2.Environment:
    """The Jinja environment of a template directory: it keeps the templates it compiled for the
    process, whatever cache its compiled copies are kept in (see `render`)."""
    if not directory.is_dir():
        if directory == TEMPLATE_DIR:
            raise FileNotFoundError(f"convgen templates not found at {TEMPLATE_DIR}: this installation of convgen is "
                                    "incomplete; reinstall it (from a source checkout: pip install -e .)")
        raise FileNotFoundError(f"templates must be a directory of convgen templates, got {str(directory)!r}")
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(directory)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _winograd_context(spec: ConvSpec) -> dict:
    """The Winograd family's matrices F(m×m, r×r), exact (rows of Fractions), and the name of its tile."""
    t = winograd.transforms(spec.tile, spec.window.kernel[0])
    return {"WINO_M": t.m, "WINO_R": t.r, "WINO_ALPHA": t.alpha, "AT": t.AT, "G": t.G, "BT": t.BT,
            "combine": winograd.linear_combination}


def dx_is_forward(spec: ConvSpec) -> bool:
    """Whether the input gradient of `spec`'s module runs its forward kernels over dy with the weights
    turned round (templates/direct/backward_data.c.j2), where dx is a forward pass with c and f swapped
    over the same window flipped: specialized direct windows at stride 1 of one tap and no padding,
    and, in NCHW, of any size with zero padding centred on the window (d·(k − 1)/2 on each side:
    ResNet's 3×3 p1 layers)."""
    w = spec.window
    if not (spec.family == "direct" and spec.specialized and not spec.epilogue.active and w.stride == (1, 1)):
        return False
    if w.kernel == (1, 1):
        return w.padding == ((0, 0), (0, 0))
    return spec.layout == "NCHW" and w.padding_mode == "zeros" and all(
        before == after and 2 * before == d * (k - 1) for k, d, (before, after) in zip(w.kernel, w.dilation, w.padding))


def template_context(spec: ConvSpec, schedule: Schedule, ops=None, part: str = "whole") -> dict:
    """Everything the templates see. Values reaching the C source are validated ints or fixed names.

    `part`: "whole" (one translation unit), "window" (a split module: its `CG_CORE` functions come
    from the core object) or "core" (the core object: generic, its entry points static and unused,
    so only the `CG_CORE` functions and what they call are compiled).
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)}, got {part!r}")
    signatures = abi.signatures(spec)
    if part == "core":
        signatures = {name: "static " + declarator for name, declarator in signatures.items()}
    ops = abi.as_ops(ops)
    dx_forward = dx_is_forward(spec)
    if dx_forward and "bwd_data" in ops:
        ops = abi.as_ops(ops + ("fwd",))  # the input gradient runs the forward kernels (not exported)
    context = {
        "part": part,
        "ops": ops,
        "DX_FORWARD": dx_forward,
        "version": __version__,
        "specialized": spec.specialized,
        "spec_text": str(spec),
        "dtype": spec.dtype,
        "c_type": spec.c_type,
        "layout": spec.layout,
        "family": spec.family,
        "signatures": signatures,
        "op_ids": dict(abi.OP_IDS),
        "padding_mode_ids": dict(abi.PADDING_MODE_IDS),
        "activation_ids": dict(abi.ACTIVATION_IDS),
        "residual_ids": dict(abi.RESIDUAL_IDS),
        "isa": schedule.isa,
        "ukernel": schedule.ukernel,
        "VECTOR_BYTES": int(schedule.vector_bytes),
        "LANES": schedule.lanes(spec.dtype),
        "MR": int(schedule.mr),
        "NV": int(schedule.nr_vectors),
        "NR": schedule.nr(spec.dtype),
        "KC": int(schedule.kc),
        "KC_FORWARD": int(schedule.kc_forward),
        "NC": int(schedule.nc),
        "MAX_UNROLLED_TAPS": int(schedule.max_unrolled_taps),
        "DW_DOT_MAX_FILTERS": int(schedule.dw_dot_max_filters),
        "DOT_F": int(schedule.dot_filters),
        "DOT_K": int(schedule.dot_columns),
        "MAX_UNROLLED_WINDOW": MAX_UNROLLED_WINDOW,
        "PIXEL_ROWS": [int(r) for r in schedule.pixel_rows],
        "PIXEL_ROWS_DW": [int(r) for r in schedule.pixel_rows_dw],
        "ROWS_MIN_WORK": int(schedule.pixel_rows_min_work),
        "ROWS_DX_VECTOR_SHARE": int(schedule.pixel_rows_dx_vector_share),
        "ROWS_NCHW_MAX_PIXELS": int(schedule.pixel_rows_nchw_max_pixels),
        "ROWS_NCHW_DW_ALL_WINDOWS": int(schedule.pixel_rows_nchw_dw_all_windows),
        "ROWS_NCHW_DW_MAX_WEIGHTS": int(schedule.pixel_rows_nchw_dw_max_weights),
        "ROWS_NHWC_DX_GROUPED_PIXELS": int(schedule.pixel_rows_nhwc_dx_grouped_pixels),
        # The pixel rows of every op (direct modules); Winograd modules take the weight gradient's only.
        "rows_all_ops": spec.family == "direct",
    }
    if spec.specialized:
        w = spec.window
        values = {"KH": w.kernel[0], "KW": w.kernel[1], "SH": w.stride[0], "SW": w.stride[1],
                  "PT": w.padding[0][0], "PL": w.padding[1][0], "DH": w.dilation[0], "DW": w.dilation[1],
                  "PM": abi.PADDING_MODE_IDS[w.padding_mode]}
        context.update({name: str(int(v)) for name, v in values.items()})
        # The padding mode is a template constant: only its own border arithmetic is generated.
        context.update(PADDING_MODE=w.padding_mode)
        # So is the epilogue's kind: only its activation is generated, straight-line.
        context.update(ACTIVATION=spec.epilogue.activation, RESIDUAL=spec.epilogue.residual)
        context.update(KH_VALUE=w.kernel[0], KW_VALUE=w.kernel[1], TAPS=w.kernel[0] * w.kernel[1])
        context.update(zip(("TAP_BASES", "TAP_LIST"), _tap_layout(w)))
    else:
        context.update({name: f"g->{field}" for name, field in _WINDOW_FIELDS.items()})
        context.update(PADDING_MODE=None)  # chosen at run time by g->pm
        context.update(ACTIVATION=None, RESIDUAL=None)  # and the epilogue by the arguments act and res
    if spec.family == "winograd":
        context.update(_winograd_context(spec))
    if spec.family == "depthwise":
        taps = spec.window.kernel[0] * spec.window.kernel[1] if spec.specialized else None
        unrolled = taps is not None and taps <= schedule.max_unrolled_taps
        registers = 32 if schedule.vector_bytes == 64 else 16  # AVX-512: 32 zmm; AVX2, SSE: 16
        context.update(depthwise.template_context(spec.window, registers, int(schedule.depthwise_rows),
                                                  int(schedule.depthwise_vectors)),
                       DW_PIXELS=int(schedule.depthwise_pixels), DW_VECTORS=int(schedule.depthwise_vectors),
                       DW_STREAM_BYTES=int(schedule.depthwise_stream_bytes),
                       DW_PIXEL_MAJOR_BYTES=int(schedule.depthwise_pixel_major_bytes),
                       DW_UNROLLED=unrolled,
                       DW_FLAT_VECTORS=depthwise.flat_run_vectors(spec.window, registers, unrolled))
    return context


def _tap_layout(window) -> tuple[list, list]:
    """Where each tap of the window reads the phase planes, for the unrolled forward micro-kernel.

    Tap (i, j) reads plane ((i·dh) % sh, (j·dw) % sw) at row (i·dh) // sh and column (j·dw) // sw.
    Returns the distinct (plane, row) bases as (base, plane index, row) and, in tap order, each
    tap's (base, column).
    """
    (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.stride, window.dilation
    bases: dict = {}
    taps = []
    for i in range(kh):
        for j in range(kw):
            key = (((i * dh) % sh) * sw + (j * dw) % sw, (i * dh) // sh)
            taps.append((bases.setdefault(key, len(bases)), (j * dw) // sw))
    return [(base, plane, row) for (plane, row), base in bases.items()], taps


def splits(spec: ConvSpec) -> bool:
    """Whether the runtime builds `spec` as a window module linked with a core object: a direct module,
    specialized or generic (which links the very core its specialized windows link), or a specialized
    Winograd module, whose micro-kernels and weight gradient are the direct family's. Depthwise
    modules have no CG_CORE functions."""
    return spec.family == "direct" or (spec.family == "winograd" and spec.specialized)


def render(spec: ConvSpec, schedule: Schedule, templates=None, ops=None, split: bool = False,
           compiled_templates: jinja2.BytecodeCache | None = None) -> Rendered:
    """Render the module source of `spec` under `schedule`, with its cdef and symbols.

    `ops`: the ops whose entry points the module carries ("fwd", "bwd_data", "bwd_weight"; default
    all three, as `convgen show` and `export` want them); only their kernels are rendered, so a module
    of one op compiles in a fraction of the time. `templates`: a directory laid out as templates/ (an
    edited copy, say) instead of convgen's own. `split`: render a spec that `splits` as a window
    module and the parts of the core it links (`Rendered.cores`), as the runtime builds it; by default one
    self-contained source, as `convgen show`, `generate` and `export` write it. `compiled_templates`:
    a Jinja bytecode cache that keeps the templates compiled between processes (the runtime passes
    `convgen.runtime.cache.compiled_templates()`, kept in its kernel cache), which saves a process's
    first render most of its time.
    """
    ops = abi.as_ops(ops)
    schedule = schedule.for_family(spec.family)
    environment = _environment(Path(templates) if templates is not None else TEMPLATE_DIR)
    # Consulted only for templates the environment has not compiled in this process: a process that
    # moves to another cache directory keeps the templates it compiled, not compiling them again.
    environment.bytecode_cache = compiled_templates
    template = environment.get_template(f"{spec.family}/module.c.j2")
    cores: tuple = ()
    if split and splits(spec):
        source = _declarations_only(template.render(template_context(spec, schedule, ops, part="window")))
        # The core is rendered from the generic twin (direct, for Winograd too) of every op, under this
        # family's schedule, and compiled in parts: the module links the parts whose functions it
        # declares (a forward pass's first call does not wait for the compile of its gradients'
        # micro-kernels, and the modules of one op and of every op share the parts they both link).
        generic = spec.generic()
        core_template = environment.get_template(f"{generic.family}/module.c.j2")
        core = core_template.render(template_context(generic, schedule, abi.OPS, part="core"))
        cores = core_parts(core, _core_names(source), spec)
    else:
        source = template.render(template_context(spec, schedule, ops))
    return Rendered(spec, schedule, source, abi.cdef(spec, ops),
                    {entry: spec.symbol(entry) for entry in abi.module_entries(ops)}, ops, cores)


# A core function as the templates write it: `CG_CORE` (or `CG_PLAN`) and its declarator at the start
# of a line, the body's braces alone on their own lines, at the start.
_CORE_FUNCTION = re.compile(r"^((?:CG_CORE|CG_PLAN) [^;{}]*?\))\n\{\n.*?\n\}\n", re.S | re.M)
# ... and its name, declared or defined.
_CORE_NAME = re.compile(r"^(?:CG_CORE|CG_PLAN) [^;{}(]*?\b(\w+)\(", re.M)

# The parts the core object is compiled in besides the common part, by the names of their functions:
# the pixel rows' GEMM kernels (of the forward pass and the input gradient) and the weight gradient's
# kernels. Every other CG_CORE and CG_PLAN function (the GEMM micro-kernels, packing, the workspace,
# the plans) is in the common part, which every split module links. A module links the parts whose
# functions its window declares, and compiles those the cache lacks side by side: a direct window's
# first forward call compiles its window code, the common part and the rows part at once (on 2
# cores, k3s1p1 float32: the common part alone took 1.0-1.1 s at -O3, the two halves 0.4-0.6 s each),
# and a Winograd window's, which calls no pixel rows, the common part alone.
CORE_PARTS = {
    "rows": re.compile(r"rows_igemm_\d+|rows_gemm_run_\d+|rows_bias_rows|rows_pad_dy_band"),
    "dw": re.compile(r"dw_\w+|dy_rows|rows_box_sum_\d+|rows_gemm_add_\d+"),
}


def core_part(name: str) -> str:
    """The part of the core object (`CORE_PARTS`, else "common") that defines the function `name`."""
    return next((part for part, pattern in CORE_PARTS.items() if pattern.fullmatch(name)), "common")


def _core_names(source: str) -> list:
    """The CG_CORE and CG_PLAN functions `source` declares or defines."""
    return _CORE_NAME.findall(source)


def core_parts(core: str, declared, spec: ConvSpec) -> tuple:
    """The sources of the parts of the core source `core` that define the functions `declared` (and
    the common part): each the whole source with the other parts' functions left declarations, so it
    compiles only its own. ValueError if `core` lacks a declared function."""
    defined = set(_core_names(core))
    missing = set(declared) - defined
    if missing:
        raise ValueError(f"the core object of {spec} would not define {', '.join(sorted(missing))}, which its "
                         "window module declares")
    needed = ["common"] + [part for part in CORE_PARTS if any(core_part(name) == part for name in declared)]
    return tuple(_declarations_only(core, keep=part) for part in needed)


def compilable_part(part_source: str) -> str:
    """What the compiler gets of a core part's source (one of `Rendered.cores`, which the cache keys
    on): its own functions, the other parts' declarations, and only what its functions use. The rest
    of the generic module (its entry points and window code, unused there) is left out: without
    optimization (-O0, as the sanitizer builds compile) a compiler emits every static function, and
    theirs would reference the functions of parts a module need not link. Done at compile time only:
    the cut reads the whole source, which would cost every cached load a third of a second."""
    own = [_CORE_NAME.match(match.group(0)).group(1) for match in _CORE_FUNCTION.finditer(part_source)]
    return extract(part_source, list(dict.fromkeys(own)))


def _declarations_only(source: str, keep: str | None = None) -> str:
    """`source` with the body of every `CG_CORE` and `CG_PLAN` function replaced by a semicolon: a
    declaration of the function the core object defines; with `keep`, those of the core part `keep`
    stay whole (the source of that part)."""
    def declare(match):
        if keep is not None and core_part(_CORE_NAME.match(match.group(0)).group(1)) == keep:
            return match.group(0)
        return match.group(1) + (";  /* in the core object */\n" if keep is None else ";  /* in another part */\n")
    declared, count = _CORE_FUNCTION.subn(declare, source)
    if count != len(re.findall(r"^(?:CG_CORE|CG_PLAN) ", source, re.M)):
        raise ValueError("a CG_CORE function or CG_PLAN function in the templates is not written as its declarator, "
                         "then its body between braces alone on their own lines")
    return declared
