"""The wheel, as a user gets it: built from a copy of the checkout, installed into a fresh virtualenv,
and used from a directory outside the source tree, by its Python API and its console script.

This is what catches a wheel that installs and imports but cannot render a kernel, because the
templates (top-level templates/ in the checkout) did not ship as package data.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from convgen._version import __version__

ROOT = Path(__file__).resolve().parent.parent
# What the copy of the checkout leaves out: version control, environments, build output and caches.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                    ".hypothesis", ".cache", "generated")

# Run by the fresh virtualenv's python: the three ops on small float32 arrays against the installed
# convgen.reference; prints where convgen and its templates were found and the relative errors.
USE_THE_API = textwrap.dedent("""\
    import json
    import numpy as np
    import convgen
    from convgen import reference
    from convgen.codegen import render

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(4).astype(np.float32)
    kw = dict(stride=2, padding=1)
    y = convgen.conv2d(x, w, bias, **kw)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    wt = rng.standard_normal((3, 5, 3, 3)).astype(np.float32)  # (C_in, C_out, KH, KW)
    bias_t = rng.standard_normal(5).astype(np.float32)
    gradients = zip(convgen.conv2d_backward(dy, x, w, **kw), reference.conv2d_backward(dy, x, w, **kw))
    pairs = {
        "conv2d": (y, reference.conv2d(x, w, bias, **kw)),
        **{f"conv2d_backward {name}": pair for name, pair in zip(("dx", "dw", "db"), gradients)},
        "conv_transpose2d": (convgen.conv_transpose2d(x, wt, bias_t, **kw),
                             reference.conv_transpose2d(x, wt, bias_t, **kw)),
    }
    errors = {}
    for name, (got, want) in pairs.items():
        assert got.shape == want.shape and got.dtype == np.float32, (name, got.shape, want.shape, got.dtype)
        errors[name] = float(np.abs(got - want).max() / np.abs(want).max())
    print(json.dumps({"convgen": convgen.__file__, "reference": reference.__file__,
                      "templates": str(render.TEMPLATE_DIR), "errors": errors}))
""")


def run(command, cwd, env=None, timeout=600):
    proc = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"$ {' '.join(map(str, command))}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, venv): the checkout's wheel, and a fresh virtualenv with it and its dependencies installed.

    The wheel is built from a copy, so no build/ or *.egg-info lands in the checkout and parallel runs do
    not share a build directory; without build isolation, with the setuptools of the test environment
    (the `test` extra pins one that builds wheels by itself). The new virtualenv has no pip of its own:
    this environment's pip installs into it (`pip --python`), with pip's usual index, config and cache.
    """
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir",
         work / "dist", source], cwd=work)
    (wheel,) = (work / "dist").glob("convgen-*.whl")
    venv = work / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=work)
    run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--quiet", wheel], cwd=work)
    return wheel, venv


@pytest.fixture
def user_env(tmp_path):
    """The environment of a user outside the checkout: nothing points Python at the source tree, and
    kernels go into a cache of their own."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME") and not k.startswith("CONVGEN_")}
    env["CONVGEN_CACHE_DIR"] = str(tmp_path / "cache")
    return env


def test_wheel_holds_the_templates_and_the_version(installed):
    wheel, _ = installed
    assert wheel.name.startswith(f"convgen-{__version__}-")  # pyproject reads convgen/_version.py
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if name.startswith("convgen/templates/")}
    templates = {f"convgen/templates/{path.relative_to(ROOT / 'templates').as_posix()}"
                 for path in (ROOT / "templates").rglob("*.j2")}
    assert templates and shipped == templates


def test_wheel_holds_every_python_module(installed):
    """Every module of the package ships (a subpackage missing from pyproject's list would not)."""
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if name.endswith(".py")}
    modules = {path.relative_to(ROOT).as_posix() for path in (ROOT / "convgen").rglob("*.py")}
    assert modules and modules <= shipped, sorted(modules - shipped)


def test_installed_wheel_without_pytorch(installed, tmp_path, user_env):
    """The wheel's dependencies leave PyTorch out: convgen.compat imports, convgen.torch says what is missing."""
    _, venv = installed
    script = ("import convgen.compat.cs231n\n"
              "try:\n    import convgen.torch\nexcept ImportError as exc:\n    print(exc)\n")
    proc = run([venv / "bin" / "python", "-c", script], cwd=tmp_path, env=user_env)
    assert proc.stdout.startswith("convgen.torch needs PyTorch, which is not installed"), proc.stdout


def test_installed_wheel_runs_the_ops_and_the_cli_outside_the_source_tree(installed, tmp_path, user_env):
    _, venv = installed
    kernels = tmp_path / "kernels.toml"
    kernels.write_text('[[set]]\nwindows = ["k3s2p1"]\ndtypes = ["float32"]\nlayouts = ["NCHW"]\ngeneric = false\n')

    version = run([venv / "bin" / "convgen", "--version"], cwd=tmp_path, env=user_env)
    assert version.stdout == f"convgen {__version__}\n"
    build = run([venv / "bin" / "convgen", "build", kernels.name, "-j", "1"], cwd=tmp_path, env=user_env)
    summary = r"1 kernel modules: 1 built, 0 already cached, 0 failed \(\d+\.\d s\)\n"
    assert re.fullmatch(summary, build.stdout), build.stdout
    assert "[1/1] built k3s2p1 float32 NCHW" in build.stderr
    listing = run([venv / "bin" / "convgen", "cache", "list"], cwd=tmp_path, env=user_env).stdout
    assert "\nk3s2p1 float32 NCHW " in listing

    script = tmp_path / "use_the_api.py"
    script.write_text(USE_THE_API)
    result = json.loads(run([venv / "bin" / "python", script.name], cwd=tmp_path, env=user_env).stdout)
    for name in ("convgen", "reference", "templates"):  # the installed copy, not the checkout
        assert Path(result[name]).resolve().is_relative_to(venv.resolve()), (name, result[name])
    assert Path(result["templates"]).name == "templates" and Path(result["templates"]).parent.name == "convgen"
    assert result["errors"] and all(err <= 1e-4 for err in result["errors"].values()), result["errors"]
