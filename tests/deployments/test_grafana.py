"""The Grafana dashboard asks only for metrics the app exports: every ray_vlm_* series in its queries is declared
in deployments/metrics.py (Ray adds the ray_ prefix), and each panel's queries are well-formed."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deployments" / "grafana" / "vlm-dashboard.json"


def test_the_dashboard_queries_only_exported_metrics():
    declared = set(
        re.findall(r'(?:Histogram|Counter|Gauge)\(\s*"(vlm_\w+)"', (ROOT / "deployments" / "metrics.py").read_text())
    )
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"ray_(vlm_\w+)", e)}
    assert used and used <= declared, used - declared
    # Every declared metric has a panel: an operator sees all of them.
    assert declared <= used, declared - used
    for expr in exprs:
        assert expr.count("(") == expr.count(")"), expr
    histograms = set(re.findall(r'Histogram\(\s*"(vlm_\w+)"', (ROOT / "deployments" / "metrics.py").read_text()))
    for name in re.findall(r"ray_(vlm_\w+)_bucket", " ".join(exprs)):
        assert name in histograms, name  # histogram_quantile only over histograms
