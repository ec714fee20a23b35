"""gRPC bridge: serve a host's reverb_shm tables to remote clients (optional extra `bridge`).

  Bridge / BridgeConfig   server side (service.py), also `reverb-shm bridge NAME --port P`
  RemoteClient            the Client API over a bridge (remote.py); `Client('host:port')`
                          returns one for addresses that are not local servers
  ShardedClient           one API over several servers (sharded.py); `Client([a, b])`
  ServerTLS, ClientCredentials   TLS material and auth token (security.py)
"""
import importlib

try:   # every module of the package speaks gRPC: say which extra brings it
  import grpc  # noqa: F401  pylint: disable=unused-import
except ImportError as e:
  raise ImportError(
      "the gRPC bridge (Client('HOST:PORT') of another host, Client([...]), Server(bridge=...), "
      "`reverb-shm bridge`) needs grpcio: pip install 'reverb_shm[bridge]'") from e

# Exports are imported on first use (PEP 562): `Client(...)` consults the grpc-free
# `addresses` module, and local programs must not need the optional grpcio dependency.
_EXPORTS = {"Bridge": "service", "BridgeConfig": "service", "ClientCredentials": "security",
            "ServerTLS": "security", "RemoteClient": "remote", "ShardedClient": "sharded"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'reverb_shm.bridge' has no attribute {name!r}")
  return getattr(importlib.import_module(f"reverb_shm.bridge.{module}"), name)
