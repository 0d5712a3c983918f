"""Kernel-set files: TOML lists of specs to build ahead of time or render into generated/.

    # kernels.toml
    [[set]]
    windows = ["k3s1p1", "k3s2p1"]   # the compact window text of ConvSpec.parse
    dtypes = ["float32", "float64"]  # default ["float32"]
    layouts = ["NCHW"]               # default ["NCHW"]
    generic = true                   # also the generic build of each dtype × layout (default true)

Each [[set]] stands for every window × dtype × layout combination.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from .spec import ConvSpec

_KEYS = {"windows", "dtypes", "layouts", "generic"}


def load_spec_file(path) -> list[ConvSpec]:
    """The specs a kernel-set file lists, in file order, without repeats."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"spec file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"spec file {path} is not valid TOML: {exc}") from None
    sets = data.get("set")
    if not isinstance(sets, list) or not sets:
        raise ValueError(f"spec file {path} must contain at least one [[set]] table")
    specs = []
    for number, entry in enumerate(sets, 1):
        unknown = set(entry) - _KEYS
        if unknown:
            raise ValueError(f"spec file {path}, set {number}: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
        windows = entry.get("windows", [])
        dtypes = entry.get("dtypes", ["float32"])
        layouts = entry.get("layouts", ["NCHW"])
        for name, value in (("windows", windows), ("dtypes", dtypes), ("layouts", layouts)):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"spec file {path}, set {number}: {name} must be a list of strings")
        for dtype in dtypes:
            for layout in layouts:
                specs += [ConvSpec.parse(text, dtype, layout) for text in windows]
                if entry.get("generic", True):
                    specs.append(ConvSpec(None, dtype, layout))
    return list(dict.fromkeys(specs))
