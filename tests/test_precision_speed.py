"""Smoke test of launch/studies/precision_speed.py: one tiny step per precision."""

import sys

import pytest

import multiworker

pytestmark = pytest.mark.multiworker


def test_reports_each_precision_against_the_first_and_with_determinism(tmp_path):
    # A process of its own (`multiworker.run`): the study turns op determinism on.
    process = multiworker.run(
        [sys.executable, "-m", "tfscale.launch.studies.precision_speed", "--model=alexnet_bn",
         "--image_size=67", "--fc_units=8", "--num_classes=10",
         "--batch_size=2", "--steps=1", "--warmup_steps=1", "--rounds=1",
         "--deterministic_too"],
        tmp_path, multiworker.worker_env(tmp_path), timeout=300)
    assert process.returncode == 0, process.stdout[-4000:]
    lines = process.stdout.splitlines()
    assert any(l.startswith("alexnet_bn, 67x67, batch 2, 1 x 1 timed steps")
               for l in lines)
    f32 = [l for l in lines if l.startswith("  float32 ")]
    bf16 = [l for l in lines if l.startswith("  mixed_bfloat16 ")]
    assert len(f32) == 1 and "1.00x float32" in f32[0]
    assert len(bf16) == 1 and "images/s" in bf16[0]
    # Each precision again under op determinism, against itself without.
    f32_det = [l for l in lines if l.startswith("  float32, deterministic ")]
    bf16_det = [l for l in lines if l.startswith("  mixed_bfloat16, deterministic ")]
    assert len(f32_det) == 1 and "x without determinism" in f32_det[0]
    assert len(bf16_det) == 1 and "x without determinism" in bf16_det[0]
