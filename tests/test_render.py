"""The rendered C: specialized and generic from one template, the window loops gone when specialized."""

import dataclasses
import re

import pytest

from convgen.runtime.kernels import settings
from convgen.codegen.csource import top_level_items
from convgen.codegen.render import render
from convgen.planning.epilogue import Epilogue
from convgen.planning.spec import ConvSpec, Window

WINDOW_LOOP = re.compile(r"for \(int64_t [ij] = 0; [ij] < (g->k[hw]|\d+);")
TAP_LOOP = re.compile(r"for \(int64_t t = 0; t < KK;")


@pytest.fixture(scope="module")
def schedule():
    return settings().schedule()


@pytest.mark.parametrize("text", ["k3s1p1", "k5s1p2", "k7s2p3", "k3x5s2x1p1x2d2", "k1s1p0", "k7x4s3x2p3x1"])
def test_specialized_source_has_no_window_loop(schedule, text):
    spec = ConvSpec(Window.parse(text))
    source = render(spec, schedule).source
    assert not WINDOW_LOOP.search(source), WINDOW_LOOP.search(source)
    assert not TAP_LOOP.search(source)
    for field in ("kh", "kw", "sh", "sw", "pt", "pl", "dh", "dw"):
        assert f"g->{field}" not in source
    kh, kw = spec.window.kernel
    # every tap is written out once per unrolled packing routine
    assert source.count(f"const int64_t i = {kh - 1}, j = {kw - 1};") >= 2
    assert spec.symbol("fwd") in source


# The functions that loop over the taps, even specialized: run once per tap, they gain nothing from
# literal taps but compile time (packing a tap's weights as panels, planning which taps a phase reads).
PER_TAP_LOOP = re.compile(r"for \(int64_t tap = 0; tap < (\d+); \+\+tap\)")
PER_TAP_FUNCTIONS = {"rows_pack_forward_nchw", "rows_pack_weights", "rows_phase_taps", "rows_phase_reach"}


@pytest.mark.parametrize("text", ["k3s1p1", "k5s2p2", "k3x5s2x1p1x2d2"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_specialized_source_loops_over_taps_only_where_literal_taps_gain_nothing(schedule, text, layout):
    spec = ConvSpec(Window.parse(text), layout=layout)
    kh, kw = spec.window.kernel
    looping = set()
    for item in top_level_items(render(spec, schedule).source):
        bounds = PER_TAP_LOOP.findall(item.text)
        if bounds:
            assert set(bounds) == {str(kh * kw)}, item.names
            assert f"const int64_t i = tap / {kw}, j = tap % {kw};" in item.text
            looping |= item.names
    assert looping and looping <= PER_TAP_FUNCTIONS


def test_windows_past_max_unrolled_taps_keep_only_the_micro_kernel_tap_loop(schedule):
    """8x8 has 64 taps, above max_unrolled_taps (49): packing stays unrolled, the micro-kernel loops over taps."""
    spec = ConvSpec(Window.parse("k8s2p3"))
    source = render(spec, schedule).source
    assert not WINDOW_LOOP.search(source)
    assert len(TAP_LOOP.findall(source)) == 1
    assert source.count("const int64_t i = 7, j = 7;") >= 2
    unrolled = render(spec, dataclasses.replace(schedule, max_unrolled_taps=64)).source
    assert not TAP_LOOP.search(unrolled) and not WINDOW_LOOP.search(unrolled)
    looped = render(ConvSpec(Window.parse("k7s2p3")), dataclasses.replace(schedule, max_unrolled_taps=25)).source
    assert len(TAP_LOOP.findall(looped)) == 1


def test_generic_source_loops_over_the_window(schedule):
    source = render(ConvSpec(None), schedule).source
    assert WINDOW_LOOP.search(source) and TAP_LOOP.search(source)
    assert "g->kh" in source and "g->dw" in source
    assert "const int64_t i = 0, j = 0;" not in source


def test_symbols_name_the_window_layout_and_dtype():
    spec = ConvSpec(Window(3, 2, 1), "float32", "NCHW")
    assert spec.name == "k3s2p1_nchw_float32" == str(spec)
    assert spec.symbol("fwd") == "cg_conv2d_fwd_k3s2p1_nchw_float32"
    assert ConvSpec(None, "float64", "NHWC").symbol("bwd_weight") == "cg_conv2d_bwd_weight_generic_nhwc_float64"


@pytest.mark.parametrize("text", ["k3s1p1", "k3x5s2x1p0_1x2_3d2x1", "k1", "k11s4p2d3", "generic"])
@pytest.mark.parametrize("entry", ["fwd", "bwd_data", "bwd_weight", "workspace", "threads"])
def test_from_symbol_reads_back_every_symbol(text, entry):
    for dtype in ("float32", "float64"):
        for layout in ("NCHW", "NHWC"):
            spec = ConvSpec.parse(text, dtype, layout)
            assert ConvSpec.from_symbol(spec.symbol(entry)) == spec


@pytest.mark.parametrize("bad", ["cg_conv2d_fwd_k3s1p1_nchw", "cg_conv2d_fwd_k3s1p1_ncwh_float32", "conv2d_k3s1p1",
                                 "cg_conv2d_fwd_banana_nchw_float32", 42])
def test_from_symbol_refuses_what_no_module_exports(bad):
    with pytest.raises(ValueError, match="is not the symbol of a convgen entry point"):
        ConvSpec.from_symbol(bad)


def test_both_variants_come_from_the_same_template(schedule):
    """Apart from the window, the two sources share every line of the GEMM and packing code."""
    special = render(ConvSpec(Window(3, 1, 1)), schedule).source
    generic = render(ConvSpec(None), schedule).source
    ukernel = special[special.index("CG_CORE void ukernel"):special.index("CG_CORE void ukernel") + 400]
    assert ukernel in generic


def test_very_large_windows_keep_constant_bound_loops(schedule):
    """Beyond 64 taps the packing code loops (with literal bounds) instead of unrolling every tap."""
    source = render(ConvSpec(Window.parse("k9s1p4")), schedule).source
    assert "for (int64_t i = 0; i < 9; ++i)" in source and "g->kh" not in source
    assert "const int64_t i = 8, j = 8;" not in source


# ------------------------------------------------------------------------- a module per op
# The kernels each op's module must carry, and functions only another op's kernels define.
OWN_KERNELS = {
    ("direct", "NHWC"): {"fwd": "rows_forward(", "bwd_data": "rows_backward_data(", "bwd_weight": "rows_backward_weight("},
    ("direct", "NCHW"): {"fwd": "forward_block(", "bwd_data": "rows_backward_data(", "bwd_weight": "dw_unit("},
    ("winograd", "NCHW"): {"fwd": "wino_run(", "bwd_data": "wino_run(", "bwd_weight": "rows_backward_weight("},
    ("depthwise", "NCHW"): {"fwd": "nchw_forward_channel(", "bwd_data": "nchw_backward_data_plane(",
                            "bwd_weight": "nchw_weight_taps("},
    ("depthwise", "NHWC"): {"fwd": "nhwc_forward(", "bwd_data": "nhwc_backward_data_rows(",
                            "bwd_weight": "nhwc_weight_rows("},
}
OPS = ("fwd", "bwd_data", "bwd_weight")


@pytest.mark.parametrize("family, layout", list(OWN_KERNELS), ids=lambda v: str(v))
@pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])
def test_a_module_of_one_op_carries_that_op_only(schedule, family, layout, specialize):
    if family == "winograd" and not specialize:
        return  # Winograd has no generic build
    spec = ConvSpec(Window(3, 1, 1) if specialize else None, "float32", layout, family, 4 if family == "winograd" else 0)
    full = render(spec, schedule)
    assert full.ops == OPS and all(spec.symbol(op) in full.source for op in OPS)
    for op in OPS:
        alone = render(spec, schedule, ops=(op,))
        assert alone.ops == (op,)
        assert set(alone.symbols) == {op, "workspace", "threads", "prepared_size", "prepare"}
        assert alone.cdef.count(";") == 5 and spec.symbol(op) in alone.cdef
        others = [other for other in OPS if other != op]
        assert spec.symbol(op) in alone.source and not any(spec.symbol(o) in alone.source for o in others)
        assert OWN_KERNELS[family, layout][op] in alone.source
        foreign = {OWN_KERNELS[family, layout][o] for o in others} - {OWN_KERNELS[family, layout][op]}
        if (family, layout, op) == ("depthwise", "NHWC", "bwd_data"):
            foreign.discard("nhwc_forward(")  # a stride-1 "same" input gradient is the forward pass over dy
        # another op's kernel is at most referenced by a plan or a comment, never defined here
        for name in foreign:
            assert not re.search(r"^static [^;]*\b" + re.escape(name), alone.source, re.MULTILINE), name
        assert len(alone.source) < len(full.source)


def test_ops_are_checked(schedule):
    with pytest.raises(ValueError, match="ops must be"):
        render(ConvSpec(Window(3, 1, 1)), schedule, ops=("forward",))
    with pytest.raises(ValueError, match="ops must be"):
        render(ConvSpec(Window(3, 1, 1)), schedule, ops=())
    assert render(ConvSpec(Window(3, 1, 1)), schedule, ops="bwd_data").ops == ("bwd_data",)


# ------------------------------------------------------------------ the core object of split modules
def preprocess(source):
    """`source` with its macros expanded, as the compiler that builds the kernels sees it."""
    import subprocess
    result = subprocess.run([settings().toolchain.compiler, "-E", "-P", "-fopenmp", "-x", "c", "-"], input=source,
                            capture_output=True, text=True, check=True)
    return result.stdout


def definitions(source):
    """{name: top-level item} of `source` preprocessed (convgen.codegen.csource reads it), a name's
    definition preferred to its declarations."""
    items = {}
    for item in top_level_items(preprocess(source)):
        for name in item.names:
            if name not in items or "{" in item.text:
                items[name] = item
    return items


def unit_text(item):
    """An item's text as either unit writes it: the core object defines as extern what a module of
    one unit makes static."""
    return re.sub(r"^static\s+", "", item.text.strip())


SPLIT_SPECS = [ConvSpec(Window.parse(text), dtype, layout) for text in ("k3s1p1", "k1s1p0", "k5s2p2", "k7s2p3", "k3x5s2x1p1x2d2")
               for dtype, layout in (("float32", "NCHW"), ("float32", "NHWC"), ("float64", "NCHW"), ("float64", "NHWC"))]
SPLIT_SPECS.append(ConvSpec(Window(3, 1, 1, padding_mode="reflect"), "float32", "NHWC"))
# Winograd modules link the core of their micro-tile's schedule, rendered from the direct family.
SPLIT_SPECS += [ConvSpec(Window.parse(text), dtype, layout, "winograd", tile)
                for text, dtype, layout, tile in (("k3s1p1", "float32", "NCHW", 4), ("k3s1p1", "float64", "NHWC", 2),
                                                  ("k3s1p0_1x2_1", "float32", "NHWC", 6), ("k3s1p2", "float64", "NCHW", 4))]
SPLIT_SPECS.append(ConvSpec(Window(3, 1, 1), "float32", "NHWC", "winograd", 4, Epilogue.parse("addrelu")))
# The generic build links the core its specialized windows link.
SPLIT_SPECS += [ConvSpec(None, "float32", "NCHW"), ConvSpec(None, "float64", "NHWC")]


@pytest.mark.parametrize("spec", SPLIT_SPECS, ids=str)
def test_the_core_object_holds_what_the_window_module_would_compile_itself(schedule, spec):
    """The split costs no specialization: every function of the core object that a window module
    calls, and everything it calls in turn, is, macros expanded, the function the specialized build of
    one unit compiles, and the window module declares the CG_CORE functions it calls (a direct module
    every one, a Winograd module those of the weight gradient) and defines none."""
    split = render(spec, schedule, split=True)
    whole, core, window = definitions(render(spec, schedule).source), definitions(split.core), definitions(split.source)
    marked = re.findall(r"^CG_CORE [^(]*?\b(\w+)\(", split.core, re.M)
    assert len(marked) >= 20, "the core object should hold the micro-kernels and the dot products"
    declared = re.findall(r"^CG_CORE [^(]*?\b(\w+)\(", split.source, re.M)
    if spec.family == "direct":
        assert sorted(declared) == sorted(marked)
    assert declared and set(declared) <= set(marked)
    assert not any(name in window and "{" in window[name].text for name in marked)
    # Everything the declared core functions reach (functions, types, tables, variables) is as the
    # window's build has it.
    reached, todo = set(), list(declared)
    while todo:
        name = todo.pop()
        if name not in reached and name in core:
            reached.add(name)
            assert name in whole and unit_text(core[name]) == unit_text(whole[name]), \
                f"{name} differs between the core object and the {spec} build"
            todo += core[name].uses
    # The plans are the generic build's (tests/test_work_splits.py checks that both builds plan alike):
    # the core defines them, the window declares them.
    plans = re.findall(r"^CG_PLAN [^(]*?\b(\w+)\(", split.core, re.M)
    assert sorted(plans) == ["make_plan", "rows_make_plan"]
    assert sorted(re.findall(r"^CG_PLAN [^(]*?\b(\w+)\(", split.source, re.M)) == sorted(plans)
    assert all("{" in core[name].text and not (name in window and "{" in window[name].text) for name in plans)
    planned, todo = set(), list(plans)
    while todo:
        name = todo.pop()
        if name not in planned and name in core:
            planned.add(name)
            todo += core[name].uses
    # A file-scope variable has a copy in each unit: none may be used on both sides (the workspace
    # kept between calls lives with the functions that take and give it back).
    reached |= planned
    for variable in reached:
        if re.match(r"static (?!const\b)[^(]*?[=;]", core[variable].text.strip()):
            in_core = {name for name in reached if variable in core[name].uses}
            in_window = {name for name, item in window.items() if "{" in item.text and variable in item.uses}
            assert not (in_core and in_window), f"{variable} is used by {in_core} in the core and by {in_window} beside it"


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_every_window_and_op_of_a_dtype_and_layout_links_one_core(schedule, layout):
    """The core object carries every op's functions: the modules of one op and of every op, of any
    window, link the same one, and each declares only the core functions its kernels call."""
    whole = render(ConvSpec(Window(3, 1, 1), "float32", layout), schedule, split=True)
    marked = set(re.findall(r"^CG_CORE [^(]*?\b(\w+)\(", whole.core, re.M))
    for text in ("k3s1p1", "k5s2p2"):
        for op in ("fwd", "bwd_data", "bwd_weight"):
            rendered = render(ConvSpec(Window.parse(text), "float32", layout), schedule, ops=(op,), split=True)
            assert rendered.core == whole.core
            declared = set(re.findall(r"^CG_CORE [^(]*?\b(\w+)\(", rendered.source, re.M))
            assert declared and declared <= marked


def test_direct_modules_and_specialized_winograd_modules_split(schedule):
    """Depthwise modules stay one unit; so does every module rendered without split=True (what
    `convgen show`, `generate` and `export` write). The generic direct module links the core object
    its dtype's and layout's specialized windows link; a Winograd module the core object a direct
    module of its micro-tile's schedule links."""
    winograd = ConvSpec(Window(3, 1, 1), family="winograd", tile=4)
    for layout in ("NCHW", "NHWC"):
        core = render(ConvSpec(Window(3, 1, 1), layout=layout), schedule, split=True).core
        assert core is not None and render(ConvSpec(None, layout=layout), schedule, split=True).core == core
    for ops in (("fwd",), ("bwd_weight",), None):
        core = render(winograd, schedule, ops=ops, split=True).core
        assert core == render(ConvSpec(Window(5, 2, 2)), schedule.for_family("winograd"), split=True).core
    one_unit = [render(spec, schedule, split=True) for spec in (
        ConvSpec(Window(3, 1, 1), family="depthwise"), ConvSpec(None, family="depthwise"))]
    one_unit += [render(spec, schedule) for spec in (ConvSpec(Window(3, 1, 1)), ConvSpec(None), winograd)]
    for rendered in one_unit:
        assert rendered.core is None
        assert "#define CG_CORE static" in rendered.source


def test_a_core_function_not_written_as_the_split_expects_is_refused(schedule, tmp_path):
    """The window module keeps a CG_CORE function's declarator and drops its body, which it finds by
    the braces alone on their lines: a function written otherwise is an error, not a silent copy."""
    import shutil
    from convgen.codegen.render import TEMPLATE_DIR
    edited = tmp_path / "templates"
    shutil.copytree(TEMPLATE_DIR, edited)
    pack = edited / "common" / "pack.c.j2"
    text = pack.read_text()
    assert "CG_CORE void pack_b_rows(" in text
    pack.write_text(re.sub(r"(CG_CORE void pack_b_rows\([^)]*\))\n\{", r"\1 {", text))
    with pytest.raises(ValueError, match="CG_CORE function"):
        render(ConvSpec(Window(3, 1, 1)), schedule, templates=edited, split=True)
    assert render(ConvSpec(Window(3, 1, 1)), schedule, templates=edited).core is None  # one unit: no split needed
