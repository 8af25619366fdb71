r"""HALP against SVRG, low-precision SGD and SGD on a strongly convex problem.

    python -m tfscale.launch.studies.halp_convergence   # about 20 s here

The claim of De Sa et al. 2018 ("High-Accuracy Low-Precision Training",
arXiv 1803.03383): with the inner iterate on a b-bit grid that is
re-centred on the anchor and rescaled by the full gradient every epoch
("bit centering"), HALP keeps SVRG's linear convergence to the exact
optimum, where low-precision SGD, its weights on a fixed b-bit grid,
stalls at a floor set by the rounding noise. Asked of L2-regularized
logistic regression (float64, no bias) on scikit-learn's digits (all 1,797
images, 64 pixels scaled to [0, 1] and centred; label: digit >= 5), trained
through `model.fit` with `tfscale.optimizers`:

- `halp`: `HALP(bits=--bits, mu=2 * --l2)` in a `VarianceReducedModel`;
- `svrg`: `SVRG`, the same without rounding;
- `lp_sgd`: `LowPrecisionSGD(bits=--bits)`, grid step
  `1.25 * max|w*| / (2**(bits-1) - 1)` (it covers the optimum with room);
- `sgd`: `keras.optimizers.SGD`, float64.

All take `--batch_size` examples per step in a fixed order; an epoch is
`--epoch_passes` passes over the data (SVRG's and HALP's T, between two
full gradients). Reported per epoch: `||w - w*|| / ||w*||`, `w*` from
Newton's method in NumPy (float64, gradient norm ~1e-17). SVRG and HALP
compute about 2.5x the gradients of SGD per epoch (two per example and a
full pass every `epoch_passes` passes): the doc says so beside the plot.

Writes `--doc` (the command and what was printed) and `--plot` (relative
error per epoch, log scale).
"""

import os
import sys
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
SETTINGS = ("halp", "svrg", "lp_sgd", "sgd")


def digits_problem():
    """(x, y): digits scaled to [0, 1] and centred, label digit >= 5."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = digits.data / 16.0
    x = x - x.mean(axis=0)
    return x, (digits.target >= 5).astype(np.float64)[:, None]


def optimum(x, y, l2):
    """The float64 minimizer of mean log-loss + l2 ||w||^2, by Newton."""
    import numpy as np

    w = np.zeros((x.shape[1], 1))
    for _ in range(50):
        p = 1 / (1 + np.exp(-x @ w))
        gradient = x.T @ (p - y) / len(x) + 2 * l2 * w
        hessian = x.T @ (x * (p * (1 - p))) / len(x) + 2 * l2 * np.eye(len(w))
        w -= np.linalg.solve(hessian, gradient)
    return w


def train(setting, x, y, w_star, steps_per_epoch):
    """Relative error to `w_star` at the end of each epoch."""
    import keras
    import numpy as np
    import tensorflow as tf
    from tfscale import models
    from tfscale import optimizers

    keras.config.set_floatx("float64")  # the compiled loss too
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((x.shape[1],), dtype="float64"),
        keras.layers.Dense(1, use_bias=False, dtype="float64",
                           kernel_initializer="zeros",
                           kernel_regularizer=keras.regularizers.L2(FLAGS.l2)),
    ])
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        FLAGS.batch_size, drop_remainder=True)
    loss = keras.losses.BinaryCrossentropy(from_logits=True, dtype="float64")
    lr = FLAGS.learning_rate
    if setting in ("halp", "svrg"):
        optimizer = (optimizers.HALP(learning_rate=lr, epoch_length=steps_per_epoch,
                                     bits=FLAGS.bits, mu=2 * FLAGS.l2, seed=1)
                     if setting == "halp" else
                     optimizers.SVRG(learning_rate=lr, epoch_length=steps_per_epoch))
        trainer = models.VarianceReducedModel(
            model, full_gradient_data=tf.data.Dataset.from_tensor_slices(
                (x, y)).batch(256))
    else:
        lr = FLAGS.sgd_learning_rate
        scale = 1.25 * np.abs(w_star).max() / (2 ** (FLAGS.bits - 1) - 1)
        optimizer = (optimizers.LowPrecisionSGD(learning_rate=lr, bits=FLAGS.bits,
                                                scale=scale, seed=1)
                     if setting == "lp_sgd" else keras.optimizers.SGD(lr))
        trainer = model
    trainer.compile(optimizer=optimizer, loss=loss)
    errors = []

    class Errors(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            w = model.trainable_variables[0].numpy()
            errors.append(float(np.linalg.norm(w - w_star) / np.linalg.norm(w_star)))

    trainer.fit(data.repeat(), epochs=FLAGS.epochs, steps_per_epoch=steps_per_epoch,
                callbacks=[Errors()], verbose=0, shuffle=False)
    return errors


def write_plot(curves, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for setting, errors in curves.items():
        axes.semilogy(range(1, len(errors) + 1), errors, marker="o", markersize=3,
                      label=LABELS[setting])
    axes.set_xlabel(f"epoch ({FLAGS.epoch_passes} passes over the data)")
    axes.set_ylabel("||w - w*|| / ||w*||")
    axes.set_title("L2-regularized logistic regression on digits")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


LABELS = {}


def main(argv):
    del argv
    x, y = digits_problem()
    steps_per_epoch = FLAGS.epoch_passes * (len(x) // FLAGS.batch_size)
    LABELS.update({
        "halp": f"HALP, {FLAGS.bits}-bit offset",
        "svrg": "SVRG, float64",
        "lp_sgd": f"low-precision SGD, {FLAGS.bits}-bit weights",
        "sgd": "SGD, float64",
    })
    w_star = optimum(x, y, FLAGS.l2)
    lines = []

    def say(line=""):
        print(line, flush=True)
        lines.append(line)

    say(f"{len(x)} examples, {x.shape[1]} features, l2={FLAGS.l2}, batch "
        f"{FLAGS.batch_size}, {steps_per_epoch} steps per epoch; HALP/SVRG "
        f"learning rate {FLAGS.learning_rate}, SGD {FLAGS.sgd_learning_rate}")
    curves = {}
    for setting in FLAGS.settings:
        start = time.time()
        curves[setting] = train(setting, x, y, w_star, steps_per_epoch)
        errors = curves[setting]
        say(f"{LABELS[setting]:32s} relative error by epoch: "
            + " ".join(f"{e:.1e}" for e in errors)
            + f"  ({time.time() - start:.0f} s)")
    say()
    for setting, errors in curves.items():
        say(f"{LABELS[setting]:32s} final {errors[-1]:.2e}, best {min(errors):.2e}")
    write_plot(curves, FLAGS.plot)
    plot = os.path.relpath(FLAGS.plot, os.path.dirname(FLAGS.doc) or ".")
    os.makedirs(os.path.dirname(FLAGS.doc) or ".", exist_ok=True)
    with open(FLAGS.doc, "w", encoding="utf-8") as f:
        f.write("# HALP against SVRG, low-precision SGD and SGD\n\n")
        f.write("Generated by `launch/studies/halp_convergence.py`, whose "
                "docstring says what each setting is. Command:\n\n")
        command = " ".join(["python -m tfscale.launch.studies.halp_convergence", *sys.argv[1:]])
        f.write(f"```\n{command}\n```\n\nWhat it printed:\n\n```\n")
        f.write("\n".join(lines) + "\n```\n\n")
        f.write(f"![relative error per epoch]({plot})\n\n")
        f.write("Per epoch SVRG and HALP compute about 2.5 times the "
                "per-example gradients SGD does (each step evaluates its batch "
                "at the weights and at the anchor, and each epoch starts with "
                "a full pass).\n")


def define_flags():
    flags.DEFINE_list("settings", list(SETTINGS), f"Of {list(SETTINGS)}.")
    flags.DEFINE_integer("epochs", 15, "Epochs (of --epoch_passes passes).",
                         lower_bound=1)
    flags.DEFINE_integer("epoch_passes", 2,
                         "Passes over the data per epoch: SVRG's and HALP's T.",
                         lower_bound=1)
    flags.DEFINE_integer("batch_size", 32, "Examples per step.", lower_bound=1)
    flags.DEFINE_integer("bits", 8, "Bits of HALP's offset and LP-SGD's weights.",
                         lower_bound=2)
    # Keras's L2 regularizer rounds its factor to float32: 2**-7 is exact
    # there, so the model's loss is the one whose optimum Newton finds.
    flags.DEFINE_float("l2", 2.0 ** -7, "L2 coefficient: loss + l2 * ||w||^2 "
                       "(keep it exact in float32).", lower_bound=0.0)
    flags.DEFINE_float("learning_rate", 1.0, "HALP's and SVRG's step size.")
    flags.DEFINE_float("sgd_learning_rate", 0.3, "SGD's and LP-SGD's step size.")
    flags.DEFINE_string("doc", "docs/halp_convergence.md", "Markdown report to write.")
    flags.DEFINE_string("plot", "docs/halp_convergence.png", "PNG plot to write.")


def run():
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
