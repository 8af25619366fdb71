"""fit, evaluate, predict and a custom loop on data the workers cannot share
evenly, as a user writes them: plain `tf.data` and Keras's defaults.

Each scenario builds the same BN-free model from the same seed and reports
its weights, history, evaluation and predictions. Run on 1 worker with
--as_workers=N, the `ran_out` scenario builds the global batches N workers
would see together, so the test can compare.
"""

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import keras
import tfscale
from report import report

flags.DEFINE_list("as_workers", [], "1 worker: the worker counts whose "
                  "`ran_out` global batches to train on, as reference.")
flags.DEFINE_list("scenarios", [], "Only these scenarios (default: all).")
FLAGS = flags.FLAGS


def examples(count, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 5, count).astype("int64")
    return x, y


def build(strategy, steps_per_execution=1):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3, activation="relu"),
            keras.layers.Flatten(), keras.layers.Dense(5)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=steps_per_execution)
    return model


def weights(model):
    return [w.tolist() for w in model.get_weights()]


def keras_fit(strategy, count, batch, drop_remainder, steps_per_execution=1):
    """The user's `fit` on `from_tensor_slices(...).batch(batch)`; Keras
    distributes it (`experimental_distribute_dataset`)."""
    x, y = examples(count)
    model = build(strategy, steps_per_execution)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch, drop_remainder=drop_remainder)
    history = model.fit(train, epochs=2, verbose=0)
    # evaluate and predict as most users call them: numpy and a batch size.
    evaluation = model.evaluate(x, y, batch_size=batch, verbose=0)
    predictions = model.predict(x, batch_size=batch, verbose=0)
    return dict(weights=weights(model), history=history.history,
                evaluation=evaluation, predictions=predictions.tolist())


def ran_out_batches(num_workers, worker):
    """Worker `worker`'s batches of 5 when `num_workers` workers read files of
    unequal length: worker w has 2 + w % 3 batches (the last worker's last
    batch has 3 examples), so workers run out of data at different steps."""
    count = 2 + worker % 3
    x, y = examples(5 * count, seed=100 + worker)
    if worker == num_workers - 1:
        x, y = x[:-2], y[:-2]
    return x, y


def ran_out(strategy, as_workers):
    model = build(strategy)
    if strategy.num_workers > 1:
        def dataset_fn(context):
            x, y = ran_out_batches(context.num_input_pipelines,
                                   context.input_pipeline_id)
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(5)
        train = strategy.distribute_datasets_from_function(dataset_fn)
    else:  # the same global batches on one worker
        parts = [ran_out_batches(as_workers, w) for w in range(as_workers)]
        steps = max(len(y) for _, y in parts)
        global_batches = []
        for step in range(0, steps, 5):
            global_batches.append(tuple(
                np.concatenate([part[i][step:step + 5] for part in parts])
                for i in (0, 1)))
        train = tf.data.Dataset.from_generator(
            lambda: iter(global_batches),
            output_signature=(tf.TensorSpec((None, 6, 6, 2), tf.float32),
                              tf.TensorSpec((None,), tf.int64)))
    history = model.fit(train, epochs=2, verbose=0)
    return dict(weights=weights(model), history=history.history)


def custom_loop(strategy, count, batch):
    """TensorFlow's custom-training-loop tutorial with a Keras loss."""
    x, y = examples(count)
    model = build(strategy)
    with strategy.scope():
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(batch))

    @tf.function
    def train_step(inputs):
        def step_fn(inputs):
            images, labels = inputs
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(images, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        losses = strategy.run(step_fn, args=(inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    try:
        losses = [float(train_step(inputs)) for inputs in dataset]
    except tf.errors.InvalidArgumentError as error:
        return dict(error=error.message)
    return dict(weights=weights(model), losses=losses)


def main(argv):
    del argv
    strategy = tfscale.Strategy()
    as_workers = [int(n) for n in FLAGS.as_workers]
    scenarios = {
        # 32 on 3, 5, 7 workers: 11/11/10, ...; 8 whole batches.
        "batch_32": lambda: keras_fit(strategy, 256, 32, drop_remainder=True),
        # 33 with Keras's default drop_remainder=False: a last batch of 26,
        # and 3 steps per execution.
        "batch_33_partial": lambda: keras_fit(strategy, 257, 33, drop_remainder=False,
                                              steps_per_execution=3),
        # A last batch of 1 example: every worker but one has none.
        "empty_tail": lambda: keras_fit(strategy, 257, 32, drop_remainder=False),
        "custom_loop": lambda: custom_loop(strategy, 256, 32),
    }
    if strategy.num_workers > 1:
        scenarios["ran_out"] = lambda: ran_out(strategy, None)
    for n in as_workers:
        scenarios[f"ran_out_{n}"] = lambda n=n: ran_out(strategy, n)
    # Last: a refused step stops the loop, not the process.
    scenarios["custom_loop_empty_tail"] = lambda: custom_loop(strategy, 257, 32)
    # In the order above: a refused custom loop step stays last.
    chosen = [name for name in scenarios if name in FLAGS.scenarios or not FLAGS.scenarios]
    report({name: scenarios[name]() for name in chosen})


if __name__ == "__main__":
    app.run(main)
