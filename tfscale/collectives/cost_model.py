"""Alpha-beta cost model of the all-reduce algorithms.

Sending a message of b bytes over a link takes `alpha + b * beta`: alpha is
the per-message latency (seconds), beta the inverse bandwidth (seconds per
byte). Two link classes: `intra` between workers of one node, `inter`
between nodes. For a buffer of S bytes on m nodes of k workers (n = m k):

| algorithm | stages (each a sum of steps) |
|---|---|
| ring | 2(n-1) x (alpha_e + S/n beta_e): every step crosses the slowest link |
| hierarchical | 2(k-1) x (alpha_i + S/k beta_i) in the node; 2(m-1) x (alpha_e + S/m beta_e) among leaders; ceil(log2 k) x (alpha_i + S beta_i) broadcast (a tree) |
| 2d | 2(k-1) x (alpha_i + S/k beta_i); 2(m-1) x (alpha_e + S/m beta_e) (k rings of S/k share the node's link); (k-1) x (alpha_i + S/k beta_i) all-gather |
| halving_doubling | for s < log2 p': 2 x (alpha + S/2^(s+1) beta), on the link step s crosses; plus 2 x (alpha + S beta) for the fold when p != p' |

(`_e` is `inter` when m > 1, else `intra`.) Each stage is one collective
op, and each op also costs `op_seconds` whatever its size (halving_doubling:
one op per pairwise step): with TensorFlow's collectives that fixed cost,
not link latency, decides small buffers (BENCHMARKS.md, section "The
fixed cost of one collective").
For halving_doubling, p' is the
largest power of two <= n and nodes are taken to hold consecutive ranks: a
step whose pairs all stay inside nodes uses `intra`, one where c workers of a
node exchange with other nodes moves c x the step's bytes over that node's
`inter` link. On one link class this is MPICH's cost of the algorithm
(pmodels/mpich, allreduce_intra_reduce_scatter_allgather.c):
2 log2(p') alpha + 2 (p'-1)/p' S beta, plus 2 (alpha + S beta) with a fold. Split into c chunks whose stages
overlap (`algorithms`), a pipeline takes the sum of one chunk's stages plus
(c - 1) times its slowest stage. Contention for CPU cores and memory
bandwidth is not modelled: on a machine where workers share the cores the
stages of a pipeline overlap less than predicted.

`fit` estimates the four link parameters and `op_seconds` from measured
times; `DEFAULT` is a starting point, not a measurement of your cluster.
"""

import collections
import dataclasses
import json
import functools
import math

import numpy as np

from tfscale._validation import is_int
from tfscale._validation import is_number
from tfscale.collectives import topology as topology_lib
from tfscale.communication_names import BUFFER_ALGORITHMS

# Chunk counts the pipelined algorithms choose from.
CHUNK_CHOICES = (1, 2, 4, 8, 16, 32)
# The hybrid threshold is searched up to this size.
_MAX_SEARCH_BYTES = 2**40


@dataclasses.dataclass(frozen=True)
class Link:
    """One link class.

    Attributes:
        alpha: latency of one message, in seconds.
        beta: time per byte, in seconds (1 / bandwidth in bytes per second).
    """

    alpha: float
    beta: float

    def __post_init__(self):
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not is_number(value) or not 0 <= value < math.inf:
                raise ValueError(
                    f"Argument `{name}` must be a finite number >= 0 (seconds"
                    f"{'' if name == 'alpha' else ' per byte'}). "
                    f"Received: {name}={value!r}"
                )

    def steps(self, count, step_bytes):
        """Time of `count` sequential messages of `step_bytes` each."""
        return count * (self.alpha + step_bytes * self.beta)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Predicts all-reduce times from two alpha-beta link classes.

    Attributes:
        intra: `Link` between workers of one node.
        inter: `Link` between nodes.
        op_seconds: the fixed cost of one collective op, whatever its size
            (TensorFlow's collective executor, instance resolution, the
            op's own scheduling): paid once per stage of each chunk, and
            once per pairwise step of halving-doubling.
    """

    intra: Link
    inter: Link
    op_seconds: float = 0.0

    def __post_init__(self):
        if not is_number(self.op_seconds) or not 0 <= self.op_seconds < math.inf:
            raise ValueError(
                "Argument `op_seconds` must be a finite number >= 0 (seconds). "
                f"Received: op_seconds={self.op_seconds!r}")

    def stage_times(self, algorithm, size_bytes, node_sizes):
        """Times of the stages one buffer goes through, in order.

        Args:
            algorithm: one of `BUFFER_ALGORITHMS`.
            size_bytes: bytes of the buffer.
            node_sizes: number of workers in each node. With one node, or one
                worker per node, the hierarchical algorithms run as a ring
                (as `tfscale.collectives` does).

        Returns:
            A list of seconds, one per stage.
        """
        _check_algorithm(algorithm)
        sizes = _check_node_sizes(node_sizes)
        n, m, k = sum(sizes), len(sizes), max(sizes)
        slow = self.inter if m > 1 else self.intra
        if algorithm == "halving_doubling":
            # One stage: each step needs the previous one's sum.
            return [self._halving_doubling_seconds(size_bytes, sizes)]
        if algorithm == "ring" or m == 1 or m == n:
            return [self.op_seconds + slow.steps(2 * (n - 1), size_bytes / n)]
        if algorithm == "hierarchical":
            return [
                self.op_seconds + self.intra.steps(2 * (k - 1), size_bytes / k),
                self.op_seconds + self.inter.steps(2 * (m - 1), size_bytes / m),
                self.op_seconds + self.intra.steps(math.ceil(math.log2(k)), size_bytes),
            ]
        if len(set(sizes)) > 1:
            raise ValueError(
                "The 2d algorithm needs nodes of equal size. "
                f"Received: node_sizes={list(sizes)}"
            )
        return [
            self.op_seconds + self.intra.steps(2 * (k - 1), size_bytes / k),
            self.op_seconds + self.inter.steps(2 * (m - 1), size_bytes / m),
            self.op_seconds + self.intra.steps(k - 1, size_bytes / k),
        ]

    def _halving_doubling_seconds(self, size_bytes, node_sizes):
        folds, steps = _halving_doubling_crossings(node_sizes)
        # (workers of one node sending to other nodes, bytes each) per message
        # step: the fold in and out, then each halving step and its doubling
        # mirror image.
        messages = [(c, size_bytes) for c in folds]
        for s, crossing in enumerate(steps):
            messages += [(crossing, size_bytes / 2 ** (s + 1))] * 2
        total = len(messages) * self.op_seconds  # one op per pairwise step
        for crossing, step_bytes in messages:
            if crossing:
                total += self.inter.steps(1, crossing * step_bytes)
            else:
                total += self.intra.steps(1, step_bytes)
        return total

    def predict(self, algorithm, size_bytes, node_sizes, num_chunks=None):
        """Predicted seconds to all-reduce one buffer.

        Args:
            algorithm: one of `BUFFER_ALGORITHMS`.
            size_bytes: bytes of the buffer.
            node_sizes: number of workers in each node.
            num_chunks: chunks pipelined through the stages; `None`: the best
                of `CHUNK_CHOICES` (`best_num_chunks`).
        """
        if num_chunks is None:
            num_chunks = self.best_num_chunks(algorithm, size_bytes, node_sizes)
        stages = self.stage_times(algorithm, size_bytes / num_chunks, node_sizes)
        if len(stages) == 1:
            # One stage has nothing to overlap with: chunks run one by one.
            return num_chunks * stages[0]
        return sum(stages) + (num_chunks - 1) * max(stages)

    def best_num_chunks(self, algorithm, size_bytes, node_sizes):
        """The chunk count in `CHUNK_CHOICES` with the lowest predicted time.

        Always 1 for a single-stage algorithm (the ring), and for buffers too
        small to split into chunks of at least one 4-byte element.
        """
        if len(self.stage_times(algorithm, size_bytes, node_sizes)) == 1:
            return 1
        choices = [c for c in CHUNK_CHOICES if c * 4 <= size_bytes] or [1]
        return min(
            choices, key=lambda c: self.predict(algorithm, size_bytes, node_sizes, c)
        )

    def hybrid_threshold_bytes(self, node_sizes):
        """The buffer size at which a ring becomes faster than hierarchical.

        Hybrid all-reduce uses hierarchical below it and the ring at or above.

        Returns:
            An int number of bytes; 0 if the ring is predicted at least as
            fast at every size (as with one node), `math.inf` if
            hierarchical is predicted faster at every size up to 1 TiB.
        """

        def ring_wins(size):
            return self.predict("ring", size, node_sizes) <= self.predict(
                "hierarchical", size, node_sizes
            )

        if ring_wins(1):
            return 0
        below = 1
        while below < _MAX_SEARCH_BYTES:
            above = below * 2
            if ring_wins(above):
                while above - below > 1:  # bisect to the byte
                    middle = (below + above) // 2
                    below, above = (below, middle) if ring_wins(middle) else (middle, above)
                return above
            below = above
        return math.inf

    def get_config(self):
        return {
            "intra": dataclasses.asdict(self.intra),
            "inter": dataclasses.asdict(self.inter),
            "op_seconds": self.op_seconds,
        }

    @classmethod
    def from_config(cls, config):
        """The model of `get_config`; a config without `op_seconds` (fitted
        before it existed) gets 0."""
        return cls(intra=Link(**config["intra"]), inter=Link(**config["inter"]),
                   op_seconds=config.get("op_seconds", 0.0))


# A starting point until `fit` has measurements of your cluster: TensorFlow's
# gRPC collectives (about 100 us per message even on one host), memory-speed
# copies inside a node and 10 Gbit/s Ethernet between nodes; and the fixed
# cost of a collective op, of the order of one CollectiveReduceV2 of 4 bytes
# as `tfscale-bench fixedcost` measures it (BENCHMARKS.md, section "The
# fixed cost of one collective").
DEFAULT = CostModel(
    intra=Link(alpha=100e-6, beta=1 / 4e9),
    inter=Link(alpha=150e-6, beta=1 / 1.25e9),
    op_seconds=1.0e-3,
)


def load(path):
    """The `CostModel` in the JSON file `path`: its `get_config()`, or the
    fit `tfscale-bench project --fitted_output` writes (which nests it under
    "cost_model"). Raises ValueError naming the file when it holds neither."""
    try:
        with open(path) as f:
            config = json.load(f)
        config = config.get("cost_model", config)
        return CostModel.from_config(config)
    except FileNotFoundError:
        raise ValueError(f"Cost model file {path!r} does not exist.") from None
    except OSError as error:
        raise ValueError(f"Cost model file {path!r} cannot be read: {error}.") from None
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise ValueError(
            f"Cost model file {path!r} holds no cost model ({type(error).__name__}: "
            f"{error}). Expected the JSON of `CostModel.get_config()` or of "
            "`tfscale-bench project --fitted_output`.") from None


def fit(measurements, node_sizes, prior=DEFAULT):
    """Fits alpha and beta of both link classes, and `op_seconds`, to
    measured times.

    Least squares on relative errors (times span microseconds to seconds),
    with every parameter kept >= 0. A parameter that no measurement depends on
    (the `inter` link when all measurements ran on one node) keeps its value
    from `prior`.

    Args:
        measurements: rows `(algorithm, size_bytes, seconds)` or
            `(algorithm, size_bytes, seconds, num_chunks)` (default 1 chunk),
            all measured on one topology, e.g. by `tfscale-bench`.
        node_sizes: number of workers in each node of that topology.
        prior: `CostModel` to start from.

    Returns:
        A fitted `CostModel`.
    """
    from scipy import optimize  # scikit-learn's dependency; only fit needs it

    rows = []
    for row in measurements:
        if len(row) not in (3, 4):
            raise ValueError(
                "Argument `measurements` must hold rows (algorithm, size_bytes, "
                f"seconds[, num_chunks]). Received: a row {row!r}"
            )
        algorithm, size, seconds = row[:3]
        num_chunks = row[3] if len(row) == 4 else 1
        _check_algorithm(algorithm)
        if not seconds > 0 or not size > 0:
            raise ValueError(
                "Argument `measurements` must hold positive sizes and times. "
                f"Received: a row {row!r}"
            )
        rows.append((algorithm, float(size), float(seconds), int(num_chunks)))
    if not rows:
        raise ValueError("Argument `measurements` must not be empty. Received: []")
    _check_node_sizes(node_sizes)
    # Unknowns relative to the prior keep the problem well scaled; a prior of
    # 0 is replaced by a tiny scale so that the parameter can still move.
    scale = np.array([
        prior.intra.alpha, prior.intra.beta, prior.inter.alpha, prior.inter.beta,
        prior.op_seconds,
    ])
    scale = np.where(scale > 0, scale, [1e-6, 1e-10, 1e-6, 1e-10, 1e-6])

    def model_of(x):
        p = [float(v) for v in x * scale]
        return CostModel(Link(p[0], p[1]), Link(p[2], p[3]), p[4])

    def predictions(model):
        return [model.predict(a, s, node_sizes, c) for a, s, _, c in rows]

    times = [t for _, _, t, _ in rows]

    # Only the parameters some measurement depends on move (one node never
    # uses the `inter` link); the rest keep the prior's values.
    start = predictions(model_of(np.ones(5)))
    free = [predictions(model_of(np.where(np.arange(5) == j, 2.0, 1.0))) != start
            for j in range(5)]

    def full(x_free):
        x = np.ones(5)
        x[np.array(free)] = x_free
        return x

    def residuals(x_free):
        return [p / t - 1.0 for p, t in zip(predictions(model_of(full(x_free))), times)]

    result = optimize.least_squares(
        residuals, np.ones(sum(free)), bounds=(0.0, np.inf), x_scale=1.0, diff_step=1e-6,
        xtol=1e-12, ftol=1e-12, gtol=1e-12,
    )
    return model_of(full(result.x))


@functools.lru_cache(maxsize=64)
def _halving_doubling_crossings(node_sizes):
    """How many workers of one node (the most in any node) send to another
    node: `(folds, steps)`, folds `(in, out)` (empty on a power of two),
    steps one count per halving step; 0: every message stays in its node.
    Nodes hold consecutive ranks."""
    node_of = [i for i, size in enumerate(node_sizes) for _ in range(size)]
    schedule = topology_lib.halving_doubling(len(node_of))

    def crossing(messages):
        senders = collections.Counter(
            node_of[source] for source, dest in messages
            if node_of[source] != node_of[dest])
        return max(senders.values(), default=0)

    folds = ()
    if schedule.folds:
        folds = (crossing(schedule.folds),
                 crossing([(p, e) for e, p in schedule.folds]))
    steps = tuple(
        crossing([*step, *((b, a) for a, b in step)]) for step in schedule.steps)
    return folds, steps


def _check_algorithm(algorithm):
    if algorithm not in BUFFER_ALGORITHMS:
        raise ValueError(
            f"Argument `algorithm` must be one of {list(BUFFER_ALGORITHMS)}. "
            f"Received: algorithm={algorithm!r}"
        )


def _check_node_sizes(node_sizes):
    sizes = tuple(node_sizes)
    if not sizes or any(
not is_int(s) or s < 1 for s in sizes
    ):
        raise ValueError(
            "Argument `node_sizes` must be a non-empty list of integers >= 1. "
            f"Received: node_sizes={node_sizes!r}"
        )
    return sizes
