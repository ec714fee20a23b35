"""Server: owns a shared-memory segment holding its tables.

The server does no per-request work: processes attach to the segment and operate on the
tables directly. The Server object creates the segment, keeps a TCP port bound (so
``Client('localhost:PORT')`` resolves to it and no two servers share a port), reaps dead
processes' resources, and closes and unlinks everything on :meth:`stop`. Thread-safe.

After :meth:`stop` the Server holds nothing of its segment: the mapping (and, once every other
process let go too, the memory) goes as soon as no object of this process uses it any more.
Objects that do keep it mapped, so that nothing ever reads unmapped memory: zero-copy arrays
sampled before the stop (they stay readable and intact) and Client / SharedTable handles taken
before it, whose calls raise TableClosedError. ``server.segment`` and the Server's own table
calls raise TableClosedError after the stop.
"""
import atexit
import collections
import errno
import os
import signal
import socket
import threading
import weakref
from typing import Optional, Sequence

from reverb_shm import checkpointers, errors
from reverb_shm import table as table_lib
from reverb_shm._internal import shm
from reverb_shm._internal._lib import check, ffi, lib
from reverb_shm.table import Table

__all__ = ["Server", "Table", "DEFAULT_ARENA_BYTES", "DEFAULT_MAX_SHARE", "DEFAULT_PINS_PER_PROC",
           "PIN_ENTRY_BYTES"]

DEFAULT_ARENA_BYTES = 8 << 20  # the arena's first extent; it grows by itself up to max_bytes
DEFAULT_MAX_SHARE = 0.5        # default max_bytes: this share of /dev/shm free at start
DEFAULT_PINS_PER_PROC = 65536
PIN_ENTRY_BYTES = 12          # one pin-log entry (u64 entry + u32 free-stack slot)
_REAP_INTERVAL_S = 0.5

# Servers of this process still running; stopped at interpreter exit so that a script that
# ends (or dies on an exception) without stop() leaves no segment behind.
_live_servers: "weakref.WeakSet[Server]" = weakref.WeakSet()


@atexit.register
def _stop_live_servers() -> None:
  for server in list(_live_servers):
    try:
      server.stop()
    except Exception:  # pylint: disable=broad-except  (best effort at exit)
      pass


class Server:
  """A reverb_shm server.

  Args:
    tables: the tables (at least one, unique names).
    port: TCP port to reserve and register as the server's address; None picks a free one.
    checkpointer: a checkpointers.CheckpointerBase; None -> checkpointers.default_checkpointer().
      The newest complete checkpoint (else its fallback) is restored before the server starts.
    on_config_mismatch: when a restored table's configuration in code differs from the
      checkpoint's: 'error' (ValueError naming the fields), 'prefer_code' or
      'prefer_checkpoint'. server_info() shows the effective configuration.
    name: server name (the segment is /dev/shm/rvshm.NAME); default f"reverb_{port}".
    arena_bytes: bytes of shared memory for chunk data and item descriptors to start with
      (default 8 MiB); the arena then grows by extents as data arrives, up to max_bytes. Set it
      to the expected data size to have everything reserved at start.
    max_bytes: the most bytes of /dev/shm this server may hold (tables' metadata, arena and pin
      logs). Default: half of what /dev/shm has free when the server starts (at least what it
      needs to start). An insert needing more fails with ResourceExhaustedError naming it.
    storage: a directory on a local filesystem for the disk tier: chunk payloads (and item
      descriptors: the whole arena) live in a file there, mapped into every process, while the
      tables' records, key index, sum trees, rate limiter and pin logs stay in /dev/shm.
      Sampling, priority updates, zero-copy views and batched gathers work unchanged; the page
      cache is the only cache. max_bytes then bounds the file (default: half of the
      directory's free space). The file (same mode as the segment) is removed on stop, and by
      `reverb-shm gc` or the next server start when this server dies. It is not a checkpoint:
      a server killed with SIGKILL cannot be restarted from it (use a checkpointer).
    max_procs: maximum number of processes attached at once.
    pins_per_proc: most chunks and sampled items one process may hold pinned at once (live
      sample views and chunks being written), 16..2**20; a batch needing more fails with
      ResourceExhaustedError. A process's pin log grows to it as needed (12 bytes per pin).
    bridge: a reverb_shm.bridge.BridgeConfig to also serve the tables over gRPC in this
      process (needs the `bridge` extra); see `bridge_address`.
    mode: permission bits of the segment and port alias: 0o600 (default: only this user's
      processes may attach) or 0o660 (also processes of the file's group). Other bits are
      refused.
    metrics_port: serve the server's counters in the Prometheus text format on this TCP port
      (http://127.0.0.1:PORT/metrics; 0 picks a free port, see `metrics_port`), from a thread
      of this process. Needs the `metrics` extra (prometheus-client). None: no endpoint.

  Segment size: the segment /dev/shm/rvshm.NAME starts with
    the tables' metadata (records, key index, selector structures: roughly 150 to 350 bytes
      per unit of max_size, as some arrays are rounded up to powers of two)
    + operation counters: (max_procs + 1) x tables x 320 bytes
    + arena_bytes (chunk data and item descriptors; 8 MiB by default)
  and grows as it is used: arena extents (at least 4 MiB, a quarter of the arena, at most
  256 MiB beyond the need) and, per attached process, pin-log pages (12 bytes per pin held at
  once, in steps of 1024 pins), all within max_bytes. Its file is as large as it may grow, but
  only the reserved part holds memory (`du`, not `ls -l`); `reverb-shm info NAME` prints it.

  If the server process dies (SIGKILL), processes already attached keep working on the mapped
  tables (the server does no per-request work), but a blocked insert or sample fails with
  DeadOwnerError within one wait slice (0.1 s), and new attaches fail with DeadOwnerError.
  `reverb-shm gc`, or starting a server of the same name, removes the stale segment.

  Raises:
    ValueError: no tables, duplicate table names, bad name, port unavailable, a checkpoint
      that does not fit the tables (see on_config_mismatch).
    ResourceExhaustedError: /dev/shm cannot hold the segment.
    SegmentInUseError: a live server already uses that name.
  """

  def __init__(self, tables: Optional[Sequence[table_lib.Table]] = None, port: Optional[int] = None,
               checkpointer=None, *, name: Optional[str] = None,
               arena_bytes: int = DEFAULT_ARENA_BYTES, max_bytes: Optional[int] = None,
               storage: Optional[str] = None, max_procs: int = 128,
               pins_per_proc: int = DEFAULT_PINS_PER_PROC, mode: int = 0o600, bridge=None,
               on_config_mismatch: str = "error", metrics_port: Optional[int] = None):
    self._stopped = True
    self._bridge = None
    self._metrics = None
    self._pid = os.getpid()
    self._lock = threading.Lock()
    if not tables:
      raise ValueError("At least one table must be provided")
    tables = list(tables)
    for t in tables:
      if not isinstance(t, table_lib.Table):
        raise TypeError(f"tables must be reverb_shm.Table objects, got {t!r}")
    dupes = sorted(n for n, c in collections.Counter(t.name for t in tables).items() if c > 1)
    if dupes:
      raise ValueError(f"Table names must be unique; duplicated: {dupes}")
    for t in tables:
      t._check_unbound()  # pylint: disable=protected-access
    if name is not None:
      shm.validate_server_name(name)
    shm.validate_mode(mode)
    if on_config_mismatch not in checkpointers.ON_CONFIG_MISMATCH:
      raise ValueError(f"on_config_mismatch must be one of {checkpointers.ON_CONFIG_MISMATCH}, "
                       f"got {on_config_mismatch!r}")
    try:
      if checkpointer is None:
        checkpointer = checkpointers.default_checkpointer()
      # Table configs are fixed when the segment is created: read the checkpoint first.
      restoring = checkpointer.load_latest()
    except OSError as e:
      raise shm.descriptor_error(e, "looking for the server's latest checkpoint") from e
    created_tables = tables
    restore_indices: dict = {}
    if restoring is not None:
      created_tables, restore_indices = checkpointers.effective_tables(tables, restoring,
                                                                       on_config_mismatch)
    # What servers killed without stop() left behind goes back to the system first (logged).
    try:
      shm.reclaim_dead(storage=storage)
    except OSError as e:   # e.g. a file of another user in /dev/shm: not this server's business
      shm.log.warning("could not reclaim what dead servers left in %s: %s", shm.SHM_DIR, e)
    self._socket = self._bind_port(port)
    self._port = self._socket.getsockname()[1]
    self._name = name if name is not None else f"reverb_{self._port}"
    try:
      shm.validate_server_name(self._name)
      self._segment = shm.Segment.create(self._name, created_tables, arena_bytes=arena_bytes,
                                         max_procs=max_procs, pins_per_proc=pins_per_proc,
                                         mode=mode, max_bytes=max_bytes,
                                         max_share=DEFAULT_MAX_SHARE, storage=storage)
    except BaseException:
      self._socket.close()
      raise
    try:
      if restoring is not None:
        checkpointers.restore_into(self._segment, restoring, restore_indices)
      try:
        shm.register_port(self._port, self._name, mode)
        checkpointers.publish(self._name, checkpointer)
      except OSError as e:
        if isinstance(e, errors.ReverbError):
          raise
        raise shm.os_error(e, f"cannot register server {errors.quoted_name(self._name)} in "
                              f"{shm.SHM_DIR}") from e
    except BaseException:
      checkpointers.unpublish(self._name)
      shm.unregister_port(self._port, self._name)
      self._segment.close()
      self._segment.unlink()
      self._socket.close()
      raise
    self._tables = tables
    self._checkpointer = checkpointer
    for i, t in enumerate(tables):
      t._bind(self._segment, i)  # pylint: disable=protected-access
    self._stop_event = threading.Event()
    self._stopped = False
    self._reaper = threading.Thread(target=self._reap_loop, name=f"reverb_shm-reaper-{self._name}",
                                    daemon=True)
    try:
      self._reaper.start()
    except RuntimeError as e:   # this process may not create a thread
      self.stop()
      raise shm.os_error(e, f"cannot start server {errors.quoted_name(self._name)}: its reaper "
                            f"thread could not "
                         "be started", errno.EAGAIN) from None
    _live_servers.add(self)
    if bridge is not None:
      from reverb_shm.bridge import Bridge  # pylint: disable=g-import-not-at-top
      try:
        self._bridge = Bridge(self, bridge)
      except BaseException:
        self.stop()
        raise
    if metrics_port is not None:
      from reverb_shm.metrics import MetricsExporter  # pylint: disable=g-import-not-at-top
      try:
        self._metrics = MetricsExporter(self._name, metrics_port)
      except BaseException:
        self.stop()
        raise

  @property
  def metrics_port(self) -> Optional[int]:
    """TCP port of the Prometheus endpoint (Server(metrics_port=...)), or None without one."""
    return None if self._metrics is None else self._metrics.port

  @property
  def bridge_address(self):
    """'HOST:PORT' of the in-process gRPC bridge, or None without one."""
    return None if self._bridge is None else self._bridge.address

  @staticmethod
  def _bind_port(port: Optional[int]) -> socket.socket:
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 0 <= port < 65536):
      raise ValueError(f"port must be an int in [0, 65535] or None, got {port!r}")
    try:
      sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
      raise shm.descriptor_error(e, "opening the server's port socket") from e
    try:
      sock.bind(("127.0.0.1", port or 0))
    except OSError as e:
      sock.close()
      raise ValueError(f"Failed to bind port {port}: {e.strerror}") from None
    return sock

  def _reap_loop(self) -> None:
    reaped = ffi.new("uint32_t *")
    seg = self._segment    # stop() joins this thread before it lets the segment go
    while not self._stop_event.wait(_REAP_INTERVAL_S):
      try:
        lib.rs_reap(seg.base, reaped)
      except Exception:  # pylint: disable=broad-except  (keep reaping)
        pass

  # ---- properties
  port = property(lambda self: self._port)
  name = property(lambda self: self._name)
  @property
  def segment(self) -> shm.Segment:
    """The server's Segment in this process.

    Raises:
      TableClosedError: the server was stopped (the Server no longer holds its segment).
    """
    return self._live_segment()

  def _live_segment(self) -> shm.Segment:
    seg = self._segment
    if seg is None:
      raise errors.TableClosedError(
          f"server {errors.quoted_name(self._name)} was stopped: the Server no longer holds its "
          f"segment (handles "
          "taken before stop() raise TableClosedError; start a new Server to serve again)")
    return seg
  checkpointer = property(lambda self: self._checkpointer)

  @property
  def in_process_client(self):
    """A Client of this server (same as localhost_client())."""
    return self.localhost_client()

  def localhost_client(self):
    """Client(f'localhost:{port}')."""
    from reverb_shm.client import Client  # pylint: disable=g-import-not-at-top
    return Client(f"localhost:{self._port}")

  def shared_table_name(self, table) -> str:
    """'SERVER/TABLE' name for SharedTable.attach (table: name or Table)."""
    table_name = table.name if isinstance(table, table_lib.Table) else table
    self._live_segment().table_index(table_name)
    return f"{self._name}/{table_name}"

  def shared_table(self, table):
    """SharedTable handle of `table` (name or Table) in this process."""
    from reverb_shm.shared_table import SharedTable  # pylint: disable=g-import-not-at-top
    table_name = table.name if isinstance(table, table_lib.Table) else table
    seg = self._live_segment()
    return SharedTable(seg, seg.table_index(table_name))

  def checkpoint(self) -> str:
    """Writes a checkpoint with the server's checkpointer; returns its path (see
    Client.checkpoint)."""
    return self._checkpointer.save(self._live_segment())

  def reset_rate_limiter(self, table) -> None:
    """Forgets the rate-limiter history of `table` (name or Table) without dropping items.

    For a table restored with counters that no longer suit the code (e.g. another limiter):
    afterwards inserts = size, deletes = 0 and samples is the smallest count that puts the
    limiter inside its [min_diff, max_diff] band, as if the items had just been inserted.

    Raises:
      UnknownTableError: no such table.
    """
    table_name = table.name if isinstance(table, table_lib.Table) else table
    seg = self._live_segment()
    index = seg.table_index(table_name)
    check(lib.rs_table_reset_limiter(seg.base, index),
          f"resetting the rate limiter of table {errors.quoted_name(table_name)}")

  # ---- lifecycle
  def stop(self) -> None:
    """Closes every table (blocked calls in every process fail with TableClosedError), stops
    the reaper, unlinks the segment and the port alias and frees the port. Idempotent."""
    with self._lock:
      if self._stopped:
        return
      if os.getpid() != self._pid:
        raise RuntimeError(f"server {errors.quoted_name(self._name)} belongs to process "
                           f"{self._pid}; only that "
                           "process can stop it")
      self._stopped = True
    if self._bridge is not None:
      self._bridge.stop()
    if self._metrics is not None:
      self._metrics.stop()
    check(lib.rs_segment_close(self._segment.base), f"closing server "
                                                    f"{errors.quoted_name(self._name)}")
    self._stop_event.set()
    if self._reaper.ident is not None:   # started
      self._reaper.join(timeout=10)
    for t in self._tables:
      t._unbind()  # pylint: disable=protected-access
    shm.unregister_port(self._port, self._name)
    checkpointers.unpublish(self._name)
    self._segment.unlink()
    self._segment.close()
    self._segment = None  # type: ignore[assignment]  # unmapped once nothing else uses it
    self._socket.close()

  @property
  def stopped(self) -> bool:
    return self._stopped

  def wait(self) -> None:
    """Blocks until the server is stopped; Ctrl-C (SIGINT) stops it and raises
    KeyboardInterrupt.

    As Reverb does, a SIGINT handler is installed for the duration of the wait (when called
    from the main thread), so Ctrl-C works even in a process that inherited SIGINT ignored
    (e.g. started in the background by a non-interactive shell).
    """
    previous = None
    if threading.current_thread() is threading.main_thread():
      previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
      while not self._stop_event.wait(0.5):
        pass
    except KeyboardInterrupt:
      self.stop()
      raise
    finally:
      if previous is not None:
        signal.signal(signal.SIGINT, previous)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()

  def __del__(self):
    try:
      if not getattr(self, "_stopped", True) and self._pid == os.getpid():
        self.stop()
    except Exception:  # pylint: disable=broad-except
      pass

  def __repr__(self):
    return f"Server(name={self._name!r}, port={self._port}, stopped={self._stopped})"
