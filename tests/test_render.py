"""The rendered C: specialized and generic from one template, the window loops gone when specialized."""

import dataclasses
import re

import pytest

from convgen.runtime.kernels import settings
from convgen.codegen.csource import top_level_items
from convgen.codegen.render import compilable_part, core_part, dx_is_forward, render
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
PER_TAP_FUNCTIONS = {"rows_pack_forward_unit", "rows_pack_row", "rows_phase_taps", "rows_phase_reach"}


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
        if op == "bwd_data" and dx_is_forward(spec):  # (NCHW 3x3 p1: the forward pass over dy, its own too)
            others.remove("fwd")
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


def core_defined(source):
    """The CG_CORE and CG_PLAN functions `source` defines (not only declares), in order."""
    return re.findall(r"^(?:CG_CORE|CG_PLAN) [^;{}]*?\b(\w+)\([^;{}]*\)\n\{", source, re.M)


def is_prototype(item):
    """Whether `item` declares a function without defining it."""
    text = item.text.strip()
    return not text.startswith("typedef") and re.fullmatch(r"[^{};=]*\([^{};]*\)\s*;", text) is not None


def core_declared(source):
    """The CG_CORE and CG_PLAN functions `source` declares or defines."""
    return re.findall(r"^(?:CG_CORE|CG_PLAN) [^;{}(]*?\b(\w+)\(", source, re.M)


@pytest.mark.parametrize("spec", SPLIT_SPECS, ids=str)
def test_the_core_object_holds_what_the_window_module_would_compile_itself(schedule, spec):
    """The split costs no specialization: every function of the core object that a window module
    calls, and everything it calls in turn, is, macros expanded, the function the specialized build of
    one unit compiles. The core object is compiled in parts (`CORE_PARTS`): each defines its own
    functions and declares the others', and the window module declares the CG_CORE functions it calls
    (a direct module every one, a Winograd module those of the weight gradient) and defines none."""
    split = render(spec, schedule, split=True)
    whole, window = definitions(render(spec, schedule).source), definitions(split.source)
    parts = [definitions(source) for source in split.cores]
    defined = [core_defined(source) for source in split.cores]
    part_names = ["common"] + [core_part(names[0]) for names in defined[1:]]
    assert part_names[0] == "common" and len(set(part_names)) == len(part_names)
    for name, names in zip(part_names, defined):
        assert names and all(core_part(function) == name for function in names)
    marked = [function for names in defined for function in names]
    assert len(marked) >= 20, "the core object should hold the micro-kernels and the dot products"
    declared = re.findall(r"^CG_CORE [^(]*?\b(\w+)\(", split.source, re.M)
    if spec.family == "direct":
        assert sorted(declared) == sorted(name for name in marked if not name.endswith("make_plan"))
    assert declared and set(declared) <= set(marked)
    assert not any(name in window and "{" in window[name].text for name in marked)
    # Everything the declared core functions reach (functions, types, tables, variables) is as the
    # window's build has it, in the part that defines it.
    owner = {function: index for index, names in enumerate(defined) for function in names}

    def reach(names):
        """{(name, part index)}: what `names` reach in the parts, each function in the part that
        defines it (not through another part's declaration of it)."""
        found, todo = set(), [(name, owner[name]) for name in names]
        while todo:
            name, index = todo.pop()
            core = parts[index]
            if (name, index) not in found and name in core and not is_prototype(core[name]):
                found.add((name, index))
                todo += [(used, owner.get(used, index)) for used in core[name].uses]
        return found

    reached = reach(declared)
    for name, index in reached:
        assert name in whole and unit_text(parts[index][name]) == unit_text(whole[name]), \
            f"{name} differs between part {part_names[index]} of the core object and the {spec} build"
    # The plans are the generic build's (tests/test_work_splits.py checks that both builds plan alike):
    # the common part defines them, the window declares them.
    plans = re.findall(r"^CG_PLAN [^(]*?\b(\w+)\(", split.cores[0], re.M)
    assert sorted(plans) == ["make_plan", "rows_make_plan"] and set(plans) <= set(defined[0])
    assert sorted(re.findall(r"^CG_PLAN [^(]*?\b(\w+)\(", split.source, re.M)) == sorted(plans)
    assert not any(name in window and "{" in window[name].text for name in plans)
    # A file-scope variable has a copy in each unit: none may be used in two of them (the workspace
    # kept between calls lives with the functions that take and give it back), whether the window's
    # kernels or its plans reach it.
    reached |= reach(plans)
    units = [{name: item for name, item in window.items() if "{" in item.text}]
    units += [{name: item for name, item in part.items() if "{" in item.text and (name, index) in reached}
              for index, part in enumerate(parts)]
    variables = {name for name, index in reached
                 if re.match(r"static (?!const\b)[^(]*?[=;]", parts[index][name].text.strip())}
    for variable in variables:
        users = [i for i, unit in enumerate(units) if any(variable in item.uses for item in unit.values())]
        assert len(users) <= 1, f"{variable} is used in {len(users)} units (0: the window, then the core's parts)"


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_every_window_and_op_of_a_dtype_and_layout_links_the_parts_it_calls(schedule, layout):
    """The modules of one op and of every op, of any window, link parts of one core: the common part
    and, for the forward pass and the input gradient, the pixel rows' kernels, for the weight
    gradient its own, each declaring only the core functions its kernels call."""
    whole = render(ConvSpec(Window(3, 1, 1), "float32", layout), schedule, split=True)
    assert [core_part(core_defined(source)[0]) for source in whole.cores[1:]] == ["rows", "dw"]
    expected = {"fwd": ["common", "rows"], "bwd_data": ["common", "rows"], "bwd_weight": ["common", "dw"]}
    for text in ("k3s1p1", "k5s2p2"):
        for op in ("fwd", "bwd_data", "bwd_weight"):
            rendered = render(ConvSpec(Window.parse(text), "float32", layout), schedule, ops=(op,), split=True)
            parts = ["common"] + [core_part(core_defined(source)[0]) for source in rendered.cores[1:]]
            assert parts == expected[op]
            assert all(source in whole.cores for source in rendered.cores)
            declared = set(core_declared(rendered.source))
            assert declared <= {name for source in rendered.cores for name in core_defined(source)}
            assert all(core_part(name) in parts for name in declared)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_each_core_part_references_only_its_own_and_the_common_parts_functions(schedule, layout, tmp_path):
    """A module links the common part and only the other parts its ops call (a Winograd forward
    module the common part alone), so no part may reference a function another non-common part
    defines: compiled without optimization (CONVGEN_CFLAGS=-O0, as the sanitizer builds are), which
    emits every static function and file-scope table, each part's undefined symbols name none of them."""
    import shutil
    import subprocess

    compiler = settings().toolchain.compiler
    cores = render(ConvSpec(Window(3, 1, 1), "float32", layout), schedule, split=True).cores
    defined = [set(core_defined(source)) for source in cores]
    assert len(cores) == 3 and all(defined)
    for index, source in enumerate(cores):
        c_path, o_path = tmp_path / f"part{index}.c", tmp_path / f"part{index}.o"
        c_path.write_text(compilable_part(source))
        subprocess.run([compiler, "-O0", "-fopenmp", "-fPIC", *schedule.arch_flags, "-c", str(c_path), "-o",
                        str(o_path)], check=True, capture_output=True)
        undefined = set(subprocess.run([shutil.which("nm") or "nm", "-u", str(o_path)], check=True,
                                       capture_output=True, text=True).stdout.split())
        others = set().union(*(names for other, names in enumerate(defined) if other not in (0, index)))
        assert not undefined & others, f"core part {index} references {sorted(undefined & others)} of another part"


def test_direct_modules_and_specialized_winograd_modules_split(schedule):
    """Depthwise modules stay one unit; so does every module rendered without split=True (what
    `convgen show`, `generate` and `export` write). The generic direct module links the parts of the
    core its dtype's and layout's specialized windows link; a Winograd module the parts of the core a
    direct module of its micro-tile's schedule links: the common part, and the weight gradient's (it
    calls no pixel rows)."""
    winograd = ConvSpec(Window(3, 1, 1), family="winograd", tile=4)
    for layout in ("NCHW", "NHWC"):
        cores = render(ConvSpec(Window(3, 1, 1), layout=layout), schedule, split=True).cores
        assert cores and render(ConvSpec(None, layout=layout), schedule, split=True).cores == cores
    direct = render(ConvSpec(Window(5, 2, 2)), schedule.for_family("winograd"), split=True).cores
    assert len(direct) == 3
    for ops, parts in ((("fwd",), direct[:1]), (("bwd_weight",), direct[::2]), (None, direct[::2])):
        assert render(winograd, schedule, ops=ops, split=True).cores == parts
    one_unit = [render(spec, schedule, split=True) for spec in (
        ConvSpec(Window(3, 1, 1), family="depthwise"), ConvSpec(None, family="depthwise"))]
    one_unit += [render(spec, schedule) for spec in (ConvSpec(Window(3, 1, 1)), ConvSpec(None), winograd)]
    for rendered in one_unit:
        assert rendered.cores == ()
        assert "#define CG_CORE static" in rendered.source


def test_a_window_declaring_a_core_function_no_part_defines_is_refused():
    """A module whose window declares a core function that no part of its core defines would fail to
    load: `core_parts` refuses it, naming the function. Each part keeps its own functions whole."""
    from convgen.codegen.render import core_parts
    core = ("CG_CORE void ukernel(int n)\n{\n    (void)n;\n}\n"
            "CG_CORE void dw_dot_unit(int n)\n{\n    (void)n;\n}\n")
    spec = ConvSpec(Window(3, 1, 1))
    with pytest.raises(ValueError, match="would not define rows_box_sum_1"):
        core_parts(core, ["ukernel", "rows_box_sum_1"], spec)
    common, dw = core_parts(core, ["ukernel", "dw_dot_unit"], spec)
    assert core_defined(common) == ["ukernel"] and core_defined(dw) == ["dw_dot_unit"]
    assert core_parts(core, ["ukernel"], spec) == (common,)
    assert [core_part(name) for name in ("ukernel", "make_plan", "rows_igemm_2", "rows_box_sum_1", "dw_dot_sums")] \
        == ["common", "common", "rows", "dw", "dw"]


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
    assert render(ConvSpec(Window(3, 1, 1)), schedule, templates=edited).cores == ()  # one unit: no split needed
