"""A large-batch run's `Settings`, the published `RECIPES`, and the settings
file beside its checkpoints. Importing this module imports neither TensorFlow
nor Keras: tfscale-train checks its flags with it before it imports
TensorFlow (seconds on a small machine), and refuses bad ones at once.

`tfscale.recipes` builds the optimizer, schedule and precision policy that
`Settings` describe, and re-exports the public names of this module.

A run's settings go to `SETTINGS_FILE` in its checkpoint directory
(`write_settings`); a run resuming from those checkpoints with other
settings is refused with the differences (`check_settings_unchanged`), as
tf-models keeps `params.yaml` beside its checkpoints (its optimization
configs, too, are plain dataclasses apart from the factory that builds from
them).
"""

import dataclasses
import json
import os
import uuid

from tfscale import _validation
# Not `from tfscale import batch_growth`: a public name of `tfscale` loads
# all of it, TensorFlow included.
from tfscale.batch_growth import check_max_global_batch_size
from tfscale.batch_growth import parse as parse_batch_schedule
from tfscale.batch_growth import phases as batch_growth_phases
from tfscale.batch_growth import to_string as batch_schedule_text

OPTIMIZERS = ("sgd", "lars", "rmsprop_warmup")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
LR_SCHEDULES = ("constant", "warmup_poly", "one_cycle", "slow_start")

# Published large-batch settings. Each number is copied from the source named
# in the comment next to it (the `--flags` there are the source's own); where a
# source gives no value the key is absent and the `Settings` default applies.
RECIPES = {
    # MLPerf Training v0.6, Google's ResNet-50 submission at batch 32K
    # (mlcommons/training_results_v0.6,
    # Google/benchmarks/resnet/tpu-v3-1024/run_and_time.sh and its
    # implementations/tpu-v3-1024-resnet/resnet/lars_util.py). Published but
    # not set here: --label_smoothing=0.1 (tfscale has no label smoothing)
    # and --train_steps=2983 (about 76 epochs: the `epochs` of training).
    # That code also adds weight_decay * l2 to the loss; tfscale applies it
    # once.
    "resnet50_lars_32k": {
        "optimizer": "lars",  # --enable_lars=True
        "base_batch_size": 32768,  # --train_batch_size=32768
        "learning_rate": 31.2,  # --lars_base_learning_rate=31.2
        "warmup_epochs": 25.0,  # --lars_warmup_epochs=25
        "weight_decay": 1e-4,  # --weight_decay=0.0001
        "lars_epsilon": 1e-5,  # --lars_epsilon=1e-05
        # resnet_main.py: flags.DEFINE_float('momentum', default=0.9).
        "momentum": 0.9,
        # lars_util.py passes no eeta: tf.contrib.opt.LARSOptimizer's
        # default, eeta=0.001.
        "eeta": 0.001,
        "lr_schedule": "warmup_poly",  # lars_util.py: poly_rate_schedule
        "poly_power": 2.0,  # lars_util.py: polynomial_decay(..., power=2.0)
        # lars_util.py logs lars_opt_end_learning_rate 0.0001 (the default
        # end_learning_rate of tf.train.polynomial_decay, which it calls).
        "end_learning_rate": 1e-4,
    },
    # MLPerf Training v1.0 reference, ResNet-50 with LARS at batch 4K on
    # TPU-v3-64 (mlcommons/training, image_classification/
    # README_tensorflow2.md, tensorflow2/lars_util.py, lars_optimizer.py).
    # Published but not set: --label_smoothing=0.1, --train_epochs=42.
    "resnet50_lars_4k": {
        "optimizer": "lars",  # --optimizer=LARS
        "base_batch_size": 4096,  # --batch_size=4096
        "learning_rate": 10.0,  # --base_learning_rate=10.0
        "warmup_epochs": 5.0,  # --warmup_epochs=5
        "weight_decay": 2e-4,  # --weight_decay=0.0002
        "lars_epsilon": 0.0,  # --lars_epsilon=0
        "momentum": 0.9,  # --momentum=0.9
        "eeta": 0.001,  # lars_optimizer.py: LARSOptimizer(eeta=0.001)
        "lr_schedule": "warmup_poly",  # --lr_schedule=polynomial
        "poly_power": 2.0,  # lars_util.py: PolynomialDecay(power=2.0)
        # lars_util.py: end_learning_rate defaults to 0.0001.
        "end_learning_rate": 1e-4,
    },
    # AlexNet-BN with LARS at 8K, from the NVCaffe solver of Boris Ginsburg
    # (a LARS author): borisgin/nvcaffe, models/alexnet_bn/solver_8K.prototxt.
    # You et al. 2017 (arXiv 1708.03888) report these runs, but the paper's
    # own tables were not available to check against. NVCaffe differs in
    # schedule shape: its warmup starts at rampup_lr=1 (not 0), its poly decay
    # counts from step 0, not from the end of the warmup, and this file uses
    # LARC's "clip" policy where tfscale's LARS scales.
    "alexnet_bn_lars_8k": {
        "optimizer": "lars",  # larc: true
        "base_batch_size": 8192,  # base_lr: 10  # B=8K
        "learning_rate": 10.0,  # base_lr: 10
        "eeta": 0.001,  # larc_eta: 0.001
        # rampup_interval: 600 iterations at 8192 images of 1,281,167.
        "warmup_epochs": round(600 * 8192 / 1281167, 2),
        "lr_schedule": "warmup_poly",  # lr_policy: "poly"
        "poly_power": 2.0,  # power: 2.
        # Caffe's poly policy reaches 0 at max_iter (15600, "100 epochs").
        "end_learning_rate": 0.0,
        "momentum": 0.9,  # momentum: 0.9
        "weight_decay": 5e-4,  # weight_decay: 0.0005
    },
    # AlexNet-BN with LARS at 32K: borisgin/nvcaffe,
    # models/alexnet_bn/solver_32k.prototxt (same caveats as 8K; this file
    # uses local_lr_auto, i.e. LARS scaling, not LARC clipping).
    "alexnet_bn_lars_32k": {
        "optimizer": "lars",  # local_lr_auto: true
        "base_batch_size": 32768,  # base_lr: 32  # B=32K
        "learning_rate": 32.0,  # base_lr: 32
        "eeta": 0.001,  # local_gw_ratio: 0.001
        # rampup_interval: 400 iterations ("10 epochs") at 32768 images.
        "warmup_epochs": round(400 * 32768 / 1281167, 2),
        "lr_schedule": "warmup_poly",  # lr_policy: "poly"
        "poly_power": 2.0,  # power: 2.
        # Caffe's poly policy reaches 0 at max_iter (4000, "100 epochs").
        "end_learning_rate": 0.0,
        "momentum": 0.9,  # momentum: 0.9
        "weight_decay": 5e-4,  # weight_decay: 0.0005
    },
}
# Jia et al. 2018 (arXiv 1807.11205) trained AlexNet-BN for 95 epochs and
# ResNet-50 for 90 epochs at batch 64K (abstract); their learning rates and
# warmup lengths were not found in the sources available, so there is no
# 64K recipe.
# Smith, Kindermans, Ying and Le 2017 (arXiv 1711.00489) trained
# Inception-ResNet-V2 in under 2500 parameter updates with batches of 65536
# and ResNet-50 in under 30 minutes (the abstracts of its two versions); the
# settings of those ImageNet runs were not in the sources available, nor was
# public code that reproduces them, so there is no batch-growth recipe. A
# recipe can hold one: `batch_schedule` and `max_global_batch_size` are
# `Settings` fields like the others.


SETTINGS_FILE = "settings.json"

# Fields by the check they take: (name, rule, test).
_ENUMS = (("optimizer", OPTIMIZERS), ("precision", PRECISIONS),
          ("lr_schedule", LR_SCHEDULES), ("recipe", ("none", *RECIPES)))
_FLOATS = (
    ("learning_rate", "a number > 0", lambda v: v > 0),
    # Keras's SGD and tfscale's LARS both refuse momentum outside [0, 1].
    ("momentum", "a number in [0, 1]", lambda v: 0 <= v <= 1),
    ("warmup_epochs", "a number >= 0", lambda v: v >= 0),
    ("end_learning_rate", "a number >= 0", lambda v: v >= 0),
    ("poly_power", "a number >= 0", lambda v: v >= 0),
    ("weight_decay", "a number >= 0", lambda v: v >= 0),
    ("eeta", "a number >= 0", lambda v: v >= 0),
    ("lars_epsilon", "a number >= 0", lambda v: v >= 0),
    ("rmsprop_learning_rate", "a number >= 0", lambda v: v >= 0),
    ("rmsprop_warmup_center_epochs", "a number >= 0", lambda v: v >= 0),
    ("rmsprop_warmup_period_epochs", "a number > 0", lambda v: v > 0),
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything that decides the optimizer, its schedule and precision.

    The defaults are plain SGD with momentum 0.9 at a constant learning rate
    of 0.05 in float32 (tfscale-train's defaults). `from_recipe` starts from
    a published recipe instead; `get_config`/`from_config` round-trip
    through JSON.

    Attributes:
        optimizer: "sgd", "lars" or "rmsprop_warmup"
            (`optimizers.RMSpropWarmup`, Akiba et al. 2017).
        precision: Keras dtype policy, one of `PRECISIONS`.
        learning_rate: the peak learning rate (after warmup), for
            `base_batch_size` examples if `scale_lr`.
        momentum: momentum of SGD and LARS (RMSpropWarmup's `mu1`).
        lr_schedule: one of `LR_SCHEDULES` (see `tfscale.recipes.make_schedule`).
        warmup_epochs: length of the linear warmup.
        end_learning_rate: "warmup_poly": the learning rate at the end.
        poly_power: "warmup_poly": the power of the decay.
        weight_decay: L2 on the gradient, biases and BatchNorm excluded.
        scale_lr: apply the linear scaling rule from `base_batch_size`.
        base_batch_size: the batch `learning_rate` is given for.
        eeta: LARS trust coefficient.
        lars_epsilon: LARS: added to the gradient norm in the trust ratio.
        recipe: name of the `RECIPES` entry the values came from, or "none".
        rmsprop_learning_rate: "rmsprop_warmup": RMSprop's learning rate
            at the start of training.
        rmsprop_warmup_center_epochs: "rmsprop_warmup": the epoch at which
            RMSprop and SGD weigh half each (`beta_center`).
        rmsprop_warmup_period_epochs: "rmsprop_warmup": `beta_period` in
            epochs; SGD alone from center + period / 2 on.
        accumulation_steps: micro-batches per optimizer step (Keras's
            `gradient_accumulation_steps`; 1: none). The global batch stays
            the examples of one optimizer step: each micro-batch holds
            1/accumulation_steps of it, and tfscale all-reduces once per
            step.
        batch_schedule: grow the global batch instead of decaying the
            learning rate (Smith et al. 2017; `tfscale.batch_growth`):
            `"epoch:factor,..."` events, e.g. `"30:5,60:5"` (a sequence of
            pairs is accepted and stored as that text); `""`: none. Needs
            `lr_schedule="constant"`: the events are the decay.
        max_global_batch_size: with `batch_schedule`, the largest global
            batch; an event that would pass it divides the learning rate
            by its factor instead (the paper's hybrid). 0: no limit.

    Example:

    ```python
    settings = Settings.from_recipe("resnet50_lars_4k", warmup_epochs=2.0)
    assert Settings.from_config(settings.get_config()) == settings
    ```
    """

    optimizer: str = "sgd"
    precision: str = "float32"
    learning_rate: float = 0.05
    momentum: float = 0.9
    lr_schedule: str = "constant"
    warmup_epochs: float = 0.0
    end_learning_rate: float = 0.0
    poly_power: float = 2.0
    weight_decay: float = 0.0
    scale_lr: bool = False
    base_batch_size: int = 256
    eeta: float = 0.001
    lars_epsilon: float = 0.0
    recipe: str = "none"
    accumulation_steps: int = 1
    # optimizers.RMSpropWarmup's defaults, which cite their source.
    rmsprop_learning_rate: float = 3e-4
    rmsprop_warmup_center_epochs: float = 10.0
    rmsprop_warmup_period_epochs: float = 5.0
    batch_schedule: str = ""
    max_global_batch_size: int = 0

    def __post_init__(self):
        for name, allowed in _ENUMS:
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"`{name}` must be one of {list(allowed)}. "
                    f"Received: {name}={value!r}"
                )
        for name, rule, ok in _FLOATS:
            value = getattr(self, name)
            if not (_validation.is_finite_number(value) and ok(value)):
                raise ValueError(
                    f"`{name}` must be {rule}. Received: {name}={value!r}")
            # Frozen: store 10 as 10.0 so that equal settings compare and
            # serialize alike.
            object.__setattr__(self, name, float(value))
        if not isinstance(self.scale_lr, bool):
            raise ValueError("`scale_lr` must be a boolean. "
                             f"Received: scale_lr={self.scale_lr!r}")
        value = self.base_batch_size
        if not (_validation.is_int(value) and value >= 1):
            raise ValueError("`base_batch_size` must be an integer >= 1. "
                             f"Received: base_batch_size={value!r}")
        object.__setattr__(self, "base_batch_size", int(value))
        value = self.accumulation_steps
        if not (_validation.is_int(value) and value >= 1):
            raise ValueError("`accumulation_steps` must be an integer >= 1. "
                             f"Received: accumulation_steps={value!r}")
        object.__setattr__(self, "accumulation_steps", int(value))
        self._check_batch_schedule()

    def _check_batch_schedule(self):
        # Stored as canonical text: equal schedules compare and save alike.
        object.__setattr__(self, "batch_schedule", batch_schedule_text(
            parse_batch_schedule(self.batch_schedule)))
        value = check_max_global_batch_size(self.max_global_batch_size)
        object.__setattr__(self, "max_global_batch_size", value)
        if value and not self.batch_schedule:
            raise ValueError(
                "`max_global_batch_size` limits the growth of "
                "`batch_schedule`; give a batch_schedule or leave it 0. "
                f"Received: max_global_batch_size={value}, batch_schedule=''")
        if self.batch_schedule and self.lr_schedule != "constant":
            raise ValueError(
                "`batch_schedule` replaces the learning-rate decay, so it "
                "needs lr_schedule='constant' (a warmup is allowed). "
                f"Received: batch_schedule={self.batch_schedule!r}, "
                f"lr_schedule={self.lr_schedule!r}")

    @classmethod
    def from_recipe(cls, name, **overrides):
        """The settings of `RECIPES[name]`, with `overrides` replacing some.

        Args:
            name: a key of `RECIPES`.
            **overrides: `Settings` fields that win over the recipe's
                values; fields neither sets keep their defaults.
        """
        if name not in RECIPES:
            raise ValueError(f"`name` must be one of {list(RECIPES)}. "
                             f"Received: name={name!r}")
        return cls.from_config({**RECIPES[name], "recipe": name, **overrides})

    def get_config(self):
        """The fields as a JSON-serializable dict (`from_config` inverts it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config):
        """`Settings` from a dict of fields, as `get_config` returns it."""
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(config) - set(names))
        if unknown:
            raise ValueError(
                f"`config` must hold only Settings fields ({', '.join(names)})."
                f" Received: config with {', '.join(unknown)}")
        return cls(**config)

    def peak_learning_rate(self, global_batch_size):
        """The learning rate after warmup (linearly scaled if `scale_lr`)."""
        if not self.scale_lr:
            return self.learning_rate
        # Keras: imported here, not when this module is.
        from tfscale.schedules import linear_scaling

        return linear_scaling(
            self.learning_rate, global_batch_size, self.base_batch_size)


def batch_phases(settings, global_batch_size, steps_per_epoch, epochs):
    """The `tfscale.batch_growth.Phase`s of `settings` (one phase
    without a `batch_schedule`); arguments as
    `tfscale.recipes.make_schedule`'s."""
    return batch_growth_phases(
        settings.batch_schedule, global_batch_size, steps_per_epoch, epochs,
        settings.max_global_batch_size)


def describe(settings, global_batch_size=None):
    """One line saying which optimizer, schedule and precision are in use.

    Args:
        settings: a `Settings`.
        global_batch_size: shows the linearly scaled learning rate if given.
    """
    s = settings
    parts = [f"optimizer {s.optimizer} (momentum {s.momentum:g}"]
    if s.weight_decay:
        parts.append(f", weight decay {s.weight_decay:g} except bias/BN")
    if s.optimizer == "lars":
        parts.append(f", eeta {s.eeta:g}")
        if s.lars_epsilon:
            parts.append(f", epsilon {s.lars_epsilon:g}")
    if s.optimizer == "rmsprop_warmup":
        parts.append(
            f", from RMSprop at lr {s.rmsprop_learning_rate:g} to SGD: half "
            f"at epoch {s.rmsprop_warmup_center_epochs:g}, SGD alone from "
            f"epoch {s.rmsprop_warmup_center_epochs + s.rmsprop_warmup_period_epochs / 2:g}")
    parts.append(f"), lr {s.lr_schedule} ")
    if s.scale_lr and global_batch_size:
        peak = s.peak_learning_rate(global_batch_size)
        parts.append(f"{peak:g} (= {s.learning_rate:g} x {global_batch_size}"
                     f"/{s.base_batch_size})")
    elif s.scale_lr:
        parts.append(f"{s.learning_rate:g} x batch/{s.base_batch_size}")
    else:
        parts.append(f"{s.learning_rate:g}")
    if s.warmup_epochs:
        parts.append(f", warmup {s.warmup_epochs:g} epochs")
    if s.lr_schedule == "warmup_poly":
        parts.append(f", power {s.poly_power:g} to {s.end_learning_rate:g}")
    if s.accumulation_steps > 1:
        parts.append(f", {s.accumulation_steps} micro-batches per step")
    if s.batch_schedule:
        growth = ", ".join(f"x{factor} from epoch {epoch}" for epoch, factor
                           in parse_batch_schedule(s.batch_schedule))
        parts.append(f", global batch {growth}")
        if s.max_global_batch_size:
            parts.append(f" up to {s.max_global_batch_size}, then lr / factor")
    parts.append(f", precision {s.precision}")
    if s.precision == "mixed_float16":
        parts.append(" with dynamic loss scaling")
    if s.recipe != "none":
        parts.append(f", recipe {s.recipe}")
    return "".join(parts)


class SettingsChangedError(ValueError):
    """A run would resume from checkpoints written with other settings."""


def write_settings(directory, settings, **training):
    """Writes `settings` and `training` to `directory/SETTINGS_FILE`.

    Atomic: the JSON goes to a temporary file that then replaces the old
    one, so a reader sees the old file or the new one, never a part.

    Args:
        directory: the run's checkpoint directory (created if missing).
        settings: a `Settings`.
        **training: other JSON values that decide the training and must
            not change on resume (model, data set, global batch size, ...).
    """
    clash = sorted(set(training) & set(settings.get_config()))
    if clash:
        raise ValueError(
            "`training` must not repeat Settings fields. Received: "
            + ", ".join(f"{name}={training[name]!r}" for name in clash))
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, SETTINGS_FILE)
    partial = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(partial, "w", encoding="utf-8") as f:
            json.dump({"settings": settings.get_config(), "training": training},
                      f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def read_settings(directory):
    """`(settings, training)` as `write_settings` wrote them in `directory`.

    Raises:
        FileNotFoundError: `directory` holds no `SETTINGS_FILE`.
    """
    with open(os.path.join(directory, SETTINGS_FILE), encoding="utf-8") as f:
        saved = json.load(f)
    return Settings.from_config(saved["settings"]), saved["training"]


def settings_differences(saved, current, unsaved_defaults=None):
    """Lines `name: <saved> saved, <current> now`, one per differing value.

    Args:
        saved: `(settings, training)` as `read_settings` returns them.
        current: `(settings, training)` of the run about to start.
        unsaved_defaults: `{name: value}` for `training` values a settings
            file written by an older version may lack: missing there, they
            count as `value` (the default), so a newer option left at its
            default does not stop a resume. (Missing `Settings` fields take
            their defaults in `read_settings` already.)
    """
    def flat(pair):
        settings, training = pair
        return {**settings.get_config(), **training}

    before, now = flat(saved), flat(current)
    for name, value in (unsaved_defaults or {}).items():
        before.setdefault(name, value)
    return [f"{name}: {before.get(name, '<unset>')!r} saved, "
            f"{now.get(name, '<unset>')!r} now"
            for name in sorted(set(before) | set(now))
            if before.get(name, "<unset>") != now.get(name, "<unset>")]


def check_settings_unchanged(directory, settings, unsaved_defaults=None,
                             **training):
    """Refuses to resume from `directory` with settings other than its own.

    Does nothing when `directory` holds no saved settings. `unsaved_defaults`:
    see `settings_differences`.

    Raises:
        SettingsChangedError: listing every difference.
    """
    try:
        saved = read_settings(directory)
    except FileNotFoundError:
        return
    lines = settings_differences(saved, (settings, training), unsaved_defaults)
    if lines:
        raise SettingsChangedError(
            f"The checkpoints in {directory} were written with other "
            "settings; resume with the settings they were written with, or "
            "train in another directory:\n  " + "\n  ".join(lines))
