"""PNG plots of tfscale-bench results (matplotlib, no display needed)."""

from tfscale import _requirements

matplotlib = _requirements.import_extra("matplotlib", "plots", "tfscale-bench --plot")
matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402  (after choosing the backend)

_FIGURE_SIZE = (7, 4.5)


def busbw_vs_size(rows, path, title):
    """busbw (MB/s) against bytes, one line per algorithm label; a dashed
    line at the link rate's bus bandwidth where a link rate is known."""
    figure, axes = plt.subplots(figsize=_FIGURE_SIZE)
    for label in dict.fromkeys(r["label"] for r in rows):
        points = sorted((r["bytes"], r["busbw"] / 1e6) for r in rows if r["label"] == label)
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    bounded = [r for r in rows if r.get("link_bound_seconds") and not r.get("compression")]
    if bounded:
        # The link bound expressed as a busbw (the same for every size).
        row = bounded[0]
        busbw = row["bytes"] / row["link_bound_seconds"] * row["busbw"] / row["algbw"]
        axes.axhline(busbw / 1e6, color="gray", linestyle="--",
                     label=f"link bound as busbw ({busbw / 1e6:.1f} MB/s, "
                     f"link {row['link_rate'] / 1e6:.0f} MB/s)")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("bytes (float32)")
    axes.set_ylabel("busbw (MB/s)")
    _save(figure, axes, path, title, grid_axis="both")


def bars(categories, series, path, title, ylabel):
    """Grouped bars: `series` is `{name: [value per category]}`."""
    figure, axes = plt.subplots(figsize=_FIGURE_SIZE)
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series.items()):
        positions = [i + (index - (len(series) - 1) / 2) * width for i in range(len(categories))]
        axes.bar(positions, values, width=width, label=name)
    axes.set_xticks(range(len(categories)))
    axes.set_xticklabels(categories, fontsize=8)
    axes.set_ylabel(ylabel)
    _save(figure, axes, path, title, grid_axis="y")


def _save(figure, axes, path, title, grid_axis):
    """Titles, grids and labels the plot, writes it to `path`, frees it."""
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", axis=grid_axis, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
