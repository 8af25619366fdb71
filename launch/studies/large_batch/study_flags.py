"""The study's flags: defined by `define_flags`, checked by `check_flags`
before anything trains."""

from absl import app
from absl import flags

from tfscale import recipe_settings
from tfscale.launch.studies.large_batch import variants

FLAGS = flags.FLAGS


def define_flags():
    """Defines the study's flags (`run()` calls it before parsing)."""
    flags.DEFINE_list("settings", list(variants.SETTINGS),
                      "Which settings to run, of "
                      f"{', '.join(variants.SETTINGS)}.")
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


def check_flags():
    """Refuses flag values the study cannot run, before anything trains."""
    unknown = [s for s in FLAGS.settings if s not in variants.SETTINGS]
    if unknown or not FLAGS.settings:
        raise app.UsageError(
            f"--settings must name some of {', '.join(variants.SETTINGS)}. "
            f"Received: settings={FLAGS.settings!r}")
    bad = [p for p in FLAGS.precisions if p not in recipe_settings.PRECISIONS]
    if bad or not FLAGS.precisions:
        raise app.UsageError(
            f"--precisions must name some of {', '.join(recipe_settings.PRECISIONS)}."
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
        if getattr(FLAGS, name) > variants.NUM_TRAIN:
            raise app.UsageError(
                f"--{name} must be at most {variants.NUM_TRAIN}, the "
                f"training set. Received: {name}={getattr(FLAGS, name)}")
    try:
        ranks = [int(r) for r in FLAGS.powersgd_ranks]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise app.UsageError(
            "--powersgd_ranks must be a list of integers >= 1. "
            f"Received: powersgd_ranks={FLAGS.powersgd_ranks!r}")
    for variant in variants.from_flags():
        if variant.grows:
            try:
                recipe_settings.batch_phases(
                    variant.settings("float32"), variant.batch,
                    variant.steps_per_epoch, FLAGS.epochs)
            except ValueError as e:
                raise app.UsageError(
                    f"--batch_growth cannot run with --epochs={FLAGS.epochs} "
                    f"and --small_batch={FLAGS.small_batch}: {e}") from None
