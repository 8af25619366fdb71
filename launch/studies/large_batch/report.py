"""The report: one table of the rows at their best learning rate, the
paper's claims tested against it, and the page that keeps both."""

import os
import statistics

from tfscale.launch.studies.large_batch import rows as study_rows

BEGIN, END = "<!-- results -->", "<!-- /results -->"


def best(records):
    """{row id: (learning rate, [its records])}: per row, the learning rate
    of the grid with the highest mean final test accuracy over seeds."""
    by_rate = {}
    for record in records:
        by_rate.setdefault(record["row"], {}).setdefault(
            record["learning_rate"], []).append(record)
    return {row: max(rates.items(),
                     key=lambda item: mean(r["final_accuracy"] for r in item[1]))
            for row, rates in by_rate.items()}


def mean(values):
    return statistics.fmean(list(values))


def spread(values):
    values = list(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return (f"{mean(values):.2f} ± {std:.2f} "
            f"({min(values):.2f}-{max(values):.2f})")


def table(rows, records):
    """Markdown table lines: each row at its best learning rate."""
    chosen = best(records)
    baseline = chosen.get(f"sgd@{study_rows.BASELINE_BATCH}")
    lines = ["| row | batch | grid (peak rates) | best | test accuracy % "
             "(mean ± std, min-max) | vs baseline | updates | s per run |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.id not in chosen:
            continue
        _, group = chosen[row.id]
        finals = [r["final_accuracy"] for r in group]
        peaks = sorted({r["peak_learning_rate"] for r in records
                        if r["row"] == row.id})
        delta = ("" if baseline is None or row.id == baseline[1][0]["row"] else
                 f"{mean(finals) - mean(r['final_accuracy'] for r in baseline[1]):+.2f}")
        batch = (f"{row.first_batch}→{row.batch}"
                 if row.first_batch != row.batch else str(row.batch))
        lines.append(
            f"| {row.label} | {batch} | {', '.join(f'{p:g}' for p in peaks)} "
            f"| {group[0]['peak_learning_rate']:g} | {spread(finals)} | {delta} "
            f"| {group[0]['updates']} | {mean(r['seconds'] for r in group):.0f} |")
    return lines


def targets(records):
    """Lines testing the claims the study was set (issue's targets), from
    the measured means; a claim whose rows did not run is skipped."""
    chosen = best(records)

    def accuracy(row_id):
        if row_id not in chosen:
            return None
        return mean(r["final_accuracy"] for r in chosen[row_id][1])

    base = accuracy(f"sgd@{study_rows.BASELINE_BATCH}")
    lars, sgd = accuracy("lars@8192"), accuracy("sgd@8192")
    mixed = accuracy("lars@8192:mixed_bfloat16")
    naive = accuracy("lars_half@8192:bfloat16")
    lines = []

    def verdict(ok):
        return "holds" if ok else "does not hold"

    if None not in (base, lars, sgd):
        ok = lars >= base - 1.0 and (base - sgd) > (base - lars)
        lines.append(
            f"- LARS at 8192 within 1 point of the batch-128 baseline, linear "
            f"scaling losing more: LARS {lars - base:+.2f} points, linear "
            f"scaling {sgd - base:+.2f}: {verdict(ok)}.")
    if None not in (lars, mixed):
        lines.append(
            f"- Mixed precision (bfloat16, LARS's update in float32) within "
            f"0.3 points of float32 at 8192: {mixed - lars:+.2f}: "
            f"{verdict(abs(mixed - lars) <= 0.3)}.")
    if None not in (mixed, naive):
        lines.append(
            f"- The naive bfloat16 LARS update visibly worse than the float32 "
            f"update path: {naive - mixed:+.2f} points against mixed "
            f"precision: {verdict(naive < mixed - 1.0)} (visibly: more than "
            "1 point).")
    return lines


def write_page(path, command, machine, lines, plot_path):
    """Rewrites the results part of the page at `path` (between its
    markers), keeping the rest; a page without markers gets them at its end."""
    plot = os.path.relpath(plot_path, os.path.dirname(path) or ".") if plot_path else None
    body = [BEGIN, "", f"Command: `{command}`", "", machine, "", *lines, ""]
    if plot:
        body += [f"![test accuracy against batch size]({plot})", ""]
    body.append(END)
    text = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
    else:
        head, tail = (text + "\n" if text else ""), "\n"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(head + "\n".join(body) + tail)
    os.replace(partial, path)
