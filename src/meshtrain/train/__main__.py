"""``python -m meshtrain.train CONFIG [--section.key VALUE ...]``: one rank (torchrun starts one per device).

From its first moment, before torch is imported (which takes seconds), a Ctrl-C or SIGTERM is recorded
for the loop to stop on, and a rank started by torchrun dies with its launcher."""

import os
import sys

from meshtrain.runtime.faults import STOP, die_with_parent

STOP.install()
if "LOCAL_RANK" in os.environ:
    die_with_parent()

from meshtrain.train.entry import main  # noqa: E402  (after the stop handler: this import loads torch)

sys.exit(main())
