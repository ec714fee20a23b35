"""Which client serves an address: shared memory (local server) or the gRPC bridge.

No grpc import here: local programs never need the optional `bridge` extra.

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
import socket
from typing import List, Optional

from reverb_shm import shm

_PROBE_TIMEOUT_S = 0.5


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
  return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


def remote_client_for(address) -> Optional[object]:
  """None when `address` is local; else the RemoteClient / ShardedClient class or instance.

  Returns the RemoteClient class (to be constructed by Client's normal __init__ protocol) or
  a ready ShardedClient instance.
  """
  if isinstance(address, (list, tuple)):
    from reverb_shm.bridge.sharded import ShardedClient  # pylint: disable=g-import-not-at-top
    return ShardedClient(list(address))
  if not isinstance(address, str) or is_local(address):
    return None
  targets = shard_targets(address)
  if len(targets) > 1:
    from reverb_shm.bridge.sharded import ShardedClient  # pylint: disable=g-import-not-at-top
    return ShardedClient(targets)
  from reverb_shm.bridge.remote import RemoteClient  # pylint: disable=g-import-not-at-top
  return RemoteClient
