"""`python -m areal_hpc.audit RUN_DIR`: the audit's command line (areal_hpc/audit/__init__.py)."""
import sys

from . import main

sys.exit(main())
