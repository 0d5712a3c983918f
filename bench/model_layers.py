"""Where a whole network's time goes: each convolution inside the running model, PyTorch eager against
the same model converted with `convgen.torch.convert`.

    python bench/model_layers.py [--model resnet18] [--formats channels_last] [--mode training]
    python bench/model_layers.py --quick        # small images, two rounds: seconds

Layers timed alone in a loop are not layers in a model: there the inputs come cold from the layer
before, the weights change between steps and the allocator hands out other memory. On ResNet-18's
channels_last training step (Zen 3) convgen's convolutions timed one by one summed to 1.4x
PyTorch's, inside the model to 1.04-1.15x: PyTorch's ran up to twice as fast in the model as alone,
convgen's about the same. This bench times each convolution module where it runs: hooks read the
clock before and after its forward pass and its backward pass (see `LayerClock`), in both models,
the steps alternated; the layers are grouped by what they compute (window, stride, padding,
dilation, groups, channels, input size). The steps are timed whole as well (the hooks cost
microseconds); "rest" is a step minus its convolutions: the layers both libraries share (BatchNorm,
activations, pooling), the loss and autograd. Writes bench/results/model_layers.md, naming the CPU.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from end_to_end import FORMATS, _loss, build_models, instruction_sets  # noqa: E402
from models import MODELS  # noqa: E402
from peak import cpu_model  # noqa: E402

CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose2d)


def describe(module: torch.nn.Module, x: torch.Tensor) -> str:
    """What a convolution module computes on x, its group in the table: window, stride, padding,
    dilation and groups (the last three where they are not 1, 0 and 1), channels and input size."""
    def text(values) -> str:
        values = tuple(values) if isinstance(values, (tuple, list)) else (values,)
        return str(values[0]) if len(set(values)) == 1 else "x".join(map(str, values))

    kind = "transposed " if isinstance(module, torch.nn.ConvTranspose2d) else ""
    parts = ["x".join(map(str, module.kernel_size))]
    if max(module.stride) > 1:
        parts.append("s" + text(module.stride))
    padding = module.padding
    if isinstance(padding, str) or any(padding):
        parts.append("p" + (padding if isinstance(padding, str) else text(padding)))
    if max(module.dilation) > 1:
        parts.append("d" + text(module.dilation))
    if module.groups > 1:
        parts.append(f"g{module.groups}")
    size = "x".join(map(str, x.shape[2:]))
    return f"{kind}{' '.join(parts)} {module.in_channels}->{module.out_channels} @{size}"


class LayerClock:
    """Hooks on every convolution module of a model that add up, per layer group and pass, the
    seconds between entering and leaving it; `running` switches the counting on and off. A backward
    pass is the run of the autograd node that made the module's output (hooks on that node, before
    and after it runs): the input and weight gradients it computes, not the other nodes the engine
    runs between the output's gradient and it."""

    def __init__(self, model: torch.nn.Module, backward: bool):
        self.seconds = collections.defaultdict(float)   # (group, "forward" | "backward") -> seconds
        self.calls = collections.Counter()              # group -> forward calls
        self.running = False
        self._started: dict = {}
        self._groups: dict = {}
        self._backward = backward
        self.handles = []
        for module in model.modules():
            if isinstance(module, CONVOLUTIONS):
                self.handles += [module.register_forward_pre_hook(self._enter_forward),
                                 module.register_forward_hook(self._leave_forward)]

    def _enter_forward(self, module, inputs):
        self._groups[id(module)] = describe(module, inputs[0])
        self._started[(id(module), "forward")] = time.perf_counter()

    def _leave_forward(self, module, inputs, output):
        self._add(module, "forward")
        if self.running:
            self.calls[self._groups[id(module)]] += 1
        node = output.grad_fn if self._backward else None
        if node is not None:
            node.register_prehook(lambda grad_outputs, module=module: self._enter_backward(module))
            node.register_hook(lambda grad_inputs, grad_outputs, module=module: self._add(module, "backward"))

    def _enter_backward(self, module):
        self._started[(id(module), "backward")] = time.perf_counter()

    def _add(self, module, which: str):
        elapsed = time.perf_counter() - self._started.pop((id(module), which))
        if self.running:
            self.seconds[(self._groups[id(module)], which)] += elapsed

    def remove(self):
        for handle in self.handles:
            handle.remove()


def measure(name: str, fmt: str, mode: str, batch: int, size: int, rounds: int, steps: int) -> dict:
    training = mode == "training"
    models = dict(zip(("torch", "convgen"), build_models(name, fmt, training)[:2]))
    x = torch.randn(batch, 3, size, size).to(memory_format=FORMATS[fmt])

    def step(model):
        if training:
            model.zero_grad(set_to_none=True)
            _loss(model(x)).backward()
        else:
            with torch.inference_mode():
                model(x)

    for model in models.values():  # compile, lay out weights, warm the allocator
        step(model), step(model)
    clocks = {library: LayerClock(model, training) for library, model in models.items()}
    wall = {library: 0.0 for library in models}  # the steps' own time, hooks and all
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        for library in order:
            clocks[library].running = True
            for _ in range(steps):
                start = time.perf_counter()
                step(models[library])
                wall[library] += time.perf_counter() - start
            clocks[library].running = False
    for clock in clocks.values():
        clock.remove()
    per_step = rounds * steps
    layers = {}
    for library, clock in clocks.items():
        for (group, which), seconds in clock.seconds.items():
            layers.setdefault(group, {"calls": clock.calls[group] // per_step})[(library, which)] = seconds / per_step
    return {"model": name, "format": fmt, "mode": mode, "batch": batch, "size": size, "rounds": rounds,
            "steps": steps, "passes": ("forward", "backward") if training else ("forward",), "layers": layers,
            "step": {library: seconds / (rounds * steps) for library, seconds in wall.items()}}


def _ratio(torch_seconds: float, convgen_seconds: float) -> str:
    return f"{torch_seconds / convgen_seconds:.2f}×" if convgen_seconds > 0 else "–"


def table(result: dict) -> list[str]:
    passes = result["passes"]
    header = ["layer", "calls per step"]
    for which in passes:
        header += [f"{which}: PyTorch (ms)", f"{which}: convgen (ms)", f"{which}: speedup"]
    lines = ["| " + " | ".join(header) + " |", "| --- | ---: |" + " ---: |" * (3 * len(passes))]
    totals = collections.defaultdict(float)
    layers = result["layers"]
    for group in sorted(layers, key=lambda g: -sum(layers[g].get(("torch", w), 0) for w in passes)):
        row = layers[group]
        cells = [group, str(row["calls"])]
        for which in passes:
            t, c = row.get(("torch", which), 0.0), row.get(("convgen", which), 0.0)
            totals[("torch", which)] += t
            totals[("convgen", which)] += c
            cells += [f"{t * 1e3:.2f}", f"{c * 1e3:.2f}", _ratio(t, c)]
        lines.append("| " + " | ".join(cells) + " |")
    cells = ["**every convolution**", str(sum(row["calls"] for row in layers.values()))]
    for which in passes:
        t, c = totals[("torch", which)], totals[("convgen", which)]
        cells += [f"{t * 1e3:.2f}", f"{c * 1e3:.2f}", _ratio(t, c)]
    lines.append("| " + " | ".join(cells) + " |")
    step = result["step"]
    convs = {library: sum(totals[(library, which)] for which in passes) for library in ("torch", "convgen")}
    rest = {library: step[library] - convs[library] for library in convs}
    lines += ["", "| the whole step (the same steps) | PyTorch (ms) | convgen (ms) | speedup |",
              "| --- | ---: | ---: | ---: |",
              f"| step | {step['torch'] * 1e3:.1f} | {step['convgen'] * 1e3:.1f} | "
              f"{_ratio(step['torch'], step['convgen'])} |",
              f"| its convolutions (hooks above) | {convs['torch'] * 1e3:.1f} | {convs['convgen'] * 1e3:.1f} | "
              f"{_ratio(convs['torch'], convs['convgen'])} |",
              f"| the rest (step minus convolutions) | {rest['torch'] * 1e3:.1f} | {rest['convgen'] * 1e3:.1f} | "
              f"{_ratio(rest['torch'], rest['convgen'])} |"]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", choices=list(MODELS))
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of: "
                        + ", ".join(FORMATS))
    parser.add_argument("--mode", default="training", choices=("training", "inference"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=None, help="image side (default 112 training, 224 inference)")
    parser.add_argument("--rounds", type=int, default=6, help="alternations of the two models")
    parser.add_argument("--steps", type=int, default=3, help="steps of a model per round")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (convgen follows it)")
    parser.add_argument("--quick", action="store_true", help="batch 2, 64² images, two rounds of one step")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "model_layers.md")
    args = parser.parse_args(argv)
    for name in ("batch", "rounds", "steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    formats = [f for f in args.formats.split(",") if f]
    if not formats or any(f not in FORMATS for f in formats):
        parser.error(f"--formats: choose from {', '.join(FORMATS)}")
    torch.set_num_threads(args.threads)
    size = args.size or (112 if args.mode == "training" else 224)
    batch, rounds, steps = args.batch, args.rounds, args.steps
    if args.quick:
        batch, size, rounds, steps = 2, 64, 2, 1
    lines = [f"# Each convolution inside the model: {args.model}, {args.mode} batch {batch}, {size}²", "",
             f"CPU: {cpu_model()}; {args.threads} threads for both libraries; float32; torch {torch.__version__}. "
             f"ms per step, means over {rounds} alternated rounds of {steps} steps of each model "
             f"(bench/model_layers.py).", "",
             instruction_sets()]
    for fmt in formats:
        result = measure(args.model, fmt, args.mode, batch, size, rounds, steps)
        lines += ["", f"## {fmt}", "", *table(result)]
        print("\n".join(lines[-(len(table(result)) + 2):]), flush=True)
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
