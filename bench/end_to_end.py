"""Whole networks, PyTorch eager against the same model converted with `convgen.torch.convert`.

    python bench/end_to_end.py [--models resnet18,mobilenet_v2,encoder_decoder] [--repeat 9]
    python bench/end_to_end.py --quick        # small images and batches, two samples: seconds

For each model (bench/models.py) and memory format (contiguous, channels_last), float32: inference at
batch 1 and 8 on 224×224 images (`torch.inference_mode`, BatchNorm in eval mode) and a training step at
batch 8 on 112×112 (forward, loss, backward; BatchNorm in training mode), the model and its inputs in
the memory format (PyTorch's channels_last recipe). PyTorch's model and its
converted copy hold the same weights and are timed alternately, medians of `--repeat` samples each,
after warm-up calls that compile any kernel the cache lacks (and, in inference, lay out convgen's
weights: the second call of a weight no gradient is taken of). Accuracy columns: the converted
model's output against PyTorch's (max |Δ| / max |PyTorch's|); for training, the parameters' gradients
of each library against the same step computed in float64 (‖g − g64‖ / ‖g64‖ over all parameters),
the geometric mean over ten inputs (three with --quick); then against the float64 step made to take
the float32 step's own decisions (`DECIDING`: which values each ReLU passes and each max-pool picks),
what each library's rounding alone does to the gradients; and how many decisions flipped against
float64's. Beside each time, the memory pages each run first touched (minor page faults, median per
sample): glibc maps every allocation past its threshold (32 MB at most) anew and unmaps it when freed,
so a batch of 8 at 224² may fault in hundreds of megabytes per run, and how much depends on what the
process allocated before: it is why a case moves by 10–50 % between runs, in either library.
Writes bench/results/end_to_end.md, naming the CPU.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import convgen.torch as cgt  # noqa: E402
from convgen.runtime.kernels import settings  # noqa: E402
from models import MODELS, convolutions  # noqa: E402
from peak import cpu_model  # noqa: E402


def instruction_sets() -> str:
    """Which vector code each library ran: convgen's schedule (CONVGEN_ISA forces it) and PyTorch's
    ATen kernels (ATEN_CPU_CAPABILITY; oneDNN follows ONEDNN_MAX_CPU_ISA)."""
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "the best this CPU runs")
    return (f"Instruction sets: convgen {settings().schedule().isa}; PyTorch ATen "
            f"{torch.backends.cpu.get_cpu_capability()}, oneDNN limited to {onednn}.")


FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max()) / max(float(want.double().abs().max()), 1e-30)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _gradients(model, x) -> list:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks (MobileNetV2's) in every library and dtype
    _loss(model(x)).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


# The layers that decide on values in a training step: which inputs a ReLU (ReLU6) passes, which one
# a max-pool picks. Where a float32 step's decision flips against float64's (a value within rounding
# of 0, or of its neighbour), its gradient takes another path: ResNet-18's gradients moved 1e-4 to
# 1e-2 from float64 with a flip, 7e-6 without, in both libraries alike. Over ten inputs the number of
# inputs with a flip decides the geometric mean more than rounding does; the float64 step replaying
# the float32 step's decisions measures the rounding alone.
DECIDING = (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.MaxPool2d)


def _decision(module, inputs, output):
    """What a DECIDING module decided in one call: the max-pool's indices, or where the activation
    passed its input (for ReLU6 also where it clipped at 6)."""
    if isinstance(module, torch.nn.MaxPool2d):
        return torch.nn.functional.max_pool2d(inputs[0], module.kernel_size, module.stride, module.padding,
                                              module.dilation, module.ceil_mode, return_indices=True)[1]
    if isinstance(module, torch.nn.ReLU6):
        return (output > 0) & (output < 6), output >= 6
    return output > 0


def _replay(module, decision, x):
    """The module's output on x under a recorded decision (gradients follow it)."""
    if isinstance(module, torch.nn.MaxPool2d):
        n, c = x.shape[:2]
        return x.reshape(n, c, -1).gather(2, decision.reshape(n, c, -1)).reshape(decision.shape)
    if isinstance(module, torch.nn.ReLU6):
        passed, clipped = decision
        return torch.where(passed, x, torch.where(clipped, torch.full_like(x, 6.0), torch.zeros_like(x)))
    return torch.where(decision, x, torch.zeros_like(x))


def _recorded_gradients(model, x) -> tuple[list, list]:
    """`_gradients(model, x)` and the decisions its DECIDING modules took, in call order."""
    decisions = []
    hooks = [m.register_forward_hook(lambda m, i, o: decisions.append(_decision(m, i, o)))
             for m in model.modules() if isinstance(m, DECIDING)]
    try:
        return _gradients(model, x), decisions
    finally:
        for hook in hooks:
            hook.remove()


def _replayed_gradients(model, x, decisions) -> list:
    """`_gradients(model, x)` with its DECIDING modules taking `decisions` (in call order) instead of
    deciding (a module called twice a step, as ResNet's blocks call their ReLU, takes two)."""
    queue = iter(decisions)
    deciding = [m for m in model.modules() if isinstance(m, DECIDING)]
    for module in deciding:
        module.forward = lambda x, module=module: _replay(module, next(queue), x)
    try:
        return _gradients(model, x)
    finally:
        for module in deciding:
            del module.forward


def _flips(decisions, reference) -> int:
    """How many of the decisions differ from the reference run's."""
    def leaves(d):
        return d if isinstance(d, tuple) else (d,)
    return sum(int((a != b).sum()) for d, r in zip(decisions, reference) for a, b in zip(leaves(d), leaves(r)))


def _gradient_error(grads, reference) -> float:
    """‖g − g64‖ / ‖g64‖ over every parameter's gradient at once (a single parameter's relative error
    says little where its true gradient is nearly zero, as a training-mode BatchNorm makes some)."""
    difference = sum(float((g.double() - r).square().sum()) for g, r in zip(grads, reference))
    return (difference / max(sum(float(r.square().sum()) for r in reference), 1e-300)) ** 0.5


# Inputs whose gradient errors are averaged (geometric mean). Training-mode BatchNorm amplifies float32
# rounding by an amount that depends on the input, so much that over ten inputs the ratio of the two
# libraries' errors ran from 0.3 to 3 on MobileNetV2 (Zen 3): over three, either could come out ahead.
ACCURACY_INPUTS = 10
QUICK_ACCURACY_INPUTS = 3


def _timed(call) -> tuple[float, int]:
    """(seconds, minor page faults) of one call."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    call()
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def build_models(name: str, fmt: str, training: bool):
    """(PyTorch's model, its copy converted with `convgen.torch.convert`, the conversion's report), in
    the memory format (PyTorch's recipe: the model and its inputs), in training or eval mode."""
    torch.manual_seed(0)
    reference = MODELS[name]().to(memory_format=FORMATS[fmt])
    # BatchNorm statistics away from 0 and 1, as a trained model's (a fresh one's are exactly those)
    for module in reference.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    reference.train(training)
    converted = copy.deepcopy(reference)
    report = cgt.convert(converted)
    return reference, converted, report


def run_case(name: str, fmt: str, mode: str, batch: int, size: int, repeat: int,
             accuracy_inputs: int = ACCURACY_INPUTS) -> dict:
    reference, converted, report = build_models(name, fmt, mode == "training")
    x = torch.randn(batch, 3, size, size).to(memory_format=FORMATS[fmt])
    row = dict(model=name, format=fmt, mode=mode, batch=batch, size=size, swapped=len(report.swapped),
               convolutions=convolutions(reference))
    if mode == "inference":
        def call(model):
            with torch.inference_mode():
                return model(x)
        row["error"] = _relative(call(converted), call(reference))  # (also the warm-up)
        call(converted), call(reference)  # the steady state: convgen lays out the weights on their second call
    else:
        def call(model):
            model.zero_grad(set_to_none=True)
            _loss(model(x)).backward()
        # Rounding through training-mode BatchNorm is amplified by an amount that depends on the input
        # (MobileNetV2: PyTorch's own error 6.7e-3 to 1.7e-2 over four inputs): the geometric mean
        # over `accuracy_inputs` inputs, of which x is the first.
        exact = copy.deepcopy(reference).double()
        errors = {"torch": [], "convgen": []}  # against float64's own step
        replayed = {"torch": [], "convgen": []}  # against float64 taking the library's decisions
        flips = {"torch": 0, "convgen": 0}
        for k in range(accuracy_inputs):
            xk = x if k == 0 else torch.randn(x.shape, generator=torch.Generator().manual_seed(k)).to(
                memory_format=FORMATS[fmt])
            xk64 = xk.double()
            want, exact_decisions = _recorded_gradients(exact, xk64)
            for library, model in (("torch", reference), ("convgen", converted)):
                grads, decisions = _recorded_gradients(model, xk)
                errors[library].append(_gradient_error(grads, want))
                replayed[library].append(_gradient_error(grads, _replayed_gradients(exact, xk64, decisions)))
                flips[library] += _flips(decisions, exact_decisions)
        row["accuracy_inputs"] = accuracy_inputs
        for library in ("torch", "convgen"):
            row[f"{library}_grad_error"] = statistics.geometric_mean(errors[library])
            row[f"{library}_grad_error_same_decisions"] = statistics.geometric_mean(replayed[library])
        row["torch_flips"], row["convgen_flips"] = flips["torch"], flips["convgen"]
    samples = {"torch": [], "convgen": []}
    faults = {"torch": [], "convgen": []}
    for r in range(repeat):
        order = (("torch", reference), ("convgen", converted))
        for library, model in (order if r % 2 == 0 else order[::-1]):
            seconds, faulted = _timed(lambda: call(model))
            samples[library].append(seconds)
            faults[library].append(faulted)
    for library in ("torch", "convgen"):
        row[f"{library}_ms"] = statistics.median(samples[library]) * 1e3
        row[f"{library}_faults"] = round(statistics.median(faults[library]))
    row["speedup"] = row["torch_ms"] / row["convgen_ms"]
    return row


def table(rows: list) -> list[str]:
    lines = ["| model | memory format | run | PyTorch (ms) | convgen (ms) | convgen speedup | "
             "page faults per run: PyTorch / convgen | accuracy |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if r["mode"] == "inference":
            accuracy = f"output vs PyTorch {r['error']:.1e}"
        else:
            accuracy = (f"grads vs float64, over {r['accuracy_inputs']} inputs: PyTorch {r['torch_grad_error']:.1e}, "
                        f"convgen {r['convgen_grad_error']:.1e}; float64 taking float32's decisions: PyTorch "
                        f"{r['torch_grad_error_same_decisions']:.1e}, convgen {r['convgen_grad_error_same_decisions']:.1e}; "
                        f"decisions flipped: PyTorch {r['torch_flips']}, convgen {r['convgen_flips']}")
        lines.append(f"| {r['model']} | {r['format']} | {r['mode']} batch {r['batch']}, {r['size']}² | "
                     f"{r['torch_ms']:.1f} | {r['convgen_ms']:.1f} | {r['speedup']:.2f}× | "
                     f"{r['torch_faults']} / {r['convgen_faults']} | {accuracy} |")
    speedups = [r["speedup"] for r in rows]
    geomean = statistics.geometric_mean(speedups)
    lines += ["", f"Geometric mean speedup {geomean:.2f}× over {len(rows)} cases; lowest {min(speedups):.2f}×."]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of: {', '.join(MODELS)}")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (convgen follows it)")
    parser.add_argument("--quick", action="store_true", help="64² images, batches 1 and 2, two samples")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of: "
                        + ", ".join(FORMATS))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "end_to_end.md")
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    torch.set_num_threads(args.threads)
    formats = [f for f in args.formats.split(",") if f]
    if any(f not in FORMATS for f in formats):
        parser.error(f"--formats: choose from {', '.join(FORMATS)}")
    # (training in --quick mode keeps 64² images: smaller ones leave BatchNorm a few values per channel
    # in the last stages, where float32 gradients lose every digit against float64, in both libraries)
    repeat, big, small, large_batch = (2, 64, 64, 2) if args.quick else (args.repeat, 224, 112, 8)
    rows = []
    for name in names:
        for fmt in formats:
            for mode, batch, size in (("inference", 1, big), ("inference", large_batch, big),
                                      ("training", large_batch, small)):
                rows.append(run_case(name, fmt, mode, batch, size, repeat,
                                     QUICK_ACCURACY_INPUTS if args.quick else ACCURACY_INPUTS))
                print(table(rows[-1:])[2], flush=True)
    lines = ["# End to end: whole networks, PyTorch eager against convgen.torch.convert", "",
             f"CPU: {cpu_model()}; {args.threads} threads for both libraries; float32; torch {torch.__version__}; "
             f"medians of {repeat} alternated samples per case.", "", instruction_sets(), "", *table(rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
