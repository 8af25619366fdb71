"""Files written whole or not at all: a reader sees the old file or the new."""

import json
import os
import tempfile


def write_json(path, value, **dump_args):
    """Writes `value` as JSON to `path` atomically, creating its directory.

    A temporary file of its own in the same directory (concurrent writers
    never share one), flushed to disk, then renamed over `path`.
    `dump_args` go to `json.dump` (`indent`, `default`).
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(
        dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as f:
            json.dump(value, f, **dump_args)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
