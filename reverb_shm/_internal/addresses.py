"""Which client serves an address: shared memory (local server) or the gRPC bridge.

This module sits below both `reverb_shm.client` and `reverb_shm.bridge`: it classifies an
address and names the class that serves it. The remote clients live in the optional bridge
package (extra `bridge`, which needs grpcio); they are looked up by module name
(`REMOTE_CLIENTS`) only when an address is remote, so local programs never import grpc and the
client module never imports the bridge.

Rules (`Client(address)`):
  * a list/tuple of addresses -> a ShardedClient over them;
  * 'shm://NAME' -> local;
  * 'HOST:PORT' with HOST naming this host (a local name, or an IP of one of its interfaces):
    local if a reverb_shm server is registered on PORT,
    remote if something else listens on PORT (a bridge), else local (a server may start later;
    Client.server_info waits for it);
  * any other HOST -> remote; a HOST that resolves to several IPv4 (or, lacking those, IPv6)
    addresses -> a ShardedClient with one shard per address.
"""
import importlib
import socket
from typing import List, Optional

from reverb_shm._internal import shm

_PROBE_TIMEOUT_S = 0.5

# Which class serves a remote address: (module, class name), imported on first use.
REMOTE_CLIENTS = {
    "remote": ("reverb_shm.bridge.remote", "RemoteClient"),
    "sharded": ("reverb_shm.bridge.sharded", "ShardedClient"),
}


def _remote_class(kind: str) -> type:
  module, name = REMOTE_CLIENTS[kind]
  return getattr(importlib.import_module(module), name)


def split(address: str):
  """(host, port) of 'HOST:PORT' / '[V6]:PORT'; ValueError otherwise."""
  host, sep, port = address.rpartition(":")
  if not sep or not port.isdigit() or not host or not 0 < int(port) < 65536:
    raise ValueError(f"invalid server address {address!r}: expected 'HOST:PORT' or 'shm://NAME'")
  return host, int(port)


def _listening(host: str, port: int) -> bool:
  try:
    with socket.create_connection((host.strip("[]"), port), timeout=_PROBE_TIMEOUT_S):
      return True
  except OSError:
    return False


def is_local(address: str) -> bool:
  """Whether `address` is served by shared memory on this host (see module docstring)."""
  if address.startswith("shm://"):
    return True
  host, port = split(address)
  if not shm.is_local_host(host):
    return False
  return shm.port_is_registered(port) or not _listening(host, port)


def shard_targets(address: str) -> List[str]:
  """The addresses a remote HOST:PORT resolves to ([address] if only one or on DNS errors)."""
  host, port = split(address)
  try:
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
  except OSError:
    return [address]
  v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
  v6 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET6})
  ips = v4 or v6
  if len(ips) <= 1:
    return [address]
  return [f"[{ip}]:{port}" if ":" in str(ip) else f"{ip}:{port}" for ip in ips]


def remote_client_for(address) -> Optional[object]:
  """None when `address` is local; else the RemoteClient / ShardedClient class or instance.

  Returns the RemoteClient class (to be constructed by Client's normal __init__ protocol) or
  a ready ShardedClient instance.
  """
  if isinstance(address, (list, tuple)):
    return _remote_class("sharded")(list(address))
  if not isinstance(address, str) or is_local(address):
    return None
  targets = shard_targets(address)
  if len(targets) > 1:
    return _remote_class("sharded")(targets)
  return _remote_class("remote")
