"""What `tfscale-bench train`'s two workers share, TensorFlow's
(train_worker.py) and JAX's (jax_train_worker.py): the model and optimizer
they time, built alike on either backend, its size, and their progress
line. Imports no TensorFlow."""

import statistics

import keras
import numpy as np

from tfscale import models


def build(spec):
    """`spec["model"]` at `spec["image_size"]`, 1000 classes, compiled with
    SGD (learning rate 0.01, momentum 0.9) and sparse cross-entropy.

    AlexNet-BN trains without dropout here: its random masks differ between
    TensorFlow and JAX, and train.py compares the two backends' losses step
    for step. A mask costs one multiply per activation of fc6 and fc7.
    """
    size = spec["image_size"]
    options = {}
    if spec["model"] == "alexnet_bn":
        options = {"fc_units": spec["fc_units"], "dropout": 0.0}
    elif spec["model"] == "alexnet_bn_small":  # no dropout
        options = {"fc_units": spec["fc_units"]}
    model = models.get(spec["model"], num_classes=1000, input_shape=(size, size, 3),
                       **options)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def gradient_floats(model):
    """The trainable parameters: what a plain all-reduce sends each step."""
    return sum(int(np.prod(v.shape)) for v in model.trainable_variables)


def print_progress(spec, precision, runs):
    """Worker 0's line after each precision: every phase's median step."""
    print(f"{spec['name']} {precision}: " + ", ".join(
        f"{r['phase']} median {statistics.median(r['step_seconds']):.3f} s/step"
        for r in runs if r["precision"] == precision), flush=True)
