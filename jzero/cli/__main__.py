"""``python -m jzero.cli ...`` = ``jzero ...``."""
import sys

from jzero.cli import main

sys.exit(main())
