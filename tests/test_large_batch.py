"""Smoke test of launch/studies/large_batch.py: tiny settings, real digits."""

import pytest
import os
import subprocess
import sys

pytestmark = pytest.mark.multiworker


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_study(tmp_path, *args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO_ROOT)
    return subprocess.run(
        [sys.executable, "-m", "launch.studies.large_batch", *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=120)


def test_writes_the_doc_and_the_plot(tmp_path):
    args = ["--epochs=2", "--warmup_epochs=1", "--seeds=1", "--precisions=float32",
            "--settings=sgd_small,lars_large,rmsprop_warmup_large,"
            "softmax_sgd_small,softmax_halp_large,batch_growth_small,"
            "powersgd_lars_large",
            "--batch_growth=1:2", "--small_batch=256", "--powersgd_ranks=1",
            "--powersgd_start_step=2",
            "--learning_rates=0.05", "--lars_learning_rates=3",
            f"--doc={tmp_path / 'out' / 'study.md'}",
            f"--plot={tmp_path / 'out' / 'study.png'}"]
    process = run_study(tmp_path, *args)
    assert process.returncode == 0, process.stdout[-4000:]
    doc = (tmp_path / "out" / "study.md").read_text()
    assert "python -m launch.studies.large_batch " + " ".join(args) in doc
    assert "![test accuracy per epoch](study.png)" in doc
    # The doc holds the printed lines, the runs and the verdicts among them.
    for line in ("[1/7] SGD, batch 256, lr 0.05, float32, seed 0",
                 "[2/7] LARS, batch 479, lr 3 + warmup, float32, seed 0",
                 "[3/7] RMSprop warm-up, batch 479, lr 0.05 x 479/256, slow "
                 "start, float32, seed 0",
                 "[5/7] HALP, 8-bit, batch 479, lr 2, float32, seed 0",
                 "6 steps/epoch", "3 steps/epoch", "BN recomputed",
                 "float32: baseline SGD, batch 256, lr 0.05",
                 "reconstructed from public Chainer code",
                 # 2 epochs of 6 steps of 256 examples, one gradient each.
                 "12 updates    3072 gradients",
                 # 2 epochs of 3 steps of 479, two gradients each, and one
                 # full pass (every 2 epochs) over the 1437 examples.
                 "6 updates    7185 gradients",
                 "x the baseline's gradient evaluations.",
                 # 6 steps of 256, then 6 * 256 // 512 = 3 steps of 512.
                 "SGD, batch 256 grown 2 at epochs 1, lr 0.05, float32, seed 0",
                 "9 updates",
                 # LARS again, its gradients through a 1-worker PowerSGD
                 # strategy (the chief's log of the plan), set against LARS.
                 "[7/7] LARS, batch 479, lr 3 + warmup, PowerSGD rank 1, "
                 "float32, seed 0",
                 "Against the same run uncompressed ("):
        assert line in process.stdout and line in doc, line
    assert "tfscale PowerSGD, rank 1, from optimizer step 2" in process.stdout
    png = (tmp_path / "out" / "study.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_refuses_bad_flags_before_training(tmp_path):
    process = run_study(tmp_path, "--settings=sgd_small,adam_large")
    assert process.returncode != 0
    assert ("--settings must name some of sgd_small, sgd_large, lars_large, "
            "slow_start_large, rmsprop_warmup_large, lr_decay_small, "
            "batch_growth_small, powersgd_sgd_small, powersgd_lars_large, "
            "softmax_sgd_small") in process.stdout
    assert "Received: settings=['sgd_small', 'adam_large']" in process.stdout
    process = run_study(tmp_path, "--epochs=2")
    assert process.returncode != 0
    assert ("--warmup_epochs must be shorter than --epochs. Received: "
            "warmup_epochs=2.0, epochs=2") in process.stdout
    assert "[1/" not in process.stdout
    process = run_study(tmp_path, "--settings=batch_growth_small",
                        "--batch_growth=20:2")
    assert process.returncode != 0
    assert ("--batch_growth cannot run with --epochs=20 and --small_batch=32: "
            "`batch_schedule` event at epoch 20 is not before the end of "
            "training") in process.stdout
    assert "[1/" not in process.stdout
