r"""tfscale-train: one worker of a synchronous multi-worker training job.

Every worker runs the same command; TF_CONFIG tells each who it is (as
Kubernetes/Kubeflow TFJob or `tfscale-launch` set it; without TF_CONFIG it
trains alone). Worker 0, the chief, prints progress and writes the export.

    tfscale-launch --num_workers=2 -- tfscale-train            # digits, alexnet_bn
    tfscale-train --model=resnet50 --dataset=imagenet \
        --manual_dir=/data/imagenet --global_batch_size=1024 --epochs=90
"""

import json
import os
import re
import sys

from absl import app
from absl import flags
from absl import logging

from launch import optimization  # defines --optimizer, --precision, ...
from launch import preflight

flags.DEFINE_string("model", "alexnet_bn", "Model: alexnet_bn or resnet50.")
flags.DEFINE_string("dataset", "digits", "Data set: digits, imagenet or synthetic.")
flags.DEFINE_string("data_dir", None, "tensorflow-datasets data_dir (imagenet).")
flags.DEFINE_string(
    "manual_dir", None,
    "Directory holding ILSVRC2012_img_{train,val}.tar (imagenet); default "
    "<data_dir>/downloads/manual.",
)
flags.DEFINE_integer("global_batch_size", 64, "Examples per step over all workers.")
flags.DEFINE_integer("epochs", 10, "Training epochs.")
flags.DEFINE_integer(
    "steps_per_epoch", 0,
    "Steps per epoch; 0: one pass over the training split (required for synthetic).",
)
flags.DEFINE_float("learning_rate", 0.05, "Learning rate (SGD with momentum).")
flags.DEFINE_float("momentum", 0.9, "SGD momentum.")
flags.DEFINE_integer(
    "fc_units", 0,
    "alexnet_bn's fully connected width; 0: 4096 as published, or 512 on "
    "digits (10 classes of 8x8 images need no more).",
)
flags.DEFINE_integer(
    "image_size", 0, "Side of the square model input; 0: the data set's default."
)
flags.DEFINE_integer("seed", 0, "Seed of weights and data order (same on all workers).")
flags.DEFINE_string(
    "model_dir", None,
    "Directory for checkpoints of the whole training state (every "
    "--checkpoint_steps, chief only, atomic). Relaunching the same command "
    "resumes from the newest one. On a cluster: storage every worker can read.",
)
flags.DEFINE_integer(
    "checkpoint_steps", 100, "Steps between checkpoints in --model_dir.", lower_bound=1
)
flags.DEFINE_string(
    "export_dir", "tfscale_export",
    "Where the chief writes the SavedModel (uint8 images in, probabilities out).",
)
flags.DEFINE_enum(
    "cluster_resolver", "tf_config", ["tf_config", "slurm"],
    "Where the cluster comes from: TF_CONFIG (Kubernetes/Kubeflow TFJob, "
    "tfscale-launch) or SLURM's environment (one task per worker, srun).",
)
flags.DEFINE_enum(
    "algorithm", "hybrid", ["ring", "hierarchical", "2d", "hybrid"],
    "All-reduce algorithm per fused buffer (tfscale.CommunicationOptions).",
)
flags.DEFINE_integer(
    "hybrid_threshold_bytes", None,
    "--algorithm=hybrid only: buffers of at least this many bytes on the wire go "
    "by ring, smaller ones hierarchical; unset: from the cost model.",
    lower_bound=0,
)
flags.DEFINE_integer(
    "local_size", None,
    "Workers per node; unset: workers on one host in TF_CONFIG form a node.",
    lower_bound=1,
)
flags.DEFINE_enum(
    "compression", None, ["bfloat16", "float16"],
    "Send float32 gradients in this 16-bit type; unset: float32.",
)
flags.DEFINE_integer(
    "fusion_threshold_bytes", 32 * 1024 * 1024, "Gradient fusion buffer size."
)
flags.DEFINE_float(
    "collective_timeout", 300,
    "Seconds a collective may wait for the other workers before the job fails.",
)
flags.DEFINE_string(
    "tensorboard_dir", None,
    "Where the chief writes per-step TensorBoard scalars: images/second, "
    "learning rate, loss scale, loss, and exposed communication seconds (the "
    "chief's wait on all-reduces after its gradients are ready).",
)
flags.DEFINE_enum(
    "verbose", "auto", ["auto", "0", "1", "2"],
    "Chief's Keras verbosity; auto: a progress bar on a terminal, a line per "
    "epoch otherwise. Other workers are silent.",
)
FLAGS = flags.FLAGS
flags.adopt_module_key_flags(optimization)  # list them in --help too


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
    if FLAGS.learning_rate <= 0:
        raise app.UsageError(f"--learning_rate must be > 0, got {FLAGS.learning_rate}.")
    if FLAGS.hybrid_threshold_bytes is not None and FLAGS.algorithm != "hybrid":
        raise app.UsageError(
            "--hybrid_threshold_bytes applies only to --algorithm=hybrid, got "
            f"--algorithm={FLAGS.algorithm}."
        )
    try:
        preflight.check_tf_config()
        preflight.check_writable_dir("model_dir", FLAGS.model_dir)
        preflight.check_writable_dir("export_dir", FLAGS.export_dir)
        preflight.check_writable_dir("tensorboard_dir", FLAGS.tensorboard_dir)
        if FLAGS.dataset == "imagenet":
            data.check_imagenet_source(FLAGS.data_dir, FLAGS.manual_dir)
    except (preflight.PreflightError, FileNotFoundError) as error:
        raise app.UsageError(str(error)) from None


# Flags whose values may differ between workers without changing the training
# (paths can be local to each machine).
_LOCAL_FLAGS = {"data_dir", "manual_dir", "model_dir", "export_dir", "verbose",
                "cluster_resolver", "tensorboard_dir"}


def shared_settings():
    """The settings every worker must agree on: flags and versions."""
    import keras
    import tensorflow as tf

    import tfscale

    settings = {
        flag.name: flag.value
        for module, module_flags in FLAGS.flags_by_module_dict().items()
        if not module.startswith("absl.")  # absl's own: logging, help
        for flag in module_flags
        if flag.name not in _LOCAL_FLAGS
    }
    settings.update(
        tfscale_version=tfscale.__version__,
        tensorflow_version=tf.__version__,
        keras_version=keras.__version__,
    )
    return settings


def model_options():
    """Model keyword arguments that flags set."""
    if FLAGS.model != "alexnet_bn":
        return {}
    fc_units = FLAGS.fc_units or (512 if FLAGS.dataset == "digits" else 4096)
    return {"fc_units": fc_units}


def train():
    import keras
    import tensorflow as tf

    import models
    import tfscale
    from tfscale import agreement
    from tfscale import callbacks
    from tfscale import checkpoint
    from tfscale import data

    resolver = None
    if FLAGS.cluster_resolver == "slurm":
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver()
    strategy = tfscale.Strategy(
        cluster_resolver=resolver,
        communication=tfscale.CommunicationOptions(
            algorithm=FLAGS.algorithm,
            fusion_threshold_bytes=FLAGS.fusion_threshold_bytes,
            hybrid_threshold_bytes=FLAGS.hybrid_threshold_bytes,
            local_size=FLAGS.local_size,
            compression=FLAGS.compression,
            timeout_seconds=FLAGS.collective_timeout,
        )
    )
    chief = strategy.is_chief
    if not chief:
        logging.set_verbosity(logging.WARNING)
    agreement.check_settings_agree(strategy, shared_settings())
    num_workers = strategy.num_workers
    dataset_spec = data.spec(FLAGS.dataset)
    image_size = FLAGS.image_size or dataset_spec.default_image_size
    train_examples = data.num_examples(FLAGS.dataset, "train", FLAGS.data_dir)
    data.check_batch(FLAGS.global_batch_size, num_workers, train_examples, "train")
    steps_per_epoch = FLAGS.steps_per_epoch or train_examples // FLAGS.global_batch_size
    eval_split = {"digits": "test", "imagenet": "validation"}.get(FLAGS.dataset)
    if eval_split:
        data.check_batch(FLAGS.global_batch_size, num_workers,
                         data.num_examples(FLAGS.dataset, eval_split), eval_split)

    def distributed(split, start_step=0):
        def make(input_context):
            return data.load(
                FLAGS.dataset, split, FLAGS.global_batch_size, image_size,
                input_context=input_context, seed=FLAGS.seed, start_step=start_step,
                data_dir=FLAGS.data_dir, manual_dir=FLAGS.manual_dir,
            )
        return strategy.distribute_datasets_from_function(make)

    keras.utils.set_random_seed(FLAGS.seed)
    optimization.set_precision()  # before the model: layers take the policy
    with strategy.scope():
        model = models.get(
            FLAGS.model,
            num_classes=dataset_spec.num_classes,
            input_shape=(image_size, image_size, dataset_spec.channels),
            **model_options(),
        )
        model.compile(
            optimizer=optimization.build_optimizer(
                FLAGS.global_batch_size, steps_per_epoch, FLAGS.epochs
            )[0],
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        # Inside the scope: restoring creates the optimizer's slot variables.
        start_step = checkpoint.restore(model, FLAGS.model_dir) if FLAGS.model_dir else 0
    if chief:
        logging.info(
            "Training %s on %s: %d worker(s), global batch %d (%d per worker), "
            "%d steps/epoch, %d epochs, %s, %s.",
            FLAGS.model, FLAGS.dataset, num_workers, FLAGS.global_batch_size,
            FLAGS.global_batch_size // num_workers, steps_per_epoch, FLAGS.epochs,
            strategy.communication,
            optimization.describe(FLAGS.global_batch_size),
        )
        if start_step:
            logging.info("Resuming from the checkpoint of step %d in %s.",
                         start_step, FLAGS.model_dir)
    verbose = FLAGS.verbose
    if verbose == "auto":
        verbose = 1 if sys.stdout.isatty() else 2
    fit_callbacks = [
        callbacks.TerminateOnNonFiniteLoss(),  # before any save of a bad step
        callbacks.Throughput(FLAGS.global_batch_size),
        callbacks.SyncBatchNormStatistics(strategy),
    ]
    if chief and FLAGS.tensorboard_dir:
        fit_callbacks.append(callbacks.TensorBoardScalars(
            FLAGS.tensorboard_dir, FLAGS.global_batch_size, strategy))
    if FLAGS.model_dir:
        fit_callbacks.append(callbacks.BackupAndResume(
            FLAGS.model_dir, strategy, FLAGS.checkpoint_steps))
    # A run resumed mid-epoch first finishes that epoch, then runs whole ones;
    # each part reads the data from the step it starts at.
    start_epoch, done_in_epoch = divmod(start_step, steps_per_epoch)
    parts = []
    if done_in_epoch:
        parts.append((start_epoch, start_epoch + 1, steps_per_epoch - done_in_epoch))
        start_epoch += 1
    if start_epoch < FLAGS.epochs:
        parts.append((start_epoch, FLAGS.epochs, steps_per_epoch))
    for initial_epoch, epochs, steps in parts:
        model.fit(
            distributed("train", start_step),
            initial_epoch=initial_epoch,
            epochs=epochs,
            steps_per_epoch=steps,
            validation_data=distributed(eval_split) if eval_split else None,
            callbacks=fit_callbacks,
            verbose=int(verbose) if chief else 0,
        )
        start_step = epochs * steps_per_epoch
    # Every worker: the export takes the chief's BatchNorm statistics.
    callbacks.batch_norm_synchronizer(model, strategy)()
    if chief and FLAGS.export_dir:
        export_on_chief(model, dataset_spec, image_size)


def export_on_chief(model, dataset_spec, image_size):
    """Writes the SavedModel; for digits, checks it on the whole test split."""
    import numpy as np
    import tensorflow as tf

    from tfscale import data
    from tfscale import export

    path = export.export_classifier(model, FLAGS.export_dir, dataset_spec, image_size)
    if FLAGS.dataset != "digits":
        print(f"Exported SavedModel to {path}", flush=True)
        return
    images, labels = data.digits_arrays("test")
    serve = tf.saved_model.load(path).signatures["serving_default"]
    probabilities = serve(images=tf.constant(images))["probabilities"]
    accuracy = float(np.mean(np.argmax(probabilities, axis=1) == labels))
    print(
        f"Exported SavedModel to {path}; its accuracy on the full "
        f"{len(labels)}-image test split: {accuracy:.4f}",
        flush=True,
    )


def describe_failure(error):
    """A one-paragraph explanation of why training stopped."""
    import tensorflow as tf

    from tfscale import agreement
    from tfscale import callbacks
    from tfscale import checkpoint

    if isinstance(error, callbacks.NonFiniteLossError):
        kept = ""
        if FLAGS.model_dir:
            step, _ = checkpoint.latest(FLAGS.model_dir)
            kept = f" The last good checkpoint (step {step}) in {FLAGS.model_dir} is kept."
        return f"{error}{kept}"
    if isinstance(error, (agreement.SettingsMismatchError, FileNotFoundError)):
        return str(error)
    if isinstance(error, tf.errors.OpError):
        # Collective errors name the peer's task where gRPC knows it.
        own = str(json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {}).get("index"))
        peers = sorted(set(re.findall(r"/job:\w+/replica:\d+/task:(\d+)", str(error)))
                       - {own})
        who = f"worker {', '.join(peers)}" if peers else "a peer worker"
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
        logging.error("%s", message)
        sys.exit(f"tfscale-train: {message}")


def run():
    app.run(main)


if __name__ == "__main__":
    run()
