"""Growing the global batch instead of decaying the learning rate.

Smith, Kindermans, Ying and Le 2017, "Don't Decay the Learning Rate,
Increase the Batch Size" (arXiv 1711.00489): SGD's noise scale is
`g = eps (N / B - 1) ~ eps N / B` (Section 1; with momentum m,
`eps N / (B (1 - m))`, Section 4), for learning rate eps, training set size
N and batch B. Dividing eps by k or multiplying B by k lowers it alike, so
where a schedule would divide the learning rate by k at some epoch, the
batch grows k times there instead: the same accuracy after the same epochs,
in fewer parameter updates. Their "hybrid" schedule (Section 5.1, Figure 1)
grows the batch while the hardware allows, then decays the learning rate.

A schedule is a list of `(epoch, factor)` events, written
`"30:5,60:5,80:5"`: from epoch 30 (counted from 0, as Keras counts) the
global batch is 5 times larger, from 60 another 5 times, and so on. With
`max_global_batch_size`, an event whose batch would pass it divides the
learning rate by its factor instead (the hybrid); setting it to the first
global batch gives the plain learning-rate decay the batch growth replaces.

An epoch keeps its examples as the batch grows: it holds
`steps_per_epoch * global_batch_size` examples of the first phase, in
`floor(that / batch)` steps of each later phase's batch. The input is one
stream of examples (`tfscale.data`): a phase reads on from where the one
before it stopped (`Phase.first_example`), so its global batches are the
same for any number of workers.

```python
phases = tfscale.batch_growth.phases("2:2", global_batch_size=64,
                                       steps_per_epoch=22, epochs=4)
for part in tfscale.batch_growth.fit_parts(phases, start_step=0):
    dataset = ...  # batches of part.phase.global_batch_size from example
                   # part.phase.first_example + part.data_step * that batch
    model.fit(dataset, initial_epoch=part.initial_epoch, epochs=part.epochs,
              steps_per_epoch=part.steps_per_epoch)
```

`tfscale.recipes.Settings(batch_schedule=..., max_global_batch_size=...)`
builds the matching learning-rate schedule (`recipes.make_optimizer`). To
resume mid-phase, restore with `tfscale.checkpoint.restore` (its step is
`fit_parts`' `start_step`) and save with `tfscale.callbacks.TrainingCheckpoint`
(`record=lambda step: phase_record(phases, step)` names the phase in each
checkpoint); `BackupAndRestore` serves a single fit.
"""

import dataclasses
import re

from tfscale._validation import is_int

_EVENT = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse(batch_schedule):
    """`((epoch, factor), ...)` of a schedule written `"30:5,60:5"`.

    Also accepts a sequence of `(epoch, factor)` pairs; `""` or `None` (no
    growth) give `()`. Epochs must be >= 1 and increasing, factors integers
    >= 2.

    Raises:
        ValueError: naming the event that is wrong.
    """
    if batch_schedule is None or batch_schedule == "":
        return ()
    if isinstance(batch_schedule, str):
        events = []
        for text in batch_schedule.split(","):
            match = _EVENT.match(text)
            if not match:
                raise ValueError(
                    "`batch_schedule` must be comma-separated epoch:factor "
                    "pairs, e.g. '30:5,60:5' (from epoch 30 the global batch "
                    "is 5x larger, from 60 25x). Received: "
                    f"batch_schedule={batch_schedule!r}, which has {text!r}")
            events.append((int(match.group(1)), int(match.group(2))))
    else:
        try:
            events = [(epoch, factor) for epoch, factor in batch_schedule]
        except (TypeError, ValueError):
            raise ValueError(
                "`batch_schedule` must be a string like '30:5,60:5' or a "
                "sequence of (epoch, factor) pairs. Received: "
                f"batch_schedule={batch_schedule!r}") from None
    previous = 0
    for epoch, factor in events:
        if not (is_int(epoch) and epoch > previous):
            raise ValueError(
                "`batch_schedule` epochs must be integers >= 1, each later "
                f"than the one before. Received: epoch {epoch!r} after "
                f"{previous} in batch_schedule={batch_schedule!r}")
        if not (is_int(factor) and factor >= 2):
            raise ValueError(
                "`batch_schedule` factors must be integers >= 2. Received: "
                f"factor {factor!r} at epoch {epoch} in "
                f"batch_schedule={batch_schedule!r}")
        previous = epoch
    return tuple((int(e), int(f)) for e, f in events)


def to_string(events):
    """The `"epoch:factor,..."` text of `parse`'s events (`""`: none)."""
    return ",".join(f"{epoch}:{factor}" for epoch, factor in events)


@dataclasses.dataclass(frozen=True)
class Phase:
    """A stretch of epochs with one global batch and one learning rate.

    Attributes:
        index: 0 for the first phase.
        first_epoch: its first epoch (counted from 0, as Keras counts).
        end_epoch: the epoch after its last.
        global_batch_size: examples per optimizer update over all workers.
        steps_per_epoch: optimizer updates per epoch.
        learning_rate_divisor: the learning rate of this phase is the
            schedule's divided by it (> 1 after a hybrid decay).
        first_step: optimizer updates before the phase.
        first_example: examples of the input stream before the phase.
    """

    index: int
    first_epoch: int
    end_epoch: int
    global_batch_size: int
    steps_per_epoch: int
    learning_rate_divisor: int
    first_step: int
    first_example: int

    @property
    def steps(self):
        """Optimizer updates in the phase."""
        return (self.end_epoch - self.first_epoch) * self.steps_per_epoch

    @property
    def end_step(self):
        """Optimizer updates at the end of the phase."""
        return self.first_step + self.steps

    def describe(self):
        """`"phase 2 (epochs 30-59)"`: how errors and logs name it."""
        return (f"phase {self.index + 1} (epochs {self.first_epoch}-"
                f"{self.end_epoch - 1})")


def check_max_global_batch_size(value):
    """`value` as an int; raises `ValueError` unless an integer >= 0."""
    if not (is_int(value) and value >= 0):
        raise ValueError(
            "`max_global_batch_size` must be an integer >= 0 (0: no limit). "
            f"Received: max_global_batch_size={value!r}")
    return int(value)


def phases(batch_schedule, global_batch_size, steps_per_epoch, epochs,
           max_global_batch_size=0):
    """The `Phase`s of training under `batch_schedule`.

    Args:
        batch_schedule: events as `parse` reads them (`""`: one phase).
        global_batch_size: the first phase's global batch.
        steps_per_epoch: the first phase's optimizer updates per epoch; an
            epoch holds `steps_per_epoch * global_batch_size` examples.
        epochs: the length of training; every event must fall before it.
        max_global_batch_size: the largest global batch (0: no limit); an
            event that would pass it divides the learning rate by its
            factor instead (Smith et al.'s hybrid).

    Raises:
        ValueError: an event at or after `epochs`, a limit below
            `global_batch_size`, or a phase whose batch is larger than an
            epoch.
    """
    events = parse(batch_schedule)
    max_global_batch_size = check_max_global_batch_size(max_global_batch_size)
    if max_global_batch_size and max_global_batch_size < global_batch_size:
        raise ValueError(
            "`max_global_batch_size` must be at least the first global batch "
            f"({global_batch_size}) or 0 (no limit). Received: "
            f"max_global_batch_size={max_global_batch_size}")
    if events and events[-1][0] >= epochs:
        raise ValueError(
            f"`batch_schedule` event at epoch {events[-1][0]} is not before "
            f"the end of training ({epochs} epochs, numbered 0-{epochs - 1}). "
            f"Received: batch_schedule={to_string(events)!r}, epochs={epochs}")
    epoch_examples = steps_per_epoch * global_batch_size
    starts = [0] + [epoch for epoch, _ in events]
    ends = starts[1:] + [epochs]
    batch, divisor, first_step, first_example = global_batch_size, 1, 0, 0
    result = []
    for index, (start, end) in enumerate(zip(starts, ends)):
        if index:
            factor = events[index - 1][1]
            if max_global_batch_size and batch * factor > max_global_batch_size:
                divisor *= factor
            else:
                batch *= factor
        steps = epoch_examples // batch
        phase = Phase(index, start, end, batch, steps, divisor, first_step,
                      first_example)
        if steps < 1:
            raise ValueError(
                f"The global batch of {phase.describe()}, {batch}, is larger "
                f"than an epoch ({epoch_examples} examples: {steps_per_epoch} "
                f"steps of {global_batch_size}); use a smaller factor or a "
                "max_global_batch_size.")
        result.append(phase)
        first_step += phase.steps
        first_example += phase.steps * batch
    return result


def check_phases(all_phases, accumulation_steps):
    """Refuses phases whose batch does not cut into `accumulation_steps`
    equal micro-batches (any number of workers shares any batch).

    Raises:
        ValueError: naming the first such phase, its batch and the steps.
    """
    for phase in all_phases:
        if phase.global_batch_size % accumulation_steps:
            raise ValueError(
                f"The global batch of {phase.describe()}, "
                f"{phase.global_batch_size}, does not cut into "
                f"accumulation_steps ({accumulation_steps}) equal "
                "micro-batches. Choose a first global batch and factors whose "
                f"products divide by {accumulation_steps}.")


@dataclasses.dataclass(frozen=True)
class FitPart:
    """One `model.fit` of a phase (see `fit_parts`).

    Attributes:
        phase: the `Phase` it trains.
        initial_epoch, epochs: `fit`'s arguments of the same names.
        steps_per_epoch: `fit`'s steps per epoch (micro-batches with
            gradient accumulation).
        data_step: fit steps of the phase trained before this part: its
            input starts that many batches into the phase's data.
    """

    phase: Phase
    initial_epoch: int
    epochs: int
    steps_per_epoch: int
    data_step: int


def fit_parts(all_phases, start_step=0, accumulation_steps=1):
    """The `FitPart`s that train `all_phases` from fit step `start_step`.

    One fit per phase; a run resumed mid-epoch first finishes that epoch in
    a fit of its own, then runs the phase's whole epochs.

    Args:
        all_phases: `phases(...)`.
        start_step: fit steps already trained (a checkpoint's step).
        accumulation_steps: micro-batches per optimizer update: each fit
            step is one micro-batch of `global_batch_size / k`.
    """
    parts = []
    for phase in all_phases:
        steps = phase.steps_per_epoch * accumulation_steps
        done = start_step - phase.first_step * accumulation_steps
        if done >= phase.steps * accumulation_steps:
            continue
        done = max(done, 0)
        epoch, done_in_epoch = divmod(done, steps)
        epoch += phase.first_epoch
        if done_in_epoch:
            parts.append(FitPart(phase, epoch, epoch + 1,
                                 steps - done_in_epoch, done))
            epoch += 1
        if epoch < phase.end_epoch:
            parts.append(FitPart(phase, epoch, phase.end_epoch, steps,
                                 (epoch - phase.first_epoch) * steps))
    return parts


def phase_record(all_phases, step, accumulation_steps=1):
    """What a checkpoint at fit step `step` records of its phase: a dict of
    `phase` (index), `global_batch_size` and `epoch`."""
    update = step // accumulation_steps
    for phase in all_phases:
        if update < phase.end_step or phase is all_phases[-1]:
            epoch = phase.first_epoch + min(
                (update - phase.first_step) // phase.steps_per_epoch,
                phase.end_epoch - phase.first_epoch)
            return {"phase": phase.index,
                    "global_batch_size": phase.global_batch_size,
                    "epoch": epoch}
    raise ValueError("`all_phases` must not be empty.")


def check_record(all_phases, saved, accumulation_steps=1):
    """Refuses a checkpoint whose recorded phase is not the one its step
    falls in under `all_phases` (the schedule changed since it was saved).

    Args:
        saved: `tfscale.checkpoint.state(directory)`; None, or a state
            saved without a phase record, passes.
    """
    if saved is None or "phase" not in saved:
        return
    expected = phase_record(all_phases, saved["step"], accumulation_steps)
    recorded = {name: saved.get(name) for name in expected}
    if recorded != expected:
        raise ValueError(
            f"The checkpoint of step {saved['step']} was saved in phase "
            f"{recorded['phase'] + 1} (global batch "
            f"{recorded['global_batch_size']}, epoch {recorded['epoch']}), "
            "but this batch schedule puts that step in phase "
            f"{expected['phase'] + 1} (global batch "
            f"{expected['global_batch_size']}, epoch {expected['epoch']}); "
            "resume with the batch schedule it was trained with.")
