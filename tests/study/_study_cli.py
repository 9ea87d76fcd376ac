"""``sat-jax ARGS`` in this process, as ``cli.run`` does it (shared by the study tests)."""

import sys

from absl import flags

from sat_jax import cli


def invoke(*args) -> int:
    """The exit status of ``sat-jax ARGS``: help requests answered by ``cli.print_help``, the rest
    parsed into absl's flags (reset from the previous call) and run by ``cli.main``."""
    rc = cli.print_help(list(args))
    if rc is not None:
        return rc
    argv = ["sat-jax", *args]
    saved = sys.argv
    sys.argv = argv
    try:
        if flags.FLAGS.is_parsed():
            flags.FLAGS.unparse_flags()
        return cli.main(flags.FLAGS(argv))
    finally:
        sys.argv = saved
