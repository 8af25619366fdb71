r"""tfscale-train: one worker of a synchronous multi-worker training job.

Every worker runs the same command; TF_CONFIG tells each who it is (as
Kubernetes/Kubeflow TFJob or `tfscale-launch` set it; without TF_CONFIG it
trains alone). Worker 0, the chief, prints progress and writes the export.

    tfscale-launch --num_workers=2 -- tfscale-train            # digits, alexnet_bn
    tfscale-train --model=resnet50 --dataset=imagenet \
        --manual_dir=/data/imagenet --global_batch_size=1024 --epochs=90

This module answers --help and refuses bad flags and a bad TF_CONFIG before
TensorFlow is imported (seconds of a worker's start); `training` checks what
needs TensorFlow, then trains.
"""

import sys

from absl import app

from tfscale import _requirements
from tfscale import dataset_specs
from tfscale.launch import garbage_collection
from tfscale.launch import preflight
from tfscale.launch import train_flags

# The models of the paper, and AlexNet-BN in miniature (the large-batch
# study's model) for jobs of seconds on small images; tfscale.models' other
# builders serve the studies.
TRAINED_MODELS = ("alexnet_bn", "alexnet_bn_small", "resnet50")


def validate_flags(config):
    """Refuses bad flags before anything starts or is written; imports no
    TensorFlow (`training.validate_flags` checks the rest)."""

    if config.model not in TRAINED_MODELS:
        raise app.UsageError(
            f"--model={config.model!r} is unknown. Known: {', '.join(TRAINED_MODELS)}"
        )
    if config.dataset not in dataset_specs.names():
        raise app.UsageError(
            f"--dataset={config.dataset!r} is unknown. Known: "
            f"{', '.join(dataset_specs.names())}"
        )
    if config.dataset == "synthetic" and not config.steps_per_epoch:
        raise app.UsageError(
            "--dataset=synthetic never ends: give --steps_per_epoch."
        )
    for name in ("epochs", "global_batch_size"):
        if getattr(config, name) < 1:
            raise app.UsageError(f"--{name} must be >= 1, got {getattr(config, name)}.")
    if config.hybrid_threshold_bytes is not None and config.algorithm not in (None, "hybrid"):
        raise app.UsageError(
            "--hybrid_threshold_bytes applies only to --algorithm=hybrid, got "
            f"--algorithm={config.algorithm}."
        )
    try:
        config.settings  # built (and checked) here: its errors are usage errors
        preflight.check_tf_config()
        # An evaluator only reads --model_dir.
        evaluates = train_flags.is_evaluator(config)
        preflight.check_writable_dir(
            "model_dir", None if evaluates else config.model_dir)
        preflight.check_writable_dir("export_dir", config.export_dir)
        preflight.check_writable_dir("tensorboard_dir", config.tensorboard_dir)
    except ValueError as error:  # PreflightError too
        raise app.UsageError(str(error)) from None
    if evaluates and not config.model_dir:
        raise app.UsageError(
            "The evaluator needs --model_dir: the training job's checkpoint "
            "directory (readable here), whose checkpoints it evaluates.")
    if evaluates and config.dataset not in dataset_specs.EVAL_SPLITS:
        raise app.UsageError(
            f"--dataset={config.dataset} has no evaluation split for the "
            f"evaluator; use {' or '.join(dataset_specs.EVAL_SPLITS)}.")


def main(argv):
    if len(argv) > 1:  # one line, not absl's usage listing of every flag
        sys.exit(f"tfscale-train: unexpected arguments: {' '.join(argv[1:])} "
                 "(flags are written --name=value; tfscale-train --helpshort "
                 "lists them)")
    config = train_flags.Config.from_flags()
    try:
        validate_flags(config)
        if _requirements.tensorflow_missing():
            sys.exit(f"tfscale-train: {_requirements.tensorflow_missing()}")
        # TensorFlow is imported here, after the checks that need none of it.
        training = garbage_collection.import_frozen("tfscale.launch.training")

        training.validate_flags(config)
    except app.UsageError as error:  # one line, not the usage listing
        sys.exit(f"tfscale-train: {error}")
    training.run(config)


def run():
    """tfscale-train's entry point: defines the flags, then parses and runs."""
    train_flags.define_flags()
    garbage_collection.skip_final_collection()
    app.run(main)


if __name__ == "__main__":
    run()
