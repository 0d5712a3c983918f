"""Render a spec's C source and cffi cdef from the Jinja templates in templates/.

The same templates render both variants: a window value is written as a literal ("3") in the
specialized build and as a field of the run-time geometry ("g->kh") in the generic one, and the
loops over the kernel window are unrolled only where the window is known.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jinja2

from . import __version__
from .schedule import Schedule
from .spec import ConvSpec

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"

# Windows larger than this keep their tap loops in the packing code: 7x7 and 8x8 are unrolled,
# a 31x31 window would be 961 copies of each loop body for no measurable gain.
MAX_UNROLLED_WINDOW = 64

OPS = ("fwd", "bwd_data", "bwd_weight", "workspace")

# Names of the window values in the templates, and the geometry field each reads when generic.
_WINDOW_FIELDS = {"KH": "kh", "KW": "kw", "SH": "sh", "SW": "sw", "PT": "pt", "PL": "pl", "DH": "dh", "DW": "dw"}


@dataclasses.dataclass(frozen=True)
class Rendered:
    """The C source of one kernel module, its cffi cdef, and its entry-point names."""

    spec: ConvSpec
    schedule: Schedule
    source: str
    cdef: str
    symbols: dict


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    if not TEMPLATE_DIR.is_dir():
        raise FileNotFoundError(f"convgen templates not found at {TEMPLATE_DIR}; install convgen from its source tree")
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def template_context(spec: ConvSpec, schedule: Schedule) -> dict:
    """Everything the templates see. Values reaching the C source are validated ints or fixed names."""
    context = {
        "version": __version__,
        "specialized": spec.specialized,
        "spec_text": str(spec),
        "dtype": spec.dtype,
        "c_type": spec.c_type,
        "layout": spec.layout,
        "symbols": {op: spec.symbol(op) for op in OPS},
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
        "MAX_UNROLLED_WINDOW": MAX_UNROLLED_WINDOW,
    }
    if spec.specialized:
        w = spec.window
        values = {"KH": w.kernel[0], "KW": w.kernel[1], "SH": w.stride[0], "SW": w.stride[1],
                  "PT": w.padding[0][0], "PL": w.padding[1][0], "DH": w.dilation[0], "DW": w.dilation[1]}
        context.update({name: str(int(v)) for name, v in values.items()})
        context.update(KH_VALUE=w.kernel[0], KW_VALUE=w.kernel[1], TAPS=w.kernel[0] * w.kernel[1])
        context.update(zip(("TAP_BASES", "TAP_LIST"), _tap_layout(w)))
    else:
        context.update({name: f"g->{field}" for name, field in _WINDOW_FIELDS.items()})
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


def render(spec: ConvSpec, schedule: Schedule) -> Rendered:
    """Render the module source and cdef of `spec` under `schedule`."""
    env = _environment()
    context = template_context(spec, schedule)
    source = env.get_template("conv.c.j2").render(context)
    cdef = env.get_template("conv.cdef.j2").render(context)
    return Rendered(spec, schedule, source, cdef, context["symbols"])
