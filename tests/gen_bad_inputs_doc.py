"""Regenerate docs/bad_inputs.md from the tests that run each case (slow ones included):

    .venv/bin/python tests/gen_bad_inputs_doc.py

Runs tests/test_bad_inputs.py and tests/test_input_matrix.py with ``MESHTRAIN_BAD_INPUTS_DOC=write``, so each
case records the line meshtrain printed instead of comparing it with the doc (:mod:`bad_inputs_doc`), and the
doc is rewritten when they end. The other checks of each case still run: a case that fails them fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    env = {**os.environ, "MESHTRAIN_BAD_INPUTS_DOC": "write", "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "slow or not slow", "-p", "no:cacheprovider",
                             "tests/test_bad_inputs.py", "tests/test_input_matrix.py", *sys.argv[1:]],
                            cwd=ROOT, env=env).returncode)
