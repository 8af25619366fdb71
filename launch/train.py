r"""tfscale-train: one worker of a synchronous multi-worker training job.

Every worker runs the same command; TF_CONFIG tells each who it is (as
Kubernetes/Kubeflow TFJob or `tfscale-launch` set it; without TF_CONFIG it
trains alone). Worker 0, the chief, prints progress and writes the export.

    tfscale-launch --num_workers=2 -- tfscale-train            # digits, alexnet_bn
    tfscale-train --model=resnet50 --dataset=imagenet \
        --manual_dir=/data/imagenet --global_batch_size=1024 --epochs=90
"""

import contextlib
import dataclasses
import json
import os
import re
import sys

from absl import app
from absl import flags
from absl import logging

from launch import preflight
from launch import train_flags

FLAGS = flags.FLAGS


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


def validate_flags():
    """Refuses bad flags before anything starts or is written."""
    import models
    from tfscale import data

    if FLAGS.model not in models.names():
        raise app.UsageError(
            f"--model={FLAGS.model!r} is unknown. Known: {', '.join(models.names())}"
        )
    if FLAGS.dataset not in data.names():
        raise app.UsageError(
            f"--dataset={FLAGS.dataset!r} is unknown. Known: {', '.join(data.names())}"
        )
    if FLAGS.dataset == "synthetic" and not FLAGS.steps_per_epoch:
        raise app.UsageError(
            "--dataset=synthetic never ends: give --steps_per_epoch."
        )
    for name in ("epochs", "global_batch_size"):
        if getattr(FLAGS, name) < 1:
            raise app.UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}.")
    if FLAGS.hybrid_threshold_bytes is not None and FLAGS.algorithm != "hybrid":
        raise app.UsageError(
            "--hybrid_threshold_bytes applies only to --algorithm=hybrid, got "
            f"--algorithm={FLAGS.algorithm}."
        )
    try:
        train_flags.settings_from_flags()
        preflight.check_tf_config()
        # An evaluator only reads --model_dir.
        preflight.check_writable_dir(
            "model_dir", None if is_evaluator() else FLAGS.model_dir)
        preflight.check_writable_dir("export_dir", FLAGS.export_dir)
        preflight.check_writable_dir("tensorboard_dir", FLAGS.tensorboard_dir)
        if FLAGS.dataset == "imagenet":
            data.check_imagenet_source(FLAGS.data_dir, FLAGS.manual_dir)
    except (ValueError, FileNotFoundError) as error:  # PreflightError too
        raise app.UsageError(str(error)) from None
    if is_evaluator() and not FLAGS.model_dir:
        raise app.UsageError(
            "The evaluator needs --model_dir: the training job's checkpoint "
            "directory (readable here), whose checkpoints it evaluates.")
    if is_evaluator() and FLAGS.dataset not in EVAL_SPLITS:
        raise app.UsageError(
            f"--dataset={FLAGS.dataset} has no evaluation split for the "
            f"evaluator; use {' or '.join(EVAL_SPLITS)}.")


def is_evaluator():
    """Whether TF_CONFIG makes this process an `evaluator` task."""
    from tfscale import evaluator

    return FLAGS.cluster_resolver == "tf_config" and evaluator.is_evaluator_task()


def shared_settings():
    """The settings every worker must agree on: flags and versions."""
    import keras
    import tensorflow as tf

    import tfscale

    return dict(
        train_flags.shared_flags(),
        tfscale_version=tfscale.__version__,
        tensorflow_version=tf.__version__,
        keras_version=keras.__version__,
    )


def model_options():
    """Model keyword arguments that flags set."""
    if FLAGS.model != "alexnet_bn":
        return {}
    fc_units = FLAGS.fc_units or (512 if FLAGS.dataset == "digits" else 4096)
    return {"fc_units": fc_units}


def strategy_from_flags():
    """The `tfscale.Strategy` of the cluster and communication flags."""
    import tfscale

    resolver = None
    if FLAGS.cluster_resolver == "slurm":
        resolver = tfscale.slurm.ClusterResolver(port_base=FLAGS.slurm_port_base)
    return tfscale.Strategy(
        cluster_resolver=resolver,
        communication=tfscale.CommunicationOptions(
            algorithm=FLAGS.algorithm,
            fusion_threshold_bytes=FLAGS.fusion_threshold_bytes,
            hybrid_threshold_bytes=FLAGS.hybrid_threshold_bytes,
            local_size=FLAGS.local_size,
            compression=FLAGS.compression,
            powersgd=powersgd_options(),
            timeout_seconds=FLAGS.collective_timeout,
            implementation=FLAGS.implementation,
        ),
        startup_timeout_seconds=FLAGS.startup_timeout or None,
    )


def powersgd_options():
    """`PowerSGDOptions` of --powersgd_rank and --powersgd_start_step (the
    defaults where not given) under --compression=powersgd, else None."""
    import tfscale

    given = {name: value for name, value in (
        ("rank", FLAGS.powersgd_rank), ("start_step", FLAGS.powersgd_start_step))
        if value is not None}
    if FLAGS.compression != "powersgd":
        if given:
            flag = f"powersgd_{next(iter(given))}"
            raise BadInputError(
                f"--{flag} only applies to --compression=powersgd; this is "
                f"--compression={FLAGS.compression}. Received: --{flag}={FLAGS[flag].value}")
        return None
    return tfscale.PowerSGDOptions(**given)


EVAL_SPLITS = {"digits": "test", "imagenet": "validation"}


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """The checked data set: what the model, the fit and the export need."""

    spec: object  # tfscale.data's spec of the data set
    image_size: int
    steps_per_epoch: int  # fit steps: micro-batches with --accumulation_steps
    eval_split: str  # None: no evaluation split
    phases: tuple = ()  # tfscale.batch_growth.Phase, one per --batch_schedule phase

    @property
    def final_step(self):
        """Fit steps (micro-batches) of the whole training."""
        return self.phases[-1].end_step * FLAGS.accumulation_steps


def check_data():
    """`DataPlan` of the flags; raises ValueError if the data cannot feed them."""
    from tfscale import batch_growth
    from tfscale import data
    from tfscale import recipes

    spec = data.spec(FLAGS.dataset)
    train_examples = data.num_examples(FLAGS.dataset, "train", FLAGS.data_dir)
    updates_per_epoch = (FLAGS.steps_per_epoch
                         or train_examples // FLAGS.global_batch_size)
    if FLAGS.batch_schedule and updates_per_epoch:
        # Every phase, named: before the first phase's unnamed checks.
        batch_growth.check_phases(
            recipes.batch_phases(train_flags.settings_from_flags(),
                                 FLAGS.global_batch_size, updates_per_epoch,
                                 FLAGS.epochs),
            FLAGS.accumulation_steps)
    data.check_batch(FLAGS.global_batch_size, train_examples, "train",
                     FLAGS.accumulation_steps)
    # Evaluation reads every example once, in batches of any size.
    eval_split = EVAL_SPLITS.get(FLAGS.dataset)
    phases = recipes.batch_phases(train_flags.settings_from_flags(),
                                  FLAGS.global_batch_size, updates_per_epoch,
                                  FLAGS.epochs)
    return DataPlan(
        spec=spec,
        image_size=FLAGS.image_size or spec.default_image_size,
        steps_per_epoch=FLAGS.accumulation_steps * updates_per_epoch,
        eval_split=eval_split,
        phases=tuple(phases),
    )


def prepare_data(prepares):
    """--dataset=imagenet: prepares --data_dir here (`prepares`), or waits
    (logging every minute) for the chief to; other data sets need nothing."""
    from tfscale import imagenet_source

    if FLAGS.dataset != "imagenet":
        if FLAGS.prepare_only:
            logging.info("--dataset=%s needs no preparation.", FLAGS.dataset)
        return
    version_dir = imagenet_source.ensure_prepared(
        FLAGS.data_dir, FLAGS.manual_dir, prepares=prepares,
        timeout_seconds=FLAGS.prepare_timeout or None, who="the chief")
    if FLAGS.prepare_only:
        logging.info("ImageNet is prepared in %s.", version_dir)


def fit_batch_size():
    """Examples per fit step over all workers: the global batch, or one
    micro-batch of it with --accumulation_steps."""
    return FLAGS.global_batch_size // FLAGS.accumulation_steps


def distributed(strategy, data_plan, split, start_step=0, phase=None):
    """`split` as this worker's share of each global (micro-)batch; of
    `phase`'s batch from where its data starts, if given."""
    from tfscale import data

    batch_size, start_example = fit_batch_size(), 0
    if phase is not None:
        batch_size = phase.global_batch_size // FLAGS.accumulation_steps
        start_example = phase.first_example

    def make(input_context):
        return data.load(
            FLAGS.dataset, split, batch_size, data_plan.image_size,
            input_context=input_context, seed=FLAGS.seed, start_step=start_step,
            data_dir=FLAGS.data_dir, manual_dir=FLAGS.manual_dir,
            start_example=start_example,
            drop_remainder=False,  # evaluation: every example, once
        )
    return strategy.distribute_datasets_from_function(make)


def check_resume_settings(settings, data_plan):
    """Refuses to resume from checkpoints trained with other settings."""
    from tfscale import batch_growth
    from tfscale import checkpoint
    from tfscale import recipes

    if FLAGS.model_dir and checkpoint.latest(FLAGS.model_dir)[0]:
        recipes.check_settings_unchanged(
            FLAGS.model_dir, settings, train_flags.training_defaults(),
            **train_flags.training_from_flags())
        batch_growth.check_record(
            data_plan.phases, checkpoint.state(FLAGS.model_dir),
            FLAGS.accumulation_steps)


def build_model(strategy, settings, data_plan, restore=True):
    """The compiled model, restored from `--model_dir` if `restore`, and its
    step."""
    import keras

    import models
    from tfscale import checkpoint
    from tfscale import recipes

    keras.utils.set_random_seed(FLAGS.seed)
    recipes.set_precision(settings)  # before the model: layers take the policy
    spec = data_plan.spec
    with strategy.scope():
        model = models.get(
            FLAGS.model,
            num_classes=spec.num_classes,
            input_shape=(data_plan.image_size, data_plan.image_size, spec.channels),
            **model_options(),
        )
        optimizer, _ = recipes.make_optimizer(
            settings, FLAGS.global_batch_size,
            data_plan.steps_per_epoch // settings.accumulation_steps, FLAGS.epochs)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        # Inside the scope: restoring creates the optimizer's slot variables.
        start_step = (checkpoint.restore(model, FLAGS.model_dir)
                      if FLAGS.model_dir and restore else 0)
    return model, start_step


def fit_callbacks(strategy, phases):
    """The callbacks of every fit: safety, progress, statistics, checkpoints."""
    from tfscale import batch_growth
    from tfscale import callbacks

    result = [
        callbacks.TerminateOnNonFiniteLoss(),  # before any save of a bad step
        callbacks.Throughput(fit_batch_size()),
        callbacks.SyncBatchNormStatistics(strategy),
        callbacks.StragglerReport(strategy, log_dir=FLAGS.tensorboard_dir),
    ]
    if strategy.is_chief and FLAGS.tensorboard_dir:
        result.append(callbacks.TensorBoardScalars(
            FLAGS.tensorboard_dir, fit_batch_size(), strategy))
    if FLAGS.model_dir:
        record = None
        if FLAGS.batch_schedule:  # each checkpoint names its phase
            def record(step):
                return batch_growth.phase_record(
                    phases, step, FLAGS.accumulation_steps)
        result.append(callbacks.TrainingCheckpoint(
            FLAGS.model_dir, strategy, FLAGS.checkpoint_steps, record=record))
    return result


def fit_with_resume(model, strategy, data_plan, start_step):
    """Trains from `start_step` to the end of `--epochs`: one fit per batch
    phase (and one to finish an epoch a resumed run starts inside)."""
    from tfscale import batch_growth

    verbose = FLAGS.verbose
    if verbose == "auto":
        verbose = 1 if sys.stdout.isatty() else 2
    callbacks = fit_callbacks(strategy, data_plan.phases)
    eval_split = data_plan.eval_split
    for part in batch_growth.fit_parts(
            data_plan.phases, start_step, FLAGS.accumulation_steps):
        fit_batch = part.phase.global_batch_size // FLAGS.accumulation_steps
        for callback in callbacks:  # images/second of this phase's batch
            if hasattr(callback, "global_batch_size"):
                callback.global_batch_size = fit_batch
        # Each part reads the data from the step it starts at.
        model.fit(
            distributed(strategy, data_plan, "train", part.data_step, part.phase),
            initial_epoch=part.initial_epoch,
            epochs=part.epochs,
            steps_per_epoch=part.steps_per_epoch,
            validation_data=(distributed(strategy, data_plan, eval_split)
                             if eval_split else None),
            callbacks=callbacks,
            verbose=int(verbose) if strategy.is_chief else 0,
        )


def recompute_batch_norm_statistics(model, strategy, data_plan):
    """--bn_statistics_batches: BatchNorm statistics of the final weights,
    averaged over this worker's training batches, then over the workers."""
    import tensorflow as tf

    from tfscale import callbacks
    from tfscale import data

    context = tf.distribute.InputContext(
        num_input_pipelines=strategy.num_workers,
        input_pipeline_id=strategy.worker_index,
        num_replicas_in_sync=strategy.num_replicas_in_sync)
    batches = data.load(
        FLAGS.dataset, "train", fit_batch_size(), data_plan.image_size,
        input_context=context, seed=FLAGS.seed, data_dir=FLAGS.data_dir,
        manual_dir=FLAGS.manual_dir)
    count = callbacks.recompute_batch_norm_statistics(
        model, batches, FLAGS.bn_statistics_batches, strategy)
    logging.info("BatchNorm statistics of %d layers recomputed from %d "
                 "batches per worker (no moving averages).", count,
                 FLAGS.bn_statistics_batches)


def log_start(strategy, settings, data_plan, start_step):
    """The chief's line saying what trains, and from which checkpoint."""
    from tfscale import data
    from tfscale import recipes

    num_workers = strategy.num_workers
    logging.info(
        "Training %s on %s: %d worker(s), global batch %d (%s), "
        "%d steps/epoch, %d epochs, %s, %s.",
        FLAGS.model, FLAGS.dataset, num_workers, FLAGS.global_batch_size,
        data.describe_share(FLAGS.global_batch_size, num_workers),
        data_plan.steps_per_epoch,
        FLAGS.epochs, strategy.communication,
        recipes.describe(settings, FLAGS.global_batch_size),
    )
    if FLAGS.accumulation_steps > 1:
        logging.info("Each step accumulates %d micro-batches of %d (%s); "
                     "%d micro-batches per epoch.",
                     FLAGS.accumulation_steps, fit_batch_size(),
                     data.describe_share(fit_batch_size(), num_workers),
                     data_plan.steps_per_epoch)
    for phase in data_plan.phases[1:]:
        logging.info("Batch schedule: %s: global batch %d (%s), "
                     "%d steps/epoch, learning rate / %d.", phase.describe(),
                     phase.global_batch_size,
                     data.describe_share(phase.global_batch_size, num_workers),
                     phase.steps_per_epoch, phase.learning_rate_divisor)
    if start_step:
        logging.info("Resuming from the checkpoint of step %d in %s.",
                     start_step, FLAGS.model_dir)


def train():
    """Sets up from the flags (bad input: `BadInputError`), trains, exports."""
    from tfscale import agreement
    from tfscale import callbacks
    from tfscale import recipes

    if is_evaluator():
        evaluate_checkpoints()
        return
    if FLAGS.prepare_only:
        prepare_data(prepares=True)
        return
    with input_checks():
        strategy = strategy_from_flags()
        if not strategy.is_chief:
            logging.set_verbosity(logging.WARNING)
        agreement.check_settings_agree(strategy, shared_settings())
        settings = train_flags.settings_from_flags()
        prepare_data(prepares=strategy.is_chief)
        data_plan = check_data()
        check_resume_settings(settings, data_plan)
        model, start_step = build_model(strategy, settings, data_plan)
    if strategy.is_chief:
        log_start(strategy, settings, data_plan, start_step)
        if FLAGS.model_dir:  # a resume compares against these
            recipes.write_settings(FLAGS.model_dir, settings,
                                   **train_flags.training_from_flags())
    fit_with_resume(model, strategy, data_plan, start_step)
    if FLAGS.bn_statistics_batches:
        recompute_batch_norm_statistics(model, strategy, data_plan)
    # Every worker: the export takes the chief's BatchNorm statistics.
    callbacks.batch_norm_synchronizer(model, strategy)()
    if strategy.is_chief and FLAGS.export_dir:
        export_on_chief(model, data_plan.spec, data_plan.image_size)


def evaluate_checkpoints():
    """The evaluator task: evaluates each checkpoint training writes into
    --model_dir on the whole evaluation split, until the last one."""
    import tensorflow as tf

    from tfscale import data
    from tfscale import evaluator

    with input_checks():
        settings = train_flags.settings_from_flags()
        prepare_data(prepares=False)  # the chief prepares
        data_plan = check_data()
        # No strategy: the evaluator runs no collectives with the trainers.
        model, _ = build_model(tf.distribute.get_strategy(), settings, data_plan,
                               restore=False)
    eval_data = data.load(
        FLAGS.dataset, data_plan.eval_split, FLAGS.global_batch_size,
        data_plan.image_size, data_dir=FLAGS.data_dir, manual_dir=FLAGS.manual_dir,
        drop_remainder=False)  # every example is evaluated
    final_step = data_plan.final_step
    logging.info("Evaluator: evaluating the checkpoints in %s on the %s split "
                 "of %s until training's last (step %d).", FLAGS.model_dir,
                 data_plan.eval_split, FLAGS.dataset, final_step)
    evaluator.CheckpointEvaluator(
        model, eval_data, FLAGS.model_dir, final_step,
        tensorboard_dir=FLAGS.tensorboard_dir,
        timeout_seconds=FLAGS.evaluator_timeout or None,
        before_restore=lambda step, prefix: check_evaluator_settings(settings),
    ).run()


def check_evaluator_settings(settings):
    """Refuses checkpoints trained with flags other than the evaluator's."""
    from tfscale import recipes

    try:
        saved = recipes.read_settings(FLAGS.model_dir)
    except FileNotFoundError:
        return
    lines = recipes.settings_differences(
        saved, (settings, train_flags.training_from_flags()),
        train_flags.training_defaults())
    if lines:
        raise BadInputError(
            f"The checkpoints in {FLAGS.model_dir} were trained with other "
            "flags than the evaluator's; start the evaluator with the "
            "training job's command:\n  " + "\n  ".join(lines))


def export_on_chief(model, dataset_spec, image_size):
    """Writes the SavedModel; for digits, checks it on the whole test split."""
    import numpy as np

    from tfscale import data
    from tfscale import export

    path = export.export_classifier(model, FLAGS.export_dir, dataset_spec, image_size)
    if FLAGS.dataset != "digits":
        print(f"Exported SavedModel to {path}", flush=True)
        return
    images, labels = data.digits_arrays("test")
    probabilities = export.verify_export(path, model, images, dataset_spec, image_size)
    accuracy = float(np.mean(np.argmax(probabilities, axis=1) == labels))
    print(
        f"Exported SavedModel to {path}; it serves the trained model's "
        f"predictions, and its accuracy on the full {len(labels)}-image test "
        f"split: {accuracy:.4f}",
        flush=True,
    )


def describe_failure(error):
    """A one-paragraph explanation of why training stopped."""
    import tensorflow as tf

    import tfscale
    from tfscale import callbacks
    from tfscale import checkpoint
    from tfscale import evaluator

    if isinstance(error, callbacks.NonFiniteLossError):
        kept = ""
        if FLAGS.model_dir:
            step, _ = checkpoint.latest(FLAGS.model_dir)
            kept = f" The last good checkpoint (step {step}) in {FLAGS.model_dir} is kept."
        return f"{error}{kept}"
    if isinstance(error, (BadInputError, FileNotFoundError)):
        return str(error)
    if isinstance(error, tfscale.StartupError):
        if error.signum is None and error.missing:
            return f"{error} --startup_timeout sets this limit."
        return str(error)
    if isinstance(error, evaluator.NoNewCheckpointError):
        return (f"{error} If training is still running, raise "
                f"--evaluator_timeout (now {FLAGS.evaluator_timeout:g} s).")
    if isinstance(error, tf.errors.OpError):
        # Collective errors name the peer's task where gRPC knows it.
        task = json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {})
        own = (task.get("type"), str(task.get("index")))
        peers = sorted(set(re.findall(r"/job:(\w+)/replica:\d+/task:(\d+)", str(error)))
                       - {own})
        who = (", ".join(f"{job} {index}" for job, index in peers)
               if peers else "a peer worker")
        return (
            f"Lost contact with {who} ({type(error).__name__}: "
            f"{_collective_cause(str(error))}). A worker died, hung or became "
            "unreachable (TensorFlow's heartbeats notice within seconds; "
            f"--collective_timeout={FLAGS.collective_timeout:g} s bounds the "
            "rest); every worker stops. Relaunch the job; with --model_dir it "
            "resumes from the last checkpoint."
        )
    return None


def _collective_cause(message):
    """The line of a TensorFlow collective error that says what happened."""
    for pattern in (r"The following tasks are unhealthy[^\n]*\n?[^\n]*",
                    r"Collective ops is aborted by: [^\n]*",
                    r"[^\n]*(?:timed out|Deadline Exceeded|Connection refused)[^\n]*"):
        match = re.search(pattern, message)
        if match:
            return " ".join(match.group(0).split())
    lines = [l.strip() for l in message.splitlines() if l.strip()]
    return lines[-1] if lines else "no details"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    validate_flags()
    try:
        train()
    except Exception as error:  # explained, then re-raised if unexplained
        message = describe_failure(error)
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


def run():
    """tfscale-train's entry point: defines the flags, then parses and runs."""
    train_flags.define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
