"""Makes absl's `--help` list the flags an entry point defines.

absl's `--help` prints the key flags of the main module, `sys.argv[0]`: a
console script (which defines none) or `python -m`'s module. Entry points
define their flags in functions of other modules, so those flags are
registered as the main module's key flags. Flags TensorFlow defines on
import are left out (tfscale-train parses before it imports TensorFlow, so
it has none of them).
"""

import sys

from absl import flags


def list_in_help(module_prefix):
    """Lists in `--help` every flag defined by modules named `module_prefix*`."""
    for module, module_flags in flags.FLAGS.flags_by_module_dict().items():
        if module.startswith(module_prefix):
            for flag in module_flags:
                flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
