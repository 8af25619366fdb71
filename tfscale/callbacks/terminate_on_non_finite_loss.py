"""`TerminateOnNonFiniteLoss`: stops every worker at the first NaN/inf loss."""

import keras
import numpy as np

from tfscale import checkpoint


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


class TerminateOnNonFiniteLoss(keras.callbacks.TerminateOnNaN):
    """Keras's `TerminateOnNaN(raise_error=True)`, raising a message that says
    what to do.

    It raises (Keras's strict mode) rather than setting `stop_training`, so
    no later callback's `on_train_end` saves the bad step. The logged loss is
    averaged over all workers, so every worker sees it at the same step and
    stops there together; place it before `TrainingCheckpoint`.
    """

    def __init__(self):
        super().__init__(raise_error=True)

    def on_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not np.isfinite(loss):
            raise NonFiniteLossError(
                f"The loss (averaged over all workers) is {loss} at step "
                f"{checkpoint.step(self.model)}; training stopped. Lower the "
                "learning rate, add warmup, or use loss scaling "
                "(tfscale.optimizers.LossScaleOptimizer under mixed_float16)."
            )
