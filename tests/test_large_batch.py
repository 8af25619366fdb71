"""The large-batch study on Fashion-MNIST (launch/studies/large_batch/):
its flags, its runs as rows on disk, its page, and one row on 1 and 2
workers giving the same weights."""

import json
import os
import sys

import pytest

import multiworker
from skips import needs_fashion_mnist
from tfscale.launch.studies.large_batch import compare
from tfscale.launch.studies.large_batch import report
from tfscale.launch.studies.large_batch import results
from tfscale.launch.studies.large_batch import rows


def run_study(tmp_path, *args, timeout=300):
    """The study as a process of its own (`multiworker.run`)."""
    return multiworker.run(
        [sys.executable, "-m", "tfscale.launch.studies.large_batch", *args],
        tmp_path, multiworker.worker_env(tmp_path), timeout)


@pytest.mark.multiworker
@needs_fashion_mnist
def test_each_run_is_a_row_on_disk_and_a_rerun_trains_nothing(tmp_path):
    # One row, which trains 2 epochs of all 60,000 images (about 130 s on
    # one process): the baseline's place in the table is checked without
    # training (test_the_table_puts_each_row_at_its_best_rate_beside_the_baseline).
    page = tmp_path / "page.md"
    page.write_text("# Results\n\nOur reading.\n\n<!-- results -->\nold\n"
                    "<!-- /results -->\n\nMore of our text.\n")
    args = ["--rows=batch_growth@16384", "--epochs=2",
            "--warmup_epochs=0.5", "--growth=1:16", "--seeds=1",
            "--sgd_learning_rates=0.05", "--results=runs.jsonl",
            f"--doc={page}", "--plot=plot.png"]
    process = run_study(tmp_path, *args)
    assert process.returncode == 0, process.stdout[-4000:]
    assert "1 run selected, 0 already in runs.jsonl, 1 to run." in process.stdout
    records = [json.loads(line) for line in
               (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["row"] for r in records] == ["batch_growth@16384"]
    # One epoch of 60000 // 1024 = 58 updates of 1024, then the same
    # 59,392 examples in 3 updates of 16384.
    assert [r["updates"] for r in records] == [58 + 3]
    assert all(len(r["accuracy"]) == 2 and r["workers"] == 1 for r in records)
    # It learns; the page keeps its own text around the results.
    assert records[0]["final_accuracy"] > 80
    text = page.read_text()
    assert text.startswith("# Results\n\nOur reading.\n\n<!-- results -->")
    assert text.endswith("<!-- /results -->\n\nMore of our text.\n")
    assert "old" not in text
    assert ("Command: `python -m tfscale.launch.studies.large_batch "
            + " ".join(args) + "`") in text
    # The batch-128 rate scaled linearly to the first batch, 1024, and kept
    # while the batch grows.
    assert "| 1024→16384 | 0.4 | 0.4 |" in text
    assert "![test accuracy against batch size](plot.png)" in text
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")

    again = run_study(tmp_path, *args)
    assert again.returncode == 0, again.stdout[-4000:]
    assert "1 run selected, 1 already in runs.jsonl, 0 to run." in again.stdout
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 1


def test_the_table_puts_each_row_at_its_best_rate_beside_the_baseline():
    def record(row, rate, peak, accuracy, updates):
        return {"row": row, "learning_rate": rate, "peak_learning_rate": peak,
                "final_accuracy": accuracy, "updates": updates, "seconds": 10.0}

    table = report.table(
        [rows.Row("sgd", 128), rows.Row("batch_growth", 16384)],
        [record("sgd@128", 0.05, 0.05, 89.0, 936),
         record("sgd@128", 0.1, 0.1, 88.0, 936),
         record("batch_growth@16384", 0.05, 0.4, 86.5, 61)])
    assert table[2:] == [
        # The baseline at its best rate, unscaled, of the two tried.
        "| SGD, batch 128 (baseline) | 128 | 0.05, 0.1 | 0.05 "
        "| 89.00 ± 0.00 (89.00-89.00) |  | 936 | 10 |",
        "| SGD, batch grown from 1024 (Smith et al.), batch 16384 | 1024→16384 "
        "| 0.4 | 0.4 | 86.50 ± 0.00 (86.50-86.50) | -2.50 | 61 | 10 |"]


def test_a_line_cut_short_by_a_crash_costs_only_its_own_run(tmp_path):
    path = str(tmp_path / "runs.jsonl")
    results.append(path, {"key": "a", "final_accuracy": 90.0})
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"key": "b", "final_acc')  # the process died here
    assert list(results.load(path)) == ["a"]
    results.append(path, {"key": "b", "final_accuracy": 80.0})
    assert results.load(path) == {"a": {"key": "a", "final_accuracy": 90.0},
                                  "b": {"key": "b", "final_accuracy": 80.0}}
    # One line per record, the cut one on its own: no blank lines.
    lines = open(path, encoding="utf-8").read().splitlines()
    assert len(lines) == 3 and all(lines), lines


@pytest.mark.multiworker
@needs_fashion_mnist
def test_one_row_on_two_workers_gives_the_one_worker_weights_up_to_rounding(tmp_path):
    # The same global batches (example-level sharding) and BatchNorm over the
    # global batch: only the order of float sums differs, and what that
    # rounding becomes after 7 LARS updates. In float64 (but fc2, float32 by
    # design) the batch-8192 row at learning rate 10 moved no weight by more
    # than 0.002 (docs/large_batch.md, "On 2 workers"); this batch-1024 row
    # on the first 7 x 1024 images (an eighth of the computation) by 6.6e-7.
    args = ["--rows=lars@1024", "--train_examples=7168", "--epochs=1",
            "--warmup_epochs=0.5", "--float64", "--seeds=1",
            "--lars_learning_rates=10", "--doc=", "--plot="]
    for workers in (1, 2):
        run = multiworker.run_module(
            "tfscale.launch.studies.large_batch", workers, tmp_path,
            [*args, f"--results={tmp_path / f'runs{workers}.jsonl'}",
             f"--weights_dir={tmp_path / f'weights{workers}'}"], timeout=300)
        assert run.returncode == 0, run.output[-6000:]
    one, two = (json.loads((tmp_path / f"runs{w}.jsonl").read_text())
                for w in (1, 2))
    assert (one["workers"], two["workers"]) == (1, 2)
    assert one["precision"] == two["precision"] == "float64"
    assert one["train_examples"] == two["train_examples"] == 7168
    assert one["updates"] == two["updates"] == 7
    (name,) = os.listdir(tmp_path / "weights1")
    absolute, _ = compare.differences(
        tmp_path / "weights1" / name, tmp_path / "weights2" / name)
    assert absolute < 1e-3, absolute
    assert abs(one["final_accuracy"] - two["final_accuracy"]) <= 0.05


@pytest.mark.multiworker
def test_help_describes_the_study_and_lists_its_flags(tmp_path):
    process = run_study(tmp_path, "--help", timeout=120)
    assert "Large-batch study on Fashion-MNIST" in process.stdout
    for flag in ("--rows", "--quick", "--results", "--weights_dir", "--doc",
                 "--plot", "--lars_learning_rates"):
        assert flag in process.stdout, flag


# Bad flags, refused before TensorFlow is imported: tests/test_imports.py.
