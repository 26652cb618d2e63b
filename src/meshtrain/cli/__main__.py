"""``python -m meshtrain.cli``: the ``meshtrain`` command."""

import sys

from meshtrain.cli.main import main

sys.exit(main())
