"""Fused inference: PyTorch eager, torch.compile and convgen.torch.fuse on whole networks, side by side.

    python bench/inference.py [--models resnet18,mobilenet_v2,encoder_decoder] [--repeat 9]
    python bench/inference.py --quick        # 64² images, batches 1 and 2, two samples, no torch.compile

For each model (bench/models.py, BatchNorm statistics away from 0 and 1 as a trained model's) and
memory format (contiguous, channels_last), float32, inference at batch 1 and 8 on 224×224 images
under `torch.no_grad`: the model as PyTorch runs it (eager); `torch.compile` with inductor and
`torch._inductor.config.freezing = True` (BatchNorm folded, weights reordered once, pointwise work
fused: what a user who wants speed on a CPU runs); and `convgen.torch.fuse(model)` (each
Conv(+BatchNorm)(+activation)(+add) chain one convgen call, the rest PyTorch's). The three are timed
alternately after warm-up calls, medians of `--repeat` samples each. Preparation is reported apart:
torch.compile's compile and first call, and fuse's tracing and folding plus its first call (kernels
from the cache, or compiled when the cache lacks them). Accuracy: each output against eager's
(max |Δ| / max |eager's|). Writes bench/results/inference.md, naming the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import convgen.torch as cgt  # noqa: E402
from end_to_end import FORMATS, instruction_sets  # noqa: E402
from models import MODELS  # noqa: E402
from peak import cpu_model  # noqa: E402


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max()) / max(float(want.double().abs().max()), 1e-30)


def _model(name: str, fmt: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]().to(memory_format=FORMATS[fmt]).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                n = module.num_features
                module.running_mean.copy_(torch.rand(n, generator=generator) - 0.5)
                module.running_var.copy_(torch.rand(n, generator=generator) * 1.5 + 0.5)
    return model


def _first(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def run_case(name: str, fmt: str, batch: int, size: int, repeat: int, compile_: bool) -> dict:
    eager = _model(name, fmt)
    x = torch.randn(batch, 3, size, size).to(memory_format=FORMATS[fmt])
    row = dict(model=name, format=fmt, batch=batch, size=size)
    with torch.no_grad():
        start = time.perf_counter()
        report = cgt.fuse(eager)
        fused = report.model
        row["fuse_s"] = time.perf_counter() - start
        row["fuse_first_s"] = _first(lambda: fused(x))
        row["fused"], row["left"] = len(report.fused), len(report.left)
        runs = {"eager": eager, "fused": fused}
        if compile_:
            import torch._inductor.config as inductor_config
            inductor_config.freezing = True
            inductor_config.compile_threads = 1  # no pool of compile workers left busy beside the timing
            torch._dynamo.reset()
            compiled = torch.compile(eager)
            row["compile_s"] = _first(lambda: compiled(x))
            runs = {"eager": eager, "compile": compiled, "fused": fused}
        want = eager(x)
        for key, model in runs.items():
            if key != "eager":
                row[f"{key}_error"] = _relative(model(x), want)
            model(x)  # warm-up
        samples = {key: [] for key in runs}
        keys = list(runs)
        for r in range(repeat):
            for key in (keys if r % 2 == 0 else keys[::-1]):
                start = time.perf_counter()
                runs[key](x)
                samples[key].append(time.perf_counter() - start)
    for key, values in samples.items():
        row[f"{key}_ms"] = statistics.median(values) * 1e3
    return row


def table(rows: list) -> list[str]:
    compiled = any("compile_ms" in r for r in rows)
    head = "| model | memory format | batch | eager (ms) |" + (" torch.compile (ms) |" if compiled else "")
    head += " convgen fused (ms) | fused / eager |" + (" fused / compile |" if compiled else "") + " accuracy |"
    lines = [head, "| --- | --- | ---: | ---: |" + (" ---: |" if compiled else "") + " ---: | ---: |"
             + (" ---: |" if compiled else "") + " --- |"]
    for r in rows:
        line = f"| {r['model']} | {r['format']} | {r['batch']} | {r['eager_ms']:.1f} |"
        if compiled:
            line += f" {r['compile_ms']:.1f} |"
        line += f" {r['fused_ms']:.1f} | {r['eager_ms'] / r['fused_ms']:.2f}× |"
        if compiled:
            line += f" {r['compile_ms'] / r['fused_ms']:.2f}× |"
        accuracy = f"fused {r['fused_error']:.1e}" + (f", compile {r['compile_error']:.1e}" if compiled else "")
        lines.append(line + f" {accuracy} |")
    lines.append("")
    for label, key in (("fused / eager", "eager_ms"), ("fused / torch.compile", "compile_ms")):
        if all(key in r for r in rows):
            ratios = [r[key] / r["fused_ms"] for r in rows]
            lines.append(f"{label}: geometric mean {statistics.geometric_mean(ratios):.2f}× over {len(rows)} "
                         f"cases; lowest {min(ratios):.2f}×.")
    if compiled:
        ratios = [r["eager_ms"] / r["compile_ms"] for r in rows]
        lines.append(f"torch.compile / eager: geometric mean {statistics.geometric_mean(ratios):.2f}×.")
    lines += ["", "Preparation (s): fuse's tracing and folding + its first call; torch.compile's compile and first "
                  "call.", "", "| model | memory format | batch | fuse | fuse first call |"
              + (" torch.compile first call |" if compiled else ""),
              "| --- | --- | ---: | ---: | ---: |" + (" ---: |" if compiled else "")]
    for r in rows:
        lines.append(f"| {r['model']} | {r['format']} | {r['batch']} | {r['fuse_s']:.2f} | {r['fuse_first_s']:.2f} |"
                     + (f" {r['compile_s']:.1f} |" if compiled else ""))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of: {', '.join(MODELS)}")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (convgen follows it)")
    parser.add_argument("--quick", action="store_true", help="64² images, batches 1 and 2, two samples, no compile")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of: " + ", ".join(FORMATS))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "inference.md")
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    formats = [f for f in args.formats.split(",") if f]
    if any(f not in FORMATS for f in formats):
        parser.error(f"--formats: choose from {', '.join(FORMATS)}")
    torch.set_num_threads(args.threads)
    repeat, size, batches = (2, 64, (1, 2)) if args.quick else (args.repeat, 224, (1, 8))
    compile_ = not (args.quick or args.no_compile)
    rows = []
    for name in names:
        for fmt in formats:
            for batch in batches:
                rows.append(run_case(name, fmt, batch, size, repeat, compile_))
                print(table(rows[-1:])[2], flush=True)
    lines = ["# Fused inference: PyTorch eager, torch.compile and convgen.torch.fuse", "",
             f"CPU: {cpu_model()}; {args.threads} threads for every library; float32; torch {torch.__version__}; "
             f"{size}² images; medians of {repeat} alternated samples per case.", "", instruction_sets(), "",
             *table(rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
