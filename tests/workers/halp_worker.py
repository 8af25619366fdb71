"""Trains L2-regularized logistic regression (float64) with 8-bit HALP.

Every worker builds the same 32 examples; each global batch of 8 is split
in consecutive halves between the workers, and the full-gradient data is
the whole set (VarianceReducedModel gives each worker its share). Reports
the final weights, the optimizer's anchor and full gradient, the data (so
the test can recompute the full gradient over all examples) and the step
count. The constants match tests/test_halp.py's reference.
"""

import keras
import numpy as np
import tensorflow as tf
from absl import app

import tfscale
from tfscale import models
from report import report

FEATURES = 4
EXAMPLES = 32
GLOBAL_BATCH = 8
L2 = 0.0625  # exact in float32 (Keras rounds it there)
STEPS = 10


def main(argv):
    keras.config.set_floatx("float64")  # the compiled loss too
    strategy = tfscale.Strategy(
        communication=tfscale.CommunicationOptions(timeout_seconds=120))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, FEATURES))
    y = (rng.random((EXAMPLES, 1)) < 1 / (1 + np.exp(-x @ rng.normal(size=(FEATURES, 1))))
         ).astype(np.float64)
    per_worker = GLOBAL_BATCH // strategy.num_workers
    start = strategy.worker_index * per_worker
    share = np.concatenate([np.arange(b + start, b + start + per_worker)
                            for b in range(0, EXAMPLES, GLOBAL_BATCH)])
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.Input((FEATURES,), dtype="float64"),
            keras.layers.Dense(1, dtype="float64",
                               kernel_regularizer=keras.regularizers.L2(L2)),
        ])
        trainer = models.VarianceReducedModel(
            model, full_gradient_data=tf.data.Dataset.from_tensor_slices(
                (x, y)).batch(GLOBAL_BATCH))
        optimizer = tfscale.optimizers.HALP(
            learning_rate=0.5, epoch_length=4, bits=8, mu=2 * L2, seed=5)
        trainer.compile(optimizer=optimizer,
                        loss=keras.losses.BinaryCrossentropy(from_logits=True, dtype="float64"))
    initial = [v.numpy().ravel().tolist() for v in model.trainable_variables]
    data = strategy.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.from_tensor_slices(
            (x[share], y[share])).batch(per_worker).repeat())
    trainer.fit(data, epochs=1, steps_per_epoch=STEPS, verbose=0)
    report({
        "steps": STEPS,
        "iterations": int(optimizer.iterations.numpy()),
        "initial_weights": initial,
        "weights": [v.numpy().ravel().tolist() for v in model.trainable_variables],
        "anchor": [v.numpy().ravel().tolist() for v in optimizer.anchors],
        "full_gradient": [v.numpy().ravel().tolist() for v in optimizer.full_gradients],
        "x": x.tolist(),
        "y": y.tolist(),
    })


if __name__ == "__main__":
    app.run(main)
