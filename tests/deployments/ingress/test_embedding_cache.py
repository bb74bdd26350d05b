"""The ingress's embedding cache of references: bounded by bytes with each call's object counted once and whole,
least recently used out first, and a failed call's entries forgotten together."""

from __future__ import annotations

from deployments.ingress.generate import EmbeddingRefs


def test_a_calls_object_counts_once_and_goes_with_its_last_entry():
    cache = EmbeddingRefs(max_bytes=1000)
    cache.put(["a", "b"], "call1", 600)  # one call, two images: 600 bytes together
    assert cache.get("a") == ("call1", 0) and cache.get("b") == ("call1", 1)
    assert cache.stats()["bytes"] == 600 and cache.stats()["objects"] == 1
    cache.put(["c"], "call2", 300)
    assert cache.stats()["bytes"] == 900
    cache.get("a")  # the least recent now: b, then a, then c
    cache.get("c")
    cache.put(["d"], "call3", 300)  # 1200: b goes, which frees nothing (a holds call1), so a goes too
    assert [cache.get(k) for k in "abcd"] == [None, None, ("call2", 0), ("call3", 0)]
    stats = cache.stats()
    assert (stats["bytes"], stats["objects"], stats["evictions"]) == (600, 2, 2)


def test_least_recently_used_goes_first():
    cache = EmbeddingRefs(max_bytes=1000)
    for key in "abcd":
        cache.put([key], f"call-{key}", 300)  # the fourth pushes the first out
    assert cache.get("a") is None and cache.get("b") == ("call-b", 0)
    cache.put(["e"], "call-e", 300)  # b was just used: c goes
    assert cache.get("c") is None and cache.get("b") == ("call-b", 0) and cache.stats()["bytes"] == 900


def test_a_call_over_the_budget_is_not_kept_and_a_known_key_keeps_its_entry():
    cache = EmbeddingRefs(max_bytes=1000)
    cache.put(["big"], "call1", 1001)
    assert cache.get("big") is None and cache.stats()["bytes"] == 0
    cache.put(["a"], "call2", 100)
    cache.put(["a", "b"], "call3", 200)  # a was there: it stays with call2; b is call3's position 1
    assert cache.get("a") == ("call2", 0) and cache.get("b") == ("call3", 1)
    cache.put(["a"], "call4", 100)  # nothing new: call4 is not kept at all
    assert cache.stats()["objects"] == 2 and cache.stats()["bytes"] == 300


def test_discard_forgets_every_entry_of_the_calls():
    cache = EmbeddingRefs(max_bytes=1000)
    cache.put(["a", "b"], "call1", 400)
    cache.put(["c"], "call2", 100)
    cache.discard(["call1", "never-cached"])
    assert cache.get("a") is None and cache.get("b") is None and cache.get("c") == ("call2", 0)
    assert cache.stats()["bytes"] == 100 and cache.stats()["objects"] == 1
