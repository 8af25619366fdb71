"""Pure helpers of tfscale-bench: sizes, rates, statistics, checks, tables,
the cluster's description.

No TensorFlow here: the bench's launching process and the tests use these
without starting a runtime.

Definitions (as nccl-tests defines them, PERFORMANCE.md there):

- algbw = bytes / seconds: the buffer size over the time of one all-reduce.
- busbw = algbw * 2(n-1)/n on n workers: what each worker's link must carry
  for a bandwidth-optimal all-reduce, so that busbw is comparable to a link's
  rate whatever n is.

The link bound of an all-reduce across m nodes over rate-limited links (each
node's link carries R bytes/second in each direction): every node must end
with a sum that depends on the other nodes' S-byte partial sums, and must
deliver its own. For m = 2: node B's result cannot be computed without S bytes
of information from node A (A's partial sum can be any S-byte value), and
vice versa; the two directions run concurrently, each at R, so no algorithm
finishes before S / R. For m nodes the bandwidth-optimal bound is
2(m-1)/m * S / R per node link (Patarasuk and Yuan 2009, "Bandwidth optimal
all-reduce algorithms for clusters of workstations"), which is S / R at
m = 2. S counts the bytes on the wire (half the float32 bytes with 16-bit
compression). Ethernet/IP/TCP headers and gRPC framing also cross the link
and are not in S: even a perfect algorithm stays a few percent above it.
"""

import math
import re
import statistics

import numpy as np

from tfscale import _atomic

_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 1024, "K": 1024, "KIB": 1024,
    "MB": 1024**2, "M": 1024**2, "MIB": 1024**2,
    "GB": 1024**3, "G": 1024**3, "GIB": 1024**3,
}


def parse_size(text):
    """`"64KB"` -> 65536 (KB, MB, GB are powers of 1024, as in nccl-tests)."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(
            "A size must be an integer with an optional unit B, KB, MB or GB "
            f"(powers of 1024), e.g. 64KB. Received: {text!r}"
        )
    return int(match.group(1)) * _SIZE_UNITS[unit]


def parse_sizes(texts, element_bytes=4):
    """Sizes in bytes, each a positive multiple of `element_bytes`."""
    sizes = []
    for text in texts:
        size = parse_size(text)
        if size <= 0 or size % element_bytes:
            raise ValueError(
                f"A size must be a positive multiple of {element_bytes} bytes "
                f"(one float32). Received: {text!r} = {size} bytes"
            )
        sizes.append(size)
    return sizes


# tc(8): "bit" or a bare number is bits per second; "bps" is BYTES per second.
_RATE_UNITS = {
    "": 1 / 8, "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
    "tbit": 1e12 / 8, "kibit": 1024 / 8, "mibit": 1024**2 / 8,
    "gibit": 1024**3 / 8, "tibit": 1024**4 / 8,
    "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
    "kibps": 1024, "mibps": 1024**2, "gibps": 1024**3, "tibps": 1024**4,
}


def parse_rate(text):
    """A tc rate (`"200mbit"`) in bytes per second (25e6), as tc reads it."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _RATE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            "A rate must be a positive number with a tc unit (bit, kbit, mbit, "
            "gbit, or bps, kbps, mbps, gbps for bytes per second), e.g. "
            f"200mbit. Received: {text!r}"
        )
    return float(match.group(1)) * _RATE_UNITS[unit]


def node_sizes(num_workers, local_size=None, emulate_nodes=None):
    """Workers per node, as tfscale groups them for the bench's launch.

    `local_size` cuts consecutive workers into nodes of that size (the last
    one smaller); otherwise `emulate_nodes` nodes of equal size; otherwise
    every worker is on 127.0.0.1: one node.
    """
    if local_size:
        return [
            min(local_size, num_workers - start)
            for start in range(0, num_workers, local_size)
        ]
    if emulate_nodes:
        return [num_workers // emulate_nodes] * emulate_nodes
    return [num_workers]


def describe_cluster(context):
    """One line on the workers, their nodes and the link between the nodes.

    Args:
        context: num_workers, node_sizes, emulate_nodes, inter_node_rate and
            link_rate (bytes/second or None), as every row records them.
    """
    nodes = context["node_sizes"]
    shape = (f"{len(nodes)} node(s) of {nodes[0]}" if len(set(nodes)) == 1
             else f"nodes of sizes {nodes}")
    if context.get("emulate_nodes"):
        rate = context.get("inter_node_rate")
        link = (f"emulated nodes (network namespaces), inter-node link tbf "
                f"{rate} = {context['link_rate'] / 1e6:.1f} MB/s per direction"
                if rate else "emulated nodes, inter-node link not rate limited")
    else:
        link = "loopback (127.0.0.1), no rate limit"
    return f"{context['num_workers']} workers in {shape}; {link}"


def bus_factor(num_workers):
    """busbw / algbw for an all-reduce on `num_workers` workers: 2(n-1)/n."""
    return 2 * (num_workers - 1) / num_workers if num_workers > 1 else 1.0


def link_bound_seconds(wire_bytes, num_nodes, rate_bytes_per_second):
    """Least time to all-reduce `wire_bytes` across rate-limited node links.

    See the module docstring: 2(m-1)/m * S / R, S / R for two nodes. None
    when there is no rate-limited link (one node, or no rate).
    """
    if num_nodes < 2 or not rate_bytes_per_second:
        return None
    return 2 * (num_nodes - 1) / num_nodes * wire_bytes / rate_bytes_per_second


def median_of_max(times_by_worker):
    """Median over repeats of the slowest worker's time in each repeat.

    Args:
        times_by_worker: one list of seconds per worker, one entry per repeat
            (an all-reduce is done when the last worker has its result).

    Returns:
        `(median, per_repeat)` with per_repeat the list of maxima.
    """
    counts = {len(t) for t in times_by_worker}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(
            "Every worker must report the same, non-zero number of repeats. "
            f"Received: {[len(t) for t in times_by_worker]} repeats"
        )
    per_repeat = [max(values) for values in zip(*times_by_worker)]
    return statistics.median(per_repeat), per_repeat


def integer_inputs(shapes, rank):
    """Integer-valued float32 arrays for worker `rank`: exact sums expected.

    Values are in -4..4 and differ between ranks, so a result that is not the
    sum over all workers (a local copy, a missing or doubled contribution)
    differs from `expected_sum`. Sums over up to 32 workers stay within
    -128..128, integers that float32, bfloat16 and float16 hold exactly, and
    so do all partial sums: compressed all-reduces must be exact too.
    """
    arrays = []
    for index, shape in enumerate(shapes):
        count = int(np.prod(shape, dtype=np.int64))
        values = (np.arange(count, dtype=np.int64) + 7 * index + 3 * rank) % 9 - 4
        arrays.append(values.astype(np.float32).reshape(shape))
    return arrays


def expected_sum(shapes, num_workers):
    """The exact element-wise sum of `integer_inputs` over all ranks."""
    if num_workers > 32:
        raise ValueError(
            "integer_inputs is exact in 16 bits for at most 32 workers. "
            f"Received: num_workers={num_workers}"
        )
    totals = None
    for rank in range(num_workers):
        inputs = integer_inputs(shapes, rank)
        totals = inputs if totals is None else [t + x for t, x in zip(totals, inputs)]
    return totals


def count_wrong(results, expected):
    """Number of elements of `results` that differ from `expected` (#wrong).

    Shapes must match; a missing or extra tensor, or a shape mismatch, counts
    every element of the tensor concerned as wrong.
    """
    results, expected = list(results), list(expected)
    common = min(len(results), len(expected))
    wrong = sum(int(np.size(x)) for x in results[common:] + expected[common:])
    for result, want in zip(results, expected):
        result, want = np.asarray(result), np.asarray(want)
        if result.shape != want.shape:
            wrong += max(result.size, want.size)
        else:
            wrong += int(np.count_nonzero(result != want))
    return int(wrong)


def human_bytes(size):
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= scale:
            value = size / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{size} B"


def format_table(headers, rows, align=None):
    """A plain text table, columns right-aligned unless `align` says "<"."""
    cells = [[str(c) for c in headers]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or [">"] * len(headers)
    lines = []
    for index, row in enumerate(cells):
        line = "  ".join(f"{c:{a}{w}}" for c, a, w in zip(row, align, widths))
        lines.append(line.rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value):
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def write_json(value, path):
    """Writes `value` as JSON to `path`, creating its directory; a reader
    sees the old file or the whole new one."""
    _atomic.write_json(path, value, indent=1)
