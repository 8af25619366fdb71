"""The plot: test accuracy against batch size, one line per method."""

import os

from tfscale import _requirements
from tfscale.launch.studies.large_batch import report
from tfscale.launch.studies.large_batch import rows as study_rows


def write_plot(records, path):
    """Mean final test accuracy at each row's best learning rate against its
    batch (log scale), min-max over seeds as error bars."""
    matplotlib = _requirements.import_extra("matplotlib", "plots", "The plot")
    # The Agg backend: chosen when a plot is written, not on import (a
    # setting of the whole process, made before pyplot is imported).
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = report.best(records)
    figure, axis = plt.subplots(figsize=(8, 5))
    lines = {}
    for row in study_rows.all_rows():
        if row.id not in chosen:
            continue
        finals = [r["final_accuracy"] for r in chosen[row.id][1]]
        name = (study_rows.LABELS[row.method] if row.precision == "float32"
                else f"{study_rows.LABELS[row.method]}, {row.precision}")
        if row.method == "sgd":  # the baseline starts the linear-scaling line
            name = study_rows.LABELS["sgd"]
        lines.setdefault(name, []).append(
            (row.batch, report.mean(finals), min(finals), max(finals)))
    for name, points in lines.items():
        points.sort()
        x = [p[0] for p in points]
        y = [p[1] for p in points]
        errors = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
        axis.errorbar(x, y, yerr=errors, marker="o", capsize=3, label=name)
    baseline = chosen.get(f"sgd@{study_rows.BASELINE_BATCH}")
    if baseline:
        axis.axhline(report.mean(r["final_accuracy"] for r in baseline[1]),
                     color="grey", linestyle=":", label="baseline, batch 128")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("global batch size")
    axis.set_ylabel("test accuracy (%), best learning rate")
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small", loc="lower left")
    epochs = {r["epochs"] for r in records}
    axis.set_title(f"Fashion-MNIST, alexnet_bn_small, {'/'.join(map(str, sorted(epochs)))} "
                   "epochs: mean over seeds, min-max bars")
    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
