"""`python -m reverb_shm.cli ...`: the `reverb-shm` command line."""
import sys

from reverb_shm.cli.main import main

sys.exit(main())
