"""`python -m ktx train|eval|infer|params ...` (same as the `ktx` console script)."""

import sys

from ktx.cli import main

if __name__ == "__main__":
    sys.exit(main())
