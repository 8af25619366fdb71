"""The study's flags: defined by `define_flags`, checked by `check_flags`
before anything trains."""

from absl import app
from absl import flags

# Not `from tfscale import batch_growth`: a public name of `tfscale` loads
# all of it, TensorFlow included, and the flags are checked before that.
from tfscale.batch_growth import parse as parse_batch_schedule
from tfscale.launch.studies.large_batch import rows

FLAGS = flags.FLAGS

# --quick: a selection that shows every method in minutes.
QUICK_EPOCHS = 2
QUICK_RESULTS = "large_batch_quick.jsonl"
QUICK_GROWTH = "1:16"  # 1024 to 16384 within the 2 epochs


def define_flags():
    """Defines the study's flags (`run()` calls it before parsing)."""
    flags.DEFINE_bool("quick", False,
                      f"One run per row (the middle learning rate, seed 0), "
                      f"{QUICK_EPOCHS} epochs (growth {QUICK_GROWTH}), results in "
                      f"./{QUICK_RESULTS}, "
                      "no page or plot unless --doc/--plot are given.")
    flags.DEFINE_list("rows", [], "Rows to run (method@batch[:precision], "
                      "e.g. lars@8192); default: all.")
    flags.DEFINE_integer("epochs", 8, "Epoch budget, the same for every run.",
                         lower_bound=1)
    flags.DEFINE_integer("seeds", 2, "Seeds 0..N-1 (weights and data order).",
                         lower_bound=1)
    flags.DEFINE_list("batches", ["1024", "4096", "8192", "16384"],
                      "Large batches of the sgd and lars rows; the largest is "
                      "the rmsprop_warmup and batch_growth rows' batch.")
    flags.DEFINE_list("sgd_learning_rates", ["0.025", "0.05", "0.1"],
                      "SGD grid at batch 128, scaled linearly to each batch.")
    flags.DEFINE_list("lars_learning_rates", ["5", "10", "20"],
                      "LARS grid at batch 8192, scaled by sqrt(batch / 8192).")
    flags.DEFINE_float("warmup_epochs", 1.0,
                       "Linear warmup of every row above batch 128.",
                       lower_bound=0.0)
    flags.DEFINE_float("weight_decay", 5e-4,
                       "L2 on the gradient, biases and BatchNorm excluded "
                       "(but in lars_decay_all).", lower_bound=0.0)
    flags.DEFINE_float("momentum", 0.9, "Momentum of SGD and LARS.")
    flags.DEFINE_string("growth", "4:4,6:4",
                        "batch_growth: epoch:factor events growing batch "
                        f"{rows.GROWTH_START_BATCH} to the largest batch.")
    flags.DEFINE_string("results", "docs/bench/large_batch_runs.jsonl",
                        "The runs on disk, one JSON line each; finished runs "
                        "found there are not run again.")
    flags.DEFINE_string("doc", "docs/large_batch.md",
                        "The page whose <!-- results --> part is rewritten; "
                        "empty: none.")
    flags.DEFINE_string("plot", "docs/large_batch.png",
                        "The plot of test accuracy against batch; empty: none.")
    flags.DEFINE_string("weights_dir", None,
                        "Keep each run's final weights here (.npz, chief "
                        "only), to compare runs on 1 and N workers.")
    flags.DEFINE_bool("float64", False,
                      "Compute the float32 rows in float64 (fc2 stays float32): "
                      "to tell float32's rounding from a real difference "
                      "between 1 and N workers (docs/large_batch.md, \"On 2 "
                      "workers\").")
    flags.DEFINE_integer("train_examples", rows.NUM_TRAIN,
                         "Train on the first N images of the training split "
                         "(an epoch: N // batch updates); fewer for a quick "
                         "check, such as 1 against N workers. Test accuracy "
                         "is always on all 10,000 test images.",
                         lower_bound=1, upper_bound=rows.NUM_TRAIN)
    flags.DEFINE_bool("report_only", False,
                      "Train nothing: report the runs on disk.")


def check_flags():
    """Refuses bad flags with one line each, before TensorFlow is imported."""
    if FLAGS.quick:
        for name, value in (("epochs", QUICK_EPOCHS), ("results", QUICK_RESULTS),
                            ("growth", QUICK_GROWTH), ("doc", ""), ("plot", "")):
            if not FLAGS[name].present:
                FLAGS[name].value = value
    known = [row.id for row in rows.all_rows()]
    unknown = [name for name in FLAGS.rows if name not in known]
    if unknown:
        raise app.UsageError(
            f"--rows must name rows of the study: {', '.join(known)}. "
            f"Unknown: {', '.join(unknown)}")
    for name in ("batches", "sgd_learning_rates", "lars_learning_rates"):
        try:
            values = [float(v) for v in FLAGS[name].value]
        except ValueError:
            values = []
        if not values or min(values) <= 0:
            raise app.UsageError(f"--{name} must be numbers > 0. "
                                 f"Received: {FLAGS[name].value}")
    if FLAGS.warmup_epochs >= FLAGS.epochs:
        raise app.UsageError(
            "--warmup_epochs must be shorter than --epochs. Received: "
            f"warmup_epochs={FLAGS.warmup_epochs}, epochs={FLAGS.epochs}")
    other = [row.id for row in rows.selected_rows() if row.precision != "float32"]
    if FLAGS.float64 and other:
        raise app.UsageError(
            "--float64 computes float32 rows in float64; --rows must not name "
            f"rows of other precisions. Received: {', '.join(other)}")
    # row.batch: the largest batch a row trains with (batch_growth's grown one).
    short = [row.id for row in rows.selected_rows()
             if FLAGS.train_examples < row.batch]
    if short:
        raise app.UsageError(
            f"--train_examples={FLAGS.train_examples} holds no whole batch of "
            f"{', '.join(short)}: give at least the largest batch of each row.")
    if any(row.method == "batch_growth" for row in rows.selected_rows()):
        check_growth()
    # Every row's settings, checked by Settings itself.
    try:
        for row in rows.selected_rows():
            for learning_rate in row.learning_rates():
                row.settings(learning_rate)
    except ValueError as error:
        raise app.UsageError(str(error)) from None


def check_growth():
    """--growth must grow the first batch to the largest within training."""
    largest = max(int(b) for b in FLAGS.batches)
    try:
        events = parse_batch_schedule(FLAGS.growth)
    except ValueError as error:
        raise app.UsageError(f"--growth: {error}") from None
    grown = rows.GROWTH_START_BATCH
    for epoch, factor in events:
        grown *= factor
        if epoch >= FLAGS.epochs:
            raise app.UsageError(
                f"--growth's event at epoch {epoch} is not before the end of "
                f"training (--epochs={FLAGS.epochs}).")
    if grown != largest:
        raise app.UsageError(
            f"--growth must grow batch {rows.GROWTH_START_BATCH} to the "
            f"largest of --batches ({largest}); it reaches {grown}.")
