"""The start-up check runs once per key on a node: a second runner of the same checkpoint, device, dtype and limits
reuses the first's result (its worst batch is not encoded again, its throughput not re-measured); a changed limit, a
changed checkpoint, or a stored result that cannot be read checks again."""

from __future__ import annotations

import json
import logging

from encoders import EncoderRunner, ModelSpec, Qwen2VLVisionEncoder
from encoders.startup_checks import StartupChecks
from schemas import EncoderArgs


class _Counting(Qwen2VLVisionEncoder):
    batches: list[list[int]] = []  # the patches of each image of each forward

    def forward(self, batch):
        _Counting.batches.append([pixels.shape[0] for pixels, _ in batch])
        return super().forward(batch)


def _start(checkpoint, checks: StartupChecks, **opts) -> tuple[EncoderRunner, list[list[int]]]:
    _Counting.batches = []
    spec = ModelSpec.load(checkpoint, device="cpu", dtype="float32")
    runner = EncoderRunner(spec, EncoderArgs(**opts), model_factory=_Counting, checks=checks)
    return runner, _Counting.batches


def test_a_second_replica_reuses_the_check_and_a_changed_limit_checks_again(checkpoint, tmp_path, caplog):
    checks = StartupChecks(tmp_path)
    first, batches = _start(checkpoint, checks)
    assert first.startup_check == "ran" and len(batches) == 2  # the worst batch, then the throughput's
    largest = max(batches[0])
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        second, batches = _start(checkpoint, checks)
    assert second.startup_check == "reused" and second.gflops == first.gflops
    assert len(batches) == 1 and max(batches[0]) < largest  # one small warm-up image, not the worst batch
    assert "result of" in caplog.text and "reused" in caplog.text
    third, batches = _start(checkpoint, checks, max_batch_patches=1000)
    assert third.startup_check == "ran" and len(batches) == 2
    assert len(list(tmp_path.glob("*.json"))) == 2  # one result a key


def test_a_changed_checkpoint_checks_again(checkpoint, tmp_path):
    checks = StartupChecks(tmp_path)
    _start(checkpoint, checks)
    config = checkpoint / "preprocessor_config.json"
    config.write_text(config.read_text())  # same content, a new modification time: another checkpoint's files
    runner, batches = _start(checkpoint, checks)
    assert runner.startup_check == "ran" and len(batches) == 2


def test_an_unreadable_result_checks_again_and_is_replaced(checkpoint, tmp_path):
    checks = StartupChecks(tmp_path)
    _start(checkpoint, checks)
    (stored,) = tmp_path.glob("*.json")
    stored.write_text("{not json")
    runner, _ = _start(checkpoint, checks)
    assert runner.startup_check == "ran"
    assert json.loads(stored.read_text())["gflops"] == runner.gflops


def test_without_a_store_every_runner_checks(checkpoint):
    _Counting.batches = []
    spec = ModelSpec.load(checkpoint, device="cpu", dtype="float32")
    for _ in range(2):
        assert EncoderRunner(spec, EncoderArgs(), model_factory=_Counting).startup_check == "ran"
    assert len(_Counting.batches) == 4
