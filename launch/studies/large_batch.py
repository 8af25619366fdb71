r"""Large-batch study on digits: what closes the large-batch gap?

    python -m launch.studies.large_batch   # defaults: 24 min here (144 runs)

The question of You et al. 2017, Jia et al. 2018 and Akiba et al. 2017,
asked of a data set that fits on this machine: at the same epoch budget a
large batch makes far fewer updates; does large-batch SGD fall short of the
small-batch accuracy, and which technique closes the gap? One process
trains on scikit-learn's digits (1,437 training and 360 test images, real
data): what varies is the batch size and the optimizer, not the number of
workers. The AlexNet-BN settings, all with momentum 0.9, L2 weight decay
on the gradient (biases and BatchNorm parameters excluded):

- `sgd_small`: SGD, `--small_batch`, for each of `--learning_rates`,
  polynomial decay (power 2) to 0 at the end of the same number of epochs.
- `sgd_large`: SGD, `--large_batch`, for each of `--learning_rates` scaled
  linearly (`lr * large_batch / small_batch`), `--warmup_epochs` of warmup,
  the same decay.
- `lars_large`: LARS, `--large_batch`, for each peak of
  `--lars_learning_rates`, `--warmup_epochs` of warmup, the same decay,
  biases and BatchNorm excluded from decay and from layer adaptation.
- `slow_start_large`: SGD as `sgd_large`, but after the warmup Akiba et
  al.'s slow-start schedule (`lr_schedule="slow_start"`,
  `tfscale.schedules.SlowStart`: 0.5, 0.075, 0.01, 0.001 times the scaled
  rate from 0, 40/90, 70/90, 85/90 of training).
- `rmsprop_warmup_large`: Akiba et al.'s combination: RMSprop warm-up
  (`optimizer="rmsprop_warmup"`, `tfscale.optimizers.RMSpropWarmup`, its
  RMSprop learning rate 3e-4; RMSprop and SGD weigh half each at 10/90 of
  training, SGD alone from 12.5/90, the 10- and 5-epoch defaults of a
  90-epoch run scaled to `--epochs`) with the slow-start schedule on SGD's
  rate, scaled linearly from each of `--learning_rates`; no linear warmup.
- `batch_growth_small`: Smith et al. 2017, "Don't Decay the Learning Rate,
  Increase the Batch Size": SGD from `--small_batch` at a constant rate
  (each of `--learning_rates`), the batch multiplied by each factor of
  `--batch_growth` (`epoch:factor` events; default `3:5,6:5`: 32, 160,
  800, early enough that training has not converged yet) at its epoch
  (`Settings.batch_schedule`, `tfscale.batch_growth`; an epoch keeps its
  1,440 examples, in fewer updates).
- `lr_decay_small`: the decay that growth replaces: the same events divide
  the learning rate instead (`max_global_batch_size` = `--small_batch`).
- `powersgd_sgd_small`, `powersgd_lars_large`: `sgd_small` at
  `--powersgd_learning_rate` and `lars_large` at
  `--powersgd_lars_learning_rate`, their gradients all-reduced by PowerSGD
  (Vogels, Karimireddy and Jaggi 2019; `tfscale.Strategy` with
  `CommunicationOptions(compression="powersgd")`) at each rank of
  `--powersgd_ranks`, uncompressed for the first `--powersgd_start_step`
  updates, error feedback on. One worker: PowerSGD's sums are linear (P = M Q
  summed over workers is (sum of M) Q, and the errors kept add up to the
  sum's error), so one worker with the global batch follows the same
  compressed trajectory as N workers sharing it. Each is compared with the
  same run uncompressed.

Each runs under every `--precisions` policy and every seed; the baseline
every other row is compared with is the best `sgd_small` learning rate, and
each of the last three rows also with the row it changes one thing of.
After training, every AlexNet-BN run is evaluated twice: with Keras's
BatchNorm moving averages, and with "BatchNorm without moving averages"
(Akiba et al.; `tfscale.callbacks.recompute_batch_norm_statistics`: the
statistics recomputed for the final weights over one epoch of training
batches). An "epoch" is `round(1437 / batch)` steps; the default large
batch, 479, is a third of the training set: 3 steps per epoch against 45
for batch 32 (ImageNet at 64K makes 20). The optimizers come from
`tfscale.recipes.make_optimizer`, the code behind tfscale-train's flags.

The AlexNet-BN model is a small AlexNet-BN (conv-BN-ReLU-pool blocks,
BatchNorm after the last pool as in Jia et al., two dense layers) on the
8x8 images: the project's `models.alexnet_bn` at its smallest input
(67x67) trains at about 50 images/s on this 2-core machine, and bfloat16 is
slower still (no AVX-512 here, so TensorFlow falls back to Eigen kernels):
hours, not minutes. `--model=alexnet_bn` runs it anyway.

HALP does not apply to that model (its theory needs a strongly convex
loss; BatchNorm and non-convexity break it), so HALP is compared on
L2-regularized softmax regression (no bias, `--softmax_l2 * ||W||^2` in the
loss: strongly convex, mu = 2 * l2) on the same digits, their 64 pixels
scaled to [0, 1] and centred, float32, once per seed (not per precision),
at both batches, at a constant step size (`--softmax_learning_rate` at the
small batch, `--softmax_large_learning_rate` at the large one):

- `softmax_sgd_small`, `softmax_sgd_large`: Keras SGD, float32 weights;
  `softmax_sgd_small` is the baseline of this group.
- `softmax_lp_sgd_small`, `softmax_lp_sgd_large`: 8-bit low-precision SGD
  (`tfscale.optimizers.LowPrecisionSGD`, grid step `--softmax_lp_scale`).
- `softmax_svrg_small`, `softmax_svrg_large`: SVRG
  (`tfscale.optimizers.SVRG` in a `VarianceReducedModel`), a full gradient
  every 2 epochs.
- `softmax_halp_small`, `softmax_halp_large`: HALP, 8-bit offset, the same
  epoch length, mu = 2 * `--softmax_l2`.

Reported for these: test accuracy, the final training objective, the
parameter updates and the per-example gradient evaluations (counted: SGD
one per example per step; SVRG and HALP two, plus each full-gradient pass
over the 1,437 examples, about 2.5x SGD's per epoch).

Where a paper gives an ImageNet recipe that `tfscale.recipes` can express,
it is in `tfscale.recipes.RECIPES`; Akiba et al.'s numbers could not be
checked against the paper (see below), and HALP's paper gives none for
ImageNet, so these rows add no recipe.

Writes `--doc` (default docs/large_batch.md: the command, exactly what was
printed, including one sentence per row generated from the measured
numbers) and `--plot` (test accuracy per epoch, mean over seeds with the
min-max band; one panel per precision, one for the softmax group).
"""

import contextlib
import dataclasses
import os
import statistics
import sys
import time

from absl import app
from absl import flags

from tfscale import batch_growth
from tfscale import recipes

ALEXNET_SETTINGS = ("sgd_small", "sgd_large", "lars_large",
                    "slow_start_large", "rmsprop_warmup_large",
                    "lr_decay_small", "batch_growth_small",
                    "powersgd_sgd_small", "powersgd_lars_large")
SOFTMAX_SETTINGS = tuple(f"softmax_{method}_{size}"
                         for method in ("sgd", "lp_sgd", "svrg", "halp")
                         for size in ("small", "large"))
SETTINGS = ALEXNET_SETTINGS + SOFTMAX_SETTINGS

FLAGS = flags.FLAGS

_NUM_TRAIN = 1437  # digits' training split (tfscale.data)
# As models.alexnet_bn. Keras's default, 0.99, leaves the moving statistics
# half at their initial values after the 60 steps of a large-batch run, and
# the test accuracy then measures that lag, not the weights.
_BN_MOMENTUM = 0.9
# Akiba et al.'s run is 90 epochs; RMSpropWarmup's defaults (center 10,
# period 5 epochs) are kept as fractions of it.
_AKIBA_EPOCHS = 90.0
_BITS = 8
# SVRG's and HALP's T, in epochs: about 2.5x SGD's gradients per epoch.
_SOFTMAX_EPOCHS_PER_FULL_GRADIENT = 2


@dataclasses.dataclass(frozen=True)
class Variant:
    """One setting at one learning rate."""

    setting: str
    learning_rate: float
    powersgd_rank: int = 0  # 0: gradients all-reduced uncompressed

    @property
    def large(self):
        return self.setting.endswith("_large")

    @property
    def softmax(self):
        return self.setting.startswith("softmax_")

    @property
    def grows(self):
        """Whether it runs under --batch_growth's events."""
        return self.setting in ("lr_decay_small", "batch_growth_small")

    @property
    def uncompressed(self):
        """The same run without PowerSGD (itself when uncompressed)."""
        setting = {"powersgd_sgd_small": "sgd_small",
                   "powersgd_lars_large": "lars_large"}.get(self.setting, self.setting)
        return Variant(setting, self.learning_rate)

    @property
    def method(self):
        """The softmax group's optimizer: sgd, lp_sgd, svrg or halp."""
        return self.setting[len("softmax_"):].rsplit("_", 1)[0]

    @property
    def batch(self):
        return FLAGS.large_batch if self.large else FLAGS.small_batch

    @property
    def steps_per_epoch(self):
        return max(1, round(_NUM_TRAIN / self.batch))

    def settings(self, precision):
        """The `recipes.Settings` of this AlexNet-BN variant."""
        common = dict(
            precision=precision, momentum=FLAGS.momentum,
            lr_schedule="warmup_poly", end_learning_rate=0.0, poly_power=2.0,
            weight_decay=FLAGS.weight_decay,
            warmup_epochs=FLAGS.warmup_epochs if self.large else 0.0,
        )
        if self.uncompressed.setting == "lars_large":
            return recipes.Settings(optimizer="lars",
                                    learning_rate=self.learning_rate, **common)
        # Linear scaling from the small batch (a no-op for the baseline).
        common.update(learning_rate=self.learning_rate, scale_lr=True,
                      base_batch_size=FLAGS.small_batch)
        if self.setting == "slow_start_large":
            common["lr_schedule"] = "slow_start"
        if self.grows:
            # A limit of the first batch turns every growth into a decay.
            common.update(
                lr_schedule="constant", batch_schedule=FLAGS.batch_growth,
                max_global_batch_size=(FLAGS.small_batch
                                       if self.setting == "lr_decay_small"
                                       else 0))
        if self.setting == "rmsprop_warmup_large":
            fraction = FLAGS.epochs / _AKIBA_EPOCHS
            common.update(
                lr_schedule="slow_start", warmup_epochs=0.0,
                rmsprop_warmup_center_epochs=10.0 * fraction,
                rmsprop_warmup_period_epochs=5.0 * fraction)
            return recipes.Settings(optimizer="rmsprop_warmup", **common)
        return recipes.Settings(optimizer="sgd", **common)

    @property
    def peak_learning_rate(self):
        if self.softmax:
            return self.learning_rate
        return self.settings("float32").peak_learning_rate(self.batch)

    @property
    def label(self):
        if self.powersgd_rank:
            return (f"{self.uncompressed.label}, PowerSGD rank "
                    f"{self.powersgd_rank}")
        scaled = (f"lr {self.learning_rate:g} x {self.batch}/"
                  f"{FLAGS.small_batch}")
        if self.softmax:
            name = {"sgd": "SGD, float32", "lp_sgd": f"LP-SGD, {_BITS}-bit",
                    "svrg": "SVRG, float32",
                    "halp": f"HALP, {_BITS}-bit"}[self.method]
            return f"{name}, batch {self.batch}, lr {self.learning_rate:g}"
        if self.setting == "sgd_small":
            return f"SGD, batch {self.batch}, lr {self.learning_rate:g}"
        if self.setting == "sgd_large":
            return f"SGD, batch {self.batch}, {scaled} + warmup"
        if self.setting == "slow_start_large":
            return f"SGD, batch {self.batch}, {scaled}, warmup + slow start"
        if self.setting == "rmsprop_warmup_large":
            return f"RMSprop warm-up, batch {self.batch}, {scaled}, slow start"
        if self.setting == "lars_large":
            return (f"LARS, batch {self.batch}, lr {self.learning_rate:g} "
                    "+ warmup")
        events = batch_growth.parse(FLAGS.batch_growth)
        at = ", ".join(str(epoch) for epoch, _ in events)
        factor = "x".join(str(factor) for _, factor in events)
        if self.setting == "batch_growth_small":
            return (f"SGD, batch {self.batch} grown {factor} at epochs {at}, "
                    f"lr {self.learning_rate:g}")
        return (f"SGD, batch {self.batch}, lr {self.learning_rate:g} "
                f"/ {factor} at epochs {at}")

    def precisions(self):
        """The policies it runs under: the softmax group only in float32."""
        return ("float32",) if self.softmax else tuple(FLAGS.precisions)


def variants():
    """Every variant the flags ask for, in the order of --settings."""
    result = []
    for setting in FLAGS.settings:
        if setting.startswith("softmax_"):
            rates = [FLAGS.softmax_large_learning_rate
                     if setting.endswith("_large")
                     else FLAGS.softmax_learning_rate]
        elif setting == "lars_large":
            rates = FLAGS.lars_learning_rates
        elif setting == "powersgd_sgd_small":
            rates = [FLAGS.powersgd_learning_rate]
        elif setting == "powersgd_lars_large":
            rates = [FLAGS.powersgd_lars_learning_rate]
        else:
            rates = FLAGS.learning_rates
        ranks = ([int(r) for r in FLAGS.powersgd_ranks]
                 if setting.startswith("powersgd_") else [0])
        result += [Variant(setting, float(rate), rank)
                   for rate in rates for rank in ranks]
    return result


_strategies = {}


def powersgd_strategy(rank):
    """One worker's `tfscale.Strategy` all-reducing by PowerSGD at `rank`
    (one per rank per process: every run of that rank shares it)."""
    import tfscale

    if rank not in _strategies:
        _strategies[rank] = tfscale.Strategy(
            communication=tfscale.CommunicationOptions(
                compression="powersgd", powersgd=tfscale.PowerSGDOptions(
                    rank=rank, start_step=FLAGS.powersgd_start_step)))
    return _strategies[rank]


@dataclasses.dataclass
class Run:
    """What one training run measured.

    Attributes:
        accuracy: test accuracy (%) after every epoch.
        seconds: wall time of the run.
        recomputed_accuracy: AlexNet-BN: final test accuracy (%) with the
            BatchNorm statistics recomputed for the final weights.
        objective: softmax: the final training loss + L2 term.
        updates: parameter updates made.
        gradients: softmax: per-example gradient evaluations made.
    """

    accuracy: list
    seconds: float
    recomputed_accuracy: float = None
    objective: float = None
    updates: int = 0
    gradients: int = 0


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


def test_accuracy_callback(model, images, labels):
    """A Keras callback recording `model`'s test accuracy (%) per epoch."""
    import keras

    class TestAccuracy(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            # One list over every fit (a growing batch fits once per phase).
            self.accuracy = []

        def on_epoch_end(self, epoch, logs=None):
            self.accuracy.append(accuracy_of(model, images, labels))

    return TestAccuracy()


def accuracy_of(model, images, labels):
    """Test accuracy (%) of `model` on `images`."""
    import numpy as np

    logits = model.predict_on_batch(images)
    return 100.0 * float(np.mean(np.argmax(logits, axis=1) == labels))


def train_alexnet(variant, precision, seed):
    """One AlexNet-BN run: accuracy per epoch, then with recomputed BN."""
    import keras

    from tfscale import callbacks
    from tfscale import data

    start = time.perf_counter()
    settings = variant.settings(precision)
    recipes.set_precision(settings)
    keras.utils.set_random_seed(seed)
    strategy = (powersgd_strategy(variant.powersgd_rank)
                if variant.powersgd_rank else None)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model, image_size = build_model()
        optimizer, _ = recipes.make_optimizer(
            settings, variant.batch, variant.steps_per_epoch, FLAGS.epochs)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images, labels = data.digits_arrays("test")
    images = data.preprocess(images, data.spec("digits"), image_size)
    callback = test_accuracy_callback(model, images, labels)
    phases = recipes.batch_phases(settings, variant.batch,
                                  variant.steps_per_epoch, FLAGS.epochs)
    for part in batch_growth.fit_parts(phases):  # one without growth
        phase = part.phase
        model.fit(data.digits("train", phase.global_batch_size, image_size,
                              seed=seed, start_example=phase.first_example,
                              start_step=part.data_step),
                  initial_epoch=part.initial_epoch, epochs=part.epochs,
                  steps_per_epoch=part.steps_per_epoch, callbacks=[callback],
                  verbose=0)
    # BatchNorm without moving averages: statistics of the final weights,
    # over one epoch of final training batches (another shuffle).
    last = phases[-1]
    callbacks.recompute_batch_norm_statistics(
        model, data.digits("train", last.global_batch_size, image_size,
                           seed=seed + 1),
        steps=last.steps_per_epoch)
    run = Run(callback.accuracy, 0.0,
              recomputed_accuracy=accuracy_of(model, images, labels),
              updates=int(optimizer.iterations.numpy()))
    keras.backend.clear_session()
    run.seconds = time.perf_counter() - start
    return run


def softmax_features(split):
    """Digits as 64 pixels in [0, 1], centred on the training mean."""
    import numpy as np

    from tfscale import data

    def pixels(name):
        images, labels = data.digits_arrays(name)
        pixels = images.reshape(len(images), -1).astype(np.float32) / 255.0
        return pixels, labels

    train_images, _ = pixels("train")
    images, labels = pixels(split)
    return images - train_images.mean(axis=0), labels


def softmax_optimizer(variant, seed):
    """The optimizer of a softmax variant (SVRG/HALP need a wrapper)."""
    import keras

    from tfscale import optimizers

    lr = variant.learning_rate
    epoch_length = _SOFTMAX_EPOCHS_PER_FULL_GRADIENT * variant.steps_per_epoch
    if variant.method == "halp":
        return optimizers.HALP(learning_rate=lr, epoch_length=epoch_length,
                               bits=_BITS, mu=2 * FLAGS.softmax_l2, seed=seed)
    if variant.method == "svrg":
        return optimizers.SVRG(learning_rate=lr, epoch_length=epoch_length)
    if variant.method == "lp_sgd":
        return optimizers.LowPrecisionSGD(
            learning_rate=lr, bits=_BITS, scale=FLAGS.softmax_lp_scale,
            seed=seed)
    return keras.optimizers.SGD(learning_rate=lr)


def train_softmax(variant, seed):
    """One softmax-regression run, counting updates and gradients."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfscale import optimizers

    start = time.perf_counter()
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(seed)
    x, y = softmax_features("train")
    test_x, test_y = softmax_features("test")
    model = keras.Sequential([
        keras.Input((x.shape[1],)),
        keras.layers.Dense(
            10, use_bias=False, kernel_initializer="zeros",
            kernel_regularizer=keras.regularizers.L2(FLAGS.softmax_l2)),
    ])
    optimizer = softmax_optimizer(variant, seed)
    full_passes = []

    class CountingModel(optimizers.VarianceReducedModel):
        def full_gradient(self):
            full_passes.append(len(x))
            return super().full_gradient()

    variance_reduced = variant.method in ("svrg", "halp")
    trainer = (CountingModel(model, full_gradient_data=tf.data.Dataset
                             .from_tensor_slices((x, y)).batch(512))
               if variance_reduced else model)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainer.compile(optimizer=optimizer, loss=loss)
    train = (tf.data.Dataset.from_tensor_slices((x, y))
             .shuffle(len(x), seed=seed).repeat().batch(variant.batch))
    callback = test_accuracy_callback(model, test_x, test_y)
    trainer.fit(train, epochs=FLAGS.epochs,
                steps_per_epoch=variant.steps_per_epoch, callbacks=[callback],
                verbose=0)
    weights = model.trainable_variables[0].numpy()
    l2_term = FLAGS.softmax_l2 * np.sum(weights.astype(np.float64) ** 2)
    objective = float(loss(y, model.predict_on_batch(x))) + float(l2_term)
    updates = int(optimizer.iterations.numpy())
    # Per step: the batch at the weights (and at the anchor for SVRG/HALP).
    gradients = (2 if variance_reduced else 1) * updates * variant.batch
    keras.backend.clear_session()
    return Run(callback.accuracy, time.perf_counter() - start,
               objective=objective, updates=updates,
               gradients=gradients + sum(full_passes))


def train_once(variant, precision, seed):
    """The `Run` of one variant under one precision and seed."""
    if variant.softmax:
        return train_softmax(variant, seed)
    return train_alexnet(variant, precision, seed)


def summarize(values):
    """'mean ± std (min-max)' of a list of accuracies (%)."""
    return (f"{mean(values):6.2f} ± {_std(values):5.2f} "
            f"({min(values):.2f}-{max(values):.2f})")


def plot_panels():
    """(title, precision, variants) of each panel of the plot."""
    alexnet = [v for v in variants() if not v.softmax]
    softmax = [v for v in variants() if v.softmax]
    panels = [(f"{FLAGS.model}, {p}", p, alexnet)
              for p in FLAGS.precisions if alexnet]
    if softmax:
        panels.append(("softmax regression, float32", "float32", softmax))
    return panels


def write_plot(runs, path):
    """Test accuracy per epoch: mean over seeds, min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
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
    try:
        ranks = [int(r) for r in FLAGS.powersgd_ranks]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise app.UsageError(
            "--powersgd_ranks must be a list of integers >= 1. "
            f"Received: powersgd_ranks={FLAGS.powersgd_ranks!r}")
    for variant in variants():
        if variant.grows:
            try:
                recipes.batch_phases(variant.settings("float32"), variant.batch,
                                     variant.steps_per_epoch, FLAGS.epochs)
            except ValueError as e:
                raise app.UsageError(
                    f"--batch_growth cannot run with --epochs={FLAGS.epochs} "
                    f"and --small_batch={FLAGS.small_batch}: {e}") from None


def finals(runs, field="accuracy"):
    """{(variant, precision): [final value of `field` per seed]}."""
    def last(run):
        value = getattr(run, field)
        return value[-1] if field == "accuracy" else value
    return {key: [last(r) for r in group] for key, group in runs.items()}


def mean(values):
    return statistics.fmean(values)


def _std(values):
    return statistics.stdev(values) if len(values) > 1 else 0.0


def alexnet_sentence(variant, gap, recomputed_gap, accuracy, recomputed,
                     reference=None):
    """What one AlexNet-BN row shows, from its numbers.

    `reference`: `(description, accuracies)` of the row it is set against
    (the Akiba et al. rows: SGD at the same rate; batch growth: the
    learning-rate decay it replaces), if that ran.
    """
    if mean(accuracy) < 20:
        return (f"{variant.label}: diverged (chance-level accuracy, "
                f"{mean(accuracy):.2f}%); recomputing BatchNorm statistics "
                f"gives {mean(recomputed):.2f}%, it cannot rescue the weights.")
    verdict = ("within 1 point of" if gap >= -1.0 else
               f"{-gap:.2f} points short of")
    change = mean(recomputed) - mean(accuracy)
    # Below the seeds' spread, or one test image (100/360 %): noise.
    noise = max(_std(accuracy), _std(recomputed), 100.0 / 360)
    effect = (f"a change of {change:+.2f} points, "
              + ("within" if abs(change) <= noise else "beyond")
              + f" the spread over seeds ({noise:.2f})")
    sentence = (f"{variant.label}: {verdict} the baseline with moving "
                f"averages ({gap:+.2f}); with BatchNorm statistics recomputed "
                f"for the final weights {recomputed_gap:+.2f} ({effect}).")
    if reference:
        description, accuracies = reference
        difference = mean(accuracy) - mean(accuracies)
        sentence += (f" Against {description} ({mean(accuracies):.2f}%): "
                     f"{difference:+.2f} points")
        if variant.powersgd_rank:
            sentence += (", within 1 point of it" if difference >= -1.0 else
                         f", {-difference - 1.0:.2f} points more than 1 below it")
        sentence += "."
    return sentence


def reference_row(variant, precision, accuracy, runs):
    """`alexnet_sentence`'s `reference` for `variant`, or None."""
    if variant.setting in ("slow_start_large", "rmsprop_warmup_large"):
        other = Variant("sgd_large", variant.learning_rate)
        description = ("SGD with warmup and polynomial decay at the same "
                       "scaled rate")
    elif variant.setting == "batch_growth_small":
        other = Variant("lr_decay_small", variant.learning_rate)
        description = "the learning-rate decay it replaces"
    elif variant.powersgd_rank:
        other = variant.uncompressed
        description = "the same run uncompressed"
    else:
        return None
    if (other, precision) not in accuracy:
        return None
    if variant.setting == "batch_growth_small":
        description += (f", here in {runs[(variant, precision)][0].updates}"
                        f" updates against its "
                        f"{runs[(other, precision)][0].updates}")
    return description, accuracy[(other, precision)]


def report_alexnet(say, runs):
    """Summary, gaps to the baseline and a sentence per large-batch row."""
    alexnet = [v for v in variants() if not v.softmax]
    if not alexnet:
        return
    accuracy, recomputed = finals(runs), finals(runs, "recomputed_accuracy")
    say(f"{FLAGS.model}: final test accuracy (%), mean ± std over seeds "
        "(min-max), with BatchNorm moving averages | statistics recomputed "
        "for the final weights (BN without moving averages):")
    for precision in FLAGS.precisions:
        for v in alexnet:
            key = (v, precision)
            say(f"  {v.label:56s} {precision:15s} "
                f"{v.steps_per_epoch:3d} steps/epoch, "
                f"{runs[key][0].updates:4d} updates, peak lr "
                f"{v.peak_learning_rate:<7.4g} {summarize(accuracy[key])} | "
                f"{summarize(recomputed[key])}")
    baselines = [v for v in alexnet if v.setting == "sgd_small"]
    if not baselines:
        return
    say()
    say("Difference of the mean from the best small-batch SGD mean "
        "(percentage points, moving averages | recomputed; the aim: "
        "within 1 point):")
    for precision in FLAGS.precisions:
        best = max(baselines, key=lambda v: mean(accuracy[(v, precision)]))
        base = mean(accuracy[(best, precision)])
        base_recomputed = mean(recomputed[(best, precision)])
        say(f"  {precision}: baseline {best.label}, {base:.2f}% | "
            f"{base_recomputed:.2f}%")
        sentences = []
        for v in alexnet:
            if v.setting == "sgd_small":
                continue
            key = (v, precision)
            gap = mean(accuracy[key]) - base
            recomputed_gap = mean(recomputed[key]) - base
            say(f"    {v.label:56s} {gap:+7.2f} | {recomputed_gap:+7.2f}")
            sentences.append(alexnet_sentence(
                v, gap, recomputed_gap, accuracy[key], recomputed[key],
                reference_row(v, precision, accuracy, runs)))
        say(f"  What each {precision} row shows (generated from the numbers "
            "above):")
        for sentence in sentences:
            say(f"  - {sentence}")


def softmax_sentence(variant, gap, objective, best_objective, run,
                     baseline_run, float_objective=None):
    """What one softmax row shows, from its numbers.

    `float_objective`: for the 8-bit rows, the final objective of their
    float32 counterpart at the same batch (SGD for LP-SGD, SVRG for HALP).
    """
    sentence = (f"{variant.label}: {gap:+.2f} points from the baseline's "
                f"test accuracy, training objective "
                f"{objective - best_objective:.2e} above the lowest reached, "
                f"{run.updates} updates at "
                f"{run.gradients / baseline_run.gradients:.2f}x the baseline's "
                "gradient evaluations.")
    if float_objective is not None:
        counterpart = "SGD" if variant.method == "lp_sgd" else "SVRG"
        sentence += (f" {_BITS} bits cost {objective - float_objective:.2e} "
                     f"in objective against float32 {counterpart} at this "
                     "batch.")
    return sentence


def report_softmax(say, runs):
    """Accuracy, objective, updates and gradients of the softmax group."""
    softmax = [v for v in variants() if v.softmax]
    if not softmax:
        return
    accuracy, objective = finals(runs), finals(runs, "objective")
    say(f"Softmax regression (L2 {FLAGS.softmax_l2:g}, float32, "
        f"{_BITS}-bit where named): final test accuracy (%), mean ± std "
        "(min-max); training objective (mean); updates and per-example "
        "gradient evaluations per run:")
    for v in softmax:
        key = (v, "float32")
        say(f"  {v.label:32s} {summarize(accuracy[key])}  objective "
            f"{mean(objective[key]):.6f}  {runs[key][0].updates:4d} updates"
            f"  {runs[key][0].gradients:6d} gradients")
    baseline = [v for v in softmax if v.setting == "softmax_sgd_small"]
    if not baseline:
        return
    base_key = (baseline[0], "float32")
    base = mean(accuracy[base_key])
    best_objective = min(mean(objective[(v, "float32")]) for v in softmax)
    say()
    say(f"Difference of the mean from {baseline[0].label}, {base:.2f}% "
        "(percentage points), and what each row shows (generated from the "
        "numbers above):")
    for v in softmax:
        key = (v, "float32")
        if key == base_key:
            continue
        counterpart = {"lp_sgd": "sgd", "halp": "svrg"}.get(v.method)
        float_objective = None
        if counterpart:
            size = "large" if v.large else "small"
            float_key = [k for k in objective if
                         k[0].setting == f"softmax_{counterpart}_{size}"]
            if float_key:
                float_objective = mean(objective[float_key[0]])
        say("  - " + softmax_sentence(
            v, mean(accuracy[key]) - base, mean(objective[key]),
            best_objective, runs[key][0], runs[base_key][0], float_objective))


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
        "to 0 unless the row says slow start.")
    say("Akiba et al. 2017's RMSprop warm-up, slow start and BatchNorm "
        "without moving averages are reconstructed from public Chainer code "
        "(the paper's text was not available; see their docstrings).")
    jobs = [(v, p, s) for v in variants() for p in v.precisions()
            for s in range(FLAGS.seeds)]
    jobs.sort(key=lambda job: FLAGS.precisions.index(job[1])
              if job[1] in FLAGS.precisions else 0)
    runs = {}
    start = time.perf_counter()
    for index, (variant, precision, seed) in enumerate(jobs, start=1):
        run = train_once(variant, precision, seed)
        runs.setdefault((variant, precision), []).append(run)
        extra = (f", objective {run.objective:.6f}" if variant.softmax else
                 f", BN recomputed {run.recomputed_accuracy:.2f}%")
        say(f"[{index}/{len(jobs)}] {variant.label}, {precision}, seed "
            f"{seed}: test accuracy {run.accuracy[-1]:.2f}%{extra} "
            f"({run.seconds:.0f} s)")
    say()
    report_alexnet(say, runs)
    say()
    report_softmax(say, runs)
    say()
    say(f"Total time {time.perf_counter() - start:.0f} s.")
    write_plot(runs, FLAGS.plot)
    write_doc(FLAGS.doc, command, say.lines, FLAGS.plot)
    print(f"Wrote {FLAGS.doc} and {FLAGS.plot}", flush=True)


def define_flags():
    """Defines the study's flags (`run()` calls it before parsing)."""
    flags.DEFINE_list("settings", list(SETTINGS),
                      f"Which settings to run, of {', '.join(SETTINGS)}.")
    flags.DEFINE_list("precisions", ["float32", "mixed_bfloat16"],
                      "Keras dtype policies; every AlexNet-BN setting runs under "
                      "each (the softmax group in float32 only).")
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
    flags.DEFINE_list("powersgd_ranks", ["1", "2", "4"],
                      "powersgd_* settings: PowerSGD ranks to run.")
    flags.DEFINE_float("powersgd_learning_rate", 0.05,
                       "powersgd_sgd_small: SGD learning rate (also in "
                       "--learning_rates: the uncompressed run to compare).",
                       lower_bound=0.0)
    flags.DEFINE_float("powersgd_lars_learning_rate", 3.0,
                       "powersgd_lars_large: LARS peak learning rate (also in "
                       "--lars_learning_rates).", lower_bound=0.0)
    flags.DEFINE_integer("powersgd_start_step", 10,
                         "powersgd_* settings: updates all-reduced "
                         "uncompressed before PowerSGD starts (tfscale's "
                         "default).", lower_bound=0)
    flags.DEFINE_string("batch_growth", "3:5,6:5",
                        "batch_growth_small: epoch:factor events at which the "
                        "batch grows (lr_decay_small divides the learning "
                        "rate there instead; Smith et al. 2017).")
    flags.DEFINE_float("softmax_l2", 2.0 ** -7,
                       "Softmax regression: loss + l2 * ||W||^2 (HALP's mu "
                       "is 2 * l2).", lower_bound=0.0)
    flags.DEFINE_float("softmax_learning_rate", 0.5,
                       "Softmax regression: step size at --small_batch.",
                       lower_bound=0.0)
    flags.DEFINE_float("softmax_large_learning_rate", 2.0,
                       "Softmax regression: step size at --large_batch.",
                       lower_bound=0.0)
    flags.DEFINE_float("softmax_lp_scale", 2.0 ** -6,
                       "Grid step of 8-bit LP-SGD's weights (2**-6: "
                       "[-1.98, 1.98]; the float runs end with max |w| ~1).",
                       lower_bound=0.0)
    flags.DEFINE_enum("model", "small_alexnet_bn",
                      ["small_alexnet_bn", "alexnet_bn"], "Model (see above).")
    flags.DEFINE_string("doc", "docs/large_batch.md", "Markdown report to write.")
    flags.DEFINE_string("plot", "docs/large_batch.png", "PNG plot to write.")


def run():
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
