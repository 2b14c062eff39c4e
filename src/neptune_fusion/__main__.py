"""`python -m neptune_fusion demo` runs the command line."""

import sys

from neptune_fusion.cli import main

sys.exit(main())
