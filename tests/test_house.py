"""House rules a reader relies on: pytest never collects the benchmark tools, the tests and the benchmarks borrow
nothing from each other, and the product never waits with `asyncio.wait_for`."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("deployments", "encoders", "llm", "schemas")
PACKAGES = (*PRODUCT, "demo", "bench")


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_pytest_collects_tests_only():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["testpaths"] == ["tests"] and "bench" in options["norecursedirs"]
    assert [p for p in (ROOT / "bench").rglob("test_*.py")] == [], "tests of bench/ belong in tests/"


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0]
    return {name.split(".")[0] for name in names}


def test_the_tests_and_the_benchmarks_borrow_nothing_from_each_other():
    """What both use (made-up images, free ports, the app run as `make serve` runs it, op counts) is demo/'s
    (demo/inputs.py, demo/local.py, demo/op_count.py). A benchmark's own test, tests/test_bench_*.py, imports it."""
    tests = [p for p in (ROOT / "tests").rglob("*.py") if not p.name.startswith("test_bench_")]
    borrowing = [str(p.relative_to(ROOT)) for p in tests if "bench" in _imported_packages(p)]
    assert borrowing == [], f"tests that import bench/ (move the helper to demo/): {borrowing}"
    bench = [str(p.relative_to(ROOT)) for p in (ROOT / "bench").rglob("*.py") if "tests" in _imported_packages(p)]
    assert bench == [], f"benchmarks that import tests/ (move the helper to demo/): {bench}"


def test_the_product_does_not_use_wait_for():
    """On Python 3.11 `asyncio.wait_for` returns the result of a future that completes in the same turn of the loop as
    the waiting task's cancellation, and the cancellation is lost. Serve cancels a request's calls just before the
    request itself when its client leaves (direct ingress), so those futures complete exactly then: the ingress went
    on to re-encode and generate for nobody (the soak found it). `async with asyncio.timeout(...)` does not drop it;
    tests/deployments/ingress/test_generate.py shows the difference on the encoder wait."""
    product = [p for p in _sources() if p.parts[len(ROOT.parts)] in PRODUCT]
    assert len(product) > 40, product
    found = [str(p.relative_to(ROOT)) for p in product if "wait_for(" in p.read_text()]
    assert found == [], f"use `async with asyncio.timeout(...)` instead of asyncio.wait_for in {found}"
