"""The `reverb-shm` and `reverb_server` command lines (`main`), and their textproto config.

  main            subcommands: list, info, check, gc, serve, bridge, checkpoint
  server_config   Reverb's server textproto (`reverb_server --config`) into Tables
"""
from reverb_shm.cli.main import build_parser, main, reverb_server_main

__all__ = ["build_parser", "main", "reverb_server_main"]
