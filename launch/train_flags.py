r"""tfscale-train's flags, and what they map onto in the library.

`define_flags()` defines them (tfscale-train's `run()` calls it before
parsing); the functions below read the parsed values. The optimizer,
schedule and precision flags are the fields of `tfscale.recipes.Settings`
under the same names, and their defaults are its defaults (plain SGD with
momentum 0.9 at a constant learning rate in float32):

    tfscale-train --optimizer=lars --lr_schedule=warmup_poly --warmup_epochs=2 \
        --learning_rate=0.1 --scale_lr --weight_decay=5e-5 \
        --precision=mixed_bfloat16
    tfscale-train --recipe=resnet50_lars_32k --model=resnet50 --dataset=imagenet

A `--recipe` sets published hyper-parameters (`tfscale.recipes.RECIPES`
cites their sources); flags given on the command line still win. Each
recipe's `base_batch_size` is the batch its learning rate was published for,
so `--scale_lr` scales it linearly to yours.
"""

import dataclasses
import functools
import types

from absl import flags

from tfscale.launch import flag_help
from tfscale.launch import preflight
from tfscale import communication_names
from tfscale import recipe_settings
from tfscale import startup

FLAGS = flags.FLAGS

# Flags whose values may differ between workers without changing the training
# (paths can be local to each machine).
LOCAL_FLAGS = frozenset({"data_dir", "manual_dir", "model_dir", "export_dir",
                         "verbose", "cluster_resolver", "tensorboard_dir",
                         "startup_timeout", "evaluator_timeout",
                         "slurm_port_base", "prepare_only", "prepare_timeout"})
# Flags besides the `Settings` fields whose change would make a resumed run
# train differently from the run that wrote its checkpoints.
TRAINING_FLAGS = ("model", "dataset", "global_batch_size", "epochs",
                  "steps_per_epoch", "fc_units", "image_size", "seed",
                  "compression", "bn_statistics_batches", "powersgd_rank",
                  "powersgd_start_step")


def define_flags():
    """Defines tfscale-train's flags, once, and lists them all in `--help`."""
    if "optimizer" in FLAGS:  # defined already (tests parse more than once)
        return
    _define_job_flags()
    _define_communication_flags()
    _define_optimization_flags()
    flag_help.list_in_help(__name__)


def _define_job_flags():
    """Model, data, length of training, and where things are written."""
    flags.DEFINE_string(
        "model", "alexnet_bn",
        "Model: alexnet_bn, resnet50, or alexnet_bn_small (AlexNet-BN in "
        "miniature, at the images' own size on digits and fashion_mnist).")
    flags.DEFINE_string("dataset", "digits",
                        "Data set: digits, fashion_mnist, imagenet or synthetic.")
    flags.DEFINE_string("data_dir", None,
                        "imagenet: tensorflow-datasets data_dir; fashion_mnist: the "
                        "directory of its four .gz files (default: Keras's "
                        "cache, then /usr/share/datasets/fashion-mnist).")
    flags.DEFINE_string(
        "manual_dir", None,
        "Directory holding ILSVRC2012_img_{train,val}.tar (imagenet); default "
        "<data_dir>/downloads/manual.",
    )
    flags.DEFINE_bool(
        "prepare_only", False,
        "--dataset=imagenet: prepare --data_dir from the archives in "
        "--manual_dir (tensorflow-datasets, then tfscale's record index) and "
        "exit; run it once, in one process, before a job whose workers share "
        "--data_dir. Without it the chief prepares at start and the other "
        "workers wait.")
    flags.DEFINE_float(
        "prepare_timeout", 24 * 3600,
        "--dataset=imagenet: seconds a worker waits for the chief to prepare "
        "--data_dir (logging every minute) before exiting with an error "
        "naming it; 0: wait as long as it takes.", lower_bound=0)
    flags.DEFINE_integer("global_batch_size", 64,
                         "Examples per step over all workers.")
    flags.DEFINE_integer("epochs", 10, "Training epochs.")
    flags.DEFINE_integer(
        "steps_per_epoch", 0,
        "Steps per epoch; 0: one pass over the training split (required for "
        "synthetic).",
    )
    flags.DEFINE_integer(
        "fc_units", 0,
        "alexnet_bn's fully connected width; 0: 4096 as published, or 512 on "
        "digits and fashion_mnist (10 classes of small images need no more). "
        "alexnet_bn_small's; 0: 64.",
    )
    flags.DEFINE_integer(
        "image_size", 0,
        "Side of the square model input; 0: the data set's default (for "
        "alexnet_bn_small, the images' own size where they have one).")
    flags.DEFINE_integer(
        "seed", 0, "Seed of weights and data order (same on all workers).")
    flags.DEFINE_bool(
        "deterministic", False,
        "Run every TensorFlow op with a deterministic kernel "
        "(tf.config.experimental.enable_op_determinism()). Needed on GPUs "
        "for bitwise-reproducible runs and resumes (cuDNN and NCCL choose "
        "kernels by speed); tfscale's bitwise claims hold on CPU without "
        "it, except between two runs across nodes under the default "
        "algorithm, auto, which chooses by timings (with it, by the cost "
        "model). Its cost on CPU: BENCHMARKS.md, section \"Mixed precision "
        "and op determinism on one worker\".")
    flags.DEFINE_string(
        "model_dir", None,
        "Directory for checkpoints of the whole training state (every "
        "--checkpoint_steps, chief only, atomic) and the settings they were "
        "trained with. Relaunching the same command resumes from the newest "
        "one; other training settings are refused. On a cluster: storage "
        "every worker can read.",
    )
    flags.DEFINE_integer("checkpoint_steps", 100,
                         "Steps between checkpoints in --model_dir.",
                         lower_bound=1)
    flags.DEFINE_string(
        "export_dir", "tfscale_export",
        "Where the chief writes the SavedModel (uint8 images in, "
        "probabilities out).",
    )
    flags.DEFINE_string(
        "tensorboard_dir", None,
        "Where the chief writes per-step TensorBoard scalars: images/second, "
        "learning rate, loss scale, loss, and exposed communication seconds "
        "(the chief's wait on all-reduces after its gradients are ready). "
        "An evaluator task writes its evaluation metrics under DIR/eval.",
    )
    flags.DEFINE_float(
        "evaluator_timeout", 3600,
        "An evaluator task (TF_CONFIG task type \"evaluator\", e.g. Kubeflow "
        "TFJob's Evaluator) evaluates each checkpoint in --model_dir and exits "
        "after training's last; it fails after this many seconds without a new "
        "checkpoint (0: waits forever).",
        lower_bound=0.0,
    )
    flags.DEFINE_integer(
        "bn_statistics_batches", 0,
        "BatchNorm without moving averages (Akiba et al. 2017): after "
        "training, every worker averages the batch mean and variance of each "
        "BatchNorm input over this many training batches with the final "
        "weights, the workers average those, and evaluation and the export "
        "use them instead of the moving averages. 0: keep Keras's moving "
        "averages.", lower_bound=0)
    flags.DEFINE_enum(
        "verbose", "auto", ["auto", "0", "1", "2"],
        "Chief's Keras verbosity; auto: a progress bar on a terminal, a line "
        "per epoch otherwise. Other workers are silent.",
    )


def _define_communication_flags():
    """The cluster and `tfscale.CommunicationOptions`."""
    flags.DEFINE_enum(
        "cluster_resolver", "tf_config", ["tf_config", "slurm"],
        "Where the cluster comes from: TF_CONFIG (Kubernetes/Kubeflow TFJob, "
        "tfscale-launch) or SLURM's environment (one task per worker, srun).",
    )
    flags.DEFINE_integer(
        "slurm_port_base", None,
        "--cluster_resolver=slurm: the port of each node's first task; the "
        "node's other tasks listen on the ports after it (tfscale.slurm; "
        "unset: its DEFAULT_PORT_BASE, TensorFlow's SlurmClusterResolver's).",
        lower_bound=1, upper_bound=65535,
    )
    flags.DEFINE_float(
        "startup_timeout", startup.DEFAULT_TIMEOUT_SECONDS,
        "Seconds to wait for the other workers to start (every 30 s the log "
        "names those still missing) before exiting with an error naming them; "
        "0: wait as long as it takes.",
        lower_bound=0,
    )
    flags.DEFINE_float(
        "heartbeat_timeout", startup.DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
        "Seconds without a heartbeat after which TensorFlow's coordination "
        "service takes a worker for lost and every worker stops; each "
        "heartbeat may take half of it to be answered, waiting behind the "
        "tensors on a busy link (TensorFlow's own: 10). The same on every "
        "worker: the service judges each by its own.",
        lower_bound=1,
    )
    flags.DEFINE_enum(
        "algorithm", None, communication_names.ALGORITHMS,
        "All-reduce algorithm per fused buffer "
        "(tfscale.CommunicationOptions); auto: each buffer's fastest, "
        "measured in the first steps, stored in --model_dir/autotune.json "
        "and reused on restart; unset: auto over TensorFlow's ring (a "
        "ring on one node; hybrid if --hybrid_threshold_bytes is given), "
        "ring over NCCL (one NCCL all-reduce per buffer over all workers, "
        "NCCL's own ring or tree inside).",
    )
    flags.DEFINE_string(
        "cost_model", None,
        "A cost model fitted to this cluster: the JSON `tfscale-bench project "
        "--fitted_output` writes (or CostModel.get_config()). It chooses "
        "hybrid's algorithm per buffer and the chunks of hierarchical and 2d, "
        "and orders --algorithm=auto's trials; unset: the default model "
        "(not a measurement of your cluster).",
    )
    flags.DEFINE_integer(
        "hybrid_threshold_bytes", None,
        "--algorithm=hybrid only: buffers of at least this many bytes on the "
        "wire go by ring, smaller ones hierarchical; unset: each buffer by "
        "the cost model's faster of ring and hierarchical.",
        lower_bound=0,
    )
    flags.DEFINE_integer(
        "local_size", None,
        "Workers per node; unset: workers on one host in TF_CONFIG form a "
        "node.",
        lower_bound=1,
    )
    flags.DEFINE_enum(
        "compression", None, (*communication_names.COMPRESSIONS, communication_names.POWERSGD),
        "Send float32 gradients in this 16-bit type, or (powersgd) gradient "
        "matrices as low-rank factors with error feedback; unset: float32.",
    )
    flags.DEFINE_integer(
        "powersgd_rank", None,
        "--compression=powersgd: rank of the factors; unset: 4.", lower_bound=1)
    flags.DEFINE_integer(
        "powersgd_start_step", None,
        "--compression=powersgd: optimizer updates all-reduced uncompressed "
        "before compression starts; unset: 10.", lower_bound=0)
    flags.DEFINE_integer(
        "powersgd_bucket_bytes", None,
        "--compression=powersgd: gradient bytes per bucket of matrices "
        "compressed together, last layer first, each started when backprop "
        "has produced it; unset: one bucket after the last gradient.",
        lower_bound=0)
    flags.DEFINE_enum(
        "implementation", "auto", communication_names.IMPLEMENTATIONS,
        "What carries the collectives (TensorFlow's names): auto: NCCL when "
        "the worker's device is a GPU, ring otherwise; ring: TensorFlow's "
        "ring over gRPC; nccl: NCCL between GPUs (refused without GPUs). "
        "Shared by all workers; a run resumes under another one (like "
        "--algorithm, it changes how gradients are summed, not what).",
    )
    flags.DEFINE_integer("fusion_threshold_bytes", 32 * 1024 * 1024,
                         "Gradient fusion buffer size.")
    flags.DEFINE_float(
        "collective_timeout", 300,
        "Seconds a collective may wait for the other workers before the job "
        "fails.",
    )
    flags.DEFINE_string(
        "timeline", None,
        "Directory where each worker writes worker-I.json at exit: its last "
        "steps as a Chrome/Perfetto trace (forward+backward, each gradient "
        "bucket's stages and collectives, the optimizer update); join them "
        "with `python -m tfscale.timeline merge DIR`.",
    )


def _define_optimization_flags():
    """The fields of `tfscale.recipes.Settings`, defaults included."""
    defaults = recipe_settings.Settings()
    flags.DEFINE_enum(
        "optimizer", defaults.optimizer, recipe_settings.OPTIMIZERS,
        "sgd: momentum SGD; lars: tfscale.optimizers.LARS; rmsprop_warmup: "
        "RMSprop moving gradually to momentum SGD "
        "(tfscale.optimizers.RMSpropWarmup, Akiba et al. 2017).")
    flags.DEFINE_enum(
        "precision", defaults.precision, recipe_settings.PRECISIONS,
        "Keras dtype policy. mixed_bfloat16 runs oneDNN's bfloat16 kernels on "
        "CPUs with AVX-512 (avx512_bf16) and falls back to Eigen's on CPUs "
        "without it; whether it pays depends on the CPU and the model (python -m "
        "tfscale.launch.studies.precision_speed measures yours); mixed_float16 is "
        "for GPUs and adds dynamic loss scaling that agrees across workers.",
    )
    flags.DEFINE_float(
        "learning_rate", defaults.learning_rate,
        "Peak learning rate (after warmup); for --base_batch_size examples "
        "with --scale_lr.")
    flags.DEFINE_float("momentum", defaults.momentum,
                       "Momentum of sgd and lars.")
    flags.DEFINE_enum(
        "lr_schedule", defaults.lr_schedule, recipe_settings.LR_SCHEDULES,
        "constant: the learning rate throughout (after --warmup_epochs of "
        "linear warmup if > 0); warmup_poly: linear warmup, then polynomial "
        "decay to --end_learning_rate over the remaining epochs (MLPerf "
        "LARS); one_cycle: cosine up to the learning rate over "
        "--warmup_epochs (0: 30% of training), then cosine down; slow_start: "
        "0.5x the learning rate to 40/90 of training, then 0.075x, 0.01x "
        "from 70/90, 0.001x from 85/90 (tfscale.schedules.SlowStart, Akiba "
        "et al. 2017).",
    )
    flags.DEFINE_float("warmup_epochs", defaults.warmup_epochs,
                       "Linear warmup length in epochs.", lower_bound=0.0)
    flags.DEFINE_float("end_learning_rate", defaults.end_learning_rate,
                       "warmup_poly: the learning rate at the last step.",
                       lower_bound=0.0)
    flags.DEFINE_float("poly_power", defaults.poly_power,
                       "warmup_poly: power of the decay.", lower_bound=0.0)
    flags.DEFINE_float(
        "weight_decay", defaults.weight_decay,
        "L2 added to the gradient (g + wd * w) of every variable but biases "
        "and BatchNorm parameters, for sgd and lars alike.",
        lower_bound=0.0,
    )
    flags.DEFINE_bool(
        "scale_lr", defaults.scale_lr,
        "Linear scaling rule: use learning_rate * global_batch_size / "
        "base_batch_size as the (peak) learning rate.",
    )
    flags.DEFINE_integer("base_batch_size", defaults.base_batch_size,
                         "The batch --learning_rate is given for "
                         "(--scale_lr).", lower_bound=1)
    flags.DEFINE_float("eeta", defaults.eeta, "lars: trust coefficient.",
                       lower_bound=0.0)
    flags.DEFINE_float("lars_epsilon", defaults.lars_epsilon,
                       "lars: added to the gradient norm in the trust ratio.",
                       lower_bound=0.0)
    flags.DEFINE_float(
        "rmsprop_learning_rate", defaults.rmsprop_learning_rate,
        "rmsprop_warmup: RMSprop's learning rate at the start.",
        lower_bound=0.0)
    flags.DEFINE_float(
        "rmsprop_warmup_center_epochs", defaults.rmsprop_warmup_center_epochs,
        "rmsprop_warmup: the epoch at which RMSprop and SGD weigh half each.",
        lower_bound=0.0)
    flags.DEFINE_float(
        "rmsprop_warmup_period_epochs", defaults.rmsprop_warmup_period_epochs,
        "rmsprop_warmup: length of the switch; SGD alone from center + "
        "period / 2.", lower_bound=0.0)
    flags.DEFINE_integer(
        "accumulation_steps", defaults.accumulation_steps,
        "Gradient accumulation: split each step's --global_batch_size into "
        "this many micro-batches run one after another, and update (one "
        "all-reduce) once per step: a batch larger than the workers' memory "
        "holds, trained as one step of the whole batch. 1: none.",
        lower_bound=1)
    flags.DEFINE_string(
        "batch_schedule", defaults.batch_schedule,
        "Grow the global batch instead of decaying the learning rate (Smith "
        "et al. 2017, arXiv 1711.00489): comma-separated epoch:factor, each "
        "multiplying the global batch by factor from that epoch on (counted "
        "from 0): 30:5,60:5,80:5 is 5x --global_batch_size from epoch 30, "
        "25x from 60, 125x from 80, at the same learning rate. An epoch "
        "keeps its examples, in fewer, larger steps. "
        "Needs --lr_schedule=constant (warmup allowed). Empty: a fixed batch.")
    flags.DEFINE_integer(
        "max_global_batch_size", defaults.max_global_batch_size,
        "--batch_schedule's cap (the paper's hybrid): an event whose batch "
        "would pass it divides the learning rate by its factor instead; "
        "--max_global_batch_size=--global_batch_size gives the plain "
        "learning-rate decay. 0: no cap.", lower_bound=0)
    flags.DEFINE_enum(
        "recipe", defaults.recipe, ["none", *recipe_settings.RECIPES],
        "Published large-batch hyper-parameters (tfscale.recipes.RECIPES "
        "cites their sources); flags given explicitly override them.",
    )


@dataclasses.dataclass(frozen=True)
class Config:
    """tfscale-train's flags, read once from absl (`from_flags`) and passed
    down: `config.model_dir` is the value of --model_dir.

    Attributes:
        values: every tfscale-train flag's value, by name.
        defaults: every tfscale-train flag's default, by name.
        given: the names of the flags given on the command line.
    """

    values: types.MappingProxyType
    defaults: types.MappingProxyType
    given: frozenset

    @classmethod
    def from_flags(cls):
        """The parsed flags of this module."""
        own = FLAGS.get_flags_for_module(__name__)
        return cls(values=types.MappingProxyType({f.name: f.value for f in own}),
                   defaults=types.MappingProxyType({f.name: f.default for f in own}),
                   given=frozenset(f.name for f in own if f.present))

    def __getattr__(self, name):
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"tfscale-train has no flag --{name}")

    @functools.cached_property
    def settings(self):
        """`tfscale.recipes.Settings` of the flags, `--recipe` filling in: a
        flag given on the command line wins over the recipe; the recipe wins
        over the flag's default."""
        names = recipe_settings.Settings().get_config()
        chosen = {name: self.values[name] for name in names
                  if name in self.given or self.recipe == "none"}
        if self.recipe == "none":
            return recipe_settings.Settings.from_config(chosen)
        chosen.pop("recipe", None)
        return recipe_settings.Settings.from_recipe(self.recipe, **chosen)

    @property
    def training(self):
        """The flags besides `Settings` that a resumed run must keep."""
        return {name: self.values[name] for name in TRAINING_FLAGS}

    @property
    def training_defaults(self):
        """`training` at the flags' defaults: what a settings file written
        before a flag existed counts as holding."""
        return {name: self.defaults[name] for name in TRAINING_FLAGS}

    @property
    def shared(self):
        """The flags every worker must agree on (`LOCAL_FLAGS` may differ)."""
        return {name: value for name, value in self.values.items()
                if name not in LOCAL_FLAGS}


def is_evaluator(config):
    """Whether TF_CONFIG makes this process an `evaluator` task (as Kubeflow
    writes it), under --cluster_resolver=tf_config."""
    return (config.cluster_resolver == "tf_config"
            and preflight.tf_config_task_type() == "evaluator")


def settings_from_flags():
    """`Config.from_flags().settings`."""
    return Config.from_flags().settings


def training_from_flags():
    """`Config.from_flags().training`."""
    return Config.from_flags().training


def training_defaults():
    """`Config.from_flags().training_defaults`."""
    return Config.from_flags().training_defaults


def shared_flags():
    """`Config.from_flags().shared`."""
    return Config.from_flags().shared
