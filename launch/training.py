"""tfscale-train's training, once `train.validate_flags` has passed: the
checks that need TensorFlow, then set-up from the flags (cluster, data,
model, settings), training, export, and the one-paragraph explanation of a
failure.

`train` imports this module only after its own checks, so that --help and
bad flags are answered before TensorFlow is imported.
"""

import contextlib
import dataclasses
import functools
import json
import os
import re
import sys

import keras
import numpy as np
import tensorflow as tf
from absl import app
from absl import logging

import tfscale
from tfscale import agreement
from tfscale import batch_growth
from tfscale import callbacks
from tfscale import checkpoint
from tfscale import collectives
from tfscale import data
from tfscale import dataset_specs
from tfscale import evaluator
from tfscale import export
from tfscale import fashion_mnist_source
from tfscale import flight_report
from tfscale import imagenet_source
from tfscale import models
from tfscale import recipes
from tfscale.launch import train_flags


class BadInputError(Exception):
    """Input found bad after start-up: reported in one line, no traceback."""


@contextlib.contextmanager
def input_checks():
    """Turns what the library's input checks raise into `BadInputError`.

    Only around setup (cluster, data, model, settings): the same error types
    raised later in training would be defects, and keep their traceback.
    """
    try:
        yield
    except (ValueError, NotImplementedError, FileNotFoundError,
            TimeoutError) as error:
        raise BadInputError(str(error)) from error


# In the error of a worker whose heartbeat to the coordination service timed out.
_HEARTBEAT_RPC = "CoordinationService/Heartbeat"


def validate_flags(config):
    """Refuses the bad flags whose check needs TensorFlow (run after
    `train.validate_flags`)."""

    try:
        cost_model_from_flags(config)
        if config.dataset == "imagenet":
            data.check_imagenet_source(config.data_dir, config.manual_dir)
        if config.dataset == "fashion_mnist":
            fashion_mnist_source.find(config.data_dir)
    except (ValueError, FileNotFoundError) as error:
        raise app.UsageError(str(error)) from None


def shared_settings(config):
    """The settings every worker must agree on: flags and versions, and
    the cost model's contents (not only its path: it orders auto's
    candidates and picks hybrid's algorithms, the same on every worker)."""

    return dict(
        config.shared,
        cost_model=(cost_model_from_flags(config).get_config()
                    if config.cost_model else None),
        tfscale_version=tfscale.__version__,
        tensorflow_version=tf.__version__,
        keras_version=keras.__version__,
    )


def model_options(config):
    """Model keyword arguments that flags set."""
    if config.model == "alexnet_bn_small":
        return {"fc_units": config.fc_units} if config.fc_units else {}
    if config.model != "alexnet_bn":
        return {}
    small = config.dataset in ("digits", "fashion_mnist")
    fc_units = config.fc_units or (512 if small else 4096)
    return {"fc_units": fc_units}


def model_input_size(config, spec):
    """--image_size, or the model's default for the data set: alexnet_bn_small
    reads images at their stored size (8x8 digits, 28x28 Fashion-MNIST);
    the others at the data set's default (67 at the smallest for alexnet_bn)."""
    if config.image_size:
        return config.image_size
    if config.model == "alexnet_bn_small" and spec.stored_shape:
        return spec.stored_shape[0]
    return spec.default_image_size


def strategy_from_flags(config):
    """The `tfscale.Strategy` of the cluster and communication flags."""

    resolver = None
    if config.cluster_resolver == "slurm":
        resolver = tfscale.slurm.ClusterResolver(port_base=config.slurm_port_base)
    return tfscale.Strategy(
        cluster_resolver=resolver, communication=communication_options(config),
        startup_timeout_seconds=config.startup_timeout or None,
        heartbeat_timeout_seconds=config.heartbeat_timeout,
    )


def communication_options(config):
    """The `tfscale.CommunicationOptions` of the communication flags. Where
    the algorithm may be "auto" (given, or the default over TensorFlow's
    ring), the chief stores its choice in --model_dir for a restart."""
    options = tfscale.CommunicationOptions(
        algorithm=config.algorithm,
        fusion_threshold_bytes=config.fusion_threshold_bytes,
        hybrid_threshold_bytes=config.hybrid_threshold_bytes,
        local_size=config.local_size,
        compression=config.compression,
        powersgd=powersgd_options(config),
        timeout_seconds=config.collective_timeout,
        implementation=config.implementation,
        timeline=config.timeline,
        cost_model=cost_model_from_flags(config),
    )
    if options.may_autotune and config.model_dir:
        options = dataclasses.replace(options, autotune_dir=config.model_dir)
    return options


def cost_model_from_flags(config):
    """The `CostModel` in --cost_model's file, read once; None if not given."""
    return _load_cost_model(config.cost_model) if config.cost_model else None


@functools.cache
def _load_cost_model(path):
    return collectives.cost_model.load(path)


def powersgd_options(config):
    """`PowerSGDOptions` of --powersgd_rank and --powersgd_start_step (the
    defaults where not given) under --compression=powersgd, else None."""

    given = {name: value for name, value in (
        ("rank", config.powersgd_rank), ("start_step", config.powersgd_start_step),
        ("bucket_bytes", config.powersgd_bucket_bytes))
        if value is not None}
    if config.compression != "powersgd":
        if given:
            flag = f"powersgd_{next(iter(given))}"
            raise BadInputError(
                f"--{flag} only applies to --compression=powersgd; this is "
                f"--compression={config.compression}. Received: --{flag}={getattr(config, flag)}")
        return None
    return tfscale.PowerSGDOptions(**given)


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """The checked data set: what the model, the fit and the export need."""

    spec: object  # tfscale.data's spec of the data set
    image_size: int
    steps_per_epoch: int  # fit steps: micro-batches with --accumulation_steps
    eval_split: str  # None: no evaluation split
    phases: tuple = ()  # tfscale.batch_growth.Phase, one per --batch_schedule phase
    accumulation_steps: int = 1

    @property
    def final_step(self):
        """Fit steps (micro-batches) of the whole training."""
        return self.phases[-1].end_step * self.accumulation_steps


def check_data(config):
    """`DataPlan` of the flags; raises ValueError if the data cannot feed them."""

    spec = data.spec(config.dataset)
    train_examples = data.num_examples(config.dataset, "train", config.data_dir)
    updates_per_epoch = (config.steps_per_epoch
                         or train_examples // config.global_batch_size)
    if config.batch_schedule and updates_per_epoch:
        # Every phase, named: before the first phase's unnamed checks.
        batch_growth.check_phases(
            recipes.batch_phases(config.settings,
                                 config.global_batch_size, updates_per_epoch,
                                 config.epochs),
            config.accumulation_steps)
    data.check_batch(config.global_batch_size, train_examples, "train",
                     config.accumulation_steps)
    # Evaluation reads every example once, in batches of any size.
    eval_split = dataset_specs.EVAL_SPLITS.get(config.dataset)
    phases = recipes.batch_phases(config.settings,
                                  config.global_batch_size, updates_per_epoch,
                                  config.epochs)
    return DataPlan(
        spec=spec,
        image_size=model_input_size(config, spec),
        steps_per_epoch=config.accumulation_steps * updates_per_epoch,
        eval_split=eval_split,
        phases=tuple(phases),
        accumulation_steps=config.accumulation_steps,
    )


def prepare_data(config, prepares):
    """--dataset=imagenet: prepares --data_dir here (`prepares`), or waits
    (logging every minute) for the chief to; other data sets need nothing."""

    if config.dataset != "imagenet":
        if config.prepare_only:
            logging.info("--dataset=%s needs no preparation.", config.dataset)
        return
    version_dir = imagenet_source.ensure_prepared(
        config.data_dir, config.manual_dir, prepares=prepares,
        timeout_seconds=config.prepare_timeout or None, who="the chief")
    if config.prepare_only:
        logging.info("ImageNet is prepared in %s.", version_dir)


def fit_batch_size(config):
    """Examples per fit step over all workers: the global batch, or one
    micro-batch of it with --accumulation_steps."""
    return config.global_batch_size // config.accumulation_steps


def distributed(config, strategy, data_plan, split, start_step=0, phase=None):
    """`split` as this worker's share of each global (micro-)batch; of
    `phase`'s batch from where its data starts, if given."""

    batch_size, start_example = fit_batch_size(config), 0
    if phase is not None:
        batch_size = phase.global_batch_size // config.accumulation_steps
        start_example = phase.first_example

    def make(input_context):
        return data.load(
            config.dataset, split, batch_size, data_plan.image_size,
            input_context=input_context, seed=config.seed, start_step=start_step,
            data_dir=config.data_dir, manual_dir=config.manual_dir,
            start_example=start_example,
            drop_remainder=False,  # evaluation: every example, once
        )
    return strategy.distribute_datasets_from_function(make)


def check_resume_settings(config, data_plan):
    """Refuses to resume from checkpoints trained with other settings."""

    if config.model_dir and checkpoint.latest(config.model_dir)[0]:
        recipes.check_settings_unchanged(
            config.model_dir, config.settings, config.training_defaults,
            **config.training)
        batch_growth.check_record(
            data_plan.phases, checkpoint.state(config.model_dir),
            config.accumulation_steps)


def build_model(config, strategy, data_plan, restore=True):
    """The compiled model, restored from `--model_dir` if `restore`, and its
    step."""

    keras.utils.set_random_seed(config.seed)
    settings = config.settings
    recipes.set_precision(settings)  # before the model: layers take the policy
    spec = data_plan.spec
    with strategy.scope():
        model = models.get(
            config.model,
            num_classes=spec.num_classes,
            input_shape=(data_plan.image_size, data_plan.image_size, spec.channels),
            **model_options(config),
        )
        optimizer, _ = recipes.make_optimizer(
            settings, config.global_batch_size,
            data_plan.steps_per_epoch // settings.accumulation_steps, config.epochs)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        # Inside the scope: restoring creates the optimizer's slot variables.
        start_step = (checkpoint.restore(model, config.model_dir)
                      if config.model_dir and restore else 0)
    return model, start_step


def fit_callbacks(config, strategy, phases):
    """The callbacks of every fit: safety, progress, statistics, checkpoints."""

    result = [
        callbacks.TerminateOnNonFiniteLoss(),  # before any save of a bad step
        callbacks.Throughput(fit_batch_size(config)),
        callbacks.SyncBatchNormStatistics(strategy),
        callbacks.StragglerReport(strategy, log_dir=config.tensorboard_dir),
    ]
    if strategy.is_chief and config.tensorboard_dir:
        result.append(callbacks.TensorBoardScalars(
            config.tensorboard_dir, fit_batch_size(config), strategy))
    if config.model_dir:
        record = None
        if config.batch_schedule:  # each checkpoint names its phase
            def record(step):
                return batch_growth.phase_record(
                    phases, step, config.accumulation_steps)
        result.append(callbacks.TrainingCheckpoint(
            config.model_dir, strategy, config.checkpoint_steps, record=record))
    return result


def fit_with_resume(config, model, strategy, data_plan, start_step):
    """Trains from `start_step` to the end of `--epochs`: one fit per batch
    phase (and one to finish an epoch a resumed run starts inside)."""

    verbose = config.verbose
    if verbose == "auto":
        verbose = 1 if sys.stdout.isatty() else 2
    callbacks = fit_callbacks(config, strategy, data_plan.phases)
    eval_split = data_plan.eval_split
    for part in batch_growth.fit_parts(
            data_plan.phases, start_step, config.accumulation_steps):
        fit_batch = part.phase.global_batch_size // config.accumulation_steps
        for callback in callbacks:  # images/second of this phase's batch
            if hasattr(callback, "global_batch_size"):
                callback.global_batch_size = fit_batch
        # Each part reads the data from the step it starts at.
        model.fit(
            distributed(config, strategy, data_plan, "train", part.data_step, part.phase),
            initial_epoch=part.initial_epoch,
            epochs=part.epochs,
            steps_per_epoch=part.steps_per_epoch,
            validation_data=(distributed(config, strategy, data_plan, eval_split)
                             if eval_split else None),
            callbacks=callbacks,
            verbose=int(verbose) if strategy.is_chief else 0,
        )


def recompute_batch_norm_statistics(config, model, strategy, data_plan):
    """--bn_statistics_batches: BatchNorm statistics of the final weights,
    averaged over this worker's training batches, then over the workers."""

    context = tf.distribute.InputContext(
        num_input_pipelines=strategy.num_workers,
        input_pipeline_id=strategy.worker_index,
        num_replicas_in_sync=strategy.num_replicas_in_sync)
    batches = data.load(
        config.dataset, "train", fit_batch_size(config), data_plan.image_size,
        input_context=context, seed=config.seed, data_dir=config.data_dir,
        manual_dir=config.manual_dir)
    count = callbacks.recompute_batch_norm_statistics(
        model, batches, config.bn_statistics_batches, strategy)
    logging.info("BatchNorm statistics of %d layers recomputed from %d "
                 "batches per worker (no moving averages).", count,
                 config.bn_statistics_batches)


def log_start(config, strategy, data_plan, start_step):
    """The chief's line saying what trains, and from which checkpoint."""

    num_workers = strategy.num_workers
    logging.info(
        "Training %s on %s: %d worker(s), global batch %d (%s), "
        "%d steps/epoch, %d epochs, %s, %s.",
        config.model, config.dataset, num_workers, config.global_batch_size,
        data.describe_share(config.global_batch_size, num_workers),
        data_plan.steps_per_epoch,
        config.epochs, strategy.communication,
        recipes.describe(config.settings, config.global_batch_size),
    )
    if config.accumulation_steps > 1:
        logging.info("Each step accumulates %d micro-batches of %d (%s); "
                     "%d micro-batches per epoch.",
                     config.accumulation_steps, fit_batch_size(config),
                     data.describe_share(fit_batch_size(config), num_workers),
                     data_plan.steps_per_epoch)
    for phase in data_plan.phases[1:]:
        logging.info("Batch schedule: %s: global batch %d (%s), "
                     "%d steps/epoch, learning rate / %d.", phase.describe(),
                     phase.global_batch_size,
                     data.describe_share(phase.global_batch_size, num_workers),
                     phase.steps_per_epoch, phase.learning_rate_divisor)
    if start_step:
        logging.info("Resuming from the checkpoint of step %d in %s.",
                     start_step, config.model_dir)
    if config.deterministic:
        logging.info("Op determinism on: every op runs a deterministic kernel "
                     "(tf.config.experimental.enable_op_determinism).")


def train(config):
    """Sets up from the flags (bad input: `BadInputError`), trains, exports."""

    if train_flags.is_evaluator(config):
        evaluate_checkpoints(config)
        return
    if config.prepare_only:
        prepare_data(config, prepares=True)
        return
    with input_checks():
        strategy = strategy_from_flags(config)
        if not strategy.is_chief:
            logging.set_verbosity(logging.WARNING)
        agreement.check_settings_agree(strategy, shared_settings(config))
        prepare_data(config, prepares=strategy.is_chief)
        data_plan = check_data(config)
        if config.model_dir:  # the newest checkpoint that reads back whole
            checkpoint.recover(config.model_dir, strategy.is_chief,
                               config.collective_timeout or 3600)
        check_resume_settings(config, data_plan)
        model, start_step = build_model(config, strategy, data_plan)
    if strategy.is_chief:
        log_start(config, strategy, data_plan, start_step)
        if config.model_dir:  # a resume compares against these
            recipes.write_settings(config.model_dir, config.settings,
                                   **config.training)
    fit_with_resume(config, model, strategy, data_plan, start_step)
    if config.bn_statistics_batches:
        recompute_batch_norm_statistics(config, model, strategy, data_plan)
    # Every worker: the export takes the chief's BatchNorm statistics.
    callbacks.batch_norm_synchronizer(model, strategy)()
    if strategy.is_chief and config.export_dir:
        export_on_chief(config, model, data_plan.spec, data_plan.image_size)


def evaluate_checkpoints(config):
    """The evaluator task: evaluates each checkpoint training writes into
    --model_dir on the whole evaluation split, until the last one."""

    with input_checks():
        prepare_data(config, prepares=False)  # the chief prepares
        data_plan = check_data(config)
        # No strategy: the evaluator runs no collectives with the trainers.
        model, _ = build_model(config, tf.distribute.get_strategy(), data_plan,
                               restore=False)
    eval_data = data.load(
        config.dataset, data_plan.eval_split, config.global_batch_size,
        data_plan.image_size, data_dir=config.data_dir, manual_dir=config.manual_dir,
        drop_remainder=False)  # every example is evaluated
    final_step = data_plan.final_step
    logging.info("Evaluator: evaluating the checkpoints in %s on the %s split "
                 "of %s until training's last (step %d).", config.model_dir,
                 data_plan.eval_split, config.dataset, final_step)
    evaluator.CheckpointEvaluator(
        model, eval_data, config.model_dir, final_step,
        tensorboard_dir=config.tensorboard_dir,
        timeout_seconds=config.evaluator_timeout or None,
        before_restore=lambda step, prefix: check_evaluator_settings(config),
    ).run()


def check_evaluator_settings(config):
    """Refuses checkpoints trained with flags other than the evaluator's."""

    try:
        saved = recipes.read_settings(config.model_dir)
    except FileNotFoundError:
        return
    lines = recipes.settings_differences(
        saved, (config.settings, config.training),
        config.training_defaults)
    if lines:
        raise BadInputError(
            f"The checkpoints in {config.model_dir} were trained with other "
            "flags than the evaluator's; start the evaluator with the "
            "training job's command:\n  " + "\n  ".join(lines))


def export_on_chief(config, model, dataset_spec, image_size):
    """Writes the SavedModel; for digits and Fashion-MNIST, checks it on the
    whole test split, fed raw uint8 images as stored."""

    path = export.export_classifier(model, config.export_dir, dataset_spec, image_size)
    if config.dataset == "digits":
        images, labels = data.digits_arrays("test")
    elif config.dataset == "fashion_mnist":
        images, labels = fashion_mnist_source.arrays("test", config.data_dir)
    else:
        print(f"Exported SavedModel to {path}", flush=True)
        return
    probabilities = export.verify_export(path, model, images, dataset_spec, image_size)
    accuracy = float(np.mean(np.argmax(probabilities, axis=1) == labels))
    print(
        f"Exported SavedModel to {path}; it serves the trained model's "
        f"predictions, and its accuracy on the full {len(labels)}-image test "
        f"split: {accuracy:.4f}",
        flush=True,
    )


def describe_failure(config, error):
    """A one-paragraph explanation of why training stopped."""

    if isinstance(error, callbacks.NonFiniteLossError):
        kept = ""
        if config.model_dir:
            step, _ = checkpoint.latest(config.model_dir)
            kept = f" The last good checkpoint (step {step}) in {config.model_dir} is kept."
        return f"{error}{kept}"
    if isinstance(error, (BadInputError, FileNotFoundError,
                          checkpoint.CheckpointWriteError,
                          checkpoint.NoIntactCheckpointError)):
        return str(error)
    # Errors of this worker's own data or resources, not of its peers.
    if isinstance(error, tf.errors.DataLossError):
        return (f"Corrupt data ({checkpoint.first_line(error)}): a file this worker read "
                "is damaged. Replace it (a checkpoint: --model_dir moves corrupt "
                "ones aside itself at the next start) and relaunch.")
    if isinstance(error, tf.errors.ResourceExhaustedError):
        return (f"Out of memory or disk space ({checkpoint.first_line(error)}). Free it, "
                "or use a smaller --global_batch_size, then relaunch.")
    if isinstance(error, tfscale.StartupError):
        if error.signum is None and error.missing:
            return f"{error} --startup_timeout sets this limit."
        return str(error)
    if isinstance(error, evaluator.NoNewCheckpointError):
        return (f"{error} If training is still running, raise "
                f"--evaluator_timeout (now {config.evaluator_timeout:g} s).")
    if isinstance(error, tf.errors.OpError):
        return _describe_op_error(config, error)
    return None


# The errors TensorFlow raises when a peer or the link to it fails.
_PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                tf.errors.AbortedError, tf.errors.CancelledError)
# What a collective's error says of a peer or a link (`_collective_cause`).
_PEER_CAUSES = (r"The following tasks are unhealthy[^\n]*\n?[^\n]*",
                r"Collective ops is aborted by: [^\n]*",
                r"[^\n]*(?:timed out|Deadline Exceeded|Connection refused)[^\n]*")


def _describe_op_error(config, error):
    """Lost contact, or mismatched collectives, where TensorFlow's error says
    a peer or the link to it failed; None for any other error of an op (this
    worker's own input pipeline, say): its traceback is the evidence."""
    message = str(error)
    mismatch = flight_report.peer_mismatch(message)
    if mismatch:
        return (f"The workers issued different collectives: {mismatch}. "
                "Start every worker with the same flags and the same "
                "version of the code, then relaunch.")
    tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    # Collective errors name the peer's task where gRPC knows it.
    task = tf_config.get("task", {})
    own = (task.get("type"), str(task.get("index")))
    peers = sorted(set(re.findall(r"/job:(\w+)/replica:\d+/task:(\d+)", message)) - {own})
    cause = _collective_cause(message)
    heartbeat = _HEARTBEAT_RPC in message
    if not (isinstance(error, _PEER_ERRORS) or peers or cause or heartbeat):
        return None
    who = ", ".join(f"{job} {index}" for job, index in peers) if peers else "a peer worker"
    if cause is None:
        lines = [l.strip() for l in message.splitlines() if l.strip()]
        cause = lines[-1] if lines else "no details"
    busy_link = ""
    if heartbeat:
        # The coordination service runs on the chief, else on worker 0
        # (MultiWorkerMirroredStrategy's `coordination_leader`).
        who = "chief 0" if "chief" in tf_config.get("cluster", {}) else "worker 0"
        cause = (f"this worker's heartbeat got no reply within "
                 f"{config.heartbeat_timeout / 2:g} s")
        busy_link = (" If every worker was alive, the reply waited behind "
                     "the model's tensors on a busy link: raise "
                     "--heartbeat_timeout.")
    return (
        f"Lost contact with {who} ({type(error).__name__}: {cause}). A "
        "worker died, hung or became unreachable (TensorFlow's heartbeats "
        f"notice within --heartbeat_timeout={config.heartbeat_timeout:g} s; "
        f"--collective_timeout={config.collective_timeout:g} s bounds the "
        f"rest); every worker stops.{busy_link} Relaunch the job; with "
        "--model_dir it resumes from the last checkpoint."
    )


def _collective_cause(message):
    """The line of a TensorFlow collective error that says what happened,
    or None where it says nothing of a peer or a link."""
    for pattern in _PEER_CAUSES:
        match = re.search(pattern, message)
        if match:
            return " ".join(match.group(0).split())
    return None


def run(config):
    """Trains; a failure `describe_failure` explains ends the process with
    that one line (and a signal's exit status), any other is raised."""

    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    try:
        train(config)
    except Exception as error:  # explained, then re-raised if unexplained
        message = describe_failure(config, error)
        if message is None:
            raise
        # The message says it all; the traceback is for debugging (-v=1).
        logging.debug("tfscale-train stopped:", exc_info=True)
        # Stopped by a signal: exit as shells report it (128 + its number).
        signum = getattr(error, "signum", None)
        if signum:
            print(f"tfscale-train: {message}", file=sys.stderr, flush=True)
            sys.exit(128 + signum)
        sys.exit(f"tfscale-train: {message}")
