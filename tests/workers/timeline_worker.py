"""A small fit under tfscale.Strategy with the timeline on: hierarchical
all-reduce over nodes of 2 workers with bfloat16 on the wire, one bucket per
tensor, so that every stage of a bucket shows (tfscale.timeline).

Usage: timeline_worker.py DIR
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfscale
from report import report

STEPS = 6


def main(directory):
    strategy = tfscale.Strategy(communication=tfscale.CommunicationOptions(
        algorithm="hierarchical", local_size=2, compression="bfloat16",
        fusion_threshold_bytes=0, timeline=directory))
    x = np.random.default_rng(0).normal(size=(96, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                  keras.layers.Dense(2)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)
    model.fit(data, steps_per_epoch=STEPS, epochs=1, verbose=0)
    report({"buckets": len(strategy.all_reduce_plan([v.value for v in model.trainable_variables]))})


if __name__ == "__main__":
    main(sys.argv[1])
