"""The C calling convention of a kernel module, declared once.

Every module exports the entry points below, each named `ConvSpec.symbol(entry)`. From this one
declaration come the C signatures the templates define (`signatures`), the cffi cdef (`cdef`), the
prototypes of an exported header, and the size arguments Python passes (`size_arguments`), so the
order of the int64 arguments, invisible to cffi if two were swapped, is written in one place.

All entry points take their arrays (and the forward pass its epilogue's parameters), the sizes of the
forward convolution (x (n, c, h, w) -> y (n, f, ho, wo), in `SIZE_PARAMS` order), then, in the generic
build only, the window (`WINDOW_PARAMS`, its padding mode as one of `PADDING_MODE_IDS`) and the
forward pass's epilogue (`EPILOGUE_PARAMS`: its activation and residual position as ids), then the
most threads the call may use. A transposed convolution is
run as the input gradient of the convolution from its output back to its input (`Problem.conv()`).
"""

from __future__ import annotations

import dataclasses

from ..planning.epilogue import ACTIVATIONS, RESIDUALS
from ..planning.problem import Problem
from ..planning.spec import PADDING_MODES, ConvSpec

SIZE_PARAMS = ("n", "c", "h", "w", "f", "ho", "wo", "groups")
WINDOW_PARAMS = ("kh", "kw", "sh", "sw", "pt", "pl", "dh", "dw", "pm")
# The generic build's padding-mode argument `pm`: what the padding holds.
PADDING_MODE_IDS = {mode: number for number, mode in enumerate(PADDING_MODES)}
EPILOGUE_PARAMS = ("act", "res")
# The generic build's epilogue arguments: which activation (`act`), where the residual is added (`res`).
ACTIVATION_IDS = {name: number for number, name in enumerate(ACTIVATIONS)}
RESIDUAL_IDS = {name: number for number, name in enumerate(RESIDUALS)}


@dataclasses.dataclass(frozen=True)
class EntryPoint:
    """One exported C function: its return type and the parameters before the sizes.

    `arrays` are (C type, name) pairs with "real" standing for the element type, `scalars` the
    (C type, name) pairs of the numbers after them; `op` is True for the queries that take an op id
    (OP_IDS) first.
    """

    name: str
    returns: str
    arrays: tuple[tuple[str, str], ...] = ()
    op: bool = False
    scalars: tuple[tuple[str, str], ...] = ()


ENTRY_POINTS = {
    entry.name: entry for entry in (
        # y = conv2d(x, weight) + bias (bias may be NULL), then the spec's epilogue (its activation with
        # parameters alpha and beta; `residual`, shaped as y, added before or after it; NULL without);
        # returns 0, or 1 if its workspace could not be allocated.
        # `prepared`: NULL, or what `prepare` made of these weights for this op and these sizes, read
        # instead of laying the weights out again (`weight` is then not read).
        EntryPoint("fwd", "int", (("const real *", "x"), ("const real *", "weight"), ("const real *", "prepared"),
                                  ("const real *", "bias"), ("const real *", "residual"), ("real *", "y")),
                   scalars=(("double", "alpha"), ("double", "beta"))),
        # dx = conv2d's input gradient given dy (also conv_transpose2d of dy); returns 0 or 1. `prepared` as fwd's.
        EntryPoint("bwd_data", "int", (("const real *", "dy"), ("const real *", "weight"), ("const real *", "prepared"),
                                       ("real *", "dx"))),
        # dweight = conv2d's weight gradient given dy and x; returns 0 or 1.
        EntryPoint("bwd_weight", "int", (("const real *", "dy"), ("const real *", "x"), ("real *", "dweight"))),
        # Bytes of workspace the kernel of op `op` allocates for these sizes.
        EntryPoint("workspace", "int64_t", op=True),
        # Threads the kernel of op `op` runs on for these sizes (at most nthreads).
        EntryPoint("threads", "int", op=True),
        # Reals of op `op`'s prepared weights for these sizes (what `prepare` writes); 0 if the op
        # reads the weights as they are (the weight gradient; families with nothing to lay out).
        EntryPoint("prepared_size", "int64_t", op=True),
        # Write into `prepared` (prepared_size reals, CG_ALIGN-aligned) the weights laid out as op `op`
        # reads them for these sizes: its packed panels or transformed filters, made once and passed
        # to every later call as `prepared`. Returns 0, or 1 if its scratch could not be allocated.
        EntryPoint("prepare", "int", (("const real *", "weight"), ("real *", "prepared")), op=True),
    )
}

# The op ids of the queries: which kernel a workspace or thread-count question is about.
OP_IDS = {"fwd": 0, "bwd_data": 1, "bwd_weight": 2}
# What each op computes, in words (an exported header's documentation, `convgen cache list`).
OP_TITLES = {"fwd": "forward", "bwd_data": "input gradient", "bwd_weight": "weight gradient"}
# The ops, each with its own entry point. A module carries one or more of them (the runtime builds one
# module per op, so a call compiles only what it runs; an export carries all three), and always the
# queries (and `prepare`), which answer for every op.
OPS = tuple(OP_IDS)
QUERIES = ("workspace", "threads", "prepared_size", "prepare")
# The bytes every prepared buffer is aligned to (the templates' CG_ALIGN).
PREPARED_ALIGN = 64


def as_ops(ops) -> tuple[str, ...]:
    """`ops` (None: all of them) as a tuple in OPS order; ValueError naming an unknown op."""
    if ops is None:
        return OPS
    if isinstance(ops, str):
        ops = (ops,)
    ops = tuple(ops)
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise ValueError(f"ops must be a non-empty selection of {OPS}, got {ops!r}")
    return tuple(op for op in OPS if op in ops)


def module_entries(ops=None) -> tuple[str, ...]:
    """The entry points a module of `ops` exports: those ops' and the queries."""
    return as_ops(ops) + QUERIES


def size_parameters(spec: ConvSpec) -> tuple[str, ...]:
    """The int64 parameters every entry point of `spec`'s module takes after its arrays and scalars:
    the sizes, and in the generic build the window and the epilogue too (`size_arguments` order)."""
    return SIZE_PARAMS if spec.specialized else SIZE_PARAMS + WINDOW_PARAMS + EPILOGUE_PARAMS


def parameters(entry: EntryPoint, spec: ConvSpec) -> list[str]:
    """The C parameter list of `entry` in the module of `spec`, one "type name" string each."""
    params = ["int op"] if entry.op else []
    params += [f"{ctype.replace('real', spec.c_type)}{name}" if ctype.endswith("*") else f"{ctype} {name}"
               for ctype, name in entry.arrays]
    params += [f"{ctype} {name}" for ctype, name in entry.scalars]
    params += [f"int64_t {name}" for name in size_parameters(spec)]
    return params + ["int nthreads"]


def signature(entry: EntryPoint, spec: ConvSpec, name: str | None = None) -> str:
    """`entry`'s C declarator in the module of `spec`, e.g. `int cg_conv2d_fwd_...(const float *x, ...)`
    (named `name` instead of `spec.symbol(entry.name)` if given)."""
    return f"{entry.returns} {name or spec.symbol(entry.name)}({', '.join(parameters(entry, spec))})"


def signatures(spec: ConvSpec) -> dict[str, str]:
    """Every entry point's C declarator, by entry name (what the templates define)."""
    return {name: signature(entry, spec) for name, entry in ENTRY_POINTS.items()}


def cdef(spec: ConvSpec, ops=None) -> str:
    """The cffi declarations of a module of `spec` carrying `ops` (default all: also the prototypes of
    its exported header)."""
    declarators = signatures(spec)
    return "".join(f"{declarators[entry]};\n" for entry in module_entries(ops))


def interface_symbol(entry: str) -> str:
    """The name entry point `entry` goes by in a module the runtime builds: the one its interface object
    calls (every module of a dtype and build kind links the same one; see convgen.runtime.build)."""
    return f"cg_entry_{entry}"


def address_symbol(entry: str) -> str:
    """The name of op `entry`'s address form in the interface object (`address_signature`)."""
    return f"cg_entry_{entry}_at"


def address_signature(entry: str, spec: ConvSpec) -> str:
    """The C declarator of op `entry`'s address form: its arrays as addresses (uintptr_t, 0 for NULL),
    its scalars, then a pointer to its size arguments (`size_arguments`, in order) and nthreads.
    What callers whose arrays are not NumPy's (PyTorch tensors) call: an int converts to an argument
    at no cost where a pointer takes an ffi.cast, and one array of sizes where each size took one
    conversion (on a tiny convolution from PyTorch, the call's arguments cost more than its C)."""
    point = ENTRY_POINTS[entry]
    params = [f"uintptr_t {name}" for _, name in point.arrays] + [f"{ctype} {name}" for ctype, name in point.scalars]
    return f"{point.returns} {address_symbol(entry)}({', '.join(params + ['const int64_t *sizes', 'int nthreads'])})"


def address_definition(entry: str, spec: ConvSpec) -> str:
    """The C definition of op `entry`'s address form: a call of the entry point (`interface_symbol`)."""
    point = ENTRY_POINTS[entry]
    arguments = ([f"({ctype.replace('real', spec.c_type)}){name}" for ctype, name in point.arrays]
                 + [name for _, name in point.scalars]
                 + [f"sizes[{i}]" for i in range(len(size_parameters(spec)))] + ["nthreads"])
    return f"{address_signature(entry, spec)}\n{{\n    return {interface_symbol(entry)}({', '.join(arguments)});\n}}\n"


def interface_cdef(spec: ConvSpec, ops=None) -> str:
    """The cffi declarations of the interface object of `spec`'s modules carrying `ops`: `cdef` under
    the entry points' interface names, and each op's address form, so it depends only on the dtype,
    the build (specialized or generic) and the ops, never on the window."""
    entries = "".join(f"{signature(ENTRY_POINTS[entry], spec, interface_symbol(entry))};\n"
                      for entry in module_entries(ops))
    return entries + "".join(f"{address_signature(entry, spec)};\n" for entry in as_ops(ops))


def interface_source(spec: ConvSpec, ops=None) -> str:
    """The C source of the interface object beside cffi's wrapper of `interface_cdef`: the
    declarations, and each op's address form defined on them. (What names and keys the object.)"""
    return ("#include <stdint.h>\n" + interface_cdef(spec, ops)
            + "".join(address_definition(op, spec) for op in as_ops(ops)))


def size_arguments(problem: Problem, specialized: bool) -> tuple[int, ...]:
    """The size (and, generic, window and epilogue) arguments of every entry point for `problem`, before
    nthreads."""
    conv = problem.conv()
    values = tuple(getattr(conv, name) for name in SIZE_PARAMS)
    if specialized:
        return values
    window, epilogue = conv.window, problem.epilogue
    (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.stride, window.dilation
    return values + (kh, kw, sh, sw, window.padding[0][0], window.padding[1][0], dh, dw,
                     PADDING_MODE_IDS[window.padding_mode],
                     ACTIVATION_IDS[epilogue.activation], RESIDUAL_IDS[epilogue.residual])


__all__ = ["EntryPoint", "ENTRY_POINTS", "OP_IDS", "OP_TITLES", "OPS", "QUERIES", "PREPARED_ALIGN", "as_ops", "module_entries",
           "PADDING_MODE_IDS", "SIZE_PARAMS", "WINDOW_PARAMS", "EPILOGUE_PARAMS", "ACTIVATION_IDS", "RESIDUAL_IDS", "parameters", "signature", "signatures", "cdef",
           "interface_symbol", "interface_cdef", "size_arguments", "address_symbol", "address_signature",
           "address_definition", "interface_source", "size_parameters"]
