"""The runs on disk: one JSON line per finished run, appended and flushed
to disk the moment the run ends, so that an interrupted study loses at most
the run in progress, and a rerun skips what is there."""

import json
import os


def load(path):
    """{run key: record} of the finished runs in `path` (none if absent).

    A last line cut short by a crash mid-write is ignored: that run is simply
    run again.
    """
    records = {}
    if not os.path.exists(path):
        return records
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            records[record["key"]] = record
    return records


def append(path, record):
    """Adds one finished run to `path`, on disk before this returns."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "ab+") as f:
        # After a line cut short by a crash: start a new line, or the
        # record would be glued to it and lost with it.
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(json.dumps(record, sort_keys=True).encode("utf-8") + b"\n")
        f.flush()
        os.fsync(f.fileno())
