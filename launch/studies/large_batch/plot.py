"""The plot: test accuracy per epoch, mean over seeds with the min-max band."""

import os

import numpy as np
from absl import flags

from tfscale.launch.studies.large_batch import variants

FLAGS = flags.FLAGS


def plot_panels():
    """(title, precision, variants) of each panel of the plot."""
    alexnet = [v for v in variants.from_flags() if not v.softmax]
    softmax = [v for v in variants.from_flags() if v.softmax]
    panels = [(f"{FLAGS.model}, {p}", p, alexnet)
              for p in FLAGS.precisions if alexnet]
    if softmax:
        panels.append(("softmax regression, float32", "float32", softmax))
    return panels


def write_plot(runs, path):
    """Test accuracy per epoch: mean over seeds, min-max band."""
    # Imported here, not at the top: choosing the Agg backend is a setting of
    # the whole process, made when a plot is written rather than whenever a
    # module imports this one (its backend must be chosen before pyplot is
    # imported).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    panels = plot_panels()
    figure, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5),
                                squeeze=False)
    for axis, (title, precision, panel_variants) in zip(axes[0], panels):
        for variant in panel_variants:
            curves = np.array([r.accuracy for r in runs[(variant, precision)]])
            epochs = np.arange(1, curves.shape[1] + 1)
            line, = axis.plot(epochs, curves.mean(axis=0),
                              "--" if variant.large else
                              "-." if variant.grows else "-",
                              label=variant.label, linewidth=2)
            axis.fill_between(epochs, curves.min(axis=0), curves.max(axis=0),
                              color=line.get_color(), alpha=0.15)
        axis.set_title(title)
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        if not panel_variants[0].softmax:  # the softmax group: zoomed
            axis.set_ylim(0, 100)
        axis.grid(alpha=0.3)
        axis.set_ylabel("test accuracy (%)")
        axis.legend(loc="lower right", fontsize="small")
    figure.suptitle(f"digits, {FLAGS.epochs} epochs, {FLAGS.seeds} seeds: "
                    "mean, min-max band (dashed: large batch, dash-dot: "
                    "--batch_growth events)")
    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
