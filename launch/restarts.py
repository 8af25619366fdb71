"""When `tfscale-launch` relaunches failed workers, and with which slots.

Each worker of a job has a slot, a stable identity from 0 to num_workers - 1
(exported to the worker as TFSCALE_SLOT), kept across relaunches while the
worker index in TF_CONFIG is its rank among the slots still in the job. A
`RestartPolicy` decides, after each failure, whether the job relaunches and
whether the failed slot is dropped first:

    policy = RestartPolicy(num_workers=3, max_restarts=3, min_workers=2)
    decision = policy.after_failure(WorkerFailure(index=2, slot=2, code=-9,
                                                  seconds=3.0))
    decision.restart, policy.slots  # True, [0, 1, 2]: restart 1 of 3

A slot is dropped when it fails again within `restart_window` seconds of the
relaunch that followed its earlier failure (its machine is probably broken),
as long as more than `min_workers` slots are left. Nothing here starts or
stops processes; `launch.local` does.
"""

import dataclasses
import signal

DEFAULT_RESTART_WINDOW = 60.0
# A worker's code after saving the step all workers agreed on, on a SIGTERM
# (`tfscale.preemption.PREEMPTED_EXIT_CODE`; not imported: that loads
# TensorFlow, which the launcher never does).
PREEMPTED_EXIT_CODE = 143


@dataclasses.dataclass(frozen=True)
class WorkerFailure:
    """A worker that exited non-zero or was killed; every other was stopped.

    Attributes:
        index: its worker index (TF_CONFIG's task index) in that launch.
        slot: its slot.
        code: its exit status as `subprocess` reports it (< 0: killed by
            that signal).
        seconds: time from the launch of the workers to the failure.
    """

    index: int
    slot: int
    code: int
    seconds: float

    @property
    def preempted(self):
        """Whether the worker exited after saving the step every worker
        agreed on, on a SIGTERM (`tfscale.preemption`)."""
        return self.code == PREEMPTED_EXIT_CODE

    @property
    def exit_code(self):
        """The launcher's exit code for this failure."""
        return self.code if self.code > 0 else 1

    def describe(self):
        """`worker 1 was killed by SIGKILL`, naming the slot if it differs."""
        who = f"worker {self.index}"
        if self.slot != self.index:
            who += f" (slot {self.slot})"
        if self.code < 0:
            try:
                how = f"was killed by {signal.Signals(-self.code).name}"
            except ValueError:
                how = f"was killed by signal {-self.code}"
        elif self.preempted:
            how = (f"was preempted (exit code {self.code}: a SIGTERM, after "
                   "every worker saved the same step)")
        else:
            how = f"exited with code {self.code}"
        return f"{who} {how}"


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the launcher does after a failure, and the sentence saying so."""

    restart: bool
    dropped_slot: int | None
    message: str


def check_restart_options(num_workers, max_restarts, min_workers, restart_window):
    """The reason the restart options are inconsistent, or None."""
    if max_restarts < 0:
        return f"--max_restarts={max_restarts}: must be >= 0"
    if restart_window < 0:
        return f"--restart_window={restart_window:g}: must be >= 0 seconds"
    if min_workers is None:
        return None
    if not 1 <= min_workers <= num_workers:
        return (f"--min_workers={min_workers}: must be between 1 and "
                f"--num_workers={num_workers}")
    if min_workers < num_workers and max_restarts == 0:
        return (f"--min_workers={min_workers} drops worker slots only when "
                "relaunching them: give --max_restarts >= 1 as well")
    return None


class RestartPolicy:
    """Counts restarts and decides each one (see the module docstring).

    Args:
        num_workers: workers of the first launch (slots 0 .. num_workers - 1).
        max_restarts: relaunches allowed in the whole run.
        min_workers: fewest slots the job may shrink to; None: num_workers.
        restart_window: seconds after a relaunch within which a slot that
            had failed before and fails again is dropped.
    """

    def __init__(self, num_workers, max_restarts=0, min_workers=None,
                 restart_window=DEFAULT_RESTART_WINDOW):
        problem = check_restart_options(
            num_workers, max_restarts, min_workers, restart_window)
        if problem:
            raise ValueError(problem)
        self.slots = list(range(num_workers))
        self.max_restarts = max_restarts
        self.min_workers = num_workers if min_workers is None else min_workers
        self._shrinks = self.min_workers < num_workers
        self.restart_window = restart_window
        self.restarts = 0  # relaunches so far: TFSCALE_RESTART_COUNT
        self._failed = set()  # slots that have failed at least once

    def after_failure(self, failure):
        """The `Decision` after `failure`; updates `slots` and `restarts`."""
        head = f"{failure.describe()}; stopped the other workers"
        failed_before = failure.slot in self._failed
        if not failure.preempted:  # a preempted machine is not a broken one
            self._failed.add(failure.slot)
        if self.restarts >= self.max_restarts:
            if self.max_restarts == 0:
                return Decision(False, None, head + ".")
            return Decision(False, None, f"{head}; no restart left "
                            f"(--max_restarts={self.max_restarts}).")
        again = (self._shrinks and self.restarts > 0 and failed_before
                 and not failure.preempted
                 and failure.seconds < self.restart_window)
        why = (f"failed again {failure.seconds:.3g} s after restart "
               f"{self.restarts}")
        self.restarts += 1
        restart = (f"restart {self.restarts} of {self.max_restarts} on fresh "
                   "ports.")
        if again and len(self.slots) > self.min_workers:
            self.slots.remove(failure.slot)
            return Decision(True, failure.slot, (
                f"{head}; dropping worker slot {failure.slot} ({why}); "
                f"continuing with {len(self.slots)} workers: {restart}"))
        if again:
            return Decision(True, None, (
                f"{head}; worker slot {failure.slot} {why}, but "
                f"--min_workers={self.min_workers} keeps it; {restart}"))
        return Decision(True, None, f"{head}; {restart}")
