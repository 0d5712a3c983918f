"""examples/torch_interop.py in its --quick form: it converts the network, finds that the converted
network agrees with PyTorch, and prints a row per dtype, memory format and pass; every kernel it
runs is one `make` builds ahead of time (kernels.toml); bench/results/torch_interop.md records a run of it."""

import importlib.util
import io
import re
from pathlib import Path

import convgen.frontend.ops
from convgen.tools.specfile import load_spec_file

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "torch_interop.py"
ROW = re.compile(r"(float32|float64) +(contiguous|channels_last) +(training step|inference batch) +"
                 r"\d+\.\d\d ms +\d+\.\d\d ms  \d+\.\d\d× (faster|slower)")


def _load_example():
    spec = importlib.util.spec_from_file_location("torch_interop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table(text):
    """(header line, [(dtype, memory format, pass), ...]) of the example's printed table."""
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("dtype "))
    return header, [ROW.fullmatch(line).groups()[:3] for line in lines if ROW.fullmatch(line)]


def test_torch_interop_quick(monkeypatch):
    example = _load_example()
    used = set()

    def recording(spec, active=None, _get_kernels=convgen.frontend.ops.get_kernels):
        used.add(spec)
        return _get_kernels(spec, active)

    monkeypatch.setattr(convgen.frontend.ops, "get_kernels", recording)
    log = io.StringIO()
    rows = example.main(["--quick"], out=log)
    missing = used - set(load_spec_file(ROOT / "kernels.toml"))
    assert used and not missing, f"the example compiles kernels that `make` does not build: {missing}"
    text = log.getvalue()
    assert text.startswith("CPU: ") and "convgen.torch.convert: 6 swapped, 0 left" in text
    header, table = _table(text)
    assert table == [(r["dtype"], r["memory_format"], r["name"]) for r in rows] and len(rows) == 8
    for row in rows:
        assert row["agreement"] <= (1e-4 if row["dtype"] == "float32" else 1e-10), row
        assert row["pytorch"] > 0 and row["convgen"] > 0
    assert re.search(r"float32 \S+ \(within 1e-04: yes\), float64 \S+ \(within 1e-10: yes\)\n", text)

    recorded = (ROOT / "bench" / "results" / "torch_interop.md").read_text()
    shown = re.search(r"^```text\n\$ \.venv/bin/python examples/torch_interop\.py[^\n]*\n(.*?)^```$", recorded,
                      re.MULTILINE | re.DOTALL)
    assert shown, "bench/results/torch_interop.md holds the output in a ```text block opened by its command line"
    assert _table(shown.group(1)) == (header, table), "the recorded table is not what the example prints"
