"""House rules a reader relies on: non-test files stay small, and pytest never collects the benchmark tools."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("deployments", "encoders", "llm", "schemas", "demo", "bench")
MAX_LINES = 300


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_every_non_test_file_fits_in_300_lines():
    sources = _sources()
    assert len(sources) > 50, sources  # the walk found the packages
    too_long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert too_long == {}, f"over {MAX_LINES} lines (split them): {too_long}"


def test_pytest_collects_tests_only():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["testpaths"] == ["tests"] and "bench" in options["norecursedirs"]
    assert [p for p in (ROOT / "bench").rglob("test_*.py")] == [], "tests of bench/ belong in tests/"
