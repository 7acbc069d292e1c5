"""``python -m conserve``: the same command line as ``conserve``."""
import sys

from .cli import main

sys.exit(main())
