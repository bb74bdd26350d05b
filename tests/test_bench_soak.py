"""A short soak (`make soak` is the long one): mixed good, bad, cancelled and streaming requests leave no 5xx,
no replica or object-store growth past the bounds of bench/soak.py, and no sequence or KV block held."""

from __future__ import annotations

import pytest

from bench.soak import Bounds, Mix, report, soak

pytestmark = pytest.mark.e2e


def test_short_soak_leaves_nothing_behind(base_url):
    # NOTE: the Ray cluster is the session's, shared with the other tests: the bounds are on deltas, not totals.
    # 64 MiB, not make soak's 150: 300 requests grow a replica by about 10 (2-core VM, 2026-11-22).
    result = soak(base_url, "vlm", requests=300, concurrency=8, seed=1, warmup=40, bounds=Bounds(max_rss_growth_mib=64))
    print(report(result))
    by_category = {c: [o for o in result.outcomes if o.category == c] for c in ("good", "stream", "cancel", "bad")}
    assert all(by_category.values()), {c: len(v) for c, v in by_category.items()}
    assert [o for o in result.outcomes if o.status.startswith("5")] == [], report(result)
    assert {o.status for o in by_category["good"] + by_category["stream"]} == {"200"}, report(result)
    assert {o.kind for o in by_category["bad"]} == {kind for kind, _, _ in Mix(0).bad}  # every kind was sent...
    assert all(o.ok for o in by_category["bad"]), report(result)  # ...and got its own 4xx with an error body
    assert result.violations == [], report(result)  # memory, object store, KV blocks, and the above
