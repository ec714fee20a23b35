"""gRPC bridge: serve a host's reverb_shm tables to remote clients (optional extra `bridge`).

  Bridge / BridgeConfig   server side (service.py), also `reverb-shm bridge NAME --port P`
  RemoteClient            the Client API over a bridge (remote.py); `Client('host:port')`
                          returns one for addresses that are not local servers
  ShardedClient           one API over several servers (sharded.py); `Client([a, b])`
  ServerTLS, ClientCredentials   TLS material and auth token (security.py)
"""
from reverb_shm.bridge.security import ClientCredentials, ServerTLS
from reverb_shm.bridge.service import Bridge, BridgeConfig
from reverb_shm.bridge.remote import RemoteClient
from reverb_shm.bridge.sharded import ShardedClient

__all__ = ["Bridge", "BridgeConfig", "ClientCredentials", "RemoteClient", "ServerTLS",
           "ShardedClient"]
