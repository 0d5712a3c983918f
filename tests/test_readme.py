"""The README's examples work: its Python runs, its commands succeed, its C excerpts are real output.

- ```python blocks are executed in order, in one namespace, in a scratch directory.
- ```sh blocks: each `convgen ...` line runs as `python -m convgen ...` in a scratch directory that
  holds a copy of kernels.toml; `make` lines are skipped (CI runs make itself); any other command
  fails this test, so the README shows nothing that is not checked. `convgen cache ...` lines act
  on a scratch cache, so `cache clear` does not empty the session's kernel cache.
- ```toml blocks load as spec files.
- ```c blocks start with a comment naming where they come from, `/* convgen show ... */` or
  `/* from FILE, written by: convgen export ... */`; their lines (but `...`) must appear in that
  output in the same order.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from convgen.specfile import load_spec_file

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```$", README, re.MULTILINE | re.DOTALL)


def blocks(language):
    return [text for lang, text in BLOCKS if lang == language]


def convgen(argv, cwd, env=None, timeout=300):
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "convgen", *argv], capture_output=True, text=True, cwd=cwd,
                          env=full_env, timeout=timeout)


def test_readme_has_examples_of_every_kind():
    assert blocks("python") and blocks("sh") and blocks("toml") and len(blocks("c")) >= 2


def test_python_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__readme__"}
    for number, code in enumerate(blocks("python"), 1):
        try:
            exec(compile(code, f"README.md python block {number}", "exec"), namespace)
        except Exception as exc:
            pytest.fail(f"README python block {number} failed: {type(exc).__name__}: {exc}")


def _commands():
    """(line, argv, env) of every command in the README's sh blocks, in order."""
    found = []
    for block in blocks("sh"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if not words:
                continue
            env = {}
            while "=" in words[0] and not words[0].startswith("-"):  # VAR=value prefixes
                name, value = words.pop(0).split("=", 1)
                env[name] = value
            found.append((line, words, env))
    return found


def test_shell_examples_are_make_or_convgen():
    for line, words, _ in _commands():
        assert words[0] in ("make", "convgen"), f"the README shows a command this test cannot run: {line!r}"


def test_shell_examples_run(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "kernels.toml", work / "kernels.toml")
    scratch_cache = {"CONVGEN_CACHE_DIR": str(tmp_path / "scratch-cache")}
    ran = 0
    for line, words, env in _commands():
        if words[0] != "convgen":
            continue
        if words[1:2] == ["cache"]:
            env = dict(env, **scratch_cache)
        proc = convgen(words[1:], cwd=work, env=env)
        assert proc.returncode == 0, f"README command {line!r} failed:\n{proc.stderr}"
        assert proc.stdout, f"README command {line!r} printed nothing"
        ran += 1
    assert ran >= 5


def test_toml_examples_are_valid_spec_files(tmp_path):
    for number, text in enumerate(blocks("toml"), 1):
        path = tmp_path / f"block{number}.toml"
        path.write_text(text)
        assert load_spec_file(path), f"README toml block {number} lists no kernels"


def _output_of(source_comment, cwd):
    shown = re.fullmatch(r"/\* (convgen .*?) \*/", source_comment)
    exported = re.fullmatch(r"/\* from (\S+), written by: (convgen .*?) \*/", source_comment)
    assert shown or exported, f"a C block must start with /* convgen ... */ or /* from FILE, written by: ... */, " \
                              f"got {source_comment!r}"
    command = (shown or exported).group(1 if shown else 2)
    proc = convgen(shlex.split(command)[1:], cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout if shown else (cwd / exported.group(1)).read_text()


def test_c_excerpts_are_real_generated_code(tmp_path):
    for number, block in enumerate(blocks("c"), 1):
        first, *lines = block.splitlines()
        output = iter(_output_of(first.strip(), tmp_path).splitlines())
        for line in lines:
            if line.strip() == "...":
                continue
            # Each excerpt line must come later in the output than the one before it.
            assert any(candidate.rstrip() == line.rstrip() for candidate in output), \
                f"README C block {number} ({first.strip()}): {line!r} is not in that output (in this order); " \
                f"refresh the excerpt from the command's output"
