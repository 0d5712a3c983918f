"""The benchmark's output: markdown tables (with the targets of issue 4 checked against them) and a bar chart."""

from __future__ import annotations

import math

MIB = 1 << 20
NAMES = {"specialized": "convgen specialized", "generic": "convgen generic", "numpy": "NumPy im2col+matmul",
         "pytorch": "PyTorch"}
SHORT = {"specialized": "specialized", "generic": "generic", "numpy": "NumPy", "pytorch": "PyTorch"}
OP_TITLES = {"forward": "Forward (conv2d)", "backward": "Backward (dx + dw + db)",
             "transposed": "Transposed forward (conv_transpose2d)",
             "transposed_backward": "Transposed backward (dx + dw + db)"}
IMPLS = ("specialized", "generic", "numpy", "pytorch")
MEMORY_LIMIT = 32 * MIB
ERROR_LIMIT = 1e-3  # float32 against NumPy's float32: anything above is a wrong result, not rounding


def geomean(values) -> float:
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def ratio(row, a, b):
    """How many times faster implementation a ran than b on this row (None if either is missing)."""
    if a in row["seconds"] and b in row["seconds"]:
        return row["seconds"][b] / row["seconds"][a]
    return None


def extra_bytes(row, impl) -> int:
    """Peak extra memory of one convgen call: the C workspace plus Python-side allocations (output excluded)."""
    return row["workspace_bytes"][impl] + row["python_bytes"][impl]


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


# -------------------------------------------------------------------------------------- tables
def op_table(rows, peak_all) -> list[str]:
    impls = [i for i in IMPLS if any(i in r["gflops"] for r in rows)]
    head = (["layer", "GFLOP"] + [f"{SHORT[i]} GFLOP/s (% peak)" for i in impls]
            + ["spec/generic", "spec/NumPy"] + (["spec/PyTorch"] if "pytorch" in impls else [])
            + ["workspace MiB", "extra MiB"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["layer"].name, _fmt(r["gflop"], 2)]
        for i in impls:
            g = r["gflops"].get(i)
            cells.append(f"{g:.1f} ({100 * g / peak_all:.0f}%)" if g is not None else "–")
        cells += [_fmt(ratio(r, "specialized", "generic"), 2, "×"), _fmt(ratio(r, "specialized", "numpy"), 2, "×")]
        if "pytorch" in impls:
            cells.append(_fmt(ratio(r, "specialized", "pytorch"), 2, "×"))
        cells += [_fmt(r["workspace_bytes"]["specialized"] / MIB, 2), _fmt(extra_bytes(r, "specialized") / MIB, 2)]
        lines.append("| " + " | ".join(cells) + " |")
    if len(rows) > 1:
        cells = ["**geometric mean**", ""]
        for i in impls:
            g = geomean(r["gflops"].get(i) for r in rows)
            cells.append(f"{g:.1f} ({100 * g / peak_all:.0f}%)")
        cells += [_fmt(geomean(ratio(r, "specialized", "generic") for r in rows), 2, "×"),
                  _fmt(geomean(ratio(r, "specialized", "numpy") for r in rows), 2, "×")]
        if "pytorch" in impls:
            cells.append(_fmt(geomean(ratio(r, "specialized", "pytorch") for r in rows), 2, "×"))
        cells += ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def memory_table(results) -> list[str]:
    head = ["op", "layer", "spec workspace MiB", "spec Python MiB", "spec extra MiB", "generic workspace MiB",
            "generic Python MiB", "generic extra MiB", "output MiB", "NumPy MiB (incl. its output)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        lines.append("| " + " | ".join([
            r["op"], r["layer"].name,
            _fmt(r["workspace_bytes"]["specialized"] / MIB, 2), _fmt(r["python_bytes"]["specialized"] / MIB, 3),
            _fmt(extra_bytes(r, "specialized") / MIB, 2),
            _fmt(r["workspace_bytes"]["generic"] / MIB, 2), _fmt(r["python_bytes"]["generic"] / MIB, 3),
            _fmt(extra_bytes(r, "generic") / MIB, 2),
            _fmt(r["output_bytes"] / MIB, 2), _fmt(r["python_bytes"]["numpy"] / MIB, 1)]) + " |")
    return lines


def detail_table(results) -> list[str]:
    impls = [i for i in IMPLS if any(i in r["seconds"] for r in results)]
    head = ["op", "layer", "shape"] + [f"{SHORT[i]} ms" for i in impls] + \
           [f"{SHORT[i]} error" for i in impls if i != "numpy"] + ["other processes' CPU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["op"], r["layer"].name, r["layer"].shape_text]
        cells += [_fmt(r["seconds"][i] * 1e3, 3) if i in r["seconds"] else "–" for i in impls]
        for i in impls:
            if i != "numpy":
                e = r["errors"].get(i)
                cells.append("–" if e is None else (f"{e:.1e}" if e <= ERROR_LIMIT else f"**{e:.1e} WRONG**"))
        cells.append(_fmt(None if r.get("other_load") is None else 100 * r["other_load"], 0, "%"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------------------- targets
def targets(results, peak_all, partial) -> list[str]:
    """The targets of issue 4, each met or not met by this run's numbers (or not measured)."""
    by_op = {op: [r for r in results if r["op"] == op] for op in OP_TITLES}
    fwd, bwd, tr = by_op["forward"], by_op["backward"], by_op["transposed"] + by_op["transposed_backward"]
    have_torch = any("pytorch" in r["seconds"] for r in results)
    lines = []

    def line(text, met, value):
        verdict = "not measured" if met is None else ("**met**" if met else "**not met**")
        lines.append(f"- {text}: {verdict}{'' if value is None else ' — ' + value}")

    def torch_geomean(rows):
        return geomean(ratio(r, "specialized", "pytorch") for r in rows) if rows and have_torch else None

    g = torch_geomean(fwd)
    line("forward, specialized ≥ PyTorch on the geometric mean", None if g is None else g >= 1.0,
         None if g is None else f"{g:.2f}×")
    if fwd and have_torch:
        per = {r["layer"].name: ratio(r, "specialized", "pytorch") for r in fwd}
        below = [f"{name} {v:.2f}×" for name, v in per.items() if v < 0.8]
        line("forward, specialized ≥ 0.8× PyTorch on every layer", not below,
             f"lowest {min(per.values()):.2f}× ({min(per, key=per.get)})" + (f"; below: {', '.join(below)}" if below else ""))
    else:
        line("forward, specialized ≥ 0.8× PyTorch on every layer", None, None)
    resnet = [r for r in fwd if r["layer"].name == "resnet3x3"]
    if resnet:
        share = resnet[0]["gflops"]["specialized"] / peak_all
        line("forward, specialized ≥ 70% of peak on resnet3x3", share >= 0.7,
             f"{100 * share:.0f}% ({resnet[0]['gflops']['specialized']:.1f} of {peak_all:.1f} GFLOP/s)")
    else:
        line("forward, specialized ≥ 70% of peak on resnet3x3", None, None)
    g = geomean(ratio(r, "specialized", "numpy") for r in fwd) if fwd else None
    line("forward, specialized ≥ 3× NumPy on the geometric mean", None if g is None else g >= 3.0,
         None if g is None else f"{g:.2f}×")
    g = geomean(ratio(r, "specialized", "generic") for r in fwd) if fwd else None
    every = geomean(ratio(r, "specialized", "generic") for r in results)
    line("specialized ≥ 1.2× generic on the geometric mean (forward)", None if g is None else g >= 1.2,
         None if g is None else f"{g:.2f}× (over every measured row: {every:.2f}×)")
    g = torch_geomean(bwd)
    line("backward (dx+dw+db), specialized ≥ 0.8× PyTorch on the geometric mean", None if g is None else g >= 0.8,
         None if g is None else f"{g:.2f}×")
    g = torch_geomean(tr)
    parts = ", ".join(f"{r['op']} {ratio(r, 'specialized', 'pytorch'):.2f}×" for r in tr) if g is not None else ""
    line("transposed (forward and backward), specialized ≥ 0.8× PyTorch on the geometric mean",
         None if g is None else g >= 0.8, None if g is None else f"{g:.2f}× ({parts})")
    worst = max(results, key=lambda r: extra_bytes(r, "specialized"))
    worst_generic = max(results, key=lambda r: extra_bytes(r, "generic"))
    line("peak extra memory per call ≤ 32 MiB on every layer (C workspace + Python-side, output excluded)",
         extra_bytes(worst, "specialized") <= MEMORY_LIMIT,
         f"largest {extra_bytes(worst, 'specialized') / MIB:.2f} MiB specialized ({worst['op']} "
         f"{worst['layer'].name}), {extra_bytes(worst_generic, 'generic') / MIB:.2f} MiB generic "
         f"({worst_generic['op']} {worst_generic['layer'].name})")
    wrong = [f"{r['op']} {r['layer'].name} {i}" for r in results for i, e in r["errors"].items() if e > ERROR_LIMIT]
    if wrong:
        lines.append(f"- results that disagree with NumPy (relative error > {ERROR_LIMIT:g}): {', '.join(wrong)}")
    shares = [r["other_load"] for r in results if r.get("other_load") is not None]
    if shares and max(shares) > 0.1:
        lines.append(f"- other processes took up to {100 * max(shares):.0f}% of the CPU during some rows "
                     "(see the last column below): those rows are slower and noisier than this machine's best")
    if partial:
        lines.append("- this run covered part of the suite only (--layers/--ops): the means are over what ran")
    return lines


def markdown(results, fma, info, chart=None) -> str:
    peak_all = fma["gflops_all"]
    out = ["# convgen benchmark", ""]
    out += [f"Measured {info['date']} by `{info['command']}` ({info['repeat']} timed samples per "
            f"implementation, medians, implementations alternated; {info['elapsed']:.0f} s in all)"
            + (", **part of the suite only**" if info["partial"] else "") + ".", ""]
    out += ["## Machine", "",
            f"- CPU: {info['cpu']}, {info['cores']} cores; every implementation runs {info['threads']} threads",
            f"- float32 FMA peak ({fma['isa']} loop, bench/fma_peak.c): **{fma['gflops_1']:.1f} GFLOP/s on 1 thread, "
            f"{peak_all:.1f} GFLOP/s on {fma['threads']} threads** (best of {fma['samples']} samples taken before, "
            f"between and after the rows); every \"% peak\" below is of the {fma['threads']}-thread figure",
            f"- other processes used {_other_load(results)} of the CPU time while the rows were timed "
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
    out += ["GFLOP/s: forward counts 2·N·F·(C/g)·KH·KW·Ho·Wo; backward counts dx and dw, 2× the forward "
            "(db is not counted); a transposed convolution counts as the conv2d whose input gradient it is "
            "(2·N·C_in·C_out·KH·KW·H·W), its backward twice that. Ratios are time ratios (> 1: specialized is faster). "
            "convgen writes into preallocated outputs (out=); NumPy and PyTorch allocate theirs. "
            "PyTorch gradients: `torch.ops.aten.convolution_backward` (what autograd calls), dx, dw and db in one call. "
            "workspace MiB: the C workspace convgen's kernel reports (largest kernel call of the op); "
            "extra MiB: that plus the Python-side peak (tracemalloc), the output arrays excluded.", ""]
    for op in _ops_in(results):
        out += [f"## {OP_TITLES[op]}", ""] + op_table([r for r in results if r["op"] == op], peak_all) + [""]
    out += ["## Targets (issue 4)", ""] + targets(results, peak_all, info["partial"]) + [""]
    out += ["## Memory per call", ""] + memory_table(results) + [""]
    out += ["## Times per call and agreement with NumPy", "",
            "error: max |result − NumPy| / max |NumPy| over all outputs (float32 both). "
            "other processes' CPU: the share of the machine's CPU time used by other processes while the row was timed.", ""] + detail_table(results) + [""]
    if chart:
        out += [f"![GFLOP/s per layer]({chart})", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------------------- chart
def chart(results, fma, path) -> None:
    """Grouped bars (one group per layer, one bar per implementation, its GFLOP/s on top), one panel per op."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = _ops_in(results)
    ncols = min(2, len(ops))
    nrows = -(-len(ops) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.5 * ncols, 4.2 * nrows), sharey=True, squeeze=False)
    colors = {"specialized": "#1f77b4", "generic": "#aec7e8", "numpy": "#ff7f0e", "pytorch": "#2ca02c"}
    impls = [i for i in IMPLS if any(i in r["gflops"] for r in results)]
    bar = 0.8 / len(impls)
    top = max([fma["gflops_all"]] + [g for r in results for g in r["gflops"].values()])
    for ax, op in zip(axes.flat, ops):
        rows = [r for r in results if r["op"] == op]
        for k, impl in enumerate(impls):
            xs = [j + (k - (len(impls) - 1) / 2) * bar for j in range(len(rows))]
            heights = [r["gflops"].get(impl, 0.0) for r in rows]
            ax.bar(xs, heights, bar, label=NAMES[impl], color=colors[impl])
            for x, height in zip(xs, heights):
                ax.text(x, height + top * 0.01, f"{height:.0f}", ha="center", va="bottom", fontsize=6, rotation=90)
        ax.axhline(fma["gflops_all"], color="grey", linestyle="--", linewidth=1)
        ax.text(-0.45, fma["gflops_all"], f"FMA peak {fma['gflops_all']:.0f}", va="bottom", fontsize=7, color="grey")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["layer"].name for r in rows], rotation=20, ha="right")
        ax.set_xlim(-0.5, max(len(rows), 3) - 0.5)  # a one-layer panel keeps the bar width of the others
        ax.set_ylim(0, top * 1.15)
        ax.set_title(OP_TITLES[op], fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("GFLOP/s (float32, all threads)")
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
