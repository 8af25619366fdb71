r"""tfscale-train: one worker of a synchronous multi-worker training job.

Every worker runs the same command; TF_CONFIG tells each who it is (as
Kubernetes/Kubeflow TFJob or `tfscale-launch` set it; without TF_CONFIG it
trains alone). Worker 0, the chief, prints progress and writes the export.

    tfscale-launch --num_workers=2 -- tfscale-train            # digits, alexnet_bn
    tfscale-train --model=resnet50 --dataset=imagenet \
        --manual_dir=/data/imagenet --global_batch_size=1024 --epochs=90
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging

flags.DEFINE_string("model", "alexnet_bn", "Model: alexnet_bn or resnet50.")
flags.DEFINE_string("dataset", "digits", "Data set: digits, imagenet or synthetic.")
flags.DEFINE_string("data_dir", None, "tensorflow-datasets data_dir (imagenet).")
flags.DEFINE_string(
    "manual_dir", None,
    "Directory holding ILSVRC2012_img_{train,val}.tar (imagenet); default "
    "<data_dir>/downloads/manual.",
)
flags.DEFINE_integer("global_batch_size", 64, "Examples per step over all workers.")
flags.DEFINE_integer("epochs", 8, "Training epochs.")
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
    "model_dir", None, "Directory for the Keras model the chief saves at the end."
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
    "algorithm", "ring", ["ring"], "All-reduce algorithm (tfscale.CommunicationOptions)."
)
flags.DEFINE_integer(
    "fusion_threshold_bytes", 32 * 1024 * 1024, "Gradient fusion buffer size."
)
flags.DEFINE_float(
    "collective_timeout", 300,
    "Seconds a collective may wait for the other workers before the job fails.",
)
flags.DEFINE_enum(
    "verbose", "auto", ["auto", "0", "1", "2"],
    "Chief's Keras verbosity; auto: a progress bar on a terminal, a line per "
    "epoch otherwise. Other workers are silent.",
)
FLAGS = flags.FLAGS


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


def model_options():
    """Model keyword arguments that flags set."""
    if FLAGS.model != "alexnet_bn":
        return {}
    fc_units = FLAGS.fc_units or (512 if FLAGS.dataset == "digits" else 4096)
    return {"fc_units": fc_units}


def train():
    import keras
    import numpy as np
    import tensorflow as tf

    import models
    import tfscale
    from tfscale import callbacks
    from tfscale import data
    from tfscale import export

    resolver = None
    if FLAGS.cluster_resolver == "slurm":
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver()
    strategy = tfscale.Strategy(
        cluster_resolver=resolver,
        communication=tfscale.CommunicationOptions(
            algorithm=FLAGS.algorithm,
            fusion_threshold_bytes=FLAGS.fusion_threshold_bytes,
            timeout_seconds=FLAGS.collective_timeout,
        )
    )
    chief = strategy.is_chief
    if not chief:
        logging.set_verbosity(logging.WARNING)
    num_workers = strategy.num_workers
    dataset_spec = data.spec(FLAGS.dataset)
    image_size = FLAGS.image_size or dataset_spec.default_image_size
    train_examples = data.num_examples(FLAGS.dataset, "train", FLAGS.data_dir)
    data.check_batch(FLAGS.global_batch_size, num_workers, train_examples, "train")
    steps_per_epoch = FLAGS.steps_per_epoch or train_examples // FLAGS.global_batch_size

    def dataset_fn(split):
        def make(input_context):
            return data.load(
                FLAGS.dataset, split, FLAGS.global_batch_size, image_size,
                input_context=input_context, seed=FLAGS.seed,
                data_dir=FLAGS.data_dir, manual_dir=FLAGS.manual_dir,
            )
        return strategy.distribute_datasets_from_function(make)

    train_data = dataset_fn("train")
    eval_data = None
    if FLAGS.dataset != "synthetic":
        eval_split = "test" if FLAGS.dataset == "digits" else "validation"
        eval_examples = data.num_examples(FLAGS.dataset, eval_split, FLAGS.data_dir)
        data.check_batch(FLAGS.global_batch_size, num_workers, eval_examples, eval_split)
        eval_data = dataset_fn(eval_split)

    keras.utils.set_random_seed(FLAGS.seed)
    with strategy.scope():
        model = models.get(
            FLAGS.model,
            num_classes=dataset_spec.num_classes,
            input_shape=(image_size, image_size, dataset_spec.channels),
            **model_options(),
        )
        model.compile(
            optimizer=keras.optimizers.SGD(
                learning_rate=FLAGS.learning_rate, momentum=FLAGS.momentum
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    if chief:
        logging.info(
            "Training %s on %s: %d worker(s), global batch %d (%d per worker), "
            "%d steps/epoch, %d epochs, %s.",
            FLAGS.model, FLAGS.dataset, num_workers, FLAGS.global_batch_size,
            FLAGS.global_batch_size // num_workers, steps_per_epoch, FLAGS.epochs,
            strategy.communication,
        )
    verbose = FLAGS.verbose
    if verbose == "auto":
        verbose = 1 if sys.stdout.isatty() else 2
    model.fit(
        train_data,
        epochs=FLAGS.epochs,
        steps_per_epoch=steps_per_epoch,
        validation_data=eval_data,
        callbacks=[
            callbacks.Throughput(FLAGS.global_batch_size),
            callbacks.SyncBatchNormStatistics(strategy),
        ],
        verbose=int(verbose) if chief else 0,
    )

    if not chief:
        return
    if FLAGS.model_dir:
        os.makedirs(FLAGS.model_dir, exist_ok=True)
        model.save(os.path.join(FLAGS.model_dir, "model.keras"))
    if FLAGS.export_dir and dataset_spec.stored_shape is not None:
        path = export.export_classifier(
            model, FLAGS.export_dir, dataset_spec, image_size
        )
        images, labels = data.digits_arrays("test")
        serve = tf.saved_model.load(path).signatures["serving_default"]
        probabilities = serve(images=tf.constant(images))["probabilities"]
        accuracy = float(np.mean(np.argmax(probabilities, axis=1) == labels))
        print(
            f"Exported SavedModel to {path}; its accuracy on the full "
            f"{len(labels)}-image test split: {accuracy:.4f}",
            flush=True,
        )
    elif FLAGS.export_dir:
        path = export.export_classifier(
            model, FLAGS.export_dir, dataset_spec, image_size
        )
        print(f"Exported SavedModel to {path}", flush=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    validate_flags()
    train()


def run():
    app.run(main)


if __name__ == "__main__":
    run()
