"""Trains a small model under tfscale.Strategy and reports what the test checks.

Flags: --model=dense|bn (bn: with BatchNormalization), --steps, --global_batch,
--export_dir (the chief exports with tfscale.export, as tfscale-train does; every
worker reports `model.predict` on the images the test serves).
"""


import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import keras
import tfscale
import sharded_data
from report import report
from tfscale import export

flags.DEFINE_enum("model", "dense", ["dense", "bn"], "Model to train.")
flags.DEFINE_integer("steps", 6, "Training steps.")
flags.DEFINE_integer("global_batch", 16, "Global batch size.")
flags.DEFINE_bool("sync_bn", True, "With --model=bn: average BN statistics.")
flags.DEFINE_string("export_dir", None, "Chief: export the trained model here.")
FLAGS = flags.FLAGS

# The export serves the digits' uint8 8x8 images, resized to the model's 6x6.
SERVED_IMAGES = 32

NUM_EXAMPLES = 96


def make_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(NUM_EXAMPLES, 6, 6, 1)).astype("float32")
    y = rng.integers(0, 4, NUM_EXAMPLES).astype("int64")
    return x, y


def dataset_fn(input_context):
    x, y = make_data()
    return sharded_data.round_robin(x, y, input_context, FLAGS.global_batch)


def build_model():
    layers = [keras.Input((6, 6, 1)), keras.layers.Conv2D(4, 3)]
    if FLAGS.model == "bn":
        layers.append(keras.layers.BatchNormalization())
    layers += [keras.layers.ReLU(), keras.layers.Flatten(), keras.layers.Dense(4)]
    return keras.Sequential(layers)


def main(argv):
    strategy = tfscale.Strategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    data = strategy.distribute_datasets_from_function(dataset_fn)
    callbacks = []
    if FLAGS.model == "bn" and FLAGS.sync_bn:
        callbacks.append(tfscale.callbacks.SyncBatchNormStatistics(strategy))
    history = model.fit(data, epochs=2, steps_per_epoch=FLAGS.steps // 2,
                        callbacks=callbacks, verbose=0)
    # evaluate and predict over the numpy arrays: Keras shards them itself.
    x, y = make_data()
    evaluation = model.evaluate(x, y, batch_size=FLAGS.global_batch, verbose=0)
    predictions = model.predict(x, batch_size=FLAGS.global_batch, verbose=0)
    exported = {}
    if FLAGS.export_dir:
        spec = tfscale.data.spec("digits")
        images, _ = tfscale.data.digits_arrays("test")
        inputs = tfscale.data.preprocess(images[:SERVED_IMAGES], spec, 6).numpy()
        logits = model.predict(inputs, batch_size=FLAGS.global_batch, verbose=0)
        exported["served_images_probabilities"] = tf.nn.softmax(logits).numpy().tolist()
        if strategy.is_chief:
            export.export_classifier(model, FLAGS.export_dir, spec, 6)
    report({
        "num_workers": strategy.num_workers,
        "worker_index": strategy.worker_index,
        "weights": [v.numpy().ravel().tolist() for v in model.trainable_variables],
        "non_trainable": [v.numpy().ravel().tolist()
                          for v in model.non_trainable_variables],
        "num_trainable": len(model.trainable_variables),
        "routed_batch_sizes": strategy.all_reduce_batch_sizes,
        "loss": history.history["loss"],
        "evaluation": evaluation,
        "predictions": np.asarray(predictions).tolist(),
        **exported,
    })


if __name__ == "__main__":
    app.run(main)
