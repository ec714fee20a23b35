"""`python -m reverb_shm ...`: the `reverb-shm` command line (as `python -m reverb_shm.cli`)."""
import sys

from reverb_shm.cli.main import main

sys.exit(main())
