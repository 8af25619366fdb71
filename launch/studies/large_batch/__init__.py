r"""Large-batch study on Fashion-MNIST: which technique keeps accuracy as the
batch grows from 128 to 16K, at a fixed epoch budget?

    python -m tfscale.launch.studies.large_batch           # the whole study
    python -m tfscale.launch.studies.large_batch --quick   # one run per row

The question of Goyal et al. 2017, You et al. 2017 and Jia et al. 2018,
asked in miniature of a real data set that fits this machine: Fashion-MNIST
(Xiao et al. 2017; 60,000 training and 10,000 test images, 28x28 grey, 10
classes; `tfscale.data.fashion_mnist`). One model, AlexNet-BN in miniature
(`tfscale.models.alexnet_bn_small`, width 8, fc1 64 units: 52K parameters,
BatchNorm after every conv block and after the last pool as in Jia et al.,
biases in its dense layers) at the images' own 28x28. Every run trains for
the same `--epochs` (an epoch: `60000 // batch` updates of one global batch;
`--train_examples` trains on fewer images, for a quick check)
with momentum 0.9 and L2 weight decay 5e-4 on the gradient (AlexNet-BN's
values in `tfscale.recipes.RECIPES["alexnet_bn_lars_8k"]`), biases and
BatchNorm excluded from the decay, and polynomial decay (power 2) to 0 after
a linear warmup of `--warmup_epochs` at every batch above the baseline's.

The rows (`rows.py`; a row is a method at a batch and a precision):

- `sgd@128`: the baseline, SGD with momentum at batch 128.
- `sgd@B`, B in `--batches`: Goyal et al.'s linear scaling rule with
  gradual warmup (arXiv 1706.02677, sections 2.1 and 2.2): the baseline's
  learning rate times B / 128.
- `lars@B`: LARS (You et al., arXiv 1708.03888, algorithm 1; trust
  coefficient 0.001) with the same warmup and decay.
- `lars_decay_all@8192`: LARS with the weight decay on BatchNorm's
  parameters and the biases too: Jia et al.'s ablation (arXiv 1807.11205,
  section 3, "no bias and BN weight decay").
- `lars@8192:mixed_bfloat16`: mixed precision (bfloat16 compute, float32
  weights) with LARS's update in float32, as Jia et al. section 3 do it.
- `lars_half@8192:bfloat16`: the naive alternative Jia et al. section 3
  warns against: weights, norms, trust ratio and update all in bfloat16.
- `rmsprop_warmup@16384`: Akiba, Suzuki and Fukuda 2017 (arXiv 1711.04325):
  RMSprop warm-up into SGD, with the slow-start schedule, at the largest
  batch (`tfscale.optimizers.RMSpropWarmup`, `tfscale.schedules.SlowStart`;
  their boundaries and warm-up length as fractions of a 90-epoch run).
- `batch_growth@16384`: Smith, Kindermans, Ying and Le 2017 (arXiv
  1711.00489, section 5): reach the largest batch by growing it: batch 1024
  at a constant, linearly scaled rate after the warmup, multiplied by each
  factor of `--growth` at its epoch (`tfscale.batch_growth`).

Each row runs every learning rate of its grid under every seed and reports
the grid's best learning rate by mean final test accuracy:

- SGD rows (`sgd`, `rmsprop_warmup`, `batch_growth`): `--sgd_learning_rates`
  at batch 128, scaled linearly to the row's batch (the starting batch for
  `batch_growth`);
- LARS rows: `--lars_learning_rates` at batch 8192, scaled by the square
  root of batch / 8192 at the other batches (Krizhevsky 2014, arXiv
  1404.5997, section 5; You et al.'s AlexNet-BN rates grow about that fast:
  10 at 8K, 32 at 32K in the recipes above).

A run is a row on disk (`--results`, JSON lines) the moment it finishes:
a rerun skips the runs already there, so an interrupted study continues where
it stopped. Under `tfscale-launch --num_workers=N` every run trains on N
workers through `tfscale.Strategy`, with BatchNorm over the global batch
(`synchronized=True`): the same global batches as one worker, the same
computation but for the order of float sums (`--weights_dir` keeps each
run's weights; `python -m tfscale.launch.studies.large_batch.compare A B`
compares two; `--float64` computes the float32 rows in float64, to tell
that rounding from a real difference; docs/large_batch.md, "On 2 workers").

Writes the table, the targets and the plot into `--doc` between its
`<!-- results -->` markers (the page's own text stays), and `--plot`.
"""

# The package, by concern:
#   __main__.py     main(): runs what is not on disk yet, then reports
#   study_flags.py  the flags: define_flags(), check_flags()
#   rows.py         the rows, their grids and settings; Run, one training run
#   training.py     one run, trained and measured
#   results.py      the runs on disk (JSON lines), resumable
#   report.py       the table, the targets, the page
#   plot.py         test accuracy against batch size, one line per method
#   compare.py      two runs' weights (1 worker against N workers)
