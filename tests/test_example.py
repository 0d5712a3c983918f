"""examples/train_digits.py, shortened: a few epochs must already classify the held-out digits well."""

import importlib.util
import io
import re
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_digits.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("train_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_digits_few_epochs():
    example = _load_example()
    log = io.StringIO()
    accuracy = example.main(epochs=2, seed=0, out=log)
    assert accuracy > 0.8, f"held-out accuracy {accuracy:.1%} after 2 epochs (chance is 10%)"

    lines = log.getvalue().splitlines()
    assert len([line for line in lines if line.startswith("epoch")]) == 2
    closing = re.fullmatch(r"held-out accuracy (\d+\.\d)% \(target 95%: (reached|NOT reached)\) .*", lines[-1])
    assert closing, f"unexpected closing line: {lines[-1]!r}"
    assert float(closing.group(1)) == round(accuracy * 100, 1)
    assert closing.group(2) == ("reached" if accuracy >= 0.95 else "NOT reached")
