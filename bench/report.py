"""The benchmark's output: markdown tables (with the targets of the Winograd issue checked against them,
and the rows Winograd does not touch compared with an earlier run; the suite in NHWC and the layers
outside the suite in sections of their own, with issue 11's targets for them; the depthwise rows in
GB/s with issue 11's depthwise targets) and a bar chart of the NCHW suite.

A result row (bench/run.py's run_case) is a dict: op, layer (name, k, s, is_3x3_s1, shape_text),
gflop, algorithm (what the specialized implementation computed with), seconds and gflops per
implementation, errors and error_limits per implementation, python_bytes and workspace_bytes per
convgen implementation, output_bytes, other_load; and layout on every row but the suite's NCHW ones
(which keep the names earlier runs gave them).
"""

from __future__ import annotations

import math
import re

MIB = 1 << 20
NAMES = {"specialized": "convgen specialized", "direct": "convgen specialized, forced direct",
         "generic": "convgen generic", "numpy": "NumPy im2col+matmul", "pytorch": "PyTorch"}
SHORT = {"specialized": "specialized", "direct": "spec. direct", "generic": "generic", "numpy": "NumPy",
         "pytorch": "PyTorch"}
OP_TITLES = {"forward": "Forward (conv2d)", "backward": "Backward (dx + dw + db)",
             "transposed": "Transposed forward (conv_transpose2d)",
             "transposed_backward": "Transposed backward (dx + dw + db)",
             "conv1d": "1-D forward (conv1d)", "conv1d_backward": "1-D backward (dx + dw + db)",
             "conv3d": "3-D forward (conv3d)", "conv3d_backward": "3-D backward (dx + dw + db)"}
PLANAR_OPS = ("forward", "backward", "transposed", "transposed_backward")  # the Winograd issue's targets
ND_OPS = ("conv1d", "conv1d_backward", "conv3d", "conv3d_backward")          # issue 12's
IMPLS = ("specialized", "direct", "generic", "numpy", "pytorch")
CONVGEN_IMPLS = ("specialized", "direct", "generic")
MEMORY_LIMIT = 32 * MIB
ERROR_LIMIT = 1e-3  # direct float32 against NumPy's float32: anything above is a wrong result, not rounding
# "Nothing slower elsewhere": a row Winograd does not touch counts as slower when its spec/PyTorch ratio
# fell below this share of the earlier run's (shared machines drift by a few % between runs).
SLOWER_TOLERANCE = 0.9


def geomean(values) -> float:
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def stands_in(row, impl) -> str:
    """The implementation whose time counts as `impl`'s on this row: "direct" was timed only where the
    specialized kernel is another algorithm; elsewhere the specialized kernel is the direct one."""
    if impl == "direct" and "direct" not in row["seconds"] and row["algorithm"] == "direct":
        return "specialized"
    return impl


def ratio(row, a, b):
    """How many times faster implementation a ran than b on this row (None if either is missing)."""
    a, b = stands_in(row, a), stands_in(row, b)
    if a in row["seconds"] and b in row["seconds"]:
        return row["seconds"][b] / row["seconds"][a]
    return None


def timed_ratio(row, a, b):
    """ratio(), but None unless both were timed on this row (a table cell, not a mean)."""
    return ratio(row, a, b) if a in row["seconds"] and b in row["seconds"] else None


def extra_bytes(row, impl) -> int:
    """Peak extra memory of one convgen call: the C workspace plus Python-side allocations (output excluded)."""
    return row["workspace_bytes"][impl] + row["python_bytes"][impl]


def error_limit(row, impl) -> float:
    return row.get("error_limits", {}).get(impl, ERROR_LIMIT)


def row_name(row) -> str:
    """"op layer", and the layout of a depthwise row."""
    return f"{row['op']} {row['layer'].name}" + (f" {row['layout']}" if "layout" in row else "")


def wrong_results(results) -> list[str]:
    """"op layer implementation" of every result outside its error bound against NumPy."""
    return [f"{row_name(r)} {impl} ({e:.1e} > {error_limit(r, impl):g})"
            for r in results for impl, e in r["errors"].items() if not e <= error_limit(r, impl)]


def _fmt(value, digits=1, suffix=""):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}{suffix}"


def _other_load(results) -> str:
    shares = [r["other_load"] for r in results if r.get("other_load") is not None]
    if not shares:
        return "an unknown share"
    return f"{100 * sum(shares) / len(shares):.0f}% on average (up to {100 * max(shares):.0f}% in one row)"


def _ops_in(results):
    order = list(OP_TITLES)
    return sorted({r["op"] for r in results}, key=order.index)


def _impls_in(rows, among=IMPLS):
    return [i for i in among if any(i in r["seconds"] for r in rows)]


# -------------------------------------------------------------------------------------- tables
def op_table(rows, peak_all, short=SHORT, shape=False, layout=False) -> list[str]:
    """One op's rows in GFLOP/s and ratios. `short` names the implementations in the column titles;
    `shape` adds the layer's shape, `layout` the row's layout and a geometric mean per layout."""
    impls = _impls_in(rows)
    ratios = [("direct", "spec/direct")] if "direct" in impls else []
    ratios += [("generic", "spec/generic"), ("numpy", "spec/NumPy")] + ([("pytorch", f"spec/{short['pytorch']}")]
                                                                         if "pytorch" in impls else [])
    layouts = list(dict.fromkeys(r.get("layout", "NCHW") for r in rows)) if layout else []
    head = (["layer"] + (["layout"] if layouts else []) + (["shape"] if shape else []) + ["algorithm", "GFLOP"]
            + [f"{short[i]} eff. GFLOP/s (% peak)" for i in impls]
            + [title for _, title in ratios] + ["workspace MiB", "extra MiB"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = ([r["layer"].name] + ([r.get("layout", "NCHW")] if layouts else [])
                 + ([r["layer"].shape_text] if shape else []) + [r["algorithm"], _fmt(r["gflop"], 2)])
        for i in impls:
            g = r["gflops"].get(i)
            if g is not None:
                cells.append(f"{g:.1f} ({100 * g / peak_all:.0f}%)")
            else:
                cells.append("= specialized" if stands_in(r, i) == "specialized" else "–")
        cells += [_fmt(timed_ratio(r, "specialized", other), 2, "×") for other, _ in ratios]
        cells += [_fmt(r["workspace_bytes"]["specialized"] / MIB, 2), _fmt(extra_bytes(r, "specialized") / MIB, 2)]
        lines.append("| " + " | ".join(cells) + " |")
    parts = [(f"**geometric mean, {name}**", [r for r in rows if r.get("layout", "NCHW") == name])
             for name in layouts] if len(layouts) > 1 else [("**geometric mean**", rows)]
    for title, part in parts:
        if len(part) < 2:
            continue
        cells = [title] + [""] * (len(head) - 3 - len(impls) - len(ratios))
        for i in impls:
            g = geomean(r["gflops"].get(stands_in(r, i)) for r in part)
            cells.append(f"{g:.1f} ({100 * g / peak_all:.0f}%)")
        cells += [_fmt(geomean(ratio(r, "specialized", other) for r in part), 2, "×") for other, _ in ratios]
        cells += ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def memory_table(results) -> list[str]:
    impls = [i for i in CONVGEN_IMPLS if any(i in r["workspace_bytes"] for r in results)]
    head = ["op", "layer", "algorithm"]
    for i in impls:
        head += [f"{SHORT[i]} workspace MiB", f"{SHORT[i]} Python MiB", f"{SHORT[i]} extra MiB"]
    head += ["output MiB", "NumPy MiB (incl. its output)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["op"], row_name(r).split(" ", 1)[1], r["algorithm"]]
        for i in impls:
            if i in r["workspace_bytes"]:
                cells += [_fmt(r["workspace_bytes"][i] / MIB, 2), _fmt(r["python_bytes"][i] / MIB, 3),
                          _fmt(extra_bytes(r, i) / MIB, 2)]
            else:
                cells += ["–", "–", "–"]
        cells += [_fmt(r["output_bytes"] / MIB, 2), _fmt(r["python_bytes"].get("numpy", math.nan) / MIB, 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def detail_table(results) -> list[str]:
    impls = _impls_in(results)
    head = ["op", "layer", "shape", "algorithm"] + [f"{SHORT[i]} ms" for i in impls] + \
           [f"{SHORT[i]} error" for i in impls if i != "numpy"] + ["specialized bound", "other processes' CPU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["op"], row_name(r).split(" ", 1)[1], r["layer"].shape_text, r["algorithm"]]
        cells += [_fmt(r["seconds"][i] * 1e3, 3) if i in r["seconds"] else "–" for i in impls]
        for i in impls:
            if i != "numpy":
                e = r["errors"].get(i)
                cells.append("–" if e is None else (f"{e:.1e}" if e <= error_limit(r, i) else f"**{e:.1e} WRONG**"))
        cells.append(f"{error_limit(r, 'specialized'):g}")
        cells.append(_fmt(None if r.get("other_load") is None else 100 * r["other_load"], 0, "%"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------------- an earlier run
def read_previous(path) -> dict | None:
    """What an earlier bench.md says: its date, CPU and each row's spec/PyTorch ratio by (op, layer).

    Reads the tables under the op headings by their column titles, so a bench.md from before Winograd
    (no algorithm column) reads as well. None if the file holds no such table.
    """
    text = path.read_text(encoding="utf-8")
    by_title = {title: op for op, title in OP_TITLES.items()}
    op, header, ratios = None, None, {}
    for line in text.splitlines():
        if line.startswith("#"):
            op, header = by_title.get(line.lstrip("#").strip()), None
            continue
        if op is None or not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set(line.strip()) <= set("|-: ") or "spec/PyTorch" not in header or cells[0].startswith("**"):
            continue
        try:
            ratios[(op, cells[0])] = float(cells[header.index("spec/PyTorch")].rstrip("×x"))
        except (ValueError, IndexError):
            continue
    if not ratios:
        return None
    date = re.search(r"^Measured (.+?) by `", text, re.M)
    cpu = re.search(r"^- CPU: (.+?), \d+ cores", text, re.M)
    return {"path": str(path), "date": date.group(1) if date else "an unknown date",
            "cpu": cpu.group(1) if cpu else "an unknown CPU", "ratios": ratios}


# ------------------------------------------------------------------------------------- targets
def targets(results, fma, info, previous=None) -> list[str]:
    """The targets of the Winograd issue, each met or not met by this run's numbers (or not measured)."""
    peak_all, threads = fma["gflops_all"], fma["threads"]
    by_op = {op: [r for r in results if r["op"] == op] for op in OP_TITLES}
    fwd = by_op["forward"]
    fwd3 = [r for r in fwd if r["layer"].is_3x3_s1]
    have_torch = any("pytorch" in r["seconds"] for r in results)
    lines = []

    def line(text, met, value):
        verdict = "not measured" if met is None else ("**met**" if met else "**not met**")
        lines.append(f"- {text}: {verdict}{'' if value is None else ' — ' + value}")

    def each(rows, other):
        return ", ".join(f"{r['layer'].name} {ratio(r, 'specialized', other):.2f}×" for r in rows)

    def geomean_target(text, rows, other, goal):
        if not rows or (other == "pytorch" and not have_torch):
            return line(text, None, None)
        g = geomean(ratio(r, "specialized", other) for r in rows)
        line(text, g >= goal, f"{g:.2f}× ({each(rows, other)})")

    def one_row_target(text, rows, other, goal, note=""):
        if not rows or (other == "pytorch" and not have_torch):
            return line(text, None, None)
        v = ratio(rows[0], "specialized", other)
        line(text, v >= goal, f"{v:.2f}× ({rows[0]['algorithm']}){note}")

    geomean_target("forward float32 NCHW, 3×3 stride-1 layers: specialized ≥ 1.6× PyTorch on the geometric mean",
                   fwd3, "pytorch", 1.6)
    text = "forward float32 NCHW, every 3×3 stride-1 layer: specialized ≥ 1.2× PyTorch"
    if fwd3 and have_torch:
        per = {r["layer"].name: ratio(r, "specialized", "pytorch") for r in fwd3}
        below = [f"{name} {v:.2f}×" for name, v in per.items() if v < 1.2]
        lowest = min(per, key=per.get)
        line(text, not below,
             f"lowest {per[lowest]:.2f}× ({lowest})" + (f"; below: {', '.join(below)}" if below else ""))
    else:
        line(text, None, None)
    resnet = [r for r in fwd if r["layer"].name == "resnet3x3"]
    text = f"forward, resnet3x3: effective GFLOP/s ≥ 1.5× the measured FMA peak ({threads} threads)"
    if resnet:
        g = resnet[0]["gflops"]["specialized"]
        line(text, g >= 1.5 * peak_all, f"{g / peak_all:.2f}× ({g:.1f} effective GFLOP/s, peak {peak_all:.1f}; "
                                        f"{resnet[0]['algorithm']})")
    else:
        line(text, None, None)
    geomean_target("forward, 3×3 stride-1 layers: specialized ≥ 1.6× generic on the geometric mean",
                   fwd3, "generic", 1.6)
    text = "forward, whole suite: specialized ≥ 1.25× generic on the geometric mean"
    if fwd:
        g = geomean(ratio(r, "specialized", "generic") for r in fwd)
        rest = geomean(ratio(r, "specialized", "generic") for r in fwd if not r["layer"].is_3x3_s1)
        line(text, g >= 1.25, f"{g:.2f}× (the other layers alone: {_fmt(rest, 2, '×')})")
    else:
        line(text, None, None)
    one_row_target("backward (dx+dw+db), resnet3x3: specialized ≥ 1.2× PyTorch",
                   [r for r in by_op["backward"] if r["layer"].name == "resnet3x3"], "pytorch", 1.2)
    tr3 = [r for r in by_op["transposed"] if r["layer"].is_3x3_s1]
    trb3 = [r for r in by_op["transposed_backward"] if r["layer"].is_3x3_s1]
    note = ""
    if tr3 and trb3 and have_torch and trb3[0]["layer"].name == tr3[0]["layer"].name:
        note = f"; its backward {ratio(trb3[0], 'specialized', 'pytorch'):.2f}×, not a target"
    one_row_target(f"conv_transpose2d, 3×3 stride-1 window{' (' + tr3[0]['layer'].name + ')' if tr3 else ''}: "
                   "specialized ≥ 1.5× PyTorch", tr3, "pytorch", 1.5, note)
    lines.extend(_nothing_slower(results, have_torch, previous, info.get("cpu")))
    planar = [r for r in results if r["op"] in PLANAR_OPS]  # the 1-D and 3-D rows have their own targets
    present = [i for i in CONVGEN_IMPLS if any(i in r["workspace_bytes"] for r in planar)]
    largest = {i: max((r for r in planar if i in r["workspace_bytes"]), key=lambda r: extra_bytes(r, i))
               for i in present}
    text = "peak extra memory per call ≤ 32 MiB on every layer (C workspace + Python-side, output excluded)"
    if largest:
        line(text, all(extra_bytes(r, i) <= MEMORY_LIMIT for i, r in largest.items()),
             "largest " + ", ".join(f"{extra_bytes(r, i) / MIB:.2f} MiB {SHORT[i]} ({r['op']} {r['layer'].name})"
                                    for i, r in largest.items()))
    else:
        line(text, None, None)

    # Not targets: what the algorithm buys over direct code for the same window, and the run's caveats.
    chosen = [r for r in fwd if "direct" in r["seconds"]]
    if chosen:
        lines.append(f"- for reference, what the algorithm buys over specialized direct code for the same window "
                     f"(forward): {geomean(ratio(r, 'specialized', 'direct') for r in chosen):.2f}× on the geometric "
                     f"mean ({each(chosen, 'direct')})")
    if info.get("algorithm") == "direct":
        lines.append("- this run forced every specialized kernel to direct code (--algorithm direct)")
    wrong = wrong_results(results)
    if wrong:
        lines.append(f"- results that disagree with NumPy beyond their bound: {', '.join(wrong)}")
    shares = [r["other_load"] for r in results if r.get("other_load") is not None]
    if shares and max(shares) > 0.1:
        lines.append(f"- other processes took up to {100 * max(shares):.0f}% of the CPU during some rows "
                     "(see the last column below): those rows are slower and noisier than this machine's best")
    if info.get("partial"):
        lines.append("- this run covered part of the suite only (--layers/--ops): the means are over what ran")
    return lines


def nd_targets(results) -> list[str]:
    """Issue 12's targets: conv1d and conv3d, forward and backward, at least as fast as PyTorch on
    each 1-D and 3-D row; with the extra memory each call takes (the 3-D fold copies its input)."""
    have_torch = any("pytorch" in r["seconds"] for r in results)
    lines = []
    for op in ND_OPS:
        rows = [r for r in results if r["op"] == op]
        text = f"{OP_TITLES[op]}: specialized ≥ 1.0× PyTorch on every row"
        if not rows or not have_torch:
            lines.append(f"- {text}: not measured")
            continue
        per = [(r, ratio(r, "specialized", "pytorch")) for r in rows]
        verdict = "**met**" if all(v >= 1.0 for _, v in per) else "**not met**"
        lines.append(f"- {text}: {verdict} — " + ", ".join(
            f"{r['layer'].name} {v:.2f}× ({r['algorithm']}; extra memory {extra_bytes(r, 'specialized') / MIB:.0f} MiB)"
            for r, v in per))
    return lines


def _nothing_slower(results, have_torch, previous, cpu=None) -> list[str]:
    """The rows without a 3×3 stride-1 window (Winograd does not touch them): spec/PyTorch now and in
    an earlier run, and whether any fell by more than the tolerance. Ratios from another CPU are
    shown but not judged: how convgen and PyTorch compare depends on the machine."""
    text = (f"nothing slower elsewhere: rows without a 3×3 stride-1 window keep their spec/PyTorch ratio "
            f"(at least {SLOWER_TOLERANCE:.0%} of the earlier run's)")
    others = [r for r in results if not r["layer"].is_3x3_s1]
    if not others or not have_torch:
        return [f"- {text}: not measured"]
    old = previous["ratios"] if previous else {}
    parts, slower, compared = [], [], 0
    for r in others:
        now, before = ratio(r, "specialized", "pytorch"), old.get((r["op"], r["layer"].name))
        parts.append(f"{r['op']} {r['layer'].name} {now:.2f}×" + ("" if before is None else f" (was {before:.2f}×)"))
        if before is not None:
            compared += 1
            if now < SLOWER_TOLERANCE * before:
                slower.append(f"{r['op']} {r['layer'].name}")
    if not compared:
        verdict = "not measured against an earlier run"
        source = "" if previous else " (no earlier bench.md to compare with: see --previous)"
    elif cpu is not None and previous["cpu"] != cpu:
        verdict = "not judged: the earlier run was on another CPU"
        source = (f" (earlier run: {previous['date']} on {previous['cpu']}, {previous['path']}"
                  + ("" if not slower else f"; below {SLOWER_TOLERANCE:.0%} of it: {', '.join(slower)}") + ")")
    else:
        verdict = "**not met**" if slower else "**met**"
        source = (f" (earlier run: {previous['date']} on {previous['cpu']}, {previous['path']}"
                  + ("" if not slower else f"; slower: {', '.join(slower)}") + ")")
    return [f"- {text}: {verdict} — {', '.join(parts)}{source}"]


# --------------------------------------------------------------------- NHWC and layers outside the suite
# Issue 11's targets for the dense rows: NHWC against PyTorch's channels_last on every forward and
# backward row of the suite and on the geometric mean; every layer, in and outside the suite, and the
# transposed layers at least near PyTorch.
NHWC_FLOOR, NHWC_GOAL, EVERY_LAYER_FLOOR = 1.0, 1.1, 0.9
CHANNELS_LAST = dict(SHORT, pytorch="PyTorch channels_last")


def nhwc_section(rows, peak_all) -> list[str]:
    """The suite's 2-D layers in NHWC, one table per op, against PyTorch's channels_last."""
    out = ["## NHWC (the suite in channels-last layout)", "",
           "The suite's 2-D layers with `layout=\"NHWC\"`: x (N, H, W, C), weights (KH, KW, C, F) (transposed: "
           "(KH, KW, C_out, C_in)), results (N, Ho, Wo, F); PyTorch gets the same values as channels_last tensors "
           "(its weights too). NumPy computes in NCHW (the same baseline as the NCHW tables; its result is "
           "compared through a transposed view). Columns as in the NCHW tables.", ""]
    for op in _ops_in(rows):
        out += [f"### {OP_TITLES[op]}, NHWC", ""]
        out += op_table([r for r in rows if r["op"] == op], peak_all, CHANNELS_LAST) + [""]
    return out


def extra_section(rows, peak_all) -> list[str]:
    """The layers outside the suite, one table per op, each layer in every layout that ran."""
    out = ["## Layers outside the suite", "",
           "Shapes the suite's targets should also hold on (issue 11: odd sizes, 5×5, narrow filters, batch 1 "
           "and 64), in each layout: NCHW against PyTorch's contiguous tensors, NHWC against its channels_last "
           "ones (the PyTorch and spec/PyTorch columns), as in the sections above.", ""]
    for op in _ops_in(rows):
        out += [f"### {OP_TITLES[op]}, outside the suite", ""]
        out += op_table([r for r in rows if r["op"] == op], peak_all, shape=True, layout=True) + [""]
    return out


def issue11_targets(results, nhwc=(), extra=()) -> list[str]:
    """Issue 11's targets for the dense layers, each met or not by this run's rows (or not measured):
    NHWC forward and backward against PyTorch's channels_last on the suite; forward and backward on
    every layer of the suite (NCHW) and outside it (both layouts); the transposed layers (both layouts)."""
    lines = []
    planar = [r for r in results if r["op"] in PLANAR_OPS]

    def judged(text, rows, label, floor, goal=None):
        """One target line: every row ≥ floor (and, with a goal, the geometric mean ≥ goal)."""
        per = [(label(r), timed_ratio(r, "specialized", "pytorch")) for r in rows]
        per = [(name, v) for name, v in per if v is not None]
        if not per:
            lines.append(f"- {text}: not measured")
            return
        below = [f"{name} {v:.2f}×" for name, v in per if v < floor]
        if goal is not None:  # the geometric mean, then every row
            g = geomean(v for _, v in per)
            met = not below and g >= goal
            value = f"{g:.2f}× (" + ", ".join(f"{name} {v:.2f}×" for name, v in per) + ")"
        else:
            met = not below
            lowest = min(per, key=lambda nv: nv[1])
            value = f"lowest {lowest[1]:.2f}× ({lowest[0]})"
        value += f"; below {floor:.1f}×: {', '.join(below)}" if below else ""
        lines.append(f"- {text}: {'**met**' if met else '**not met**'} — {value}")

    def layer(r):
        return r["layer"].name

    def layer_layout(r):
        return layer(r) + (f" {r['layout']}" if "layout" in r else "")

    def op_layer_layout(r):
        return f"{r['op']} {layer_layout(r)}"

    names = {"forward": "forward", "backward": "backward (dx + dw + db)"}
    for op in ("forward", "backward"):
        judged(f"NHWC {names[op]}: specialized ≥ {NHWC_FLOOR:.1f}× PyTorch channels_last on every layer of the "
               f"suite, ≥ {NHWC_GOAL:.1f}× on the geometric mean", [r for r in nhwc if r["op"] == op], layer,
               NHWC_FLOOR, NHWC_GOAL)
    for op in ("forward", "backward"):
        judged(f"{names[op]}: specialized ≥ {EVERY_LAYER_FLOOR:.1f}× PyTorch on every layer of the suite (NCHW) and "
               "outside it (NCHW, and NHWC against channels_last)",
               [r for r in planar + list(extra) if r["op"] == op], layer_layout, EVERY_LAYER_FLOOR)
    judged(f"transposed (conv_transpose2d and its backward, NCHW and NHWC): specialized ≥ {EVERY_LAYER_FLOOR:.1f}× "
           "PyTorch on every layer", [r for r in planar + list(nhwc) if r["op"].startswith("transposed")],
           op_layer_layout, EVERY_LAYER_FLOOR)
    return lines


# ------------------------------------------------------------------------------------- depthwise
# Issue 11's targets for the depthwise rows: forward against PyTorch on the geometric mean of each
# layout and on every row, backward on the geometric mean.
DEPTHWISE_FORWARD_GOAL, DEPTHWISE_FORWARD_FLOOR, DEPTHWISE_BACKWARD_GOAL = 1.5, 1.0, 1.2


def depthwise_table(rows, bandwidth_all) -> list[str]:
    """One op's depthwise rows: GB/s of each implementation (and % of the measured bandwidth for the
    specialized kernel), milliseconds, and how many times faster the specialized kernel ran."""
    impls = _impls_in(rows)
    others = [(i, f"spec/{SHORT[i]}") for i in ("pytorch", "direct", "generic", "numpy") if i in impls]
    head = (["layer", "layout", "shape", "algorithm", "MB"] + [f"{SHORT[i]} GB/s" for i in impls]
            + ["specialized ms"] + ([f"PyTorch ms"] if "pytorch" in impls else []) + [t for _, t in others])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["layer"].name, r["layout"], r["layer"].shape_text, r["algorithm"], _fmt(r["bytes"] / 1e6, 1)]
        for i in impls:
            g = r["gbs"].get(i)
            cells.append("–" if g is None else f"{g:.1f}" + (f" ({100 * g / bandwidth_all:.0f}%)"
                                                           if i == "specialized" and bandwidth_all else ""))
        cells.append(_fmt(r["seconds"]["specialized"] * 1e3, 3))
        if "pytorch" in impls:
            cells.append(_fmt(r["seconds"]["pytorch"] * 1e3, 3) if "pytorch" in r["seconds"] else "–")
        cells += [_fmt(timed_ratio(r, "specialized", i), 2, "×") for i, _ in others]
        lines.append("| " + " | ".join(cells) + " |")
    for layout in sorted({r["layout"] for r in rows}):
        part = [r for r in rows if r["layout"] == layout]
        cells = [f"**geometric mean, {layout}**", "", "", "", ""]
        cells += [_fmt(geomean(r["gbs"].get(i) for r in part), 1) for i in impls] + [""] * (1 + ("pytorch" in impls))
        cells += [_fmt(geomean(timed_ratio(r, "specialized", i) for r in part), 2, "×") for i, _ in others]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def depthwise_targets(rows) -> list[str]:
    """Issue 11's depthwise targets, each met or not by this run's rows (or not measured)."""
    lines = []
    forward = [r for r in rows if r["op"] == "forward"]
    backward = [r for r in rows if r["op"] == "backward"]

    def ratios(part):
        return {f"{r['layer'].name} {r['layout']}": timed_ratio(r, "specialized", "pytorch") for r in part}

    def verdict(met):
        return "not measured" if met is None else ("**met**" if met else "**not met**")

    for layout in ("NCHW", "NHWC"):
        found = {name: v for name, v in ratios([r for r in forward if r["layout"] == layout]).items() if v}
        text = (f"depthwise forward, {layout}: specialized ≥ {DEPTHWISE_FORWARD_GOAL}× PyTorch on the geometric "
                f"mean and ≥ {DEPTHWISE_FORWARD_FLOOR}× on every layer")
        if not found:
            lines.append(f"- {text}: not measured")
            continue
        g, below = geomean(found.values()), [f"{n} {v:.2f}×" for n, v in found.items() if v < DEPTHWISE_FORWARD_FLOOR]
        met = g >= DEPTHWISE_FORWARD_GOAL and not below
        lines.append(f"- {text}: {verdict(met)} — {g:.2f}× ("
                     + ", ".join(f"{n} {v:.2f}×" for n, v in found.items()) + ")"
                     + (f"; below {DEPTHWISE_FORWARD_FLOOR}×: {', '.join(below)}" if below else ""))
    found = {name: v for name, v in ratios(backward).items() if v}
    text = f"depthwise backward (dx + dw + db): specialized ≥ {DEPTHWISE_BACKWARD_GOAL}× PyTorch on the geometric mean"
    if found:
        g = geomean(found.values())
        lines.append(f"- {text}: {verdict(g >= DEPTHWISE_BACKWARD_GOAL)} — {g:.2f}× ("
                     + ", ".join(f"{n} {v:.2f}×" for n, v in found.items()) + ")")
    else:
        lines.append(f"- {text}: not measured")
    return lines


def depthwise_section(rows, bandwidth) -> list[str]:
    bw_all = bandwidth["gbs_all"] if bandwidth else None
    out = ["## Depthwise (groups == channels)", "",
           "MobileNet/EfficientNet-like depthwise layers, each in both layouts (NHWC against PyTorch's "
           "channels_last). A depthwise layer does a few multiply-adds per value it reads or writes, so its "
           "limit is memory, not the FMA units: GB/s count every array the op reads or writes once (forward: "
           "x, weights, y; backward: dy, x, weights, dx, dw, db), against the machine's memory bandwidth"
           + (f", measured by bench/stream.c (b = s·a over 128 MiB arrays, best of {bandwidth['samples']} "
              f"passes): **{bandwidth['gbs_1']:.1f} GB/s on 1 thread, {bw_all:.1f} GB/s on "
              f"{bandwidth['threads']} threads**; % is of the latter" if bandwidth else "")
           + ". A layer whose arrays fit in the caches can run faster than that bandwidth. NumPy: one "
           "multiply-add of a strided view per tap (convgen.tools.baselines), the check every result is compared "
           "with first.", ""]
    for op in _ops_in(rows):
        out += [f"### {OP_TITLES[op]}, depthwise", ""] + depthwise_table([r for r in rows if r["op"] == op], bw_all)
        out += [""]
    out += ["### Targets (issue 11, depthwise)", ""] + depthwise_targets(rows) + [""]
    return out


# -------------------------------------------------------------------------------------- markdown
def markdown(results, fma, info, chart=None, previous=None, depthwise=(), bandwidth=None, nhwc=(),
             extra=()) -> str:
    """The whole bench.md: `results` are the suite's NCHW rows and the 1-D and 3-D rows, `nhwc` the
    suite's 2-D layers in NHWC, `extra` the layers outside the suite, `depthwise` the depthwise rows."""
    peak_all = fma["gflops_all"]
    nhwc, extra = list(nhwc), list(extra)
    every_row = list(results) + nhwc + extra + list(depthwise)
    out = ["# convgen benchmark", ""]
    rounds = info.get("rounds", 1)
    passes = (f"; every row timed in each of {rounds} passes over all the rows, minutes apart, and each "
              f"implementation's median over the passes kept") if rounds > 1 else ""
    out += [f"Measured {info['date']} by `{info['command']}` ({info['repeat']} timed samples per "
            f"implementation, medians, implementations alternated{passes}; {info['elapsed']:.0f} s in all)"
            + (", **part of the suite only**" if info["partial"] else "") + ".", ""]
    out += ["## Machine", "",
            f"- CPU: {info['cpu']}, {info['cores']} cores; every implementation runs {info['threads']} threads",
            f"- float32 FMA peak ({fma['isa']} loop, bench/fma_peak.c): **{fma['gflops_1']:.1f} GFLOP/s on 1 thread, "
            f"{peak_all:.1f} GFLOP/s on {fma['threads']} threads** (best of {fma['samples']} samples taken before, "
            f"between and after the rows); every \"% peak\" below is of the {fma['threads']}-thread figure",
            f"- other processes used {_other_load(every_row)} of the CPU time while the rows were timed "
            f"(load average {_fmt(info['load'], 2)} before, {_fmt(info.get('load_end'), 2)} after): "
            "anything above a few % slows all implementations and makes the numbers noisier; "
            f"the bench waited {info.get('waited', 0):.0f} s in all for quiet moments"
            + (f" and measured {len(info['remeasured'])} disturbed rows a second time, keeping the quieter measurement"
               if info.get("remeasured") else ""),
            f"- Python {info['python']}, NumPy {info['numpy']}, PyTorch {info['torch']}",
            f"- NumPy's BLAS: {info['blas']}"
            + (f"; for its own process the bench did: {info['blas_env']} (see bench/run.py)" if info["blas_env"] else ""),
            f"- convgen at commit {info['revision']}; compiler: {info['compiler']}; "
            f"schedule: `{info['schedule']}`", ""]
    out += ["GFLOP/s are **effective**: the direct convolution's FLOP count divided by the time, whatever "
            "algorithm ran. Forward counts 2·N·F·(C/g)·KH·KW·Ho·Wo; backward counts dx and dw, 2× the forward "
            "(db is not counted); a transposed convolution counts as the conv2d whose input gradient it is "
            "(2·N·C_in·C_out·KH·KW·H·W), its backward twice that; conv1d and conv3d count their own taps "
            "(2·N·F·(C/g)·K·Lo, 2·N·F·(C/g)·KD·KH·KW·Do·Ho·Wo). Winograd F(m×m, 3×3) does fewer multiplies "
            "than that count (F(4×4, 3×3): 36 per 4×4 output tile and input channel instead of 144, a quarter; "
            "its transforms are additions and constant multiplies), so its effective rate can exceed 100 % of "
            "the FMA peak: past 100 %, the algorithm saved work the hardware did not have to do.", "",
            "algorithm: what the specialized implementation computed with, as `convgen.planning.planner.plan` chooses "
            "for the window (`algorithm=\"auto\"`); Winograd computes a convolution and an input gradient, a "
            "weight gradient is always direct. spec. direct: the same specialized build forced to "
            "`algorithm=\"direct\"`, timed on rows where the planner chose another algorithm (\"= specialized\" "
            "where the specialized kernel is direct already; the geometric means count it so). "
            "generic: the generic build, always direct. Ratios are time ratios (> 1: specialized is faster). "
            "convgen writes into preallocated outputs (out=); NumPy and PyTorch allocate theirs. "
            "PyTorch gradients: `torch.ops.aten.convolution_backward` (what autograd calls), dx, dw and db in one call. "
            "workspace MiB: the C workspace convgen's specialized kernel reports (largest kernel call of the op); "
            "extra MiB: that plus the Python-side peak (tracemalloc), the output arrays excluded.", ""]
    for op in _ops_in(results):
        out += [f"## {OP_TITLES[op]}", ""] + op_table([r for r in results if r["op"] == op], peak_all) + [""]
    if results:
        out += ["## Targets (Winograd issue)", ""] + targets(results, fma, info, previous) + [""]
    if any(r["op"] in ND_OPS for r in results):
        out += ["## Targets (1-D and 3-D, issue 12)", "",
                "conv1d runs on the 2-D kernels with a unit height axis (no copies); conv3d folds its depth taps "
                "into the channels, which copies its input KD/sd times over (and, in NCDHW, transposes its output "
                "or dy once): that is most of the 3-D rows' extra memory.", ""] + nd_targets(results) + [""]
    if nhwc:
        out += nhwc_section(nhwc, peak_all)
    if extra:
        out += extra_section(extra, peak_all)
    if any(r["op"] in PLANAR_OPS for r in results) or nhwc or extra:
        out += ["## Targets (issue 11, NHWC and every layer)", ""] + issue11_targets(results, nhwc, extra) + [""]
    if depthwise:
        out += depthwise_section(list(depthwise), bandwidth)
    out += ["## Memory per call", ""] + memory_table(every_row) + [""]
    out += ["## Times per call and agreement with NumPy", "",
            "error: max |result − NumPy| / max |NumPy| over all outputs (float32 both), checked before timing "
            "(the 1-D and 3-D rows, which have no NumPy baseline, against PyTorch's result instead). "
            f"Direct code must agree within {ERROR_LIMIT:g}; a Winograd kernel within its own bound "
            "(`convgen.planning.winograd.ERROR_BOUND`, the bound the planner chooses tiles by), the specialized bound column. "
            "other processes' CPU: the share of the machine's CPU time used by other processes while the row "
            "was timed.",
            ""] + detail_table(every_row) + [""]
    if chart:
        out += [f"![effective GFLOP/s per layer]({chart})", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------------------- chart
def chart(results, fma, path) -> None:
    """Grouped bars (one group per layer, one bar per implementation timed on it, its effective GFLOP/s
    on top), one panel per op; each layer's label names the specialized algorithm unless it is direct."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ops = _ops_in(results)
    ncols = min(2, len(ops))
    nrows = -(-len(ops) // ncols)
    most = max(sum(r["op"] == op for r in results) for op in ops)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(7.5, 1.0 + 0.85 * most) * ncols, 4.6 * nrows),
                             sharey=True, squeeze=False)
    colors = {"specialized": "#1f77b4", "direct": "#9467bd", "generic": "#aec7e8", "numpy": "#ff7f0e",
              "pytorch": "#2ca02c"}
    impls = _impls_in(results)
    bar = 0.8 / len(impls)
    top = max([fma["gflops_all"]] + [g for r in results for g in r["gflops"].values()])
    for ax, op in zip(axes.flat, ops):
        rows = [r for r in results if r["op"] == op]
        for j, r in enumerate(rows):
            present = [i for i in impls if i in r["gflops"]]
            for k, impl in enumerate(present):
                x, height = j + (k - (len(present) - 1) / 2) * bar, r["gflops"][impl]
                ax.bar(x, height, bar, color=colors[impl])
                ax.text(x, height + top * 0.01, f"{height:.0f}", ha="center", va="bottom", fontsize=6, rotation=90)
        ax.axhline(fma["gflops_all"], color="grey", linestyle="--", linewidth=1)
        ax.text(-0.45, fma["gflops_all"], f"FMA peak {fma['gflops_all']:.0f}", va="bottom", fontsize=7, color="grey")
        ax.set_xticks(range(len(rows)))
        labels = [r["layer"].name + ("" if r["algorithm"] == "direct" else "\n" + r["algorithm"].split(",")[0])
                  for r in rows]
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        ax.set_xlim(-0.5, max(len(rows), 3) - 0.5)  # a one-layer panel keeps the bar width of the others
        ax.set_ylim(0, top * 1.15)
        ax.set_title(OP_TITLES[op], fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("effective GFLOP/s (float32, all threads)")
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    # Above the panels, where no bar can hide behind it.
    fig.legend([Patch(color=colors[i]) for i in impls], [NAMES[i] for i in impls], fontsize=8, ncol=len(impls),
               loc="upper center", frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)
