"""The per-node server actor of a ReplayCluster (a plain class; cluster.py wraps it in
ray.remote). One instance owns one reverb_shm Server and its gRPC bridge on one Ray node."""
import os
from typing import List, Optional

import ray

from reverb_shm import checkpointers
from reverb_shm import client as client_lib
from reverb_shm import server as server_lib
from reverb_shm import table as table_lib
from reverb_shm.bridge import BridgeConfig


class NodeServer:
  """Owns shard `shard`'s Server (segment /dev/shm/rvshm.`server_name`) and its bridge.

  Args:
    tables: the reverb_shm.Table objects (unbound copies: Ray sends each actor its own).
    server_name: the segment's name.
    checkpoint_dir: the shard's checkpoint root; the newest checkpoint there is restored.
    token: the bridge's auth token (the bridge binds the node's IP, so it needs one).
    server_kwargs: further Server arguments (arena_bytes, max_procs, pins_per_proc).
  """

  def __init__(self, tables: List[table_lib.Table], server_name: str, checkpoint_dir: str,
               token: str, server_kwargs: Optional[dict] = None):
    self._checkpoint_dir = checkpoint_dir
    checkpointer = checkpointers.DefaultCheckpointer(checkpoint_dir)
    found = checkpointer.checkpoints()   # the Server restores the newest verified one
    host = ray.util.get_node_ip_address()
    self._server = server_lib.Server(
        tables, checkpointer=checkpointer, name=server_name,
        bridge=BridgeConfig(host=host, token=token), **(server_kwargs or {}))
    seg_info = client_lib.Client(f"shm://{server_name}")._segment().info()  # pylint: disable=protected-access
    self._info = {
        "node_id": ray.get_runtime_context().get_node_id(),
        "server_name": server_name,
        "port": self._server.port,
        "bridge_address": self._server.bridge_address,
        "generation": int(seg_info["generation"]),
        "pid": os.getpid(),
        "restored_from": found[0] if found else None,
    }

  def info(self) -> dict:
    """Where the shard is: node_id, server_name, port, bridge_address, generation, pid,
    restored_from (the newest checkpoint found at start, or None)."""
    return dict(self._info)

  def checkpoint(self) -> str:
    """Writes a checkpoint of the shard's tables; returns its directory."""
    return self._server.checkpoint()

  def stop(self) -> None:
    self._server.stop()
