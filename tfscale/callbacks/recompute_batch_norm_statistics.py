"""`RecomputeBatchNormStatistics`: BatchNorm inference statistics without
moving averages (Akiba et al. 2017)."""

import keras
import numpy as np

from tfscale._private import accessors
from tfscale.callbacks.sync_batch_norm_statistics import batch_norm_synchronizer


def _batch_norm_layers(model):
    return [layer for layer in accessors.flatten_layers(model)
            if isinstance(layer, keras.layers.BatchNormalization)]


def _images(batch):
    """The model input of a dataset element: `x`, `(x, y)` or `(x, y, w)`."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def recompute_batch_norm_statistics(model, dataset, steps, strategy=None):
    """Replaces BatchNorm moving averages by averages over training batches.

    Keras's BatchNormalization normalizes a training batch by its own mean
    and variance and keeps exponential moving averages of them for
    inference. With a very large batch there are few steps, the weights move
    a lot between them, and the moving averages (weighted towards old
    weights) describe the final model badly. Akiba et al. (2017) use batch
    normalization *without* moving averages: the statistics used at
    inference are computed for the trained weights. This function computes,
    for every BatchNormalization layer, the plain average over `steps`
    batches of `dataset` of the per-batch mean and variance of its input,
    with the final weights and the network in training mode (every
    BatchNorm before it normalizing by batch statistics, exactly as in
    training), and writes them into the layer's `moving_mean` and
    `moving_variance`. `model.evaluate`, `model.predict` and a SavedModel
    exported afterwards (`tfscale.export.export_classifier`) use them.

    ```python
    mean_l = average over batches b of mean(x_l(b), axes != layer.axis)
    var_l = average over batches b of var(x_l(b), axes != layer.axis)
    ```

    `var` is the batch variance BatchNormalization itself normalizes by in
    training (divided by n, not n - 1). The averages are accumulated in
    float64. The model itself is not run: a copy with the same weights is,
    so no variable of `model` changes but the statistics.

    Several workers: each averages over its own `steps` batches, and with
    `strategy` given the results are then averaged across workers
    (`batch_norm_synchronizer`), so every worker (and the chief's export)
    holds the average over all of them. Call it on every worker.

    Source: the paper's text (arXiv 1711.04325) was not available to this
    implementation, only its abstract, which names the technique "batch
    normalization without moving averages"; no section or equation of it
    is cited here. What it does at
    inference is reconstructed here as population statistics of the final
    weights: an equal-weight average of batch statistics in place of the
    exponential moving average (what Chainer, their framework, computes in
    `BatchNormalization(finetune=True)` mode, and "PreciseBN" in Wu and
    Johnson 2021).

    Args:
        model: a functional or Sequential Keras model whose BatchNorm layers
            are called once, in its own graph (not inside a nested model).
        dataset: batches of training data: `x`, `(x, y)` or `(x, y, w)`
            (a `tf.data.Dataset` or any iterable), preprocessed as for
            `fit`. Each batch should be a training batch (the statistics of a
            small batch differ from those of a large one).
        steps: int >= 1, the number of batches to average over.
        strategy: `None`, or the `tfscale.Strategy` the model was trained
            under (averages across workers).

    Returns:
        The number of BatchNormalization layers updated.

    Raises:
        ValueError: `steps` < 1, the model has no BatchNormalization layer,
            one cannot be reached from the model's inputs, or `dataset`
            holds fewer than `steps` batches.

    References:
        - [Akiba, Suzuki and Fukuda, 2017. Extremely Large Minibatch SGD:
          Training ResNet-50 on ImageNet in 15 Minutes](
          https://arxiv.org/abs/1711.04325) (abstract).
        - [Ioffe and Szegedy, 2015](https://arxiv.org/abs/1502.03167),
          Alg. 2 (inference statistics as averages over training batches).
    """
    if not (isinstance(steps, int) and not isinstance(steps, bool)
            and steps >= 1):
        raise ValueError(f"`steps` must be an integer >= 1. Received: steps={steps!r}")
    layers = _batch_norm_layers(model)
    if not layers:
        raise ValueError(
            f"`model` ({model.name}) has no BatchNormalization layer whose "
            "statistics could be recomputed.")
    # A copy runs in training mode, so `model`'s own moving averages (and
    # its Dropout seeds) are untouched while the statistics are collected.
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    copy_layers = _batch_norm_layers(copy)
    try:
        probe = keras.Model(copy.inputs, [layer.input for layer in copy_layers])
    except (ValueError, AttributeError) as e:
        raise ValueError(
            f"`model` ({model.name}) must be a functional or Sequential model "
            "with its BatchNormalization layers in its own graph (not in a "
            f"nested model); their inputs cannot be reached: {e}") from None

    sums = [None] * len(layers)
    seen = 0
    for batch in dataset:
        if seen == steps:
            break
        inputs = probe(_images(batch), training=True)
        if not isinstance(inputs, (list, tuple)):
            inputs = [inputs]
        for i, (layer, x) in enumerate(zip(copy_layers, inputs)):
            x = np.asarray(keras.ops.convert_to_numpy(x), np.float64)
            axes = tuple(a for a in range(x.ndim)
                         if a not in _axes(layer.axis, x.ndim))
            mean = x.mean(axis=axes)
            variance = x.var(axis=axes)
            if sums[i] is None:
                sums[i] = [mean, variance]
            else:
                sums[i][0] += mean
                sums[i][1] += variance
        seen += 1
    if seen < steps:
        raise ValueError(
            f"`dataset` must hold at least `steps` ({steps}) batches. "
            f"Received: a dataset of {seen} batches")
    for layer, (mean_sum, variance_sum) in zip(layers, sums):
        layer.moving_mean.assign(
            (mean_sum / seen).astype(layer.moving_mean.dtype))
        layer.moving_variance.assign(
            (variance_sum / seen).astype(layer.moving_variance.dtype))
    if strategy is not None:
        batch_norm_synchronizer(model, strategy)()
    return len(layers)


def _axes(axis, ndim):
    """BatchNormalization's `axis` (int or list) as non-negative ints."""
    axis = [axis] if isinstance(axis, int) else list(axis)
    return [a % ndim for a in axis]


class RecomputeBatchNormStatistics(keras.callbacks.Callback):
    """At the end of `fit`, BatchNorm statistics without moving averages.

    Calls `recompute_batch_norm_statistics(self.model, dataset, steps,
    strategy)` in `on_train_end`, so the model that `fit` returns (and
    `evaluate`s, and exports) normalizes by statistics of its final weights
    (Akiba et al. 2017). Give every worker the callback.

    Args:
        dataset: training batches (see `recompute_batch_norm_statistics`).
        steps: int >= 1, batches to average over.
        strategy: `None`, or the `tfscale.Strategy` of the training.
    """

    def __init__(self, dataset, steps, strategy=None):
        super().__init__()
        if not (isinstance(steps, int) and not isinstance(steps, bool)
                and steps >= 1):
            raise ValueError(
                f"`steps` must be an integer >= 1. Received: steps={steps!r}")
        self.dataset = dataset
        self.steps = steps
        self.strategy = strategy

    def on_train_end(self, logs=None):
        recompute_batch_norm_statistics(
            self.model, self.dataset, self.steps, self.strategy)
