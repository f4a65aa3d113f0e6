"""`python -m areal_hpc.analysis ROLLOUTS.h5 [...]`: see cli.py."""
import sys

from .cli import main

sys.exit(main())
