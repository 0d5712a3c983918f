"""Standalone C: a kernel module as a .c/.h pair that any C compiler builds, without Python or cffi.

The rendered module is plain C already (templates/<family>/module.c.j2); the export adds a header
that carries its prototypes (convgen.codegen.abi's declarators, the same text as the cffi cdef) with what a
C caller needs to know: the array shapes in the spec's layout, what each size means, the
output-size formula with this spec's numbers, the op ids of the queries, the thread count and the
return codes.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

from ..codegen import abi
from .._version import __version__
from ..runtime.build import DEFAULT_CFLAGS
from ..codegen.render import Rendered
from ..planning.spec import ConvSpec

# The shapes of the arrays, per layout; sizes as named in the C signatures.
_SHAPES = {
    "NCHW": {"x": "(n, c, h, w)", "y": "(n, f, ho, wo)", "weight": "(f, c / groups, {kh}, {kw})"},
    "NHWC": {"x": "(n, h, w, c)", "y": "(n, ho, wo, f)", "weight": "({kh}, {kw}, c / groups, f)"},
}

# What the padding holds in each mode other than zeros, and the sizes it needs (PyTorch's rules).
_MODE_DOCS = {"reflect": "the image mirrored at its edge, the edge not repeated; each padding must be smaller "
                         "than the input size (h or w) it pads",
              "replicate": "the edge repeated; an input padded must not be empty",
              "circular": "the image wrapped around; each padding must be at most the input size (h or w) it pads"}

_OP_DOCS = {
    "fwd": """\
Forward convolution (cross-correlation, as PyTorch's conv2d): y = conv2d(x, weight) + bias,
then the epilogue {epilogue}.
  x         input images {x}
  weight    filters {weight}
  prepared  NULL, or what `prepare` made of these filters for op 0 and these sizes: then read
            instead of weight (which may be NULL), saving the filters' layout on every call
  bias      one per output channel (f), or NULL for none
  residual  shaped as y, added before or after the activation; NULL when the epilogue adds none
  y         output images {y}, overwritten
  alpha, beta  the activation's parameters: clamp's min and max, leaky_relu's slope (alpha)
Returns 0, or 1 if the scratch memory could not be allocated (y is then left untouched).""",
    "bwd_data": """\
Input gradient: dx = dL/dx given dy = dL/dy, for the forward convolution of the same sizes.
  dy        output gradient, shaped as y {y}
  weight    filters {weight}
  prepared  NULL, or what `prepare` made of these filters for op 1 and these sizes (as for the
            forward convolution)
  dx        input gradient, shaped as x {x}, overwritten
This is also the transposed convolution (conv_transpose2d): its input is dy, its output is dx,
its weights are this weight; pass f = C_in, (ho, wo) = its input size, c = C_out and (h, w) = its
output size. Add its bias yourself.
Returns 0, or 1 if the scratch memory could not be allocated.""",
    "bwd_weight": """\
Weight gradient: dweight = dL/dweight given dy = dL/dy and the forward input x.
  dy       output gradient, shaped as y {y}
  x        input images {x}
  dweight  shaped as weight {weight}, overwritten
The bias gradient is dy summed over n, ho and wo; it is not computed here.
Returns 0, or 1 if the scratch memory could not be allocated.""",
    "workspace": """\
Bytes of scratch memory one call of op `op` allocates for these sizes and nthreads;
  op: {ops}.
The kernels allocate it themselves; this is for planning only.""",
    "threads": """\
Threads one call of op `op` runs on for these sizes: at most nthreads, fewer when the work
is too small to share, 1 when built without OpenMP;
  op: {ops}.""",
    "prepared_size": """Elements (of the dtype) of op `op`'s prepared filters for these sizes: what `prepare` writes.
0 when the op reads the filters as they are (the weight gradient always; some kernels for every op);
  op: {ops}.""",
    "prepare": """Lay out the filters once as op `op` reads them for these sizes (packed panels, or Winograd's
transformed filters), into `prepared`: prepared_size(...) elements, 64-byte aligned. Pass it as
`prepared` to every call of that op with these sizes while the filters keep their values;
prepare again after they change.
  weight    filters {weight}
  op: {ops}.
Returns 0, or 1 if the scratch memory could not be allocated.""",
}

def _op_ids_doc() -> str:
    """The op ids of the queries as documented in the header, e.g. "0 forward, 1 input gradient, ..."."""
    by_number = sorted(abi.OP_IDS.items(), key=lambda item: item[1])
    return ", ".join(f"{number} {abi.OP_TITLES[entry]}" for entry, number in by_number)


def module_basename(spec: ConvSpec) -> str:
    """File name stem of one kernel module, e.g. conv2d_k3s2p1_nchw_float32 (also used by `generate`)."""
    return f"conv2d_{spec.name}"


def compile_hint(rendered: Rendered, name: str) -> str:
    """The command line that builds the exported source as convgen builds it (less the Python parts)."""
    flags = [*DEFAULT_CFLAGS, *rendered.schedule.arch_flags, "-fopenmp", "-fno-strict-aliasing"]
    return shlex.join(["cc", *flags, "-c", f"{name}.c"])


def _epilogue_doc(spec: ConvSpec) -> str:
    """What the forward entry point does after the bias, in words."""
    if not spec.specialized:
        return "chosen at run time by act and res"
    epilogue = spec.epilogue
    if not epilogue.active:
        return "(none in this build: y is the convolution plus bias)"
    activation = "no activation" if epilogue.activation == "none" else f"activation {epilogue.activation}"
    where = {"none": "no residual", "before": "the residual added before the activation",
             "after": "the residual added after the activation"}[epilogue.residual]
    return f"of this build: {activation}, {where}"


def _sizes_doc(spec: ConvSpec) -> str:
    if spec.specialized:
        w = spec.window
        (kh, kw), (sh, sw), (dh, dw) = w.kernel, w.stride, w.dilation
        (pt, pb), (pl, pr) = w.padding
        window = (f"This build is specialized for the window {spec.short()}: kernel {kh}x{kw}, stride {sh}x{sw},\n"
                  f"padding top {pt}, bottom {pb}, left {pl}, right {pr}, dilation {dh}x{dw}. They are compiled in.")
        if w.padding_mode != "zeros":
            window += "\n" + textwrap.fill(f"The padding is {w.padding_mode}: {_MODE_DOCS[w.padding_mode]}.", 96)
        ho = f"(h + {pt + pb} - {dh * (kh - 1) + 1}) / {sh} + 1"
        wo = f"(w + {pl + pr} - {dw * (kw - 1) + 1}) / {sw} + 1"
        window_args = ""
        epilogue_args = ""
    else:
        modes = ", ".join(f"{number} {mode}" + (f" ({_MODE_DOCS[mode]})" if mode in _MODE_DOCS else "")
                          for mode, number in abi.PADDING_MODE_IDS.items())
        window = ("This is the generic build: the window is given at run time by kh, kw (kernel size), sh, sw\n"
                  "(stride), pt, pl (padding at the top and left) and dh, dw (dilation); all >= 1 but pt, pl >= 0.\n"
                  + textwrap.fill(f"pm is the padding mode: {modes}.", 96))
        ho = "(h + pt + pb - dh * (kh - 1) - 1) / sh + 1"
        wo = "(w + pl + pr - dw * (kw - 1) - 1) / sw + 1"
        window_args = " kh, kw, sh, sw, pt, pl, dh, dw, pm: the window, as above (pb, pr: bottom and right padding).\n"
        activations = ", ".join(f"{number} {name}" for name, number in abi.ACTIVATION_IDS.items())
        residuals = ", ".join(f"{number} {name}" for name, number in abi.RESIDUAL_IDS.items())
        epilogue_args = textwrap.fill(f"act, res: the forward pass's epilogue (the other ops ignore them): the activation, "
                                      f"{activations}; where the residual is added, {residuals} (before or after "
                                      f"the activation).", 96, initial_indent=" ", subsequent_indent="   ") + "\n"
    return f"""\
{window}

Sizes, the same for every op (those of the forward convolution x -> y):
 n: images in the batch; c: input channels; h, w: input height and width;
 f: output channels; groups: channel groups (divides c and f; 1 for a plain convolution);
 ho = {ho}
 wo = {wo}
   (integer division; the padding at the bottom and right is implied by ho and wo).
{window_args}{epilogue_args} nthreads: the most threads the call may use (>= 1). Built without OpenMP the call runs
   on the calling thread.
"""


def _comment(text: str, indent: str = "") -> str:
    lines = text.rstrip("\n").split("\n")
    body = "\n".join(f"{indent} * {line}".rstrip() for line in lines)
    return f"{indent}/*\n{body}\n{indent} */"


def header_text(rendered: Rendered) -> str:
    """The .h of an exported module: every entry point's prototype (convgen.codegen.abi's declarator)
    with its documentation."""
    spec = rendered.spec
    name = module_basename(spec)
    guard = re.sub(r"\W", "_", name).upper() + "_H"
    kh, kw = spec.window.kernel if spec.specialized else ("kh", "kw")
    shapes = {key: value.format(kh=kh, kw=kw) for key, value in _SHAPES[spec.layout].items()}
    blocks = [_comment(_OP_DOCS[entry].format(ops=_op_ids_doc(), epilogue=_epilogue_doc(spec), **shapes))
              + f"\n{declarator};"
              for entry, declarator in abi.signatures(spec).items()]
    about = f"""\
{name}.h: 2-D convolution kernels exported by convgen {__version__}. Plain C: no Python, no cffi.
Element type {spec.c_type} ({spec.dtype}), layout {spec.layout}; C symbols end in {spec.name}.

Build the source as convgen builds it: -fno-strict-aliasing is needed (the kernels view one
buffer through several pointer types); -fopenmp gives threads and the arch flag the vector width of
the {rendered.schedule.isa} schedule the code was rendered for, and both may be left out:
    {compile_hint(rendered, name)}
Without -fopenmp the OpenMP pragmas are ignored (-Wall warns about them: -Wno-unknown-pragmas).
Link with -lm: the forward pass's epilogue calls the math library (exp, erf, tanh).

Arrays are contiguous, row-major, of {spec.c_type}; their shapes in layout {spec.layout}:
 x {shapes["x"]}, weight {shapes["weight"]}, y {shapes["y"]}.
No alignment beyond the element type's is needed. Inputs are not modified; outputs must not
overlap inputs. The kernels trust their arguments: the sizes must match the arrays.

{_sizes_doc(spec)}"""
    return f"""{_comment(about)}
#ifndef {guard}
#define {guard}

#include <stdint.h>

#ifdef __cplusplus
extern "C" {{
#endif

{chr(10).join(block + chr(10) for block in blocks)}
#ifdef __cplusplus
}}
#endif

#endif /* {guard} */
"""


def source_text(rendered: Rendered) -> str:
    """The .c of an exported module: the rendered source, checked against its header."""
    name = module_basename(rendered.spec)
    intro = textwrap.dedent(f"""\
        /* {name}.c: exported by convgen {__version__}; the prototypes and their documentation are in {name}.h.
           Build: {compile_hint(rendered, name)} */
        #include "{name}.h"

        """)
    return intro + rendered.source


def export_module(rendered: Rendered, directory) -> tuple[Path, Path]:
    """Write `<name>.c` and `<name>.h` of `rendered` into `directory` (created if missing)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = module_basename(rendered.spec)
    c_path, h_path = directory / f"{name}.c", directory / f"{name}.h"
    h_path.write_text(header_text(rendered))
    c_path.write_text(source_text(rendered))
    return c_path, h_path
