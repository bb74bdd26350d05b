"""The layers below `deployments` run without a server: a fresh interpreter in which Ray cannot be imported imports
the engine and the encoders' model code (nano-vllm's engine runs without one, and so does ours), and one without
torch, transformers or Ray imports `schemas`. `make lint`'s import-linter contracts (pyproject.toml) name the rule an
import breaks; these check what a process does when it runs them, optional imports included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in the fresh interpreter: `blocked` (argv[1]) cannot be imported, as where they are not installed, and any
# attempt is reported, caught or not (a `try: import ray` fallback is an import of Ray too); then `modules` (argv[2]).
ABSENT = """
import sys

blocked, modules = set(sys.argv[1].split(",")), sys.argv[2].split(",")
tried = []


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            tried.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Absent())
for module in modules:
    __import__(module)
assert tried == [], f"tried to import {sorted(set(tried))}"
"""


def _import_without(blocked: tuple[str, ...], modules: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", ABSENT, ",".join(blocked), ",".join(modules)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_engine_and_the_encoders_import_without_ray():
    engine = ("llm.engine", "llm.model", "encoders.runner", "encoders", "schemas")
    run = _import_without(("ray", "deployments"), engine)
    assert run.returncode == 0, run.stderr[-3000:]


def test_schemas_import_without_torch_transformers_or_ray():
    run = _import_without(("torch", "transformers", "safetensors", "numpy", "ray"), ("schemas",))
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_ray_import_in_the_engine_fails_the_check(tmp_path):
    """The check can fail: a module that imports Ray, even behind a fallback, is refused."""
    (tmp_path / "uses_ray.py").write_text("try:\n    import ray\nexcept ImportError:\n    ray = None\n")
    run = subprocess.run(
        [sys.executable, "-c", ABSENT, "ray", "uses_ray"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert run.returncode != 0 and "tried to import ['ray']" in run.stderr
