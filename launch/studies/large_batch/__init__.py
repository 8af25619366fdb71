r"""Large-batch study on digits: what closes the large-batch gap?

    python -m tfscale.launch.studies.large_batch   # defaults: 24 min here (144 runs)

The question of You et al. 2017, Jia et al. 2018 and Akiba et al. 2017,
asked of a data set that fits on this machine: at the same epoch budget a
large batch makes far fewer updates; does large-batch SGD fall short of the
small-batch accuracy, and which technique closes the gap? One process
trains on scikit-learn's digits (1,437 training and 360 test images, real
data): what varies is the batch size and the optimizer, not the number of
workers. The AlexNet-BN settings, all with momentum 0.9, L2 weight decay
on the gradient (biases and BatchNorm parameters excluded):

- `sgd_small`: SGD, `--small_batch`, for each of `--learning_rates`,
  polynomial decay (power 2) to 0 at the end of the same number of epochs.
- `sgd_large`: SGD, `--large_batch`, for each of `--learning_rates` scaled
  linearly (`lr * large_batch / small_batch`), `--warmup_epochs` of warmup,
  the same decay.
- `lars_large`: LARS, `--large_batch`, for each peak of
  `--lars_learning_rates`, `--warmup_epochs` of warmup, the same decay,
  biases and BatchNorm excluded from decay and from layer adaptation.
- `slow_start_large`: SGD as `sgd_large`, but after the warmup Akiba et
  al.'s slow-start schedule (`lr_schedule="slow_start"`,
  `tfscale.schedules.SlowStart`: 0.5, 0.075, 0.01, 0.001 times the scaled
  rate from 0, 40/90, 70/90, 85/90 of training).
- `rmsprop_warmup_large`: Akiba et al.'s combination: RMSprop warm-up
  (`optimizer="rmsprop_warmup"`, `tfscale.optimizers.RMSpropWarmup`, its
  RMSprop learning rate 3e-4; RMSprop and SGD weigh half each at 10/90 of
  training, SGD alone from 12.5/90, the 10- and 5-epoch defaults of a
  90-epoch run scaled to `--epochs`) with the slow-start schedule on SGD's
  rate, scaled linearly from each of `--learning_rates`; no linear warmup.
- `batch_growth_small`: Smith et al. 2017, "Don't Decay the Learning Rate,
  Increase the Batch Size": SGD from `--small_batch` at a constant rate
  (each of `--learning_rates`), the batch multiplied by each factor of
  `--batch_growth` (`epoch:factor` events; default `3:5,6:5`: 32, 160,
  800, early enough that training has not converged yet) at its epoch
  (`Settings.batch_schedule`, `tfscale.batch_growth`; an epoch keeps its
  1,440 examples, in fewer updates).
- `lr_decay_small`: the decay that growth replaces: the same events divide
  the learning rate instead (`max_global_batch_size` = `--small_batch`).
- `powersgd_sgd_small`, `powersgd_lars_large`: `sgd_small` at
  `--powersgd_learning_rate` and `lars_large` at
  `--powersgd_lars_learning_rate`, their gradients all-reduced by PowerSGD
  (Vogels, Karimireddy and Jaggi 2019; `tfscale.Strategy` with
  `CommunicationOptions(compression="powersgd")`) at each rank of
  `--powersgd_ranks`, uncompressed for the first `--powersgd_start_step`
  updates, error feedback on. One worker: PowerSGD's sums are linear (P = M Q
  summed over workers is (sum of M) Q, and the errors kept add up to the
  sum's error), so one worker with the global batch follows the same
  compressed trajectory as N workers sharing it. Each is compared with the
  same run uncompressed.

Each runs under every `--precisions` policy and every seed; the baseline
every other row is compared with is the best `sgd_small` learning rate, and
each of the last three rows also with the row it changes one thing of.
After training, every AlexNet-BN run is evaluated twice: with Keras's
BatchNorm moving averages, and with "BatchNorm without moving averages"
(Akiba et al.; `tfscale.callbacks.recompute_batch_norm_statistics`: the
statistics recomputed for the final weights over one epoch of training
batches). An "epoch" is `round(1437 / batch)` steps; the default large
batch, 479, is a third of the training set: 3 steps per epoch against 45
for batch 32 (ImageNet at 64K makes 20). The optimizers come from
`tfscale.recipes.make_optimizer`, the code behind tfscale-train's flags.

The AlexNet-BN model (`--model=small_alexnet_bn`, the default) is
`tfscale.models.alexnet_bn_small`, a small AlexNet-BN (conv-BN-ReLU-pool
blocks, BatchNorm after the last pool as in Jia et al., two dense layers)
on the 8x8 images: the project's `tfscale.models.alexnet_bn` at its
smallest input (67x67) trains at about 50 images/s on this 2-core
machine, and bfloat16 is slower still (no AVX-512 here, so TensorFlow
falls back to Eigen kernels): hours, not minutes. `--model=alexnet_bn`
runs it anyway.

HALP does not apply to that model (its theory needs a strongly convex
loss; BatchNorm and non-convexity break it), so HALP is compared on
L2-regularized softmax regression (no bias, `--softmax_l2 * ||W||^2` in the
loss: strongly convex, mu = 2 * l2) on the same digits, their 64 pixels
scaled to [0, 1] and centred, float32, once per seed (not per precision),
at both batches, at a constant step size (`--softmax_learning_rate` at the
small batch, `--softmax_large_learning_rate` at the large one):

- `softmax_sgd_small`, `softmax_sgd_large`: Keras SGD, float32 weights;
  `softmax_sgd_small` is the baseline of this group.
- `softmax_lp_sgd_small`, `softmax_lp_sgd_large`: 8-bit low-precision SGD
  (`tfscale.optimizers.LowPrecisionSGD`, grid step `--softmax_lp_scale`).
- `softmax_svrg_small`, `softmax_svrg_large`: SVRG
  (`tfscale.optimizers.SVRG` in a `VarianceReducedModel`), a full gradient
  every 2 epochs.
- `softmax_halp_small`, `softmax_halp_large`: HALP, 8-bit offset, the same
  epoch length, mu = 2 * `--softmax_l2`.

Reported for these: test accuracy, the final training objective, the
parameter updates and the per-example gradient evaluations (counted: SGD
one per example per step; SVRG and HALP two, plus each full-gradient pass
over the 1,437 examples, about 2.5x SGD's per epoch).

Where a paper gives an ImageNet recipe that `tfscale.recipes` can express,
it is in `tfscale.recipes.RECIPES`; Akiba et al.'s numbers could not be
checked against the paper (see below), and HALP's paper gives none for
ImageNet, so these rows add no recipe.

Writes `--doc` (default docs/large_batch.md: the command, exactly what was
printed, including one sentence per row generated from the measured
numbers) and `--plot` (test accuracy per epoch, mean over seeds with the
min-max band; one panel per precision, one for the softmax group).
"""

# The package, by concern:
#   __main__.py     main() and run(), what `python -m` runs
#   study_flags.py  the flags: define_flags(), check_flags()
#   variants.py     the settings; Variant, one setting at one learning rate
#   training.py     one AlexNet-BN or softmax-regression run, measured as a Run
#   report.py       the printed lines, tables and sentences; the Markdown doc
#   plot.py         the plot of test accuracy per epoch
