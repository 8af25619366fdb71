r"""Large-batch study on digits: does LARS close the large-batch gap?

    python -m launch.studies.large_batch   # defaults: 6 min here, 15 under load

The question of You et al. 2017 and Jia et al. 2018, asked of a data set
that fits on this machine: at the same epoch budget a large batch makes far
fewer updates; does large-batch SGD fall short of the small-batch accuracy,
and does LARS (+ warmup, no decay on biases/BatchNorm) close the gap? One
process trains on scikit-learn's digits (1,437 training and 360 test
images, real data): what varies is the batch size and the optimizer, not
the number of workers. Settings, all with momentum 0.9, L2 weight decay on
the gradient (biases and BatchNorm parameters excluded) and a polynomial
decay (power 2) to 0 at the end of the same number of epochs:

- `sgd_small`: SGD, `--small_batch`, for each of `--learning_rates`.
- `sgd_large`: SGD, `--large_batch`, for each of `--learning_rates` scaled
  linearly (`lr * large_batch / small_batch`), `--warmup_epochs` of warmup.
- `lars_large`: LARS, `--large_batch`, for each peak of
  `--lars_learning_rates`, `--warmup_epochs` of warmup, biases and
  BatchNorm excluded from decay and from layer adaptation.

Each runs under every `--precisions` policy and every seed; the baseline a
large-batch run is compared with is the best `sgd_small` learning rate.
An "epoch" is `round(1437 / batch)` steps; the default large batch, 479, is
a third of the training set: 3 steps per epoch against 45 for batch 32
(ImageNet at 64K makes 20). The optimizers come from
`tfscale.recipes.make_optimizer`, the code behind tfscale-train's flags.

The model is a small AlexNet-BN (conv-BN-ReLU-pool blocks, BatchNorm after
the last pool as in Jia et al., two dense layers) on the 8x8 images: the
project's `models.alexnet_bn` at its smallest input (67x67) trains at about
50 images/s on this 2-core machine, and bfloat16 is slower still (no
AVX-512 here, so TensorFlow falls back to Eigen kernels): hours, not
minutes. `--model=alexnet_bn` runs it anyway.

Writes `--doc` (default docs/large_batch.md: the command and exactly what
was printed) and `--plot` (test accuracy per epoch, mean over seeds with
the min-max band).
"""

import dataclasses
import os
import statistics
import sys
import time

from absl import app
from absl import flags

from tfscale import recipes

SETTINGS = ("sgd_small", "sgd_large", "lars_large")

FLAGS = flags.FLAGS

_NUM_TRAIN = 1437  # digits' training split (tfscale.data)
# As models.alexnet_bn. Keras's default, 0.99, leaves the moving statistics
# half at their initial values after the 60 steps of a large-batch run, and
# the test accuracy then measures that lag, not the weights.
_BN_MOMENTUM = 0.9


@dataclasses.dataclass(frozen=True)
class Variant:
    """One setting at one learning rate (the baseline's, for sgd_large)."""

    setting: str
    learning_rate: float

    @property
    def large(self):
        return self.setting != "sgd_small"

    @property
    def batch(self):
        return FLAGS.large_batch if self.large else FLAGS.small_batch

    @property
    def steps_per_epoch(self):
        return max(1, round(_NUM_TRAIN / self.batch))

    def settings(self, precision):
        """The `recipes.Settings` of this variant under `precision`."""
        common = dict(
            precision=precision, momentum=FLAGS.momentum,
            lr_schedule="warmup_poly", end_learning_rate=0.0, poly_power=2.0,
            weight_decay=FLAGS.weight_decay,
            warmup_epochs=FLAGS.warmup_epochs if self.large else 0.0,
        )
        if self.setting == "lars_large":
            return recipes.Settings(optimizer="lars",
                                    learning_rate=self.learning_rate, **common)
        # Linear scaling from the small batch (a no-op for the baseline).
        return recipes.Settings(optimizer="sgd",
                                learning_rate=self.learning_rate,
                                scale_lr=True,
                                base_batch_size=FLAGS.small_batch, **common)

    @property
    def peak_learning_rate(self):
        return self.settings("float32").peak_learning_rate(self.batch)

    @property
    def label(self):
        if self.setting == "sgd_small":
            return f"SGD, batch {self.batch}, lr {self.learning_rate:g}"
        if self.setting == "sgd_large":
            return (f"SGD, batch {self.batch}, lr {self.learning_rate:g} x "
                    f"{self.batch}/{FLAGS.small_batch} + warmup")
        return f"LARS, batch {self.batch}, lr {self.learning_rate:g} + warmup"


def variants():
    """Every variant the flags ask for, in the order of --settings."""
    result = []
    for setting in FLAGS.settings:
        rates = (FLAGS.lars_learning_rates if setting == "lars_large"
                 else FLAGS.learning_rates)
        result += [Variant(setting, float(rate)) for rate in rates]
    return result


class Report:
    """Prints lines and keeps them for the Markdown report."""

    def __init__(self):
        self.lines = []

    def __call__(self, line=""):
        print(line, flush=True)
        self.lines.append(line)


def small_alexnet_bn(num_classes=10, input_shape=(8, 8, 1), width=32,
                     fc_units=64):
    """AlexNet-BN in miniature: conv-BN-ReLU-pool x2, BN, dense, logits."""
    import keras

    inputs = keras.Input(input_shape, name="images")
    x = inputs
    for index, filters in enumerate((width, 2 * width), start=1):
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False,
                                kernel_initializer="he_normal",
                                name=f"conv{index}")(x)
        x = keras.layers.BatchNormalization(momentum=_BN_MOMENTUM,
                                            name=f"conv{index}_bn")(x)
        x = keras.layers.ReLU(name=f"conv{index}_relu")(x)
        x = keras.layers.MaxPooling2D(2, name=f"pool{index}")(x)
    # BN after the last pool, Jia et al.'s change to AlexNet-BN.
    x = keras.layers.BatchNormalization(momentum=_BN_MOMENTUM,
                                        name="pool_bn")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dense(fc_units, activation="relu",
                           kernel_initializer="he_normal", name="fc1")(x)
    # float32 logits under mixed precision: a stable softmax.
    outputs = keras.layers.Dense(num_classes, dtype="float32", name="fc2")(x)
    return keras.Model(inputs, outputs, name="small_alexnet_bn")


def build_model():
    """The model of --model, and the input side it needs."""
    import models

    if FLAGS.model == "alexnet_bn":
        return models.alexnet_bn(num_classes=10, input_shape=(67, 67, 1),
                                 fc_units=64), 67
    return small_alexnet_bn(), 8


def test_accuracy_callback(images, labels):
    """A Keras callback recording test accuracy (%) after every epoch."""
    import keras
    import numpy as np

    class TestAccuracy(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.accuracy = []

        def on_epoch_end(self, epoch, logs=None):
            logits = self.model.predict_on_batch(images)
            correct = np.argmax(logits, axis=1) == labels
            self.accuracy.append(100.0 * float(np.mean(correct)))

    return TestAccuracy()


def train_once(variant, precision, seed):
    """Per-epoch test accuracies (%) and seconds of one run."""
    import keras

    from tfscale import data

    start = time.perf_counter()
    settings = variant.settings(precision)
    recipes.set_precision(settings)
    keras.utils.set_random_seed(seed)
    model, image_size = build_model()
    optimizer, _ = recipes.make_optimizer(
        settings, variant.batch, variant.steps_per_epoch, FLAGS.epochs)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images, labels = data.digits_arrays("test")
    callback = test_accuracy_callback(
        data.preprocess(images, data.spec("digits"), image_size), labels)
    model.fit(data.digits("train", variant.batch, image_size, seed=seed),
              epochs=FLAGS.epochs, steps_per_epoch=variant.steps_per_epoch,
              callbacks=[callback], verbose=0)
    keras.backend.clear_session()
    return callback.accuracy, time.perf_counter() - start


def summarize(values):
    """'mean ± std (min-max)' of a list of accuracies (%)."""
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:6.2f} ± {std:5.2f} ({min(values):.2f}-{max(values):.2f})"


def write_plot(curves, path):
    """Test accuracy per epoch: mean over seeds, min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib import ticker

    precisions = list(FLAGS.precisions)
    figure, axes = plt.subplots(1, len(precisions), sharey=True,
                                figsize=(7 * len(precisions), 5),
                                squeeze=False)
    styles = {"sgd_small": "-", "sgd_large": "--", "lars_large": ":"}
    for axis, precision in zip(axes[0], precisions):
        for variant in variants():
            runs = np.array(curves[(variant, precision)])
            epochs = np.arange(1, runs.shape[1] + 1)
            line, = axis.plot(epochs, runs.mean(axis=0), styles[variant.setting],
                              label=variant.label, linewidth=2)
            axis.fill_between(epochs, runs.min(axis=0), runs.max(axis=0),
                              color=line.get_color(), alpha=0.15)
        axis.set_title(precision)
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        axis.set_ylim(0, 100)
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (%)")
    axes[0][-1].legend(loc="lower right", fontsize="small")
    figure.suptitle(f"digits, {FLAGS.model}, {FLAGS.epochs} epochs, "
                    f"{FLAGS.seeds} seeds: mean, min-max band")
    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_doc(path, command, lines, plot_path):
    """The Markdown report: the command, the printed lines, the plot."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    plot = os.path.relpath(plot_path, os.path.dirname(path) or ".")
    with open(path, "w", encoding="utf-8") as f:
        f.write("# Large-batch study on digits\n\n")
        f.write("Generated by `launch/studies/large_batch.py`, whose docstring "
                "says what each setting is. Command:\n\n")
        f.write(f"```\n{command}\n```\n\nWhat it printed:\n\n```\n")
        f.write("\n".join(lines) + "\n```\n\n")
        f.write(f"![test accuracy per epoch]({plot})\n")


def check_flags():
    """Refuses flag values the study cannot run, before anything trains."""
    unknown = [s for s in FLAGS.settings if s not in SETTINGS]
    if unknown or not FLAGS.settings:
        raise app.UsageError(
            f"--settings must name some of {', '.join(SETTINGS)}. "
            f"Received: settings={FLAGS.settings!r}")
    bad = [p for p in FLAGS.precisions if p not in recipes.PRECISIONS]
    if bad or not FLAGS.precisions:
        raise app.UsageError(
            f"--precisions must name some of {', '.join(recipes.PRECISIONS)}."
            f" Received: precisions={FLAGS.precisions!r}")
    for name in ("learning_rates", "lars_learning_rates"):
        try:
            rates = [float(r) for r in getattr(FLAGS, name)]
        except ValueError:
            rates = []
        if not rates or min(rates) <= 0:
            raise app.UsageError(
                f"--{name} must be a list of numbers > 0. "
                f"Received: {name}={getattr(FLAGS, name)!r}")
    if FLAGS.warmup_epochs >= FLAGS.epochs:
        raise app.UsageError(
            "--warmup_epochs must be shorter than --epochs. Received: "
            f"warmup_epochs={FLAGS.warmup_epochs}, epochs={FLAGS.epochs}")
    for name in ("small_batch", "large_batch"):
        if getattr(FLAGS, name) > _NUM_TRAIN:
            raise app.UsageError(
                f"--{name} must be at most {_NUM_TRAIN}, the training set. "
                f"Received: {name}={getattr(FLAGS, name)}")


def report_results(say, curves):
    """Prints the per-variant summary and the gaps to the baseline."""
    finals = {key: [c[-1] for c in runs] for key, runs in curves.items()}
    say("Final test accuracy (%), mean ± std over seeds (min-max):")
    for precision in FLAGS.precisions:
        for variant in variants():
            say(f"  {variant.label:42s} {precision:15s} "
                f"{variant.steps_per_epoch:3d} steps/epoch, peak lr "
                f"{variant.peak_learning_rate:<7.4g} "
                f"{summarize(finals[(variant, precision)])}")
    baselines = [v for v in variants() if v.setting == "sgd_small"]
    if not baselines:
        return
    say()
    say("Difference of the mean from the best small-batch SGD mean "
        "(percentage points; the aim: LARS within 1 point):")
    for precision in FLAGS.precisions:
        best = max(baselines,
                   key=lambda v: statistics.fmean(finals[(v, precision)]))
        base = statistics.fmean(finals[(best, precision)])
        say(f"  {precision}: baseline {best.label}, {base:.2f}%")
        for variant in variants():
            if not variant.large:
                continue
            gap = statistics.fmean(finals[(variant, precision)]) - base
            verdict = "within 1 point" if gap >= -1.0 else "short by more"
            say(f"    {variant.label:42s} {gap:+7.2f}  ({verdict})")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    check_flags()
    command = " ".join(["python -m launch.studies.large_batch", *sys.argv[1:]])
    say = Report()
    say(f"Large-batch study: digits ({_NUM_TRAIN} train / 360 test images), "
        f"{FLAGS.model}, {FLAGS.epochs} epochs, seeds 0-{FLAGS.seeds - 1}, "
        f"momentum {FLAGS.momentum:g}, weight decay {FLAGS.weight_decay:g} "
        "(not on biases/BN), warmup "
        f"{FLAGS.warmup_epochs:g} epochs (large batch), poly decay (power 2) "
        "to 0.")
    runs = [(v, p, s) for p in FLAGS.precisions for v in variants()
            for s in range(FLAGS.seeds)]
    curves = {}
    start = time.perf_counter()
    for index, (variant, precision, seed) in enumerate(runs, start=1):
        accuracy, seconds = train_once(variant, precision, seed)
        curves.setdefault((variant, precision), []).append(accuracy)
        say(f"[{index}/{len(runs)}] {variant.label}, {precision}, seed "
            f"{seed}: test accuracy {accuracy[-1]:.2f}% ({seconds:.0f} s)")
    say()
    report_results(say, curves)
    say()
    say(f"Total time {time.perf_counter() - start:.0f} s.")
    write_plot(curves, FLAGS.plot)
    write_doc(FLAGS.doc, command, say.lines, FLAGS.plot)
    print(f"Wrote {FLAGS.doc} and {FLAGS.plot}", flush=True)


def define_flags():
    """Defines the study's flags (`run()` calls it before parsing)."""
    flags.DEFINE_list("settings", list(SETTINGS),
                      f"Which settings to run, of {', '.join(SETTINGS)}.")
    flags.DEFINE_list("precisions", ["float32", "mixed_bfloat16"],
                      "Keras dtype policies; every setting runs under each.")
    flags.DEFINE_integer("seeds", 3, "Seeds 0..N-1 (weights and data order).",
                         lower_bound=1)
    flags.DEFINE_integer("epochs", 20, "Epoch budget, the same for every run.",
                         lower_bound=1)
    flags.DEFINE_integer("small_batch", 32, "Batch of the baseline.",
                         lower_bound=1)
    flags.DEFINE_integer("large_batch", 479,
                         "Large batch (479 = 1437 / 3: 3 steps per epoch).",
                         lower_bound=1)
    flags.DEFINE_list("learning_rates", ["0.02", "0.05"],
                      "SGD learning rates at --small_batch (sgd_large scales "
                      "each linearly).")
    flags.DEFINE_list("lars_learning_rates", ["3", "10"],
                      "LARS peak learning rates.")
    flags.DEFINE_float("warmup_epochs", 2.0, "Warmup of the large-batch runs.",
                       lower_bound=0.0)
    flags.DEFINE_float("weight_decay", 5e-4,
                       "L2 on the gradient, biases and BatchNorm excluded.",
                       lower_bound=0.0)
    flags.DEFINE_float("momentum", 0.9, "Momentum of SGD and LARS.")
    flags.DEFINE_enum("model", "small_alexnet_bn",
                      ["small_alexnet_bn", "alexnet_bn"], "Model (see above).")
    flags.DEFINE_string("doc", "docs/large_batch.md", "Markdown report to write.")
    flags.DEFINE_string("plot", "docs/large_batch.png", "PNG plot to write.")


def run():
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
