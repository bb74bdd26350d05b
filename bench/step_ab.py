"""A decode step of the bench checkpoint with this tree's `llm` against a baseline commit's, in one run.

The baseline's `llm`, `encoders` and `schemas` are exported with `git archive` into bench_results/baseline-<rev>
(the model reads its weights with `encoders.weights` now, with `schemas.weights` before); each round
runs one child process per tree (bench/step_child.py), alternating, so a burst of other load hits both alike;
the figure per case is the median over rounds of each child's median.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("step_child.py")


def baseline_tree(rev: str, out_dir: Path) -> Path:
    """This repository's `llm`, `encoders` and `schemas` at `rev`, exported once (no checkout of the work tree)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = out_dir / f"baseline-{sha}"
    if not (tree / "llm" / "__init__.py").is_file():
        archive = subprocess.run(
            ["git", "archive", sha, "llm", "encoders", "schemas"], cwd=ROOT, check=True, capture_output=True
        ).stdout
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
    return tree


def compare(
    checkpoint: Path, baseline: Path, *, threads: int, rounds: int, reps: int, dtypes: str, batches: str
) -> dict[str, dict[str, tuple[float, float]]]:
    """{"was"|"now": {"<dtype> b<batch>": (median ms, ops per layer)}}."""
    runs: dict[str, list[dict]] = {"was": [], "now": []}
    for _ in range(rounds):
        for label, tree in (("was", baseline), ("now", ROOT)):
            out = subprocess.run(
                [
                    sys.executable,
                    str(CHILD),
                    str(tree.resolve()),
                    str(checkpoint.resolve()),
                    str(threads),
                    str(reps),
                    dtypes,
                    batches,
                ],
                check=True,
                capture_output=True,
                text=True,
                cwd=tree,
            ).stdout
            runs[label].append(json.loads(out.strip().splitlines()[-1]))
    return {
        label: {case: (statistics.median(r[case][0] for r in rs), rs[0][case][1]) for case in rs[0]}
        for label, rs in runs.items()
    }


def report(results: dict, rev: str) -> list[str]:
    was, now = results["was"], results["now"]
    lines = [
        f"| case | ops per layer, {rev} | ops per layer, now | ms, {rev} | ms, now | speed-up |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for case in now:
        lines.append(
            f"| {case} | {was[case][1]:.1f} | {now[case][1]:.1f} | {was[case][0]:.2f} | "
            f"{now[case][0]:.2f} | {was[case][0] / now[case][0]:.2f}x |"
        )
    b1, b32 = "bfloat16 b1", "bfloat16 b32"
    if b1 in now and b32 in now:
        lines.append(
            f"\ndecode step: {now[b1][1]:.0f} ops per layer; bf16 batch 1 {now[b1][0]:.1f} ms "
            f"(was {was[b1][0]:.1f}); bf16 batch 32 {now[b32][0]:.1f} ms (was {was[b32][0]:.1f})"
        )
    return lines


__all__ = ["baseline_tree", "compare", "report"]
