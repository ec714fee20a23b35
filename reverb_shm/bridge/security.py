"""Bridge security: TLS material, the auth token, and the bind-address policy.

A bridge binds 127.0.0.1 unless told otherwise; binding any other address requires TLS or an
auth token. The token travels in the `authorization` metadata of every call ("Bearer TOKEN")
and is compared in constant time.
"""
import dataclasses
import hmac
import ipaddress
import os
from typing import Optional, Sequence, Tuple

import grpc

TOKEN_METADATA = "authorization"
ENV_TOKEN = "REVERB_SHM_BRIDGE_TOKEN"
ENV_ROOT_CERT = "REVERB_SHM_BRIDGE_ROOT_CERT"
ENV_CLIENT_CERT = "REVERB_SHM_BRIDGE_CLIENT_CERT"
ENV_CLIENT_KEY = "REVERB_SHM_BRIDGE_CLIENT_KEY"


@dataclasses.dataclass(frozen=True)
class ServerTLS:
  """TLS material of a bridge (PEM bytes).

  Attributes:
    certificate_chain: the server certificate (chain).
    private_key: its private key.
    client_ca: when set, clients must present a certificate signed by this CA.
  """
  certificate_chain: bytes
  private_key: bytes
  client_ca: Optional[bytes] = None

  def credentials(self) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(self.private_key, self.certificate_chain)], root_certificates=self.client_ca,
        require_client_auth=self.client_ca is not None)


@dataclasses.dataclass(frozen=True)
class ClientCredentials:
  """How a remote client authenticates to a bridge.

  Attributes:
    token: auth token sent with every call (None: none).
    root_certificates: PEM CA bundle to verify the bridge's certificate; set to use TLS.
    certificate_chain, private_key: PEM client certificate and key (mutual TLS).
  """
  token: Optional[str] = None
  root_certificates: Optional[bytes] = None
  certificate_chain: Optional[bytes] = None
  private_key: Optional[bytes] = None

  @classmethod
  def from_env(cls) -> "ClientCredentials":
    """Credentials from REVERB_SHM_BRIDGE_TOKEN and the *_ROOT_CERT / *_CLIENT_CERT /
    *_CLIENT_KEY file paths (all optional)."""
    def read(var):
      path = os.environ.get(var)
      if not path:
        return None
      with open(path, "rb") as f:
        return f.read()
    return cls(token=os.environ.get(ENV_TOKEN) or None, root_certificates=read(ENV_ROOT_CERT),
               certificate_chain=read(ENV_CLIENT_CERT), private_key=read(ENV_CLIENT_KEY))

  @property
  def tls(self) -> bool:
    return self.root_certificates is not None

  def metadata(self) -> Tuple[Tuple[str, str], ...]:
    return ((TOKEN_METADATA, f"Bearer {self.token}"),) if self.token else ()

  def channel(self, target: str, options: Sequence[tuple]) -> grpc.Channel:
    if self.tls:
      creds = grpc.ssl_channel_credentials(self.root_certificates, self.private_key,
                                           self.certificate_chain)
      return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


def is_loopback(host: str) -> bool:
  """True for 'localhost' and loopback IPs (127.0.0.0/8, ::1)."""
  if host.lower() == "localhost":
    return True
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False


def check_bind_policy(host: str, tls: Optional[ServerTLS], token: Optional[str]) -> None:
  """ValueError unless `host` is loopback or the bridge has TLS or a token."""
  if not is_loopback(host) and tls is None and not token:
    raise ValueError(f"refusing to bind the bridge to non-loopback address {host!r} without "
                     "TLS (--tls-cert/--tls-key) or an auth token (--token / "
                     f"{ENV_TOKEN})")


def token_ok(expected: Optional[str], metadata) -> bool:
  """Whether call metadata carries `expected` (always True when no token is configured)."""
  if not expected:
    return True
  want = f"Bearer {expected}".encode()
  for key, value in metadata or ():
    if key == TOKEN_METADATA:
      got = value.encode() if isinstance(value, str) else bytes(value)
      if hmac.compare_digest(got, want):
        return True
  return False
