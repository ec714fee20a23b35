"""The `reverb-shm` and `reverb_server` command lines (`main`), and their textproto config.

  main            sub-commands: list, info, top, check, gc, serve, bridge, metrics, checkpoint
  common          naming a server (name or address), output, logging, signals
  serve           `serve` / `reverb_server`: checkpoint directory, metrics endpoint
  top             the live terminal view (rich)
  server_config   Reverb's server textproto (`reverb_server --config`) into Tables
"""
from reverb_shm.cli.main import build_parser, main, reverb_server_main, reverb_server_parser

__all__ = ["build_parser", "main", "reverb_server_main", "reverb_server_parser"]
