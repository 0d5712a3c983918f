"""One kernel cache for the whole test session, so each module compiles once per machine."""

import os
from pathlib import Path

# Before convgen is imported anywhere: every test process (and subprocess) shares this cache.
CACHE = Path(__file__).resolve().parent.parent / ".cache" / "test-kernels"
CACHE.mkdir(parents=True, exist_ok=True, mode=0o700)
os.chmod(CACHE.parent, 0o700)
os.chmod(CACHE, 0o700)
os.environ.setdefault("CONVGEN_CACHE_DIR", str(CACHE))
# Nearly every spec the tests build has all three of its ops called: one module of every op compiles
# in half to two thirds of the time of three modules of one op each. The tests of the per-op modules a
# user's first calls build set modules="per-op" themselves.
os.environ.setdefault("CONVGEN_MODULES", "whole")
# No measured wisdom (`convgen tune`) steers "auto" in the tests: a path no test writes (the tests of
# wisdom point CONVGEN_WISDOM at files of their own).
os.environ["CONVGEN_WISDOM"] = str(CACHE / "no-wisdom" / "wisdom.json")

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def prebuilt_kernels():
    """Compile the swept specs up front, all cores at once, one module of every op per spec (the
    tests run every op of them), instead of a module per op on first use.

    Under pytest-xdist (`make test` runs one worker per core) every worker builds them all with its
    share of the cores, each starting at its own place in the list: a spec another worker is
    compiling waits on the cache's lock, one it has finished is loaded from the cache. Kernels the
    grid does not list compile on first use, a module of every op (CONVGEN_MODULES above)."""
    import convgen
    from grid import all_specs

    specs = all_specs()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    start = worker * len(specs) // workers
    jobs = max(1, (os.cpu_count() or 1) // workers)
    outcomes = convgen.build_all(specs[start:] + specs[:start], jobs=jobs)
    failures = {spec: out for spec, out in outcomes.items() if isinstance(out, Exception)}
    assert not failures, f"kernel builds failed: {failures}"


@pytest.fixture
def threads():
    """Set the kernels' thread count for one test: threads(n). The previous count comes back after."""
    import convgen

    previous = convgen.num_threads()
    yield convgen.set_num_threads
    convgen.set_num_threads(previous)
