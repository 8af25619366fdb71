"""tfscale-bench allreduce: worker measurements -> rows, table and JSON.

A row is one (input set, case): an all-reduce of `bytes` float32 bytes in
`num_tensors` tensors by one algorithm, timed as the median over repeats of
the slowest worker. Every row carries the fields in `REQUIRED_FIELDS`.
"""

import collections
from tfscale.launch.bench import cluster
from tfscale.launch.bench import stats

# Fields every JSON row has (bytes/second for the bandwidths).
REQUIRED_FIELDS = (
    "algorithm", "label", "compression", "bytes", "wire_bytes", "count",
    "num_tensors", "seconds", "algbw", "busbw", "repeat_seconds",
    "num_workers", "local_size", "node_sizes", "wrong",
)


class WrongResultError(RuntimeError):
    """An all-reduce did not return the exact sum."""


def check_results(worker_outputs):
    """Raises WrongResultError naming every case a worker got wrong."""
    problems = []
    for output in worker_outputs:
        for row in output["rows"]:
            if row["wrong"]:
                problems.append(
                    f"{row['label']} on {row['inputs']}: {row['wrong']} element(s) "
                    f"differ from the exact sum on worker {output['rank']}"
                )
    if problems:
        raise WrongResultError(
            "All-reduce results are wrong, so nothing was timed for them:\n  "
            + "\n  ".join(problems)
        )


def summarize(rounds, input_sets, context):
    """Rows from the worker outputs of every launch.

    Args:
        rounds: a list over launches of lists of per-worker outputs (what
            `allreduce_worker.measure` returns), all on the same cluster.
        input_sets: `[(name, shapes)]` as given to the workers.
        context: fields shared by all rows: num_workers, local_size,
            node_sizes, mode, model, emulate_nodes, inter_node_rate,
            link_rate (bytes/second or None).

    Returns:
        A list of row dicts, in input-set order, stock first.
    """
    per_case = collections.OrderedDict()
    for outputs in rounds:
        check_results(outputs)
        by_key = collections.defaultdict(list)
        for output in sorted(outputs, key=lambda o: o["rank"]):
            for row in output["rows"]:
                by_key[(row["inputs"], row["label"])].append(row)
        for key, rows in by_key.items():
            if len(rows) != len(outputs):
                raise RuntimeError(f"Only {len(rows)} of {len(outputs)} workers measured {key}.")
            _, maxima = stats.median_of_max([r["repeat_seconds"] for r in rows])
            entry = per_case.setdefault(key, {"row": rows[0], "repeats": []})
            entry["repeats"].extend(maxima)
    order = {name: i for i, (name, _) in enumerate(input_sets)}
    shapes_of = dict((name, shapes) for name, shapes in input_sets)
    keys = sorted(per_case, key=lambda k: (order[k[0]], per_case[k]["row"]["side"] != cluster.STOCK))
    rows = []
    for key in keys:
        rows.append(_row(per_case[key]["row"], per_case[key]["repeats"],
                         shapes_of[key[0]], context))
    _add_ratios(rows)
    return rows


def _row(worker_row, repeats, shapes, context):
    import statistics

    count = sum(_num_elements(s) for s in shapes)
    size = 4 * count
    compressed = worker_row.get("compression") is not None
    wire_bytes = size // 2 if compressed else size
    seconds = statistics.median(repeats)
    n = context["num_workers"]
    algbw = size / seconds
    row = {
        "inputs": worker_row["inputs"],
        "side": worker_row["side"],
        "algorithm": worker_row["algorithm"],
        "label": worker_row["label"],
        "compression": worker_row.get("compression"),
        "bytes": size,
        "wire_bytes": wire_bytes,
        "count": count,
        "num_tensors": len(shapes),
        "seconds": seconds,
        "algbw": algbw,
        "busbw": algbw * stats.bus_factor(n),
        "repeat_seconds": repeats,
        "wrong": 0,
    }
    for name in ("bytes_per_pack", "fusion_threshold_bytes", "plan", "implementation"):
        if name in worker_row:
            row[name] = worker_row[name]
    plan = worker_row.get("plan")
    if plan and len(plan) == 1:
        row["num_chunks"] = plan[0][2]
        row["plan_algorithm"] = plan[0][0]
    row.update(context)
    bound = stats.link_bound_seconds(
        wire_bytes, len(context["node_sizes"]), context.get("link_rate"))
    row["link_bound_seconds"] = bound
    row["x_link_bound"] = seconds / bound if bound else None
    return row


def _add_ratios(rows):
    """`vs_stock`: seconds / the stock (one pack) seconds on the same inputs."""
    stock = {r["inputs"]: r["seconds"] for r in rows
             if r["side"] == cluster.STOCK and not r.get("bytes_per_pack")}
    for row in rows:
        base = stock.get(row["inputs"])
        row["vs_stock"] = row["seconds"] / base if base else None


def _num_elements(shape):
    count = 1
    for dim in shape:
        count *= dim
    return count


def table(rows):
    """The nccl-tests-like table of `rows`."""
    with_bound = any(r.get("link_bound_seconds") for r in rows)
    headers = ["size (B)", "count", "tensors", "algorithm", "wire", "time (ms)",
               "algbw (MB/s)", "busbw (MB/s)"]
    if with_bound:
        headers += ["link bound (ms)", "x bound"]
    headers += ["vs stock", "#wrong"]
    lines = []
    for r in rows:
        wire = r["compression"] or "float32"
        line = [r["bytes"], r["count"], r["num_tensors"], r["label"], wire,
                r["seconds"] * 1e3, r["algbw"] / 1e6, r["busbw"] / 1e6]
        if with_bound:
            bound = r.get("link_bound_seconds")
            line += [bound * 1e3 if bound else None, r.get("x_link_bound")]
        line += [r.get("vs_stock"), r["wrong"]]
        lines.append(line)
    align = [">", ">", ">", "<", "<"] + [">"] * (len(headers) - 5)
    return stats.format_table(headers, lines, align)


def header(context, repeats, warmup, rounds):
    """The lines printed above the table: what ran, on what."""
    lines = [
        f"# tfscale-bench allreduce: {stats.describe_cluster(context)}",
        f"# float32 inputs, sum; median over {repeats * rounds} repeat(s) "
        f"({rounds} launch(es) x {repeats}) of the slowest worker, after {warmup} "
        "warm-up call(s); each result checked against the exact sum",
        "# algbw = bytes / time; busbw = algbw * 2(n-1)/n; MB = 1e6 bytes; "
        "vs stock = time / stock (one pack) time on the same inputs",
    ]
    nodes = context["node_sizes"]
    if context.get("link_rate") and len(nodes) > 1:
        lines.append(
            "# link bound = bytes on the wire that must cross each node's link "
            f"(2(m-1)/m x wire bytes, m = {len(nodes)} nodes) / link rate")
    return "\n".join(lines)


def write_json(rows, path):
    """Writes rows (a list of dicts) to `path` once each has `REQUIRED_FIELDS`."""
    for row in rows:
        missing = [f for f in REQUIRED_FIELDS if f not in row]
        if missing:
            raise ValueError(f"Row {row.get('label')!r} lacks fields {missing}.")
    stats.write_json(rows, path)
