"""The study's rows, their learning-rate grids and settings; `Run`, one
training run of a row. No TensorFlow: the flags are checked with these
before TensorFlow is imported."""

import dataclasses
import math

from absl import flags

from tfscale import recipe_settings

FLAGS = flags.FLAGS

NUM_TRAIN = 60_000  # Fashion-MNIST's training split
BASELINE_BATCH = 128
LARS_GRID_BATCH = 8192  # --lars_learning_rates are given for this batch
GROWTH_START_BATCH = 1024  # batch_growth starts here, grows to the largest
# Akiba et al.'s run is 90 epochs: RMSpropWarmup's defaults (centre 10,
# period 5 epochs) are kept as fractions of it.
_AKIBA_EPOCHS = 90.0

METHODS = ("sgd", "lars", "lars_decay_all", "lars_half", "rmsprop_warmup",
           "batch_growth")
LABELS = {
    "sgd": "SGD, linear scaling + warmup",
    "lars": "LARS + warmup",
    "lars_decay_all": "LARS, weight decay on BN and biases too",
    "lars_half": "LARS, naive bfloat16 update",
    "rmsprop_warmup": "RMSprop warm-up + slow start (Akiba et al.)",
    "batch_growth": f"SGD, batch grown from {GROWTH_START_BATCH} (Smith et al.)",
}


@dataclasses.dataclass(frozen=True)
class Row:
    """A method at a batch (the largest, for batch_growth) and a precision."""

    method: str
    batch: int
    precision: str = "float32"

    @property
    def id(self):
        """`method@batch[:precision]`, as `--rows` names it."""
        suffix = "" if self.precision == "float32" else f":{self.precision}"
        return f"{self.method}@{self.batch}{suffix}"

    @property
    def label(self):
        if self.id == f"sgd@{BASELINE_BATCH}":
            return f"SGD, batch {BASELINE_BATCH} (baseline)"
        precision = "" if self.precision == "float32" else f", {self.precision}"
        return f"{LABELS[self.method]}, batch {self.batch}{precision}"

    @property
    def first_batch(self):
        """The global batch the run starts with."""
        return GROWTH_START_BATCH if self.method == "batch_growth" else self.batch

    @property
    def steps_per_epoch(self):
        """Updates per epoch at the first batch (whole batches only) of
        --train_examples."""
        return FLAGS.train_examples // self.first_batch

    def learning_rates(self):
        """The grid: SGD rates scaled linearly from batch 128, LARS rates by
        the square root of batch / 8192."""
        if self.method.startswith("lars"):
            factor = math.sqrt(self.batch / LARS_GRID_BATCH)
            return [round(float(lr) * factor, 4) for lr in FLAGS.lars_learning_rates]
        return [float(lr) for lr in FLAGS.sgd_learning_rates]

    def settings(self, learning_rate):
        """The `tfscale.recipes.Settings` of one run at `learning_rate` (for
        SGD rows: the rate at batch 128, scaled by the recipe)."""
        common = dict(
            momentum=FLAGS.momentum, weight_decay=FLAGS.weight_decay,
            lr_schedule="warmup_poly", poly_power=2.0, end_learning_rate=0.0,
            warmup_epochs=(FLAGS.warmup_epochs
                           if self.batch > BASELINE_BATCH else 0.0),
            learning_rate=learning_rate,
            # The naive run's bfloat16 weights come from a "bfloat16"
            # policy, which Settings does not offer; its optimizer is the
            # study's (training.py).
            precision=("float32" if self.precision == "bfloat16"
                       else self.precision))
        if self.method.startswith("lars"):
            return recipe_settings.Settings(optimizer="lars", **common)
        common.update(scale_lr=True, base_batch_size=BASELINE_BATCH)
        if self.method == "rmsprop_warmup":
            fraction = FLAGS.epochs / _AKIBA_EPOCHS
            common.update(lr_schedule="slow_start", warmup_epochs=0.0,
                          rmsprop_warmup_center_epochs=10.0 * fraction,
                          rmsprop_warmup_period_epochs=5.0 * fraction)
            return recipe_settings.Settings(optimizer="rmsprop_warmup", **common)
        if self.method == "batch_growth":
            # Growth replaces the decay: a constant rate after the warmup.
            common.update(lr_schedule="constant", batch_schedule=FLAGS.growth)
        return recipe_settings.Settings(optimizer="sgd", **common)


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: a row at one learning rate of its grid and a seed."""

    row: Row
    learning_rate: float
    seed: int
    epochs: int
    float64: bool = False  # --float64: a float32 row computed in float64
    train_examples: int = NUM_TRAIN  # --train_examples: the first N images

    @property
    def key(self):
        """What identifies the run on disk: a rerun with other epochs or
        other training images is another run."""
        return (f"{self.row.id}|lr={self.learning_rate:g}|seed={self.seed}"
                f"|epochs={self.epochs}" + ("|float64" if self.float64 else "")
                + ("" if self.train_examples == NUM_TRAIN
                   else f"|train_examples={self.train_examples}"))

    @property
    def policy(self):
        """The Keras dtype policy the run trains under."""
        return "float64" if self.float64 else self.row.precision


def all_rows():
    """Every row of the study, in the order the report lists them."""
    batches = [int(b) for b in FLAGS.batches]
    largest = max(batches)
    return [
        Row("sgd", BASELINE_BATCH),
        *[Row("sgd", b) for b in batches],
        *[Row("lars", b) for b in batches],
        Row("lars_decay_all", LARS_GRID_BATCH),
        Row("lars", LARS_GRID_BATCH, "mixed_bfloat16"),
        Row("lars_half", LARS_GRID_BATCH, "bfloat16"),
        Row("rmsprop_warmup", largest),
        Row("batch_growth", largest),
    ]


def selected_rows():
    """The rows `--rows` names (all by default)."""
    rows = all_rows()
    if not FLAGS.rows:
        return rows
    by_id = {row.id: row for row in rows}
    return [by_id[name] for name in FLAGS.rows]


def runs(rows):
    """Every run of `rows`: each learning rate of the grid, each seed; with
    --quick the middle rate of each grid and one seed."""
    result = []
    for row in rows:
        rates = row.learning_rates()
        if FLAGS.quick:
            rates = [rates[len(rates) // 2]]
        for learning_rate in rates:
            for seed in range(1 if FLAGS.quick else FLAGS.seeds):
                result.append(Run(row, learning_rate, seed, FLAGS.epochs,
                                  FLAGS.float64, FLAGS.train_examples))
    return result
