"""The sanitizer harness (tests/sanitize/run.py) fails a run when a report occurs.

`make sanitize` is only worth its zero reports if a memory error or undefined behaviour in a
kernel would really end the run. These tests hand the harness a test that calls a small module,
built like the kernels (through convgen.runtime.build, with the sanitizer flags), that writes past the end
of a heap buffer, or overflows a signed integer, and check that the run fails and prints the
sanitizer's report; and that the same harness passes a clean module.
"""

import hashlib
import re
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "sanitize"))
import run as harness  # noqa: E402  (tests/sanitize/run.py)

BAD_TEST = """
import os
from pathlib import Path

from convgen.runtime import build, cache, kernels
from convgen.codegen import render
from convgen.planning.spec import ConvSpec

os.environ["CONVGEN_CACHE_DIR"] = {cache!r}
SOURCE = r'''
#include <stdlib.h>
#include <limits.h>
int poke(int n)
{{
    int *a = malloc(sizeof(int) * (size_t)n), r;  /* n = 4, known only at run time */
    {body}
    r = a[0];
    free(a);
    return r;
}}
'''


def test_calls_the_module():
    rendered = render.Rendered(ConvSpec(None), kernels.settings().schedule(), SOURCE, "int poke(int n);", {{}})
    toolchain = kernels.settings().toolchain
    assert "-fsanitize=address,undefined" in " ".join(toolchain.cflags)
    module, _ = cache.load_or_build({key!r}, lambda name, d: build.build_module(name, rendered, toolchain, d))
    assert module.lib.poke(4) == 7
"""

BODIES = {
    "clean": "for (int i = 0; i < n; ++i) a[i] = 7;",
    "heap-buffer-overflow": "for (int i = 0; i <= n; ++i) a[i] = 7;  /* one past the end */",
    "signed-integer-overflow": "a[0] = 7; a[1] = INT_MAX - 3 + n;  /* INT_MAX + 1 */",
}


def run_harness(tmp_path, kind, capsys):
    test_file = tmp_path / f"test_{kind.replace('-', '_')}.py"
    test_file.write_text(textwrap.dedent(BAD_TEST.format(cache=str(tmp_path / "cache"), key=hashlib.sha256(kind.encode()).hexdigest(),
                                                         body=BODIES[kind])))
    (tmp_path / "cache").mkdir(mode=0o700)
    code = harness.main(["--", "--noconftest", "--rootdir", str(tmp_path), str(test_file)])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("kind, report", [
    ("heap-buffer-overflow", r"ERROR: AddressSanitizer: heap-buffer-overflow"),
    ("signed-integer-overflow", r"runtime error: signed integer overflow"),
])
def test_a_sanitizer_report_fails_the_run(tmp_path, capsys, kind, report):
    code, output = run_harness(tmp_path, kind, capsys)
    assert code == 1
    assert re.search(report, output), output[-3000:]
    assert "sanitize: 0 sanitizer report" not in output


def test_a_clean_module_passes_the_same_harness(tmp_path, capsys):
    code, output = run_harness(tmp_path, "clean", capsys)
    assert code == 0, output[-3000:]
    assert "1 passed" in output and "sanitize: 0 sanitizer report(s); exit code 0" in output


def test_reports_are_recognised_in_any_output():
    text = ("ok\n==1==ERROR: AddressSanitizer: heap-use-after-free on address 0x1\n"
            "conv.c:12:5: runtime error: load of misaligned address\n"
            "SUMMARY: UndefinedBehaviorSanitizer: undefined-behavior conv.c:12:5\n")
    assert len(harness.reports(text)) == 3
    assert harness.reports("all 12 tests passed; no runtime errors\n") == []
