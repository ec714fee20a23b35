"""`reverb-shm` and `reverb_server` console scripts (see reverb_shm._cli_main)."""
import sys

from reverb_shm._cli_main import build_parser, main, reverb_server_main, reverb_server_parser  # noqa: F401

if __name__ == "__main__":
  sys.exit(main())
