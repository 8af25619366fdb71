"""The worker side of `tfscale-bench train`: one process of a launch.

`spec["kind"]` says what it trains under: `"single"` (alone, no strategy),
`"stock"` (`tfscale.strategy.KerasMultiWorkerMirroredStrategy`: TF's own
all-reduce, with only the Keras 3 fix), `"tfscale"` (`tfscale.Strategy`
with the spec's algorithm and compression, PowerSGD's rank and start step)
or `"lockstep"` (alone, but every worker waits for all the others at the end
of each step: synchronous training without gradients). Both strategies time
their all-reduces the same way (`exposed_communication_seconds`). Under a
strategy a worker first trains the model alone, while the other workers do
the same, then under the strategy (or in lockstep); train.py turns the step
times into rows. Every run also keeps fit's loss after each step, and the
`single` worker writes its initial weights and batch for the JAX workers
(jax_train_worker.py) when `spec["reference_path"]` is set.
"""

import contextlib
import os

import keras
import numpy as np

import tfscale
from tfscale.launch.bench import cluster
from tfscale.launch.bench import train_model
from tfscale import agreement
from tfscale import callbacks
from tfscale import collectives
from tfscale import data
from tfscale.strategy import KerasMultiWorkerMirroredStrategy


def measure(spec):
    """Trains as `spec` says on this worker.

    Returns:
        `{"rank", "runs"}`: per precision a "compute" run (alone) and, under a
        strategy, a "distributed" run, each with its per-step seconds.
    """
    strategy = _strategy(spec)
    rank = strategy.worker_index if strategy else 0
    barrier = agreement.barrier(strategy) if strategy else (lambda: None)
    runs = []
    for precision in spec["precisions"]:
        keras.mixed_precision.set_global_policy(precision)
        barrier()
        runs.append({"precision": precision, "phase": "compute",
                     **_fit(spec, None)})
        if strategy is not None:
            barrier()
            timed = (_fit_in_lockstep(spec, barrier) if spec["kind"] == cluster.LOCKSTEP
                     else _fit(spec, strategy))
            runs.append({"precision": precision, "phase": "distributed", **timed})
        if rank == 0:
            train_model.print_progress(spec, precision, runs)
    keras.mixed_precision.set_global_policy("float32")
    return {"rank": rank, "runs": runs}


def _strategy(spec):
    """The strategy `spec["kind"]` names, all-reduces timed; None for "single"
    (lockstep: stock's, for its barrier only)."""
    if spec["kind"] in (cluster.STOCK, cluster.LOCKSTEP):
        return KerasMultiWorkerMirroredStrategy(time_all_reduces=True)
    if spec["kind"] == "tfscale":
        powersgd = None
        if spec["compression"] == collectives.powersgd.NAME:
            powersgd = tfscale.PowerSGDOptions(
                rank=spec["powersgd_rank"], start_step=spec["powersgd_start_step"],
                bucket_bytes=spec.get("powersgd_bucket_bytes"))
        return tfscale.Strategy(communication=tfscale.CommunicationOptions(
            algorithm=spec["algorithm"], compression=spec["compression"],
            local_size=spec["local_size"],
            fusion_threshold_bytes=spec["fusion_threshold_bytes"],
            timeout_seconds=spec["collective_timeout"], time_all_reduces=True,
            powersgd=powersgd))
    return None


class _Losses(keras.callbacks.Callback):
    """fit's loss after every step (the running mean over the epoch, as
    Keras reports it on every backend), for train.py's comparison with the
    JAX backend."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


class _Lockstep(keras.callbacks.Callback):
    """Ends each step when every worker has ended it (`barrier`: one
    all-reduce of 1.0) and keeps each step's sum, the workers that joined."""

    def __init__(self, barrier):
        super().__init__()
        self._barrier = barrier
        self.workers_per_step = []

    def on_train_batch_end(self, batch, logs=None):
        self.workers_per_step.append(float(self._barrier()[0]))


def _fit_in_lockstep(spec, barrier):
    """Timed steps of `model.fit` alone, each ended by `barrier` on every
    worker: the step time with synchronization and no gradients sent.

    Returns:
        `{"step_seconds": [...], "lockstep_workers": [...]}`: per step, the
        number of workers its barrier joined.
    """
    lockstep = _Lockstep(barrier)
    # The lockstep callback first: each step's time includes its barrier.
    timed = _fit(spec, None, extra_callbacks=[lockstep])
    return dict(timed, lockstep_workers=lockstep.workers_per_step[spec["warmup_steps"]:])


def _fit(spec, strategy, extra_callbacks=()):
    """Timed steps of `model.fit`; alone when `strategy` is None.

    Returns:
        `{"step_seconds": [...], "gradient_floats": n}` (the trainable
        parameters), plus `"exposed_communication_seconds": [...]` (per
        step, measured in the step) under a strategy.
    """
    size = spec["image_size"]
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = train_model.build(spec)
    batch = spec["per_worker_batch"]
    if strategy is None:
        dataset = data.synthetic(batch, size)
        if spec.get("reference_path") and not os.path.exists(spec["reference_path"]):
            _write_reference(spec["reference_path"], model, dataset)
    else:
        global_batch = batch * strategy.num_replicas_in_sync
        dataset = strategy.distribute_datasets_from_function(
            lambda context: data.synthetic(global_batch, size, input_context=context))
    timer = callbacks.StepTimer(strategy)
    autotune = getattr(strategy, "autotune", None)
    # Under "auto" the trials, the decision and the step after it (the train
    # function traced again with the choice) are not what is timed.
    warmup = spec["warmup_steps"] + (
        collectives.autotune.DECIDED_BY_STEP if autotune is not None else 0)
    losses = _Losses()
    model.fit(dataset, epochs=1, steps_per_epoch=warmup + spec["steps"],
              callbacks=[*extra_callbacks, losses, timer], verbose=0)
    # The model's gradients: what a plain all-reduce sends each step (PowerSGD
    # sends less, lockstep nothing). The size depends on --image_size:
    # AlexNet-BN has 50.8 M parameters at 224 x 224, 62.4 M at 227 x 227.
    timed = {"step_seconds": timer.step_seconds[warmup:], "losses": losses.losses,
             "gradient_floats": train_model.gradient_floats(model)}
    if strategy is not None:
        timed["exposed_communication_seconds"] = timer.exposed_communication_seconds[warmup:]
    if isinstance(strategy, tfscale.Strategy):
        # How many fused buffers the gradients make at the given threshold
        # (--fusion_thresholds; auto may choose a quarter of it, its report says).
        timed["gradient_buckets"] = len(strategy.all_reduce_plan(
            [v.value for v in model.trainable_variables]))
    if getattr(strategy, "powersgd", None) is not None:
        timed["powersgd"] = _powersgd_report(strategy, model)
    if autotune is not None:
        timed["autotune"] = _autotune_report(autotune)
        timed["autotune_decided_by_step"] = collectives.autotune.DECIDED_BY_STEP
    return timed


def _write_reference(path, model, dataset):
    """The initial weights and the batch every worker trains on (each
    worker's synthetic batch is the same), for the JAX workers: written
    whole or not at all."""
    images, labels = next(iter(dataset))
    arrays = {f"weight_{i}": w for i, w in enumerate(model.get_weights())}
    with open(path + ".tmp", "wb") as f:
        np.savez(f, images=images.numpy(), labels=labels.numpy(),
                 num_weights=len(arrays), **arrays)
    os.replace(path + ".tmp", path)


def _autotune_report(autotune):
    """Each all-reduce's candidates, its choice per bucket, and each
    (bucket, candidate, timed round)'s trial milliseconds on this worker;
    its fusion thresholds, the chosen one and each (threshold, candidate,
    round)'s span, and each (threshold, round)'s with each bucket its
    fastest (train.py merges the workers' as they chose by)."""
    return [{"call": key.split(";")[0], "candidates": plan["candidates"],
             "choices": plan["choices"],
             "fusion_thresholds": plan["fusion_thresholds"],
             "fusion_threshold_bytes": plan["fusion_threshold_bytes"],
             "round_milliseconds": (np.asarray(plan["seconds"]) * 1e3).round(1).tolist(),
             "span_round_milliseconds": (
                 np.asarray(plan["span_seconds"]) * 1e3).round(1).tolist(),
             "mix_span_round_milliseconds": (
                 np.asarray(plan["mix_span_seconds"]) * 1e3).round(1).tolist(),
             "retraced": plan["retraced"]}
            for key, plan in autotune.choices().items()]


def _powersgd_report(strategy, model):
    """What PowerSGD sent per step, and its error feedback after training
    (non-zero: the compressed path ran)."""
    import tensorflow as tf

    variables = model.trainable_variables
    with strategy.scope():
        state = strategy.powersgd.state(model.optimizer, variables)
    gradient_bytes, wire_bytes = collectives.powersgd.wire_bytes(
        state.matrices, [v.shape for v in variables], [v.dtype for v in variables])
    return {
        "compressed_tensors": len(state.matrices),
        "gradient_bytes": gradient_bytes,
        "wire_bytes": wire_bytes,
        "error_feedback_norm": float(tf.linalg.global_norm(
            [e.read_value() for e in state.error])),
    }
