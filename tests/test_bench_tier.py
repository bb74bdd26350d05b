"""bench/tier.py's parts that need no cluster: the workload, the CPU accounting by process, and the report's ratios."""

from __future__ import annotations

import base64
import io
from argparse import Namespace

from PIL import Image

from bench import proc_cpu, tier
from bench.metrics import RequestResult


def test_process_roles_come_from_rays_process_titles():
    assert proc_cpu.role_of("ray::ServeReplica:tier:Encoder") == "Encoder"
    assert proc_cpu.role_of("ray::ServeReplica:tier:LLM ") == "LLM"
    assert proc_cpu.role_of("ray::ProxyActor") == "proxy"
    assert proc_cpu.role_of("/v/bin/raylet --x", "raylet") == "raylet"
    assert proc_cpu.role_of("ray::IDLE") == "worker" and proc_cpu.role_of("python -m bench.tier") == "other"


def test_cpu_is_counted_between_snapshots_by_role_and_cpus():
    before = {1: proc_cpu.Proc(1, 0, 2.0, "LLM", "0"), 2: proc_cpu.Proc(2, 0, 1.0, "Encoder", "1")}
    after = {
        1: proc_cpu.Proc(1, 0, 5.0, "LLM", "0"),
        2: proc_cpu.Proc(2, 0, 1.5, "Encoder", "1"),
        3: proc_cpu.Proc(3, 0, 0.25, "Encoder", "1"),  # started in between: counted from zero
    }
    assert proc_cpu.cpu_by_role(before, after) == {"LLM": 3.0, "Encoder": 0.75}
    assert proc_cpu.cpu_by_role(before, after, by_cpus=True) == {"LLM@0": 3.0, "Encoder@1": 0.75}


def test_the_snapshot_finds_this_machines_processes():
    mine = proc_cpu.snapshot([1])  # init and its descendants: every process but the caller
    assert mine and all(p.cpu_s >= 0 for p in mine.values())


def _sizes(body: dict) -> list[tuple[int, int]]:
    urls = [p["image_url"]["url"] for p in body["messages"][0]["content"] if p.get("type") == "image_url"]
    return [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).size for u in urls]


def test_image_requests_carry_one_to_four_small_or_large_fresh_images():
    bodies, counts = tier.image_bodies(40, seed=0, max_tokens=16)
    sizes = [_sizes(b) for b in bodies]
    assert [len(s) for s in sizes] == counts and set(counts) == {1, 2, 3, 4}
    assert {size for s in sizes for size in s} == {tier.SMALL, tier.LARGE}
    again, _ = tier.image_bodies(40, seed=0, max_tokens=16)
    assert again == bodies and tier.image_bodies(40, seed=1, max_tokens=16)[0] != bodies  # seeded, not fixed
    assert [_sizes(b) for b in tier.cpu_bodies(2, 0, "x")] == [tier.CPU_SIZES] * 2


def _window(rate: float, ttft_p99: float, tpot_p99: float, good: float) -> dict:
    agg = {"ttft_ms": {"p50": ttft_p99 / 2, "p99": ttft_p99}, "tpot_ms": {"p50": tpot_p99 / 2, "p99": tpot_p99},
           "failed": 0}  # fmt: skip
    return {"rate": rate, "image": agg, "text": agg, "goodput_req_per_s": 2.0, "good_share": good,
            "out_tok_per_s": 100.0, "images_per_s": 1.0, "cores_by_process": {"LLM@0": 0.9},
            "prefill_share": [0.2]}  # fmt: skip


def _layout(cpu_ms: float, unloaded_p99: float, windows: list[dict]) -> dict:
    cpu = {"images_per_s": 10.0, "total_ms_per_image": cpu_ms, "cpu_ms_per_image": {"LLM": cpu_ms}, "failed": 0}
    unloaded = {"tpot_ms": {"p50": unloaded_p99 / 2, "p99": unloaded_p99}}
    return {"cpu": {"miss": cpu, "hit": cpu}, "text_unloaded": unloaded, "rates": windows,
            "goodput_rate": tier.goodput_rate(windows, 0.9)}  # fmt: skip


def test_the_last_line_has_the_four_ratios():
    opts = Namespace(text_streams=3, text_tokens=48, unloaded_s=20, window_s=40, image_tokens=16, ttft_bound=2.0,
                     tpot_bound=0.05, rates=[0.3, 0.6], scale_image_s=0.125, scale_concurrency=32,
                     rounds=2, attainment=0.9, judged_rate=0.6)  # fmt: skip
    results = {
        "tier": _layout(90.0, 20.0, [_window(0.3, 3000, 30, 0.95), _window(0.6, 4000, 25, 0.92)]),
        "colocated": _layout(75.0, 20.0, [_window(0.3, 9000, 80, 0.5), _window(0.6, 20000, 100, 0.2)]),
        "dp2": _layout(80.0, 20.0, [_window(0.3, 5000, 50, 0.94), _window(0.6, 8000, 60, 0.7)]),
    }
    scale = {
        k: {"images_per_s": 10.0 * k * 0.9 ** (k - 1), "cpu_ms_per_image": {"Ingress": 5.0},
            "engine_steps_ms_per_image": 1.0, "tier_own_ms_per_image": 15.0}
        for k in (1, 2, 4)
    }  # fmt: skip
    text, last = tier.report(results, scale, opts, "header")
    # cpu 90/75; 4 replicas 4 * 0.729; TPOT p99 at the judged rate (0.6) 25/20; goodput: 0.6 (both rates good) against
    # 0.3 + 0.3 * (0.94 - 0.9) / (0.94 - 0.7) = 0.35
    assert last == (
        "tier: cpu/image tier/colocated 1.20x; images/s 4 replicas/1 2.92x; TPOT p99 loaded/unloaded 1.25x; "
        "goodput tier/DP2 1.71x"
    )
    assert "1.25x" in text and "scale-out" in text  # the sweep's rows, and the scale-out's


def _result(ttft: float, tpot: float, sent: float = 0.0) -> RequestResult:
    return RequestResult(0, ok=True, sent=sent, ttft=ttft, e2e=ttft + 15 * tpot, output_tokens=16, expected_tokens=16)


def test_passes_are_pooled_not_averaged():
    """Two passes of a layout: their requests together for the percentiles and goodput, CPU seconds summed."""
    opts = Namespace(ttft_bound=2.0, tpot_bound=0.05, rates=[0.5], attainment=0.9)

    def one_pass(ttft: float, cpu_s: float) -> dict:
        cpu = {"cpu": {"LLM": cpu_s}, "images": 30, "wall": 10.0, "failed": 0}
        window = {"rate": 0.5, "span": 20.0, "images": [_result(ttft, 0.02)] * 10, "counts": [2] * 10,
                  "text": [_result(0.1, 0.03)] * 10, "cpu": {"LLM@0": 18.0}, "prefill": [4.0]}  # fmt: skip
        traffic = {"unloaded": [_result(0.1, 0.02)] * 5, "unloaded_s": 10.0, "rates": [window]}
        return {"cpu": {"miss": cpu, "hit": cpu}, "traffic": traffic}

    merged = tier.merge([one_pass(1.0, 3.0), one_pass(3.0, 6.0)], opts)
    assert merged["cpu"]["miss"]["total_ms_per_image"] == 150.0  # 9 s over 60 images
    [window] = merged["rates"]
    assert window["image"]["ttft_ms"]["p50"] == 2000.0  # half at 1 s, half at 3 s
    assert window["goodput_req_per_s"] == 30 / 40  # the first pass's 10 images and both passes' 20 texts, in 40 s
    assert (
        window["images_per_s"] == 1.0
        and window["prefill_share"] == [0.2]
        and window["cores_by_process"] == {"LLM@0": 0.9}
    )


def test_goodput_is_the_rate_where_the_share_of_good_requests_crosses_the_attainment():
    def windows(*shares: float) -> list[dict]:
        return [{"rate": 0.2 * (k + 1), "good_share": g} for k, g in enumerate(shares)]

    assert tier.goodput_rate(windows(0.99, 0.95, 0.93), 0.9) == 0.6000000000000001  # never crossed: the last rate
    assert abs(tier.goodput_rate(windows(0.99, 0.95, 0.85), 0.9) - 0.5) < 1e-9  # halfway from 0.4 to 0.6
    assert tier.goodput_rate(windows(0.8, 0.95), 0.9) == 0.0  # the lowest rate misses it already


def test_cpu_phases_pool_over_passes():
    phases = [{"cpu": {"LLM": 1.0, "Encoder": 0.5}, "images": 30, "wall": 2.0, "failed": 0},
              {"cpu": {"LLM": 2.0}, "images": 30, "wall": 4.0, "failed": 1}]  # fmt: skip
    pooled = tier.pool_cpu(phases)
    assert pooled["total_ms_per_image"] == 3500 / 60 and pooled["cpu_ms_per_image"] == {
        "LLM": 50.0,
        "Encoder": 25.0 / 3,
    }
    assert pooled["images_per_s"] == 10.0 and pooled["failed"] == 1


def test_embedding_bytes_are_the_towers_output(checkpoint, tmp_path):
    """Qwen3-VL's embedding carries its DeepStack levels beside the merged rows: (1 + 2) x 64 columns in the tiny
    checkpoint, at patch 16 (fewer tokens than Qwen2-VL's patch 14 for the same image)."""
    from demo.tiny_qwen3_vl import build_qwen3_vl_checkpoint

    q2 = tier.embedding_bytes(checkpoint)
    q3 = tier.embedding_bytes(build_qwen3_vl_checkpoint(tmp_path / "q3", max_pixels=448 * 448))
    assert q2["width"] == 64 and q3["width"] == 3 * 64
    for f in (q2, q3):
        assert f["bytes_per_image"] == f["tokens_per_image"] * f["width"] * 4
    # 224x224, 160x112 (to 168x112; to 160x128 at 32), 96x96: patch 14: 64, 24, 9 tokens; patch 16: 49, 20, 9
    assert q2["tokens_per_image"] == (64 + 24 + 9) / 3 and q3["tokens_per_image"] == (49 + 20 + 9) / 3


def test_the_families_line_is_qwen3_over_qwen2():
    def fam(ms: float, nbytes: float) -> dict:
        c = {"images_per_s": 1.0, "total_ms_per_image": ms, "cpu_ms_per_image": {"Encoder": ms}}
        return {"cpu": {"miss": c, "hit": c}, "tokens_per_image": 10.0, "width": 64, "bytes_per_image": nbytes}

    text, last = tier.family_report({"qwen2_vl": fam(10.0, 1000.0), "qwen3_vl": fam(15.0, 4000.0)})
    assert last == "families: tier cpu/image qwen3_vl/qwen2_vl 1.50x; bytes/image 4.00x"
    assert "qwen3_vl   miss" in text and tier.family_report({}) == ("", "")
