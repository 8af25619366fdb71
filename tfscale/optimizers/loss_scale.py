"""Dynamic loss scaling whose skip decision agrees across workers."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfscale")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """`keras.optimizers.LossScaleOptimizer` that is safe with many workers.

    Keras decides whether to apply a step or to skip it and halve the loss
    scale from the LOCAL gradients, before they are all-reduced. Under
    `tfscale.Strategy` (or any multi-worker strategy) a step that overflows
    on one worker only sends that worker down the skip branch while the
    others enter the gradient all-reduce: the all-reduce never completes and
    every worker hangs (or fails at the collective timeout). This subclass
    makes the workers agree first: each replica counts its non-finite
    gradients, the counts are summed over all replicas, and the step is
    applied only if the sum is 0.

    ```python
    local_bad = 0.0 if all(all(isfinite(g)) for g in grads) else 1.0
    finite = all_reduce_sum(local_bad) == 0      # same on every replica
    if finite:
        apply(grads / loss_scale)                # all-reduces the gradients
        # loss_scale *= 2 every `dynamic_growth_steps` finite steps
    else:
        loss_scale /= 2                          # every worker skips
    ```

    The extra cost is one all-reduce of a scalar per step. BatchNorm moving
    statistics are not optimizer state: a skipped step's forward pass has
    still updated them on the worker that saw the bad batch.

    `model.compile` wraps its optimizer in Keras's `LossScaleOptimizer` under
    the `mixed_float16` policy unless it already is one; this class is one,
    so passing it to `compile` is not wrapped a second time.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` instance to wrap
            (e.g. `tfscale.optimizers.LARS`).
        initial_scale: Float. The initial loss scale. Defaults to `2**15`.
        dynamic_growth_steps: Int. After this many consecutive steps with
            finite gradients on every worker, the loss scale is doubled.
            Defaults to `2000`.
        name: String, the optimizer's name.
        **kwargs: As for `keras.optimizers.LossScaleOptimizer`.

    Example:

    ```python
    keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope():
        model = models.resnet50(num_classes=1000)
        model.compile(
            optimizer=tfscale.optimizers.LossScaleOptimizer(
                tfscale.optimizers.LARS(learning_rate=...)),
            loss=...)
    ```

    References:
        - [Micikevicius et al., 2018. Mixed Precision Training](
          https://arxiv.org/abs/1710.03740)
        - [Jia et al., 2018. Highly Scalable Deep Learning Training System
          with Mixed-Precision: Training ImageNet in Four Minutes](
          https://arxiv.org/abs/1807.11205)
    """

    def check_finite(self, grads):
        """Whether `grads` are finite on EVERY replica (a boolean scalar).

        Keras calls this in a replica context, once per replica, before it
        branches on the result; all replicas must call it together.

        Args:
            grads: list of this replica's gradients (`None` entries ignored).

        Returns:
            A boolean scalar tensor, identical on all replicas.
        """
        local_finite = super().check_finite(grads)
        if keras.backend.backend() != "tensorflow":
            # tf.distribute's replicas are TensorFlow's alone. On JAX,
            # keras.distribution runs one program over global arrays: the
            # gradients checked are already the global ones, the same in
            # every process.
            return local_finite
        import tensorflow as tf  # the TensorFlow backend only

        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return local_finite
        # float32: the dtype every all-reduce path (and tfscale's fused
        # collectives) supports; the sum is an exact small integer.
        local_bad = ops.cast(ops.logical_not(local_finite), "float32")
        total_bad = context.all_reduce(tf.distribute.ReduceOp.SUM, local_bad)
        return ops.equal(total_bad, 0.0)
