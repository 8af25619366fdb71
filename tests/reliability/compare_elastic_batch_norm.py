"""How far a 3 -> 2 worker resume ends from the 3-worker run, with and without
BatchNorm: the numbers docs/failures.md's row quotes.

Usage (from the repository root, one multi-worker job at a time):
    python tests/reliability/compare_elastic_batch_norm.py

For each model of tests/workers/elastic_resume.py (no BatchNorm, BatchNorm,
BatchNormalization(synchronized=True)) it trains 40 steps on 3 workers,
checkpointing step 20, resumes that checkpoint on 2 workers to step 40, and
prints the largest difference between the two runs' final weights and between
their BatchNorm moving statistics. Same global batches in the same order, so
only what depends on how a batch is split between workers can differ: plain
BatchNorm normalizes with each worker's share of the batch.
"""

import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from multiworker import assert_succeeded  # noqa: E402
from multiworker import run_workers  # noqa: E402

STEPS = 40
SAVE_AT = 20
MODELS = {"no BatchNorm": [], "BatchNorm": ["batch_norm"],
          "BatchNorm(synchronized=True)": ["sync_batch_norm"]}


def max_difference(a, b, names):
    return max((float(np.max(np.abs(np.asarray(a[n]) - np.asarray(b[n]))))
                for n in names), default=0.0)


def compare(options, directory):
    checkpoints = directory / "checkpoints"
    runs = []
    for num_workers, save_at in ((3, SAVE_AT), (2, -1)):
        run = run_workers("elastic_resume.py", num_workers, directory,
                          args=[str(checkpoints), str(STEPS), str(save_at), *options])
        assert_succeeded(run)
        runs.append(run.results[0]["variables"])
    three, two = runs
    moving = [n for n in three if "moving" in n]
    weights = [n for n in three if n not in moving]
    return max_difference(three, two, weights), max_difference(three, two, moving)


def main():
    print(f"3 workers for {STEPS} steps vs 3 workers to step {SAVE_AT}, then 2 "
          "workers to the end; largest absolute difference:")
    for name, options in MODELS.items():
        with tempfile.TemporaryDirectory() as directory:
            weights, moving = compare(options, pathlib.Path(directory))
        statistics = f", moving statistics {moving:.2g}" if "BatchNorm" in name else ""
        print(f"  {name}: weights {weights:.2g}{statistics}", flush=True)


if __name__ == "__main__":
    main()
