"""The README's and docs/'s examples work: their Python runs, their commands succeed, their C excerpts
are real output. Each page is checked on its own:

- ```python blocks are executed in order, in one namespace per page, in a scratch directory.
- ```sh blocks: each `convgen ...` line runs as `python -m convgen ...` in a scratch directory that
  holds a kernels.toml of one window from the real one (so `convgen build` checks the command, not a
  compile of the whole default set, which tests/test_cli.py and `make` build); `make` lines are skipped (CI runs make itself); any other command
  fails this test, so no page shows a command that is not checked. `convgen cache ...` lines act
  on a scratch cache, so `cache clear` does not empty the session's kernel cache.
- ```toml blocks load as spec files.
- ```c blocks start with a comment naming where they come from, `/* convgen show ... */` or
  `/* from FILE, written by: convgen export ... */`; their lines (but `...`) must appear in that
  output in the same order.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from convgen.tools.specfile import load_spec_file

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Languages a page may show that are not run: a diagram ("") and program output ("text").
NOT_CODE = ("", "text")


def page_blocks(page: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced block of `page`, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", page.read_text(), re.MULTILINE | re.DOTALL)


def blocks(language, page=None):
    """The blocks of `language` on `page` (default: every page)."""
    return [text for p in ([page] if page else PAGES) for lang, text in page_blocks(p) if lang == language]


# One window of the default kernel set, both dtypes, NCHW, and the generic build.
SMALL_KERNEL_SET = """[[set]]
windows = ["k3s2p1"]
dtypes = ["float32", "float64"]
layouts = ["NCHW"]
"""


def test_the_small_kernel_set_is_part_of_the_default_one(tmp_path):
    (tmp_path / "small.toml").write_text(SMALL_KERNEL_SET)
    assert set(load_spec_file(tmp_path / "small.toml")) <= set(load_spec_file(ROOT / "kernels.toml"))


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def convgen(argv, cwd, env=None, timeout=300):
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "convgen", *argv], capture_output=True, text=True, cwd=cwd,
                          env=full_env, timeout=timeout)


def test_pages_have_examples_of_every_kind():
    assert blocks("python", PAGES[0]) and blocks("sh", PAGES[0]), "the README shows Python and commands"
    assert blocks("toml") and len(blocks("c")) >= 2
    assert len(PAGES) >= 6, "README.md and docs/"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_block_is_of_a_checked_kind(page):
    checked = ("python", "sh", "toml", "c")
    for lang, text in page_blocks(page):
        assert lang in checked + NOT_CODE, f"{page_id(page)}: a ```{lang} block, which no test runs"


@pytest.mark.parametrize("page", [p for p in PAGES if blocks("python", p)], ids=page_id)
def test_python_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for number, code in enumerate(blocks("python", page), 1):
        try:
            exec(compile(code, f"{page_id(page)} python block {number}", "exec"), namespace)
        except Exception as exc:
            pytest.fail(f"{page_id(page)} python block {number} failed: {type(exc).__name__}: {exc}")


def _commands(page=None):
    """(line, argv, env) of every command in the sh blocks of `page` (default: every page), in order."""
    found = []
    for block in blocks("sh", page):
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
        assert words[0] in ("make", "convgen"), f"a page shows a command this test cannot run: {line!r}"


@pytest.mark.parametrize("page", [p for p in PAGES if blocks("sh", p)], ids=page_id)
def test_shell_examples_run(page, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "kernels.toml").write_text(SMALL_KERNEL_SET)
    scratch_cache = {"CONVGEN_CACHE_DIR": str(tmp_path / "scratch-cache")}
    for line, words, env in _commands(page):
        if words[0] != "convgen":
            continue
        if words[1:2] == ["cache"]:
            env = dict(env, **scratch_cache)
        if words[1:2] in (["tune"], ["wisdom"]):  # wisdom of its own, which no other test sees
            env = dict(env, CONVGEN_WISDOM=str(tmp_path / "wisdom.json"))
        proc = convgen(words[1:], cwd=work, env=env)
        assert proc.returncode == 0, f"{page_id(page)} command {line!r} failed:\n{proc.stderr}"
        assert proc.stdout, f"{page_id(page)} command {line!r} printed nothing"


def test_pages_run_commands():
    assert sum(words[0] == "convgen" for _, words, _ in _commands()) >= 5


def test_toml_examples_are_valid_spec_files(tmp_path):
    for number, text in enumerate(blocks("toml"), 1):
        path = tmp_path / f"block{number}.toml"
        path.write_text(text)
        assert load_spec_file(path), f"toml block {number} lists no kernels"


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
                f"C block {number} ({first.strip()}): {line!r} is not in that output (in this order); " \
                f"refresh the excerpt from the command's output"
