"""bench/: the rows it builds, the tables and targets it writes, the earlier run it reads and its chart
(and its depthwise rows, in GB/s; the suite in NHWC and the layers outside the suite).

No timing is asserted here (benchmarks are scripts, not tests): the report is fed made-up rows, and
one tiny row is run once to check that every implementation's result is compared with NumPy's.
"""

import importlib.util
import os
import sys
import subprocess
from pathlib import Path

import pytest

from convgen.planning import winograd

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def run():
    """bench/run.py as a module. It sets OpenBLAS variables for its own process when imported: this
    one gets its environment back."""
    environ = dict(os.environ)
    sys.path.insert(0, str(BENCH))  # for its own `import peak, report`
    try:
        # Under its own name: tests/sanitize/run.py may already be imported as "run".
        spec = importlib.util.spec_from_file_location("bench_run", BENCH / "run.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_run"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
        os.environ.clear()
        os.environ.update(environ)
    return module


@pytest.fixture(scope="module")
def report(run):
    return run.report


FMA = {"isa": "avx2", "threads": 2, "gflops_1": 40.0, "gflops_all": 80.0, "samples": 3}


def _row(run, op, layer, algorithm, ms, errors=None, limits=None, layout=None):
    """A made-up result row: `ms` is {implementation: milliseconds}; `layout` for a row outside the
    suite's NCHW tables."""
    layer = next(l for l in run.SUITE + run.EXTRA_SUITE if l.name == layer)
    flops = layer.problem().flops * (2 if op.endswith("backward") else 1)
    seconds = {i: t / 1e3 for i, t in ms.items()}
    convgen_impls = [i for i in run.CONVGEN_IMPLS if i in seconds]
    errors = errors or {i: 1e-6 for i in seconds}
    return {"op": op, "layer": layer, "gflop": flops / 1e9, "algorithm": algorithm, "seconds": seconds,
            "gflops": {i: flops / s / 1e9 for i, s in seconds.items()}, "errors": errors,
            "error_limits": limits or {i: 1e-3 for i in seconds},
            "python_bytes": {i: 2048 for i in (*convgen_impls, "numpy")},
            "workspace_bytes": {i: 1 << 20 for i in convgen_impls}, "output_bytes": 1 << 20, "other_load": 0.0,
            **({} if layout is None else {"layout": layout})}


def _info(**changes):
    info = {"date": "today", "command": "bench/run.py", "repeat": 3, "elapsed": 1.0, "partial": False,
            "cpu": "Test CPU", "cores": 2, "threads": 2, "load": 0.1, "load_end": 0.1, "python": "3",
            "numpy": "2", "torch": "2", "blas": "blas", "blas_env": "", "compiler": "cc", "revision": "abc",
            "schedule": "Schedule()", "algorithm": "auto"}
    info.update(changes)
    return info


def _results(run):
    wino, wino_bwd = "winograd F(4x4)", "winograd F(4x4) dx, direct dw"
    wino_limits = {"specialized": 1e-4, "direct": 1e-3, "generic": 1e-3, "pytorch": 1e-3}
    fwd = lambda layer, spec, direct, generic, torch: _row(  # noqa: E731
        run, "forward", layer, wino, dict(specialized=spec, direct=direct, generic=generic, numpy=50.0,
                                          pytorch=torch), limits=wino_limits)
    return [
        fwd("resnet3x3", 1.0, 2.0, 2.2, 2.0),
        _row(run, "backward", "resnet3x3", wino_bwd,
             dict(specialized=3.0, direct=4.0, generic=5.0, numpy=90.0, pytorch=4.0)),
        _row(run, "forward", "resnet3x3s2", "direct", dict(specialized=1.0, generic=1.1, numpy=3.0, pytorch=1.0)),
        fwd("batch1_3x3", 0.1, 0.2, 0.22, 0.3),
        _row(run, "transposed", "deconv3x3", wino,
             dict(specialized=1.0, direct=1.5, generic=1.6, numpy=9.0, pytorch=1.2)),
    ]


def test_suite_has_the_3x3_stride_1_layers(run):
    names = {l.name for l in run.SUITE if l.is_3x3_s1 and not l.transposed}
    assert {"resnet3x3", "batch1_3x3", "wide3x3", "narrow3x3", "odd3x3", "bigbatch3x3"} <= names
    assert any(l.is_3x3_s1 and l.transposed for l in run.SUITE)
    odd = next(l for l in run.SUITE if l.name == "odd3x3")
    assert all(odd.problem().ho % m for m in winograd.TILES if m > 1)  # no multiple of any tile


def test_specs_follow_wisdom(run, tmp_path, monkeypatch):
    """After `make tune`, the specialized implementation is what this machine's wisdom chose, and its
    row says so: here a schedule variant of the direct kernels on ResNet's stride-2 layer, backward."""
    from convgen.runtime import kernels, wisdom
    monkeypatch.setenv("CONVGEN_WISDOM", str(tmp_path / "wisdom.json"))
    wisdom.forget_loaded()
    layer = next(l for l in run.SUITE if l.name == "resnet3x3s2")
    problem = layer.problem("NHWC")
    try:
        assert run.specialized_plan(problem, "auto", "backward").overrides == ()
        wisdom.record({wisdom.problem_class("conv2d_backward", problem): {"algorithm": "direct",
                                                                           "variant": "phase planes"}},
                      kernels.settings())
        plan = run.specialized_plan(problem, "auto", "backward")
        assert plan.overrides == run.planner.VARIANTS["phase planes"]
        assert run.specialized_plan(problem, "auto", "forward").overrides == ()  # another op's class
        assert run.specialized_plan(problem, "direct", "backward").overrides == ()  # forced: no wisdom
        specs = run.specs_of(problem, "auto", "backward")
        loaded = run.kernels_of(specs, plan)
        assert loaded["specialized"].settings.schedule().pixel_rows_min_work == 10**9
        assert loaded["generic"].settings.schedule().pixel_rows_min_work != 10**9
        assert run.row_algorithm("backward", specs["specialized"], plan.variant) == "direct, phase planes"
    finally:
        wisdom.forget_loaded()


def test_specs_follow_the_planner(run):
    """A 3×3 stride-1 layer with enough channels times Winograd and the direct kernel of the same
    window; other windows and --algorithm direct time the direct kernel only."""
    resnet = next(l for l in run.SUITE if l.name == "resnet3x3").problem()
    specs = run.specs_of(resnet, "auto")
    assert specs["specialized"].family == "winograd" and specs["direct"].family == "direct"
    assert specs["direct"].window == specs["specialized"].window and specs["generic"].window is None
    tile = specs["specialized"].tile
    assert run.algorithm_text(specs["specialized"]) == f"winograd F({tile}x{tile})"
    assert run.row_algorithm("backward", specs["specialized"]).endswith("dx, direct dw")
    assert set(run.specs_of(resnet, "direct")) == {"specialized", "generic"}
    stem = next(l for l in run.SUITE if l.name == "stem7x7s2").problem()
    assert set(run.specs_of(stem, "auto")) == {"specialized", "generic"}


def test_a_row_checks_every_result_against_numpy(run):
    """One tiny row (3×3 stride 2: direct code), run once: every implementation agrees with NumPy."""
    layer = run.Layer("tiny", 2, 3, 9, 9, 4, 3, 2, 1)
    case = run.make_case("backward", layer, None)
    assert set(case.funcs) == {"specialized", "generic", "numpy"} and case.algorithm == "direct"
    row = run.run_case(case, repeat=1, min_time=0.0)
    assert all(e <= 1e-5 for e in row["errors"].values()), row["errors"]
    assert not run.report.wrong_results([row])


def test_nd_rows_are_checked_against_torch(run):
    """A tiny 3-D backward row and a 1-D forward row, run once: every implementation agrees with PyTorch,
    the row says which algorithm ran, and the FLOPs are the 3-D convolution's."""
    torch = pytest.importorskip("torch")
    video = run.NdLayer("tiny3d", 3, 1, 8, (3, 6, 6), 8, 3, 1, 1)
    assert video.problem().flops == 2 * 1 * 8 * 8 * 27 * 3 * 6 * 6
    for op, layer in (("conv3d_backward", video), ("conv1d", run.NdLayer("tiny1d", 1, 2, 3, (20,), 4, 9, 1, 4))):
        case = run.make_case(op, layer, torch)
        assert case.reference == "pytorch" and "numpy" not in case.funcs
        row = run.run_case(case, repeat=1, min_time=0.0)
        assert all(e <= case.error_limits[i] for i, e in row["errors"].items()), row["errors"]
    assert run.ops_of(video) == ("conv3d", "conv3d_backward")
    assert {"audio_k9", "video3x3x3"} <= {layer.name for layer in run.SUITE}


def test_nd_targets(run, report):
    audio = next(l for l in run.SUITE if l.name == "audio_k9")
    row = _row(run, "conv1d", "audio_k9", "direct", dict(specialized=1.0, generic=1.1, pytorch=2.0))
    del row["python_bytes"]["numpy"]
    slow = _row(run, "conv1d_backward", "audio_k9", "direct", dict(specialized=2.0, generic=2.1, pytorch=1.0))
    lines = report.nd_targets([row, slow])
    assert lines[0].startswith("- 1-D forward (conv1d): specialized ≥ 1.0× PyTorch on every row: **met** — audio_k9 2.00×")
    assert "**not met** — audio_k9 0.50×" in lines[1] and lines[2].endswith("not measured")
    text = report.markdown([row, slow], FMA, _info())
    assert "## 1-D forward (conv1d)" in text and "## Targets (1-D and 3-D, issue 12)" in text
    assert audio.problem().flops == 2 * 8 * 64 * 64 * 9 * 16000


def test_tables_and_targets(run, report):
    results = _results(run)
    text = report.markdown(results, FMA, _info())
    assert "## Targets (Winograd issue)" in text and "effective" in text and "exceed 100 %" in text
    forward = text.split("## Forward (conv2d)")[1].split("##")[0]
    assert "spec. direct eff. GFLOP/s" in forward and "spec/direct" in forward and "spec/generic" in forward
    resnet_s2 = next(line for line in forward.splitlines() if line.startswith("| resnet3x3s2 "))
    assert "= specialized" in resnet_s2  # its specialized kernel is the direct one
    lines = report.targets(results, FMA, _info())

    def find(start):
        return next(line for line in lines if line.startswith("- " + start))

    # resnet3x3 2.0×, batch1 3.0× PyTorch: geomean 2.45×, lowest 2.0×.
    assert "**met** — 2.45×" in find("forward float32 NCHW, 3×3 stride-1 layers")
    assert "**met** — lowest 2.00× (resnet3x3)" in find("forward float32 NCHW, every 3×3")
    # resnet3x3: 1.85 GFLOP in 1 ms is 1850 effective GFLOP/s, 23× the 80 GFLOP/s peak.
    assert "**met**" in find("forward, resnet3x3: effective GFLOP/s")
    assert "**met** — 1.33× (winograd F(4x4) dx, direct dw)" in find("backward (dx+dw+db), resnet3x3")
    assert "**not met** — 1.20×" in find("conv_transpose2d, 3×3 stride-1 window")
    # spec/generic: 2.2 and 2.2 on the 3×3 rows, 1.1 on resnet3x3s2.
    assert "**met** — 2.20×" in find("forward, 3×3 stride-1 layers: specialized ≥ 1.6× generic")
    assert "**met**" in find("forward, whole suite")
    assert "not measured against an earlier run" in find("nothing slower elsewhere")
    assert "**met**" in find("peak extra memory")
    assert any("what the algorithm buys" in line and "2.00×" in line for line in lines)


def test_winograd_rows_are_held_to_their_own_bound(run, report):
    """Winograd's bound (1e-4 in float32) is tighter than the direct 1e-3: 5e-4 is wrong for it only."""
    errors = {"specialized": 5e-4, "direct": 5e-4, "generic": 1e-6, "numpy": 0.0, "pytorch": 1e-6}
    limits = {"specialized": winograd.ERROR_BOUND["float32"], "direct": 1e-3, "generic": 1e-3, "numpy": 1e-3,
              "pytorch": 1e-3}
    row = _row(run, "forward", "odd3x3", "winograd F(4x4)",
               dict(specialized=1.0, direct=2.0, generic=2.0, numpy=9.0, pytorch=2.0), errors, limits)
    assert [w.split(" (")[0] for w in report.wrong_results([row])] == ["forward odd3x3 specialized"]
    assert "**5.0e-04 WRONG**" in "\n".join(report.detail_table([row]))
    row["errors"]["specialized"] = float("nan")
    assert report.wrong_results([row])


def test_earlier_run_is_read_back_and_compared(run, report, tmp_path):
    results = _results(run)
    earlier = tmp_path / "bench.md"
    earlier.write_text(report.markdown(results, FMA, _info()))
    previous = report.read_previous(earlier)
    assert previous["cpu"] == "Test CPU" and previous["date"] == "today"
    assert previous["ratios"][("forward", "resnet3x3s2")] == pytest.approx(1.0)
    assert previous["ratios"][("transposed", "deconv3x3")] == pytest.approx(1.2)

    slower = [dict(r) for r in results]
    s2 = next(r for r in slower if r["layer"].name == "resnet3x3s2")
    s2["seconds"] = dict(s2["seconds"], specialized=1.25e-3)  # 0.8× PyTorch, was 1.0×
    line = next(l for l in report.targets(slower, FMA, _info(), previous) if "nothing slower" in l)
    assert "**not met**" in line and "forward resnet3x3s2 0.80× (was 1.00×)" in line
    line = next(l for l in report.targets(results, FMA, _info(), previous) if "nothing slower" in l)
    assert "**met**" in line
    line = next(l for l in report.targets(slower, FMA, _info(cpu="Other CPU"), previous) if "nothing slower" in l)
    assert "not judged" in line and "(was 1.00×)" in line


def test_a_bench_md_from_before_winograd_reads(report, tmp_path):
    """The tables of the previous issue had no algorithm column: spec/PyTorch is found by its title."""
    old = tmp_path / "bench.md"
    old.write_text("Measured 2026-11-29 23:39 UTC by `bench/run.py` (9 ...).\n\n- CPU: Intel Xeon, 2 cores; x\n\n"
                   "## Forward (conv2d)\n\n| layer | GFLOP | specialized GFLOP/s (% peak) | spec/PyTorch | extra MiB |\n"
                   "|---|---|---|---|---|\n| stem7x7s2 | 1.89 | 283.1 (60%) | 1.01× | 1.27 |\n"
                   "| **geometric mean** |  | 241.2 (51%) | 1.12× |  |\n\n## Targets (issue 4)\n\n- x\n")
    previous = report.read_previous(old)
    assert previous["ratios"] == {("forward", "stem7x7s2"): 1.01} and previous["cpu"] == "Intel Xeon"


def test_chart_draws_every_implementation(run, report, tmp_path):
    path = tmp_path / "bench.png"
    report.chart(_results(run), FMA, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------ depthwise rows
def _depthwise_row(run, op, name, layout, ms):
    """A made-up depthwise row: `ms` is {implementation: milliseconds}."""
    layer = next(l for l in run.DEPTHWISE_SUITE if l.name == name)
    seconds = {i: t / 1e3 for i, t in ms.items()}
    nbytes = layer.bytes(op, layout)
    return {"op": op, "layer": layer, "layout": layout, "bytes": nbytes, "algorithm": "depthwise",
            "seconds": seconds, "gbs": {i: nbytes / s / 1e9 for i, s in seconds.items()},
            "gflops": {i: 1.0 for i in seconds}, "errors": {i: 1e-6 for i in seconds},
            "error_limits": {i: 1e-3 for i in seconds}, "python_bytes": {i: 2048 for i in (*seconds, "numpy")},
            "workspace_bytes": {"specialized": 1 << 20}, "output_bytes": 1 << 20, "other_load": 0.0}


def test_depthwise_suite_and_bytes(run):
    """Both windows and strides, batch 1 and 8; bytes count every array once (8×144×56×56 float32: 14.45 MB)."""
    suite = {(l.k, l.s) for l in run.DEPTHWISE_SUITE}
    assert {(3, 1), (3, 2), (5, 1), (5, 2)} <= suite and {l.n for l in run.DEPTHWISE_SUITE} >= {1, 8}
    layer = next(l for l in run.DEPTHWISE_SUITE if l.name == "dw3x3s1")
    image, weights = 8 * 144 * 56 * 56 * 4, 144 * 9 * 4
    assert layer.bytes("forward") == 2 * image + weights == layer.bytes("forward", "NHWC")
    assert layer.bytes("backward") == 3 * image + 2 * weights + 144 * 4
    problem = layer.problem("NHWC")
    assert problem.groups == problem.c == 144 and problem.input_shape == (8, 56, 56, 144)
    assert run.specs_of(problem, "auto")["specialized"].family == "depthwise"


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("op", ["forward", "backward"])
def test_a_depthwise_row_checks_every_result_against_numpy(run, op, layout):
    """A tiny depthwise layer, run once: every implementation (PyTorch in its layout too) agrees with NumPy."""
    from convgen.tools.baselines import torch_module
    layer = run.DepthwiseLayer("tiny", 2, 8, 9, 11, 3, 2)
    case = run.make_depthwise_case(op, layer, layout, torch_module())
    assert {"specialized", "direct", "generic", "numpy"} <= set(case.funcs) and case.algorithm == "depthwise"
    row = run.run_case(case, repeat=1, min_time=0.0)
    assert all(e <= 1e-5 for e in row["errors"].values()), row["errors"]
    assert not run.report.wrong_results([row])


def test_depthwise_tables_and_targets(run, report):
    rows = [_depthwise_row(run, "forward", "dw3x3s1", "NCHW", dict(specialized=1.0, generic=2.0, pytorch=2.0)),
            _depthwise_row(run, "forward", "dw3x3b1", "NCHW", dict(specialized=1.0, generic=2.0, pytorch=0.9)),
            _depthwise_row(run, "forward", "dw3x3s1", "NHWC", dict(specialized=1.0, generic=2.0, pytorch=2.0)),
            _depthwise_row(run, "forward", "dw5x5s2", "NHWC", dict(specialized=1.0, generic=2.0, pytorch=1.5)),
            _depthwise_row(run, "backward", "dw3x3s1", "NCHW", dict(specialized=1.0, generic=2.0, pytorch=1.1)),
            _depthwise_row(run, "backward", "dw3x3s1", "NHWC", dict(specialized=1.0, generic=2.0, pytorch=1.4))]
    bandwidth = {"threads": 2, "gbs_1": 10.0, "gbs_all": 20.0, "samples": 3}
    text = report.markdown([], FMA, _info(), depthwise=rows, bandwidth=bandwidth)
    assert "## Depthwise (groups == channels)" in text and "20.0 GB/s on 2 threads" in text
    assert "## Targets (Winograd issue)" not in text  # no dense rows ran
    table = text.split("### Forward (conv2d), depthwise")[1].split("###")[0]
    # 28.9 MB in 1 ms is 28.9 GB/s, 145 % of the 20 GB/s bandwidth (the arrays can sit in the caches).
    assert "| dw3x3s1 | NCHW | 8×144×56×56, k3s1p1 | depthwise | 28.9 | 28.9 (145%) |" in table
    assert "**geometric mean, NHWC**" in table and "1.73×" in table  # sqrt(2.0 · 1.5)
    targets = report.depthwise_targets(rows)
    # NCHW: geometric mean sqrt(2 · 0.9) = 1.34×, and dw3x3b1 below 1.0×; NHWC: 1.73×, none below.
    assert targets[0].startswith("- depthwise forward, NCHW") and "**not met** — 1.34×" in targets[0]
    assert "below 1.0×: dw3x3b1 NCHW 0.90×" in targets[0]
    assert "**met** — 1.73×" in targets[1]
    assert "**met** — 1.24× (dw3x3s1 NCHW 1.10×, dw3x3s1 NHWC 1.40×)" in targets[2]
    assert report.depthwise_targets(rows[:2])[1].endswith(": not measured")


# ------------------------------------------------------------------ NHWC rows and layers outside the suite
def test_extra_layers_and_row_groups(run):
    """The layers outside the suite are the shapes issue 11 names; --layouts chooses the 2-D rows' layouts."""
    extra = run.EXTRA_SUITE
    assert any(l.k == 5 and l.h % 2 for l in extra)               # 5×5 on an odd image
    assert any(l.f <= 8 < l.c for l in extra)                     # narrow filters
    assert {1, 64} <= {l.n for l in extra}                        # batch 1 and 64
    assert any(l.s == 2 and l.h % 2 for l in extra)               # stride 2 over an odd size
    names = [l.name for l in run.SUITE + extra + run.DEPTHWISE_SUITE]
    assert len(names) == len(set(names))  # --layers picks a layer by name

    planar = [l for l in run.SUITE if not isinstance(l, run.NdLayer)]
    everything = run.row_groups(names, list(run.OPS), ["NCHW", "NHWC"])
    assert len(everything["nhwc"]) == 2 * len(planar) and {r[2] for r in everything["nhwc"]} == {"NHWC"}
    assert len(everything["extra"]) == 2 * 2 * len(extra)  # forward and backward, both layouts
    assert {op for op, _, _ in everything["nhwc"]} == {"forward", "backward", "transposed", "transposed_backward"}
    only_nhwc = run.row_groups(names, ["forward"], ["NHWC"])
    assert not only_nhwc["suite"] and {r[2] for r in only_nhwc["extra"] + only_nhwc["depthwise"]} == {"NHWC"}
    assert run.parse_args(["--layouts", "NHWC"]).layouts == ["NHWC"]
    assert run.parse_args([]).layouts == ["NCHW", "NHWC"]
    with pytest.raises(SystemExit):
        run.parse_args(["--layouts", "NCWH"])

    # NHWC problems: x (N, H, W, C), weights (KH, KW, C, F); transposed (KH, KW, C_out, C_in).
    dcgan = next(l for l in run.SUITE if l.name == "dcgan4x4s2").problem("NHWC")
    assert dcgan.input_shape == (8, 28, 28, 64) and dcgan.weight_shape == (4, 4, 32, 64)
    assert dcgan.output_shape == (8, 56, 56, 32)
    odd = next(l for l in extra if l.name == "odd3x3s2").problem("NHWC")
    assert odd.weight_shape == (3, 3, 64, 96) and odd.output_shape == (8, 15, 15, 96)


def test_make_builds_the_bench_windows(run):
    """Every module the bench's rows call (window, layout, dtype, family, specialized or generic) is in
    kernels.toml, so `make` builds them ahead."""
    from convgen.tools.specfile import load_spec_file
    built = set(load_spec_file(BENCH.parent / "kernels.toml"))
    groups = run.row_groups([l.name for l in run.SUITE + run.EXTRA_SUITE + run.DEPTHWISE_SUITE], list(run.OPS),
                            list(run.LAYOUTS))
    needed = {}
    for rows in groups.values():
        for op, layer, layout in rows:
            problem = layer.problem() if isinstance(layer, run.NdLayer) else layer.problem(layout)
            for spec in run.specs_of(problem, "auto").values():
                needed.setdefault(spec, layer.name)
    missing = {f"{spec} ({name})" for spec, name in needed.items() if spec not in built}
    assert len(needed) > 10 and not missing, f"windows the bench calls that kernels.toml lacks: {missing}"


@pytest.mark.parametrize("op, layer", [
    ("forward", ("tiny3x3", 2, 8, 9, 7, 8, 3, 1, 1)),
    ("backward", ("tiny3x3", 2, 8, 9, 7, 8, 3, 1, 1)),
    ("transposed", ("tiny4x4s2", 2, 6, 5, 4, 3, 4, 2, 1, True)),
    ("transposed_backward", ("tiny4x4s2", 2, 6, 5, 4, 3, 4, 2, 1, True)),
], ids=["forward", "backward", "transposed", "transposed_backward"])
def test_an_nhwc_row_checks_every_result_against_numpy(run, op, layer):
    """A tiny NHWC row, run once: convgen (NHWC arrays) and PyTorch (channels_last) agree with NumPy's
    result in NHWC; every result has the NHWC shapes."""
    from convgen.tools.baselines import torch_module
    torch = torch_module()
    layer = run.Layer(*layer)
    case = run.make_case(op, layer, torch, layout="NHWC")
    assert {"specialized", "generic", "numpy"} <= set(case.funcs) and ("pytorch" in case.funcs) == (torch is not None)
    problem = layer.problem("NHWC")
    for name, func in case.funcs.items():
        result = func()
        result = func.as_numpy(result) if hasattr(func, "as_numpy") else result
        shapes = [a.shape for a in (result if isinstance(result, tuple) else (result,))]
        expected = ([problem.output_shape] if op in ("forward", "transposed")
                    else [problem.input_shape, problem.weight_shape, (layer.f,)])
        assert shapes == expected, (name, shapes)
    row = run.run_case(case, repeat=1, min_time=0.0)
    assert all(e <= min(1e-4, case.error_limits[i]) for i, e in row["errors"].items()), row["errors"]
    assert not run.report.wrong_results([row])
    with pytest.raises(ValueError, match="layout"):
        run.make_case(op, layer, None, layout="NWHC")


def test_rows_timed_in_several_passes_keep_the_median(run, report):
    """--rounds: a row timed in several passes over the suite keeps each implementation's median time
    (rates recomputed from it, GB/s too), the most any pass saw of other processes; the rest of the
    row is the first pass's. 2 passes by default, 1 with --quick, at least 1."""
    passes = [_row(run, "forward", "odd5x5", "direct", dict(specialized=s, pytorch=p), layout="NHWC")
              for s, p in ((1.0, 1.2), (3.0, 0.9), (2.0, 1.0))]
    for r, load, size in zip(passes, (0.02, 0.07, None), (4e6, 5e6, 6e6)):
        r["other_load"], r["bytes"] = load, size
    merged = run.merge_rounds(passes)
    assert merged["seconds"] == {"specialized": 2e-3, "pytorch": 1e-3}
    assert merged["gflops"]["specialized"] == pytest.approx(passes[0]["gflop"] / 2e-3)
    assert merged["gbs"] == pytest.approx({"specialized": 4e6 / 2e-3 / 1e9, "pytorch": 4e6 / 1e-3 / 1e9})
    assert merged["other_load"] == 0.07 and merged["errors"] is passes[0]["errors"]
    assert run.merge_rounds(passes[:1]) is passes[0]
    assert "each implementation's median over the passes" in report.markdown(
        _results(run), dict(isa="avx2", gflops_1=50.0, gflops_all=100.0, threads=2, samples=3),
        _info(rounds=2))
    assert run.parse_args([]).rounds == 2 and run.parse_args(["--quick"]).rounds == 1
    assert run.parse_args(["--quick", "--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        run.parse_args(["--rounds", "0"])


def test_a_quick_run_of_a_layer_outside_the_suite(run, tmp_path):
    """bench/run.py's main on one layer outside the suite, forward, both layouts: each result agrees
    with NumPy's (else the exit status is 1) and the report has the section and the targets."""
    status = run.main(["--quick", "--repeat", "1", "--no-torch", "--no-chart", "--wait-quiet", "0",
                       "--layers", "odd5x5", "--ops", "forward", "--out", str(tmp_path)])
    assert status == 0
    text = (tmp_path / "bench.md").read_text()
    table = text.split("### Forward (conv2d), outside the suite")[1].split("##")[0]
    assert "| odd5x5 | NCHW | 4×48×13×13 → 48 ch, k5s1p2 |" in table
    assert "| odd5x5 | NHWC | 4×48×13×13 → 48 ch, k5s1p2 |" in table
    assert "## Targets (issue 11, NHWC and every layer)" in text and "**part of the suite only**" in text
    assert "## Forward (conv2d)\n" not in text and "## NHWC" not in text  # no suite layer ran
    details = text.split("## Times per call")[1]
    assert "| forward | odd5x5 NHWC |" in details and "WRONG" not in details


def _nhwc_and_extra(run):
    """Made-up NHWC rows of the suite and rows outside it; spec/PyTorch in the comments."""
    dense = dict(specialized=1.0, generic=1.1, numpy=9.0)

    def row(op, layer, layout, torch, algorithm="direct"):
        return _row(run, op, layer, algorithm, dict(dense, pytorch=torch), layout=layout)

    nhwc = [row("forward", "resnet3x3", "NHWC", 1.5, "winograd F(4x4)"),  # 1.50×
            row("forward", "resnet3x3s2", "NHWC", 0.95),                  # 0.95×
            row("backward", "resnet3x3", "NHWC", 1.2),                    # 1.20×
            row("backward", "batch1_3x3", "NHWC", 1.1),                   # 1.10×
            row("transposed", "dcgan4x4s2", "NHWC", 0.8)]                 # 0.80×
    extra = [row("forward", "odd5x5", "NCHW", 1.0), row("forward", "odd5x5", "NHWC", 0.85),
             row("forward", "batch64_3x3", "NCHW", 1.44), row("forward", "batch64_3x3", "NHWC", 1.0),
             row("backward", "odd5x5", "NCHW", 2.0), row("backward", "odd5x5", "NHWC", 1.8)]
    return nhwc, extra


def test_nhwc_and_extra_tables(run, report, tmp_path):
    results = _results(run)
    nhwc, extra = _nhwc_and_extra(run)
    text = report.markdown(results, FMA, _info(), nhwc=nhwc, extra=extra)
    order = ["## Forward (conv2d)\n", "## Targets (Winograd issue)", "## NHWC (the suite in channels-last layout)",
             "### Forward (conv2d), NHWC", "### Transposed forward (conv_transpose2d), NHWC",
             "## Layers outside the suite", "### Forward (conv2d), outside the suite",
             "### Backward (dx + dw + db), outside the suite", "## Targets (issue 11, NHWC and every layer)"]
    assert [text.index(heading) for heading in order] == sorted(text.index(heading) for heading in order)
    forward = text.split("### Forward (conv2d), NHWC")[1].split("###")[0]
    assert "| layer | algorithm | GFLOP |" in forward  # one layout: no layout column
    assert "PyTorch channels_last eff. GFLOP/s (% peak)" in forward and "spec/PyTorch channels_last" in forward
    resnet = next(line for line in forward.splitlines() if line.startswith("| resnet3x3 "))
    assert "| winograd F(4x4) |" in resnet and "| 1.50× |" in resnet
    assert "**geometric mean**" in forward and "1.19×" in forward  # sqrt(1.5 · 0.95)
    outside = text.split("### Forward (conv2d), outside the suite")[1].split("###")[0]
    assert "| layer | layout | shape | algorithm | GFLOP |" in outside
    assert "| odd5x5 | NHWC | 4×48×13×13 → 48 ch, k5s1p2 | direct |" in outside
    nchw_mean = next(line for line in outside.splitlines() if line.startswith("| **geometric mean, NCHW**"))
    nhwc_mean = next(line for line in outside.splitlines() if line.startswith("| **geometric mean, NHWC**"))
    assert nchw_mean.endswith("| 1.20× |  |  |") and nhwc_mean.endswith("| 0.92× |  |  |")  # sqrt(1.44), sqrt(.85)
    assert "| forward | resnet3x3 NHWC |" in text.split("## Times per call")[1]

    # The NCHW tables read back as before: NHWC and outside rows do not replace the suite's ratios.
    earlier = tmp_path / "bench.md"
    earlier.write_text(text)
    ratios = report.read_previous(earlier)["ratios"]
    assert ratios[("forward", "resnet3x3")] == pytest.approx(2.0) and ("forward", "odd5x5") not in ratios
    assert text.split("## NHWC")[0] == report.markdown(results, FMA, _info()).split("## Targets (issue 11")[0]


def test_issue11_targets(run, report):
    results = _results(run)
    nhwc, extra = _nhwc_and_extra(run)
    lines = report.issue11_targets(results, nhwc, extra)
    assert len(lines) == 5
    # NHWC forward: geometric mean sqrt(1.5 · 0.95) = 1.19× ≥ 1.1×, but resnet3x3s2 is below 1.0×.
    assert lines[0].startswith("- NHWC forward: specialized ≥ 1.0× PyTorch channels_last on every layer of the "
                               "suite, ≥ 1.1× on the geometric mean: ")
    assert lines[0].endswith("**not met** — 1.19× (resnet3x3 1.50×, resnet3x3s2 0.95×); "
                             "below 1.0×: resnet3x3s2 0.95×")
    assert lines[1].startswith("- NHWC backward")
    assert lines[1].endswith("**met** — 1.15× (resnet3x3 1.20×, batch1_3x3 1.10×)")
    # Every layer, NCHW suite and both layouts outside it: odd5x5 NHWC 0.85× forward; backward lowest 1.33×.
    assert lines[2].startswith("- forward: specialized ≥ 0.9× PyTorch on every layer of the suite (NCHW) and "
                               "outside it (NCHW, and NHWC against channels_last): ")
    assert lines[2].endswith("**not met** — lowest 0.85× (odd5x5 NHWC); below 0.9×: odd5x5 NHWC 0.85×")
    assert lines[3].endswith("**met** — lowest 1.33× (resnet3x3)")
    # Transposed, both layouts: deconv3x3 (NCHW) 1.20×, dcgan4x4s2 NHWC 0.80×.
    assert lines[4].endswith("**not met** — lowest 0.80× (transposed dcgan4x4s2 NHWC); "
                             "below 0.9×: transposed dcgan4x4s2 NHWC 0.80×")
    # Without those rows, or without PyTorch, the lines say so.
    assert all(line.endswith(": not measured") for line in report.issue11_targets([], [], []))
    no_torch = [dict(r, seconds={i: t for i, t in r["seconds"].items() if i != "pytorch"}) for r in nhwc]
    assert report.issue11_targets([], no_torch, [])[0].endswith(": not measured")
    assert "**met** — 1.50× (resnet3x3 1.50×)" in report.issue11_targets([], nhwc[:1], [])[0]


def test_first_call_bench_times_a_new_window_in_a_fresh_cache(tmp_path):
    """bench/first_call.py: one case, one fresh process; the report names the CPU, both first calls,
    both calls of the next window, and a second process's start and first call on the filled cache."""
    out = tmp_path / "first_call.md"
    proc = subprocess.run([sys.executable, str(BENCH / "first_call.py"), "--repeat", "1", "--out", str(out),
                           "--cases", "k2s1p0:NHWC:direct"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = out.read_text()
    assert "CPU: " in report
    row = next(line for line in report.splitlines() if line.startswith("| k2s1p0 | NHWC | direct |"))
    times = [float(cell) for cell in row.strip("|").split("|")[3:]]
    assert len(times) == 7 and all(0 < t < 600 for t in times)


def test_the_bench_models_are_torchvisions():
    """bench/models.py against torchvision's published sizes: ResNet-18 11,689,512 parameters and 20
    convolutions, MobileNetV2 3,504,872 parameters and 52 convolutions (17 of them depthwise)."""
    sys.path.insert(0, str(BENCH))
    import torch
    from models import convolutions, mobilenet_v2, resnet18
    for build, parameters, convs in ((resnet18, 11_689_512, 20), (mobilenet_v2, 3_504_872, 52)):
        model = build()
        assert sum(p.numel() for p in model.parameters()) == parameters
        assert convolutions(model) == convs
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 1000)
    depthwise = [m for m in mobilenet_v2().modules() if isinstance(m, torch.nn.Conv2d) and m.groups > 1]
    assert len(depthwise) == 17 and all(m.groups == m.in_channels == m.out_channels for m in depthwise)


def test_end_to_end_bench_times_a_converted_model_and_checks_it(tmp_path):
    """bench/end_to_end.py --quick on the encoder-decoder, channels_last: three rows naming the CPU,
    outputs agreeing with PyTorch, and gradients as close to float64 as PyTorch's; the instruction
    sets both libraries ran."""
    out = tmp_path / "end_to_end.md"
    proc = subprocess.run([sys.executable, str(BENCH / "end_to_end.py"), "--quick", "--models", "encoder_decoder",
                           "--formats", "channels_last", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = out.read_text()
    assert "CPU: " in report and "Geometric mean speedup" in report
    # which vector code each library ran: convgen's schedule as built here
    from convgen.runtime.kernels import settings
    assert f"Instruction sets: convgen {settings().schedule().isa}; PyTorch ATen " in report
    rows = [line for line in report.splitlines() if line.startswith("| encoder_decoder | channels_last |")]
    assert len(rows) == 3
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[3]) > 0 and float(cells[4]) > 0
        torch_faults, convgen_faults = (int(v) for v in cells[6].split(" / "))  # pages first touched per run
        assert torch_faults >= 0 and convgen_faults >= 0
        numbers = [float(v.rstrip(",;")) for v in cells[7].split() if v[0].isdigit()]
        if "output vs PyTorch" in cells[7]:
            assert numbers[0] < 1e-4
        else:  # "grads vs float64, over 3 inputs: PyTorch e1, convgen e2; float64 taking float32's
            # decisions: PyTorch e3, convgen e4; decisions flipped: PyTorch k1, convgen k2"
            inputs, torch_error, convgen_error, torch_same, convgen_same, torch_flips, convgen_flips = numbers
            assert inputs == 3  # (--quick)
            assert convgen_error <= 2 * torch_error + 1e-7
            assert 0 < convgen_same <= 2 * torch_same + 1e-7 and torch_same > 0
            assert torch_flips >= 0 and convgen_flips >= 0 and torch_flips == int(torch_flips)


def test_end_to_end_accuracy_replays_a_steps_decisions():
    """The float64 step replaying decisions (bench/end_to_end.py): replaying a run's own decisions
    gives that run's gradients (ReLU used twice a step, ReLU6, a max-pool); one decision flipped
    (a ReLU that passed a value the max-pool picks now blocks it) moves them and is counted; the
    modules decide again afterwards."""
    import torch
    sys.path.insert(0, str(BENCH))
    try:
        from end_to_end import _flips, _recorded_gradients, _replayed_gradients
    finally:
        sys.path.remove(str(BENCH))
    nn = torch.nn
    torch.manual_seed(0)
    relu = nn.ReLU(inplace=True)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), relu, nn.MaxPool2d(3, 2, 1), nn.Conv2d(4, 4, 3, padding=1),
                          relu, nn.Conv2d(4, 4, 1), nn.ReLU6()).double()
    with torch.no_grad():
        model[5].bias.copy_(torch.tensor([-1.0, 0.5, 5.9, 8.0]))  # values below 0, between, past ReLU6's 6
    x = torch.randn(2, 2, 8, 8, dtype=torch.float64)
    grads, decisions = _recorded_gradients(model, x)
    assert len(decisions) == 4 and decisions[3][1].any() and decisions[3][0].any()  # ReLU, pool, ReLU, ReLU6
    replayed = _replayed_gradients(model, x, decisions)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(grads, replayed))
    assert not any("forward" in vars(m) for m in model.modules())  # the modules decide again
    flipped = [d.clone() if isinstance(d, torch.Tensor) else d for d in decisions]
    plane = flipped[0][0, 0].view(-1)  # the first ReLU's decisions on the first channel
    plane[next(i for i in decisions[1][0, 0].view(-1).tolist() if plane[i])] = False  # one the max-pool picks
    assert _flips(flipped, decisions) == 1 and _flips(decisions, decisions) == 0
    moved = _replayed_gradients(model, x, flipped)
    assert not all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(grads, moved))


def test_inference_bench_times_a_fused_model_and_checks_it(tmp_path):
    """bench/inference.py --quick on the encoder-decoder, channels_last: a row per batch naming the
    CPU, the fused model's output agreeing with eager's, its preparation timed; the summary line."""
    out = tmp_path / "inference.md"
    proc = subprocess.run([sys.executable, str(BENCH / "inference.py"), "--quick", "--models", "encoder_decoder",
                           "--formats", "channels_last", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = out.read_text()
    assert "CPU: " in report and "fused / eager: geometric mean" in report
    rows = [line for line in report.splitlines() if line.startswith("| encoder_decoder | channels_last |")]
    assert len(rows) == 4  # two batches, then their preparation
    for row in rows[:2]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[3]) > 0 and float(cells[4]) > 0 and cells[5].endswith("×")
        assert float(cells[6].split()[1]) < 1e-4
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[3]) >= 0 and float(cells[4]) > 0


def test_overhead_bench_times_each_op_through_python_and_in_c(tmp_path):
    """bench/overhead.py: each op through its Python function and straight through its cffi entry
    point (with every argument the entry declares), both builds; then the calls from PyTorch."""
    out = tmp_path / "overhead.md"
    proc = subprocess.run([sys.executable, str(BENCH / "overhead.py"), "--repeat", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = out.read_text()
    assert "CPU: " in report and "Largest overhead:" in report
    rows = [line for line in report.splitlines() if line.startswith(("| conv2d |", "| conv2d_backward |",
                                                                     "| conv_transpose2d |"))]
    assert len(rows) == 6  # three ops, specialized and generic
    for row in rows:
        through_op, c_only = (float(c) for c in row.strip("|").split("|")[2:4])
        assert through_op > 0 and c_only > 0
    torch_rows = [line for line in report.splitlines() if line.startswith(("| contiguous |", "| channels_last |"))]
    assert len(torch_rows) == 4 and all(row.rstrip().endswith(("(met) |", "(not met) |")) for row in torch_rows)


def test_model_layers_bench_times_every_convolution_of_a_step(tmp_path):
    """bench/model_layers.py --quick on ResNet-18, channels_last training: a row per kind of layer,
    their calls adding up to the model's 20 convolutions, every pass of both libraries timed (the
    stem's backward too, whose input takes no gradient), the totals their sums, the step's parts."""
    out = tmp_path / "model_layers.md"
    proc = subprocess.run([sys.executable, str(BENCH / "model_layers.py"), "--quick", "--formats", "channels_last",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = out.read_text()
    assert "CPU: " in report and "## channels_last" in report
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in report.splitlines()
            if line.startswith("| ") and "->" in line]
    # ResNet-18's kinds of convolution: 7x7 stem, 3x3 at four widths, three 3x3 and three 1x1 stride 2
    assert len(rows) == 11 and sum(int(r[1]) for r in rows) == 20
    assert any(r[0] == "7x7 s2 p3 3->64 @64x64" for r in rows)
    times = [[float(v) for v in (r[2], r[3], r[5], r[6])] for r in rows]
    assert all(t > 0 for row in times for t in row)
    total = next(line for line in report.splitlines() if line.startswith("| **every convolution**"))
    cells = [c.strip() for c in total.strip("|").split("|")]
    for column, index in ((2, 0), (3, 1), (5, 2), (6, 3)):
        assert float(cells[column]) == pytest.approx(sum(t[index] for t in times), abs=0.01 * len(rows))
    assert "| step |" in report and "| the rest (step minus convolutions) |" in report


def test_model_layers_clock_times_a_modules_own_backward_node():
    """The clock's windows: a convolution whose forward pass sleeps 20 ms and whose backward node
    sleeps 30 ms, in a model that sleeps 500 ms after it in the forward pass and beside it in a
    branch's backward node: twice each, at least 40 and 60 ms (a sleep is never short), and neither
    window takes in the model's sleeps (which would make it a second or more)."""
    import time
    import torch
    sys.path.insert(0, str(BENCH))
    try:
        from model_layers import LayerClock
    finally:
        sys.path.remove(str(BENCH))

    class Sleepy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, seconds):
            ctx.seconds = seconds
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ctx.seconds)
            return grad, None

    class SlowConv(torch.nn.Conv2d):
        def forward(self, x):
            time.sleep(0.02)
            return Sleepy.apply(super().forward(x), 0.03)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = SlowConv(2, 2, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            time.sleep(0.5)
            return y + Sleepy.apply(x * 2, 0.5)

    model = Model()
    clock = LayerClock(model, backward=True)
    clock.running = True
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    for _ in range(2):
        model(x).sum().backward()
    clock.remove()
    (group,) = {g for g, _ in clock.seconds}
    assert group == "3x3 p1 2->2 @5x5" and clock.calls[group] == 2
    assert 0.04 <= clock.seconds[(group, "forward")] < 0.5
    assert 0.06 <= clock.seconds[(group, "backward")] < 0.5
