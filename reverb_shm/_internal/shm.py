"""The one place where shared-memory segments are created, attached and unlinked.

A server's segment is the POSIX shm object ``/rvshm.<server name>`` (``/dev/shm/rvshm.<name>``),
created by the owning :class:`~reverb_shm.Server` with O_CREAT|O_EXCL and mode 0600. The file is
as large as the segment may grow (its layout), but only what is in use holds memory: the creator
reserves the header, the tables and the first arena (posix_fallocate), and the C core reserves
further arena extents and pin-log pages as they are needed (a clean ResourceExhaustedError when
/dev/shm is full, never a SIGBUS). Every process maps the whole file once, so growth needs no
remapping. Its lifetime belongs to the server (unlinked on stop); attaching
processes never unlink it. posix_ipc does not register segments with multiprocessing's
resource tracker, so an attaching process exiting leaves the segment alone.

Creation protocol: the creator holds an exclusive flock(2) on the new segment's file from just
after O_CREAT|O_EXCL until rs_segment_init has written the owner's pid and start time. Anyone
about to unlink a segment it judges stale (``reverb-shm gc``, a creator reclaiming the name)
first takes that lock without waiting: a segment whose lock is held is being created and counts
as live. A gc may still take the lock in the instant between the creator's O_EXCL open and its
flock; the creator then finds the name no longer refers to its file and creates it afresh.
For the rest of its life the owner holds a shared flock on the segment's file (its own open
file, closed in forked children): a segment whose lock is held after initialisation is live
even when its owner's pid means nothing here (a server in another pid namespace sharing
/dev/shm), and the lock goes with the owner process, however it ends.

Liveness across pid namespaces: a pid names a process only in its own pid namespace, so every
judgement of whether a server or an attached process lives (attaching, port resolution, the
owner watch, blocked calls, the reaper, process lists) counts a process alive when its pid and
start time match here OR it holds its liveness lock: an open-file-description read lock on one
byte of the segment's file, byte 0 for the owner and byte 1 + slot for a registered process
(csrc/liveness.c). Each process's Segment keeps its own open file of the segment for these
locks and probes (reopened in a forked child, so that a child never holds its parent's locks).

Disk tier (``storage=DIR``): the arena (chunk payloads and item descriptors) is the file
``DIR/rvshm.<name>.<generation>.arena`` (mode as the segment's), mapped by every process over
the arena's range of its segment mapping, so offsets and addresses are the same as in memory; the
header, tables (records, key index, sum trees), slots and pin logs stay in /dev/shm. The
sidecar ``/dev/shm/rvshm-storage.<name>`` holds the file's path: attaching processes map it,
and whoever reclaims a dead server's segment (gc, a starting server) unlinks the file too.

Port aliases (``Client('localhost:PORT')``) are small files ``/dev/shm/rvshm.port.<PORT>``,
mode 0600, holding the server name and owner pid.
"""
import errno
import fcntl
import ipaddress
import logging
import mmap
import os
import re
import resource
import secrets
import socket
import stat
import threading
import weakref
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import msgpack
import posix_ipc

from reverb_shm import errors
from reverb_shm._internal import owner_watch
from reverb_shm._internal._lib import check, ffi, last_error, lib

__all__ = ["Segment", "validate_server_name", "validate_mode", "register_port", "unregister_port",
           "prune_stale_aliases", "list_segments", "remove_stale", "is_local_host",
           "resolve_address", "segment_path", "reclaim_dead", "allocated_bytes", "start_bytes",
           "os_error", "SHM_DIR"]

log = logging.getLogger("reverb_shm.shm")

SHM_DIR = "/dev/shm"
_PREFIX = "rvshm."
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_MiB = 1 << 20
_MIN_SEGMENT_BYTES = 64


def validate_server_name(name: str) -> str:
  """Returns `name` if it is 1..64 characters of [A-Za-z0-9_.-]; raises ValueError otherwise."""
  if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
    raise ValueError(f"invalid server name {errors.quoted_name(name)}: expected 1 to 64 "
                     f"characters from "
                     "[A-Za-z0-9_.-] (no '/')")
  return name


_MODES = (0o600, 0o660)


def validate_mode(mode: int) -> int:
  """Returns `mode` if it is 0o600 (owner only) or 0o660 (owner and group); else ValueError."""
  if isinstance(mode, bool) or not isinstance(mode, int) or mode not in _MODES:
    raise ValueError(f"segment mode must be 0o600 (owner only) or 0o660 (owner and group), "
                     f"got {mode!r}")
  return mode


def _shm_name(name: str) -> str:
  return "/" + _PREFIX + name


def segment_path(name: str) -> str:
  """Filesystem path of the segment of server `name` (for stat / diagnostics)."""
  return os.path.join(SHM_DIR, _PREFIX + name)


def _free_bytes() -> int:
  try:
    st = os.statvfs(SHM_DIR)
  except OSError as e:
    raise os_error(e, f"cannot use {SHM_DIR}") from None
  return st.f_bavail * st.f_frsize


def _errno_of(e: BaseException) -> Optional[int]:
  """The errno behind `e`: posix_ipc reports some causes (too many open files) without one."""
  if isinstance(e, posix_ipc.PermissionsError):
    return errno.EACCES
  if getattr(e, "errno", None):
    return e.errno  # type: ignore[attr-defined]
  try:   # no errno: is it that no file may be opened?
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
  except OSError as probe:
    return probe.errno
  os.close(fd)
  return None


def _what_to_do(code: Optional[int]) -> str:
  if code == errno.ENOENT and not os.path.isdir(SHM_DIR):
    return (f"reverb_shm keeps its servers in POSIX shared memory, a tmpfs mounted on {SHM_DIR}, "
            f"which this system lacks: mount one (mount -t tmpfs -o size=1g tmpfs {SHM_DIR})")
  if code == errno.EMFILE:
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (f"this process has as many files open as its limit allows (RLIMIT_NOFILE {limit}, "
            "`ulimit -n`); a server keeps 3 files open and every server a process uses 1 or 2: "
            "raise the limit or close files")
  if code == errno.EFBIG:
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return ("the file is as large as the server may grow (sparse: memory or disk is taken only as "
            f"it is used), and this process may not make files that large (RLIMIT_FSIZE {limit} "
            "bytes, `ulimit -f`): raise the limit, or create the server with a smaller max_bytes")
  if code == errno.ENFILE:
    return "the system's open-file limit is reached (fs.file-max): close files or raise it"
  if code == errno.EROFS:
    return (f"{SHM_DIR} is mounted read-only; reverb_shm keeps its servers there and needs it "
            "writable (remount it read-write; in a container, do not mount /dev/shm read-only)")
  if code == errno.EACCES:
    return (f"this user may not create files in {SHM_DIR}; reverb_shm needs it writable by every "
            "user that runs a server (mode 1777, as Linux sets it up)")
  if code == errno.ENOSPC:
    return f"{SHM_DIR} has no room left (space or inodes): free some, or give it more room"
  if code == errno.EAGAIN:
    return ("no thread could be created: this user has as many processes and threads as its "
            "limit allows (RLIMIT_NPROC, `ulimit -u`): raise the limit or end processes")
  return "a system call failed"


def os_error(e: BaseException, doing: str, code: Optional[int] = None) -> errors.SystemCallError:
  """The SystemCallError for `e` (an OSError or a posix_ipc error; or any error, whose errno is
  then `code`) met while `doing`: its errno, the system's reason and what the user can change."""
  code = code or _errno_of(e)
  message = f"{doing}: {os.strerror(code) if code else e} ({_what_to_do(code)})"
  return errors.SystemCallError(code, message) if code else errors.SystemCallError(message)


def out_of_descriptors() -> bool:
  """Whether this process cannot open one more file: its RLIMIT_NOFILE is reached."""
  try:
    fd = os.open(os.devnull, os.O_RDONLY)
  except OSError as e:
    return e.errno == errno.EMFILE
  os.close(fd)
  return False


def descriptor_error(e: OSError, doing: str) -> OSError:
  """The error to raise for `e`, an OSError of a step that opens files (Python's tempfile, a
  directory listing, a socket) met while `doing`: the SystemCallError(EMFILE) naming
  RLIMIT_NOFILE when no descriptor is free (tempfile then reports a misleading ENOENT), else
  `e` itself."""
  if e.errno == errno.EMFILE or out_of_descriptors():
    return os_error(e, doing, errno.EMFILE)
  return e


def _access_denied(what: str) -> errors.AccessDeniedError:
  return errors.AccessDeniedError(
      f"{what} (a server's segment and port alias admit their creator's user only, or also its "
      "group when the server was created with mode=0o660): run this process as the server's "
      "user, or start the server with mode=0o660 and this user in its group")


def _owner_alive(pid: int, start_time: int) -> bool:
  """Whether process `pid` of this pid namespace, started at `start_time`, lives (pids only:
  see _owner_live for a server that may live in another pid namespace)."""
  return pid > 0 and lib.rs_proc_start_time(pid) == start_time and start_time != 0


def _owner_live(name: str, pid: int, start_time: int) -> bool:
  """Whether the server `name` whose owner is (`pid`, `start_time`) lives: its pid here, or
  its liveness lock (a server in another pid namespace sharing /dev/shm), or its creation lock."""
  return _owner_alive(pid, start_time) or _life_locked(name)


def _header_owner(mem) -> Tuple[int, int]:
  """(pid, start_time) from the header of open segment `mem`; (0, 0) before initialisation."""
  if mem.size < 48:
    return (0, 0)
  with mmap.mmap(mem.fd, 48, prot=mmap.PROT_READ) as mm:
    header = bytes(mm[:48])
  pid = int.from_bytes(header[32:36], "little", signed=True)
  start_time = int.from_bytes(header[40:48], "little")
  return (pid, start_time)


def _names_file(fd: int, name: str) -> bool:
  """True if the segment name of server `name` still refers to the file open as `fd`."""
  try:
    st = os.stat(segment_path(name))
  except FileNotFoundError:
    return False
  fst = os.fstat(fd)
  return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _examine(name: str, reclaim: bool = False) -> Optional[dict]:
  """Owner state of the segment of server `name`, unlinking it if stale and `reclaim`.

  Returns None if there is no such segment, else a dict: pid (owner, 0 if not initialised),
  state ("live", "starting": its creator holds the creation lock, "foreign": another user's,
  which this process may not open, or "stale": owner dead or creator died before initialising
  it) and removed (True if this call unlinked it). The
  verdict and the unlink happen under the segment's creation lock (see the module docstring).
  """
  shm_name = _shm_name(name)
  try:
    mem = posix_ipc.SharedMemory(shm_name)
  except posix_ipc.ExistentialError:
    return None
  except posix_ipc.PermissionsError:   # another user's server: never ours to judge or remove
    return {"pid": 0, "state": "foreign", "removed": False}
  try:
    try:
      fcntl.flock(mem.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:   # being created, or its owner holds its life lock
      pid = _header_owner(mem)[0]
      return {"pid": pid, "state": "live" if pid else "starting", "removed": False}
    if not _names_file(mem.fd, name):
      return None                   # unlinked (and maybe re-created) since we opened it
    pid, start_time = _header_owner(mem)
    if _owner_alive(pid, start_time) or lib.rs_live_probe(mem.fd, 0) == 1:
      return {"pid": pid, "state": "live", "removed": False}
    if reclaim:
      try:
        posix_ipc.unlink_shared_memory(shm_name)
      except posix_ipc.ExistentialError:
        pass
    return {"pid": pid, "state": "stale", "removed": reclaim}
  finally:
    mem.close_fd()                  # releases the lock


def _table_configs(tables):
  """(rs_table_config[] of `tables`, objects that must outlive it)."""
  cfgs = ffi.new("rs_table_config[]", len(tables))
  keep = []
  for cfg, table in zip(cfgs, tables):
    name_bytes = table.name.encode("utf-8")
    ffi.memmove(cfg.name, name_bytes, len(name_bytes))
    rl = table.rate_limiter
    cfg.max_size = table.max_size
    cfg.max_times_sampled = table.max_times_sampled
    cfg.sampler_kind = table.sampler.kind
    cfg.sampler_exponent = table.sampler.exponent
    cfg.remover_kind = table.remover.kind
    cfg.remover_exponent = table.remover.exponent
    cfg.samples_per_insert = rl.samples_per_insert
    cfg.min_size_to_sample = rl.min_size_to_sample
    cfg.min_diff = rl.min_diff
    cfg.max_diff = rl.max_diff
    blob = ffi.from_buffer(table.config_blob())
    keep.append(blob)
    cfg.blob = ffi.cast("const uint8_t *", blob)
    cfg.blob_len = len(blob)
  return cfgs, keep


def start_bytes(tables, arena_bytes: int, max_procs: int = 128, pins_per_proc: int = 65536) -> int:
  """Bytes a server of `tables` reserves in /dev/shm when it starts with `arena_bytes` (its
  header, the tables' metadata, the first arena extent and the first pins of every pin log).
  Raises ValueError on a bad configuration."""
  cfgs, keep = _table_configs(tables)  # pylint: disable=unused-variable
  initial = ffi.new("uint64_t *")
  if lib.rs_segment_size_ex(cfgs, len(tables), max_procs, pins_per_proc, arena_bytes, arena_bytes,
                            initial) == 0:
    raise ValueError(f"invalid segment configuration: {last_error()}")
  return initial[0] + lib.rs_segment_start_pin_bytes(max_procs, pins_per_proc)


class Segment:
  """A mapped reverb_shm segment.

  Attributes:
    name: server name.
    base: cffi `void *` of the mapping in this process.
    buf: writable memoryview of the whole mapping.
    size: mapping size in bytes.

  Thread-safe: the C core locks; slot registration is guarded by a lock.
  """

  _cache: Dict[tuple, "Segment"] = {}
  _cache_lock = threading.Lock()

  def __init__(self, name: str, mem_fd: int, size: int, owner: bool):
    self.name = name
    self.size = size
    self.owner = owner
    try:
      self._mm = mmap.mmap(mem_fd, size)
    except OSError as e:
      if e.errno in (errno.EMFILE, errno.ENFILE):   # mmap keeps a duplicate of the fd
        raise os_error(e, f"cannot map the segment of server {errors.quoted_name(name)}") from None
      if e.errno != errno.ENOMEM:
        raise
      raise errors.ResourceExhaustedError(
          f"cannot map the segment of server {errors.quoted_name(name)}: it spans "
          f"{size / _MiB:.1f} MiB of address "
          f"space (its tables plus room for the arena up to the server's max_bytes) and this "
          f"process may not map that much ({e.strerror}; `ulimit -v`?): raise the address-space "
          f"limit, or create the server with a smaller max_bytes") from None
    self.buf = memoryview(self._mm)
    self._base_buf = ffi.from_buffer(self._mm)
    self.base = ffi.cast("void *", self._base_buf)
    self.address = int(ffi.cast("uintptr_t", self.base))
    # This process's registration: (pid, slot, generation) or None. Replaced as a whole, so
    # readers need no lock; changes happen under _slot_lock (reentrant: a Pins finaliser may
    # run inside a locked section of the same thread).
    self._registration: Optional[Tuple[int, int, int]] = None
    self._generation = 0     # bumped on every register and unregister
    self._slot_lock = threading.RLock()
    _segments.add(self)
    self._table_names: Optional[List[str]] = None
    self._configs: dict = {}
    self._closed = False
    # Set (by the owner_watch thread) once the server owning an attached segment is seen
    # dead; the objects in _death_listeners then hear of it (_on_server_death()).
    self.owner_dead = False
    self._death_listeners: weakref.WeakSet = weakref.WeakSet()
    # Appended to "arena full" errors: which setting sizes this arena (the bridge's
    # staging segments name theirs).
    self.arena_hint = ""
    self.arena_path: Optional[str] = None   # disk tier: the arena's file
    # This process's own open file of the segment: its liveness locks (the owner's byte 0 and
    # flock, its slot's byte) and the probes of others' (see the module docstring).
    self._live_fd = _reopen(mem_fd, name)
    self._live = [self._live_fd]      # shared with the finaliser (a fork child replaces it)
    lib.rs_set_liveness_fd(self.base, self._live_fd)
    weakref.finalize(self, _forget_live_fd, self.address, self._live)
    self._life_locked = False   # owner: holds its flock and byte 0

  # ---- creation / attachment
  @classmethod
  def create(cls, name: str, tables: Sequence, *, arena_bytes: int, max_procs: int = 128,
             pins_per_proc: int = 65536, mode: int = 0o600, max_bytes: Optional[int] = None,
             max_share: Optional[float] = None, storage: Optional[str] = None) -> "Segment":
    """Creates and initialises the segment of server `name` holding `tables`.

    Args:
      name: validated server name.
      tables: reverb_shm.Table objects (configuration).
      arena_bytes: bytes for chunk data and item descriptors to start with.
      max_procs: maximum number of processes attached at once.
      pins_per_proc: maximum chunks/items one process may pin at once (each process's pin log
        grows to it as needed, 12 bytes per pin).
      mode: permission bits of the segment: 0o600 (default) or 0o660 (group may attach).
      max_bytes: the most bytes of /dev/shm the segment may hold (header, tables, arena and pin
        logs); the arena grows by extents up to it. None: the arena keeps arena_bytes.
      max_share: with max_bytes None, max_bytes is this share of the space /dev/shm has free
        now (at least what the segment needs to start).
      storage: a directory on a local filesystem: the arena lives in a file there (disk tier,
        see the module docstring); max_bytes (or max_share of the directory's free space)
        then bounds that file, and /dev/shm holds only the header, tables and pin logs.

    Raises:
      ValueError: bad name or configuration, max_bytes below the starting size.
      ResourceExhaustedError: /dev/shm lacks the space ("need X MiB, /dev/shm has Y MiB free",
        with the settings that size it).
      SegmentInUseError: a live server owns a segment of that name.
    """
    validate_server_name(name)
    validate_mode(mode)
    for arg, value in (("arena_bytes", arena_bytes), ("max_procs", max_procs),
                       ("pins_per_proc", pins_per_proc)) + (
                           (("max_bytes", max_bytes),) if max_bytes is not None else ()):
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{arg} must be a positive int, got {value!r}")
      limit = 1 << (63 if arg.endswith("bytes") else 32)
      if value >= limit:
        raise ValueError(f"{arg}={value} is too large: expected below 2**{limit.bit_length() - 1}")
    cfgs, keep = _table_configs(tables)  # pylint: disable=unused-variable  (keeps blobs alive)
    initial = ffi.new("uint64_t *")
    if lib.rs_segment_size_ex(cfgs, len(tables), max_procs, pins_per_proc, arena_bytes,
                              arena_bytes, initial) == 0:
      raise ValueError(f"invalid segment configuration: {last_error()}")
    initial_bytes = initial[0]     # header, tables and the first arena extent
    pin_bytes = lib.rs_segment_start_pin_bytes(max_procs, pins_per_proc)
    start = initial_bytes + pin_bytes
    arena_off = initial_bytes - ((arena_bytes + 63) & ~63)
    free = _free_bytes()
    if storage is not None:
      storage = _storage_dir(storage)
      if max_bytes is None:
        st = os.statvfs(storage)
        max_bytes = max(start, int(st.f_bavail * st.f_frsize * (max_share or 0.5)))
      shm_start = arena_off + pin_bytes     # header + tables, and the first pins of the pin logs
      if shm_start > free:
        raise errors.ResourceExhaustedError(_no_room(name, shm_start, free))
      free = max(free, start)               # the arena's bytes go to the file
    if max_bytes is None and max_share is not None:
      max_bytes = max(start, int(free * max_share))
    if max_bytes is not None and max_bytes < start:
      raise ValueError(f"max_bytes={max_bytes} ({max_bytes / _MiB:.1f} MiB) is below the "
                       f"{start / _MiB:.1f} MiB server {errors.quoted_name(name)} needs to start "
                       f"(its tables' "
                       "metadata + arena_bytes): raise max_bytes, or lower arena_bytes or the "
                       "tables' max_size")
    arena_max = arena_bytes if max_bytes is None else max(arena_bytes, max_bytes)
    size = lib.rs_segment_size_ex(cfgs, len(tables), max_procs, pins_per_proc, arena_bytes,
                                  arena_max, initial)
    if size == 0:
      raise ValueError(f"invalid segment configuration: {last_error()}")
    if start > free:
      raise errors.ResourceExhaustedError(_no_room(name, start, free))
    shm_name = _shm_name(name)
    generation = secrets.randbits(64)
    mem = cls._create_exclusive(name, shm_name, mode)   # creation lock held until close_fd
    arena_path = None
    try:
      os.fchmod(mem.fd, mode)
      try:
        os.ftruncate(mem.fd, size)    # sparse: only what is reserved holds memory
      except OSError as e:
        raise os_error(e, f"cannot size segment {segment_path(name)} of server "
                          f"{errors.quoted_name(name)} to "
                       f"{size / _MiB:.1f} MiB") from None
      try:
        os.posix_fallocate(mem.fd, 0, arena_off if storage is not None else initial_bytes)
      except OSError as e:
        raise errors.ResourceExhaustedError(
            _no_room(name, start, _free_bytes(), f" ({e.strerror})")) from None
      seg = cls(name, mem.fd, size, owner=True)
      try:
        if storage is not None:
          arena_path = os.path.join(storage, f"{_PREFIX}{name}.{generation:016x}.arena")
          seg._map_arena_file(arena_path, arena_off, arena_max,
                              create=(mode, initial_bytes - arena_off))
        pid = os.getpid()
        # the owner's liveness lock first (OFD locks do not meet the creation flock)
        check(lib.rs_live_lock(seg._live_fd, 0, 1), f"locking segment of server "
                                                    f"{errors.quoted_name(name)}")
        check(lib.rs_segment_init_ex(seg.base, size, cfgs, len(tables), max_procs, pins_per_proc,
                                     arena_bytes, arena_max, max_bytes or 0, pid,
                                     lib.rs_proc_start_time(pid), generation),
              f"initialising segment of server {errors.quoted_name(name)}")
        if storage is not None:
          lib.rs_segment_set_arena_file(seg.base)
      except BaseException:
        seg._closed = True
        raise
    except BaseException:
      posix_ipc.unlink_shared_memory(shm_name)
      if arena_path is not None:
        _unlink_arena_file(name)
      raise
    finally:
      # Explicitly: the mapping holds a dup of the fd, which would keep the lock (and pass it
      # to forked children) after close_fd.
      fcntl.flock(mem.fd, fcntl.LOCK_UN)
      mem.close_fd()
    seg._hold_life_lock()
    with cls._cache_lock:
      cls._cache[(name, os.getpid())] = seg
    return seg

  def _hold_life_lock(self) -> None:
    """The owner's shared flock on its segment file, held while it lives (liveness that does
    not depend on pids: see the module docstring). Best effort: without it, pids decide."""
    try:
      fcntl.flock(self._live_fd, fcntl.LOCK_SH)   # waits out a gc that is judging it right now
      self._life_locked = True
    except OSError:
      pass

  def _drop_life_lock(self) -> None:
    """Drops the owner's flock and liveness byte (its slot's byte stays while registered)."""
    if self._life_locked:
      self._life_locked = False
      fcntl.flock(self._live_fd, fcntl.LOCK_UN)
    if self.owner:
      lib.rs_live_lock(self._live_fd, 0, 0)

  def owner_alive(self) -> bool:
    """Whether the server owning this segment lives: its pid and start time here, or (a server
    in another pid namespace) its liveness lock on the segment's file."""
    info = self.info()
    return (_owner_alive(info["owner_pid"], info["owner_start_time"])
            or lib.rs_live_probe(self._live_fd, 0) == 1)

  def slot_locked(self, slot: int) -> bool:
    """Whether another open file of the segment holds the liveness lock of process slot `slot`
    (its process lives, in this pid namespace or another)."""
    return lib.rs_live_probe(self._live_fd, 1 + slot) == 1

  def _map_arena_file(self, path: str, arena_off: int, arena_max: int, create=None) -> None:
    """Maps the disk tier's arena file over the arena's range of this mapping.

    `create` = (mode, first extent bytes): the creator makes the file (O_EXCL) and first
    publishes its path in the storage sidecar, so that a crash never orphans the file.
    """
    if create is not None:
      sidecar = sidecar_path(self.name, "storage")
      fd = os.open(sidecar, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
      with os.fdopen(fd, "w") as f:
        f.write(path)
      try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, create[0])
      except OSError as e:
        raise errors.ResourceExhaustedError(
            f"cannot create the arena file {path} of server {errors.quoted_name(self.name)} "
            f"(storage=): "
            f"{e.strerror}; pass a writable directory on a disk file system") from None
      try:
        os.fchmod(fd, create[0])
        try:
          os.ftruncate(fd, arena_max)
        except OSError as e:
          raise os_error(e, f"cannot size the arena file {path} of server "
                            f"{errors.quoted_name(self.name)} to "
                         f"{arena_max / _MiB:.1f} MiB") from None
        try:
          os.posix_fallocate(fd, 0, create[1])
        except OSError as e:
          raise errors.ResourceExhaustedError(
              f"cannot create the arena file {path} of server {errors.quoted_name(self.name)}: "
              f"need "
              f"{create[1] / _MiB:.1f} MiB ({e.strerror}); free disk space or lower arena_bytes"
          ) from None
      except BaseException:
        os.close(fd)
        raise
    else:
      try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
      except OSError as e:
        raise errors.ServerUnavailableError(
            f"cannot open the arena file {path} of server {errors.quoted_name(self.name)} "
            f"(storage=): "
            f"{e.strerror}") from None
    rc = lib.rs_map_arena_file(self.base, arena_off, arena_max, fd)
    if rc != lib.RS_OK:
      os.close(fd)
      check(rc, f"mapping the arena file of server {errors.quoted_name(self.name)}")
    self.arena_path = path
    weakref.finalize(self, _forget_arena_file, self.address, fd)

  @staticmethod
  def _create_exclusive(name: str, shm_name: str, mode: int):
    """The new segment `shm_name`, opened with its creation lock held (see module docstring).

    Reclaims the name from a stale segment (dead owner, or creator died mid-creation).
    """
    for _ in range(5):
      try:
        mem = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, mode=mode)
      except (OSError, posix_ipc.PermissionsError) as e:
        doing = f"cannot create segment {segment_path(name)} of server {errors.quoted_name(name)}"
        raise os_error(e, doing) from None
      except posix_ipc.ExistentialError:
        found = _examine(name, reclaim=True)
        if found is not None and found["state"] == "live":
          raise errors.SegmentInUseError(
              f"a server named {errors.quoted_name(name)} is already running (segment "
              f"{segment_path(name)} "
              f"owned by live pid {found['pid']}); choose another name or stop it") from None
        if found is not None and found["state"] == "foreign":
          raise errors.SegmentInUseError(
              f"a server named {errors.quoted_name(name)} of another user exists (segment "
              f"{segment_path(name)}, "
              "which this user may not open or remove): choose another name") from None
        if found is not None and found["state"] == "starting":
          raise errors.SegmentInUseError(
              f"another process is creating a server named {errors.quoted_name(name)} (segment "
              f"{segment_path(name)}); choose another name") from None
        continue
      fcntl.flock(mem.fd, fcntl.LOCK_EX)      # waits only for a gc's brief look
      if _names_file(mem.fd, name):
        return mem
      mem.close_fd()    # a gc judged it stale before we locked it and unlinked it: again
    raise errors.SegmentInUseError(f"could not create segment {segment_path(name)}: it keeps "
                                   "reappearing or vanishing (other processes create or remove "
                                   "it concurrently)")

  @classmethod
  def attach(cls, name: str) -> "Segment":
    """The mapping of server `name` in this process (cached per process).

    Raises:
      ServerUnavailableError: no running server of that name.
      AccessDeniedError: another user's server (its segment may not be opened).
      CorruptError: the segment's layout does not match this build, or it is truncated.
      DeadOwnerError: the segment exists but the server that created it was killed.
    """
    validate_server_name(name)
    key = (name, os.getpid())
    with cls._cache_lock:
      seg = cls._cache.get(key)
      if seg is not None and not seg.owner_dead and not seg.is_closed():
        return seg
      try:
        mem = posix_ipc.SharedMemory(_shm_name(name))
      except posix_ipc.ExistentialError:
        raise errors.ServerUnavailableError(
            f"no reverb_shm server named {errors.quoted_name(name)} is running (no "
            f"{segment_path(name)})") from None
      except posix_ipc.PermissionsError as e:
        raise _access_denied(f"cannot open segment of server {errors.quoted_name(name)}: "
                             f"{e}") from None
      except OSError as e:
        doing = f"cannot open segment {segment_path(name)} of server {errors.quoted_name(name)}"
        raise os_error(e, doing) from None
      try:
        if mem.size < _MIN_SEGMENT_BYTES:   # mmap of an empty or tiny file: fail clearly
          raise errors.CorruptError(
              f"segment {segment_path(name)} of server {errors.quoted_name(name)} holds "
              f"{mem.size} bytes, smaller "
              f"than a segment header: truncated, or its creator is still initialising it")
        seg = cls(name, mem.fd, mem.size, owner=False)
      finally:
        mem.close_fd()
      check(lib.rs_segment_validate(seg.base, seg.size), f"attaching to server "
                                                         f"{errors.quoted_name(name)}")
      info = seg.info()
      if info["arena_file"]:
        try:
          with open(sidecar_path(name, "storage"), encoding="utf-8") as f:
            path = f.read()
        except OSError:
          raise errors.ServerUnavailableError(
              f"server {errors.quoted_name(name)} keeps its arena in a file, but its storage "
              f"sidecar "
              f"{sidecar_path(name, 'storage')} is missing (server stopping or removed)") from None
        seg._map_arena_file(path, info["arena_off"], info["arena_max"])
      if not seg.owner_alive():
        seg._closed = True
        raise seg.dead_owner_error()
      cls._cache[key] = seg
    ref = weakref.ref(seg)

    def locked() -> bool:   # the owner's liveness lock (a server in another pid namespace)
      live = ref()
      return live is not None and not live.owner_dead and \
          lib.rs_live_probe(live._live_fd, 0) == 1  # pylint: disable=protected-access

    def died() -> None:
      alive = ref()
      if alive is not None:
        alive._owner_died()  # pylint: disable=protected-access

    try:
      owner_watch.watch(info["owner_pid"], info["owner_start_time"], died, locked=locked)
    except RuntimeError as e:   # its thread could not start: attach again on the next call
      seg.close()
      raise os_error(e, f"cannot attach to server {errors.quoted_name(name)}: the thread that "
                        f"notices the "
                     "server's death could not be started", errno.EAGAIN) from None
    return seg

  def closed_error(self) -> "errors.TableClosedError":
    """The error every use of this segment raises once it was closed in this process (its
    server stopped): one message, whichever step (registering, writing a chunk) notices it."""
    return errors.TableClosedError(
        f"server {errors.quoted_name(self.name)} stopped: its segment was closed in this process "
        f"and this "
        "process's registration ended (its chunks can no longer be written); attach again "
        "(a new Client) to use a restarted server")

  def dead_owner_error(self) -> "errors.DeadOwnerError":
    """The error every Client call raises once this segment's server is dead."""
    return errors.DeadOwnerError(
        f"server {errors.quoted_name(self.name)} is dead (owner pid {self.info()['owner_pid']} is "
        f"gone) but its "
        f"segment {segment_path(self.name)} remains: restart the server (it reclaims the name) "
        "or run `reverb-shm gc`")

  def add_death_listener(self, listener) -> None:
    """`listener._on_server_death()` is called (from another thread) when the server dies."""
    self._death_listeners.add(listener)

  def _owner_died(self) -> None:
    if not self._closed and self.info()["closed"]:
      return      # stopped cleanly: calls raise TableClosedError, not DeadOwnerError
    self.owner_dead = True
    for listener in list(self._death_listeners):
      listener._on_server_death()  # pylint: disable=protected-access

  # ---- process slot
  @property
  def slot(self) -> int:
    """This process's slot in the segment, registered on first use (again after a fork)."""
    return self.registration()[0]

  def registration(self) -> Tuple[int, int]:
    """(slot, generation) of this process's registration, registering on first use.

    The generation changes whenever this process registers or unregisters (close(), fork), so
    pins recorded with an older generation are known to be gone (see :meth:`unpin`).

    Raises:
      TableClosedError: close() was called (the server stopped).
      ResourceExhaustedError: every process slot is taken.
    """
    reg = self._registration
    pid = os.getpid()
    if reg is None or reg[0] != pid:
      with self._slot_lock:
        reg = self._registration
        if reg is None or reg[0] != pid:
          if self._closed:
            raise self.closed_error()
          out = ffi.new("uint32_t *")
          check(lib.rs_proc_register(self.base, pid, lib.rs_proc_start_time(pid), out),
                f"registering process {pid} with server {errors.quoted_name(self.name)}")
          self._generation += 1
          reg = self._registration = (pid, out[0], self._generation)
    return reg[1], reg[2]

  @property
  def generation(self) -> int:
    """Changes whenever this process registers or unregisters (see :meth:`registration`)."""
    return self._generation

  def unpin(self, generation: int, pins) -> bool:
    """Drops `pins` (uint32 pin ids, C-contiguous) taken under registration `generation`.

    A no-op returning False when that registration is over (this process unregistered, or is
    a fork child of the process that took them): unregistering dropped the pins already, and
    the slot number may now belong to a newer registration whose pins must stay.

    Raises:
      ReverbError: the C core rejected the pins (a pin not held by the slot).
    """
    with self._slot_lock:
      reg = self._registration
      if reg is None or reg[2] != generation or reg[0] != os.getpid():
        return False
      check(lib.rs_unpin(self.base, reg[1], len(pins), ffi.from_buffer("uint32_t[]", pins)),
            f"releasing {len(pins)} pins")
    return True

  def _after_fork_in_child(self) -> None:
    # Another thread of the parent may have held the lock at fork time. The parent's
    # registration, pins and chunks are not this process's: make them stale.
    self._slot_lock = threading.RLock()
    self._registration = None
    self._generation += 1
    # The parent's open file (and its liveness locks) stays the parent's: a file of our own.
    old = self._live_fd
    lib.rs_forget_liveness_fd(self.base, old)
    self._life_locked = False
    try:
      self._live_fd = _reopen(old, self.name)
    finally:
      os.close(old)
    self._live[0] = self._live_fd
    lib.rs_set_liveness_fd(self.base, self._live_fd)

  # ---- tables
  def table_names(self) -> List[str]:
    if self._table_names is None:
      n = self.info()["num_tables"]
      out = ffi.new("char[64]")
      names = []
      for i in range(n):
        check(lib.rs_table_name(self.base, i, out))
        names.append(ffi.string(out).decode("utf-8"))
      self._table_names = names
    return list(self._table_names)

  def table_index(self, table_name: str) -> int:
    """Index of `table_name`; UnknownTableError lists the available tables."""
    try:
      return self.table_names().index(table_name)
    except ValueError:
      raise errors.UnknownTableError(
          f"table {errors.quoted_name(table_name)} not found on server "
          f"{errors.quoted_name(self.name)}; available tables: "
          f"{self.table_names()}") from None

  def table_config(self, index: int) -> dict:
    """Decoded msgpack config blob of table `index` (keys: version, signature)."""
    config = self._configs.get(index)
    if config is None:
      off, length = ffi.new("uint64_t *"), ffi.new("uint32_t *")
      check(lib.rs_table_blob(self.base, index, off, length))
      config = msgpack.unpackb(bytes(self.buf[off[0]:off[0] + length[0]]), raw=False,
                               strict_map_key=False)
      self._configs[index] = config
    return config

  def stats(self, index: int) -> dict:
    """rs_table_stats of table `index` as a dict."""
    out = ffi.new("rs_table_stats *")
    check(lib.rs_table_get_stats(self.base, index, out), f"reading stats of table {index}")
    return _struct_dict(out, "rs_table_stats")

  def info(self) -> dict:
    """rs_segment_info as a dict."""
    out = ffi.new("rs_segment_info *")
    check(lib.rs_segment_get_info(self.base, out), f"reading segment of server "
                                                   f"{errors.quoted_name(self.name)}")
    return _struct_dict(out, "rs_segment_info")

  def is_closed(self) -> bool:
    return self._closed or bool(self.info()["closed"])

  def check(self) -> None:
    """Runs the C invariant checker (rs_check) over every table and the arena.

    Takes every lock briefly. Raises:
      CorruptError: an invariant does not hold; the message is the checker's report.
    """
    report = ffi.new("char[]", 1 << 16)
    rc = lib.rs_check(self.base, report, len(report))
    if rc == lib.RS_ECORRUPT:
      raise errors.CorruptError(ffi.string(report).decode("utf-8", "replace"))
    check(rc, f"checking invariants of server {errors.quoted_name(self.name)}")

  # ---- teardown
  def close(self) -> None:
    """Releases this process's slot (and its pins) and forgets the cached mapping.

    Pins and Chunks taken before become stale: their release() is then a no-op.

    The mapping itself is unmapped by garbage collection once no array, table or thread of
    this process uses it any more, so live zero-copy views never dangle. Idempotent.
    """
    with self._slot_lock:
      reg, self._registration = self._registration, None
      self._generation += 1     # before unregistering: pins of `reg` are stale from here on
      if reg is not None and reg[0] == os.getpid():
        lib.rs_proc_unregister(self.base, reg[1])
    self._closed = True
    with Segment._cache_lock:
      key = (self.name, os.getpid())
      if Segment._cache.get(key) is self:
        del Segment._cache[key]

  def unlink(self) -> None:
    """Removes the segment's name, and with the disk tier its arena file and sidecar (owner
    only; existing mappings stay valid). Idempotent."""
    if not self.owner:
      raise PermissionError(f"only the server owning {errors.quoted_name(self.name)} may unlink "
                            f"its segment")
    if self.arena_path is not None:
      _unlink_arena_file(self.name)
    try:
      posix_ipc.unlink_shared_memory(_shm_name(self.name))
    except posix_ipc.ExistentialError:
      pass
    self._drop_life_lock()

  def __repr__(self):
    return f"Segment(name={self.name!r}, size={self.size}, owner={self.owner})"


_segments: weakref.WeakSet = weakref.WeakSet()


def _reopen(fd: int, name: str) -> int:
  """A new open file (read-only, close-on-exec) of the file open as `fd` (segment `name`)."""
  try:
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
  except OSError as e:   # no /proc: by name, if the name still refers to that file
    if e.errno in (errno.EMFILE, errno.ENFILE):
      raise os_error(e, f"cannot open segment {segment_path(name)} of server "
                        f"{errors.quoted_name(name)}") from None
    new = os.open(segment_path(name), os.O_RDONLY | os.O_CLOEXEC)
    a, b = os.fstat(fd), os.fstat(new)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
      os.close(new)
      raise errors.ServerUnavailableError(
          f"the segment of server {errors.quoted_name(name)} was removed while it was being "
          f"mapped") from None
    return new


def _forget_live_fd(address: int, holder: List[int]) -> None:
  lib.rs_forget_liveness_fd(ffi.cast("void *", address), holder[0])
  try:
    os.close(holder[0])
  except OSError:
    pass



def _forget_arena_file(address: int, fd: int) -> None:
  lib.rs_unmap_arena_file(ffi.cast("void *", address))
  os.close(fd)


def _storage_dir(path) -> str:
  if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes) or \
      not os.fspath(path):
    raise ValueError(f"storage must be a directory path (str or os.PathLike), got {path!r}")
  path = os.path.abspath(os.fspath(path))
  if not os.path.isdir(path):
    raise ValueError(f"storage={path!r} is not a directory (the disk tier keeps each server's "
                     "arena in a file there)")
  if os.path.realpath(path).startswith(os.path.realpath(SHM_DIR)):
    raise ValueError(f"storage={path!r} is inside {SHM_DIR}: it should be a disk directory")
  if not os.access(path, os.W_OK | os.X_OK):
    raise ValueError(f"storage={path!r} is not writable by this user (or is on a read-only "
                     "file system): the disk tier creates each server's arena file there")
  return path


def _owned_regular_file(path: str, follow: bool = False) -> bool:
  """Whether `path` is a regular file owned by this process's effective user."""
  try:
    st = os.stat(path) if follow else os.lstat(path)
  except OSError:
    return False
  return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _arena_file_of_sidecar(sidecar: str) -> Optional[str]:
  """The arena file a storage sidecar names, if both are ours: the sidecar and the file are
  regular files owned by this user (not links), and the file is named as the server of the
  sidecar names its arena files (rvshm.<name>.<16 hex digits>.arena). Anything else (a sidecar
  another user wrote in the shared /dev/shm, a path to some other file) names nothing."""
  name = os.path.basename(sidecar).split(".", 1)[-1]
  try:
    fd = os.open(sidecar, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
  except OSError:
    return None
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
      return None
    path = os.read(fd, 8192).decode("utf-8", "replace")
  except OSError:
    return None
  finally:
    os.close(fd)
  pattern = re.escape(_PREFIX + name) + r"\.[0-9a-f]{16}\.arena"
  if not os.path.isabs(path) or not re.fullmatch(pattern, os.path.basename(path)):
    return None
  return path if _owned_regular_file(path) else None


def _unlink_arena_file(name: str) -> None:
  """Unlinks the arena file of server `name` named by its storage sidecar, then the sidecar."""
  sidecar = sidecar_path(name, "storage")
  path = _arena_file_of_sidecar(sidecar)
  for doomed in ((path,) if path else ()) + (sidecar,):
    try:
      os.unlink(doomed)
    except OSError:
      pass


def _no_room(name: str, need: int, free: int, why: str = "") -> str:
  return (f"cannot create segment for server {errors.quoted_name(name)}: need {need / _MiB:.1f} "
          f"MiB, {SHM_DIR} has "
          f"{free / _MiB:.1f} MiB free{why}. The server starts with its tables' metadata (about "
          "150-350 bytes per unit of max_size) + arena_bytes; lower arena_bytes (the arena grows "
          "by itself up to max_bytes) or the tables' max_size, stop other servers "
          "(`reverb-shm list`), or give /dev/shm more room (docker run --shm-size=1g)")


def _reset_locks_in_child() -> None:
  # A thread of the parent may have held the cache lock at fork time: it would never be
  # released in the child, whose only thread is the forking one.
  Segment._cache_lock = threading.Lock()  # pylint: disable=protected-access
  # Nor may it keep its parent's segments alive: each segment's open file (holding the
  # parent's liveness locks) is replaced by the child's own (the parent's locks stay).
  for seg in list(_segments):
    seg._after_fork_in_child()  # pylint: disable=protected-access


os.register_at_fork(after_in_child=_reset_locks_in_child)

_FIELDS: dict = {}


def _struct_dict(cdata, ctype: str) -> dict:
  fields = _FIELDS.get(ctype)
  if fields is None:
    fields = _FIELDS[ctype] = [f for f, _ in ffi.typeof(ctype).fields]
  return {f: getattr(cdata, f) for f in fields}


# ---------------------------------------------------------------- port aliases
def _alias_path(port: int) -> str:
  return os.path.join(SHM_DIR, f"{_PREFIX}port.{int(port)}")


def _unlink_stale_files(is_stale, dry_run: bool) -> List[str]:
  """Unlinks (unless dry_run) every file of SHM_DIR for which is_stale(entry) holds; paths."""
  removed: list = []
  try:
    entries = os.listdir(SHM_DIR)
  except OSError:
    return removed
  for entry in entries:
    if not is_stale(entry):
      continue
    path = os.path.join(SHM_DIR, entry)
    removed.append(path)
    if not dry_run:
      try:
        os.unlink(path)
      except OSError:
        pass
  return removed


def prune_stale_aliases(dry_run: bool = False, names: Optional[Iterable[str]] = None) -> List[str]:
  """Removes port aliases whose owner process is dead; returns their paths.

  Args:
    dry_run: only report what would be removed.
    names: if given, only aliases naming one of these servers are considered.
  """
  names = None if names is None else set(names)

  def is_stale(entry: str) -> bool:
    if not entry.startswith(_PREFIX + "port."):
      return False
    alias = _read_alias(os.path.join(SHM_DIR, entry))
    return (alias is not None and (names is None or alias[0] in names)
            and not _owner_live(*alias))

  return _unlink_stale_files(is_stale, dry_run)


def _life_locked(name: str) -> bool:
  """Whether the segment of server `name` is locked by its owner (its liveness lock or flock)
  or by its creator: live."""
  try:
    fd = os.open(segment_path(validate_server_name(name)), os.O_RDONLY | os.O_CLOEXEC)
  except (OSError, ValueError):
    return False
  try:
    if lib.rs_live_probe(fd, 0) == 1:
      return True
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return False
  except BlockingIOError:
    return True
  except OSError:
    return False
  finally:
    os.close(fd)


def register_port(port: int, name: str, mode: int = 0o600) -> None:
  """Maps `port` to server `name` for this host (replaces a stale alias of a dead owner).

  `mode` (0o600 or 0o660, as the segment's) are the alias file's permission bits.
  """
  prune_stale_aliases()
  path = _alias_path(port)
  pid = os.getpid()
  data = f"{name}\n{pid}\n{lib.rs_proc_start_time(pid)}\n".encode()
  for _ in range(3):
    try:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
      alias = _read_alias(path)
      if alias is not None and _owner_live(*alias):
        raise errors.SegmentInUseError(f"port {port} is already registered by server "
                                       f"{alias[0]!r} (pid {alias[1]})") from None
      try:
        os.unlink(path)
      except FileNotFoundError:
        pass
      continue
    os.fchmod(fd, validate_mode(mode))
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    return
  raise errors.SegmentInUseError(f"could not register port {port}: {path} keeps reappearing")


def unregister_port(port: int, name: str) -> None:
  """Removes the alias of `port` if it still names server `name`."""
  path = _alias_path(port)
  alias = _read_alias(path)
  if alias is not None and alias[0] == name and alias[1] == os.getpid():
    try:
      os.unlink(path)
    except FileNotFoundError:
      pass


def _read_alias(path: str):
  try:
    with open(path, "rb") as f:
      lines = f.read().decode().split("\n")
    return lines[0], int(lines[1]), int(lines[2])
  except (OSError, ValueError, IndexError):   # gone, another user's (unreadable), or malformed
    return None


def local_hosts() -> set:
  """Lower-case names and addresses that mean this host ('localhost', its hostname, ...)."""
  return _local_hosts()


def port_is_registered(port: int) -> bool:
  """Whether a live reverb_shm server of this host is registered on `port`."""
  alias = _read_alias(_alias_path(port))
  return alias is not None and _owner_live(*alias)


def _local_hosts():
  hosts = {"localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0", "[::]", "::", "ip6-localhost"}
  try:
    hosts.add(socket.gethostname().lower())
    hosts.add(socket.getfqdn().lower())
  except OSError:
    pass
  return hosts


def is_local_host(host: str) -> bool:
  """Whether `host` names this host: a local name, or an IP address of one of its interfaces.

  An IP literal is local when a socket can bind to it (no DNS lookup is made).
  """
  host = host.lower()
  if host in _local_hosts():
    return True
  try:
    ip = ipaddress.ip_address(host.strip("[]"))
  except ValueError:
    return False
  family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
      sock.bind((str(ip), 0))
    return True
  except OSError:
    return False


def resolve_address(address: str) -> str:
  """Server name for `address`: 'shm://NAME', or 'HOST:PORT' with HOST this host.

  Raises:
    ValueError: malformed address or a host other than this one.
    ServerUnavailableError: nothing is registered on that port.
    AccessDeniedError: another user's server is registered on that port.
  """
  if not isinstance(address, str):
    raise TypeError(f"server address must be a str, got {type(address).__name__}")
  if address.startswith("shm://"):
    return validate_server_name(address[len("shm://"):])
  host, sep, port = address.rpartition(":")
  if not sep or not port.isdigit():
    raise ValueError(f"invalid server address {address!r}: expected 'HOST:PORT' or 'shm://NAME'")
  if not is_local_host(host):
    raise ValueError(f"server address {address!r} is not on this host; reverb_shm serves "
                     "processes on one host (use the gRPC bridge for remote clients)")
  path = _alias_path(int(port))
  alias = _read_alias(path)
  if alias is None and os.path.exists(path) and not os.access(path, os.R_OK):
    raise _access_denied(f"the server on port {port} (address {address!r}) belongs to another "
                         f"user: {path} is not readable by this one")
  if alias is None or not _owner_live(*alias):
    raise errors.ServerUnavailableError(f"no reverb_shm server is registered on port {port} "
                                        f"(address {address!r})")
  return alias[0]


def _segment_names(names: Optional[Iterable[str]]) -> List[str]:
  if names is not None:
    return sorted({validate_server_name(name) for name in names})
  try:
    entries = sorted(os.listdir(SHM_DIR))
  except OSError:
    return []
  return [entry[len(_PREFIX):] for entry in entries
          if entry.startswith(_PREFIX) and not entry.startswith(_PREFIX + "port.")]


def _scan(names: Optional[Iterable[str]], reclaim: bool) -> List[dict]:
  rows = []
  for name in _segment_names(names):
    path = segment_path(name)
    if not os.path.exists(path):
      continue
    size = allocated_bytes(path)    # what it holds (its file is as large as it may grow)
    found = _examine(name, reclaim)
    if found is not None:
      rows.append({"name": name, "path": path, "size": size, "pid": found["pid"],
                   "state": found["state"], "alive": found["state"] != "stale"})
  return rows


def list_segments(names: Optional[Iterable[str]] = None) -> List[dict]:
  """Segments of this host (or only of servers `names`).

  Returns:
    dicts with name, path, size (bytes of /dev/shm it holds), pid (owner; 0 while starting),
    state ("live", "starting": being created, "foreign": another user's, not accessible,
    "stale": owner dead) and alive (state != "stale").
  """
  return _scan(names, reclaim=False)


def remove_stale(dry_run: bool = False, names: Optional[Iterable[str]] = None,
                 storage: Optional[str] = None) -> List[str]:
  """Unlinks segments and port aliases whose owner process is dead; returns their paths.

  A segment still being created counts as live (see the module docstring).

  Args:
    dry_run: only report what would be removed.
    names: if given, only the segments and port aliases of these servers are considered.
    storage: a disk-tier directory: also its arena files (this user's) whose server has no
      segment any more (e.g. after /dev/shm was cleared by a reboot).

  Raises:
    ValueError: a name in `names` is not a valid server name, or `storage` is not a directory.
  """
  if names is not None:
    names = _segment_names(names)
  stale = [row for row in _scan(names, reclaim=not dry_run) if not row["alive"]]
  doomed = {row["name"] for row in stale}   # a dry run leaves them, yet reports their sidecars
  removed = ([row["path"] for row in stale] + prune_stale_aliases(dry_run, names) +
             _prune_orphan_sidecars(dry_run, names, doomed))
  if storage is not None:
    removed += _prune_orphan_arena_files(_storage_dir(storage), dry_run, names, doomed, removed)
  return removed


_ARENA_FILE_RE = re.compile(re.escape(_PREFIX) + r"([A-Za-z0-9_.\-]{1,64})\.[0-9a-f]{16}\.arena")


def _prune_orphan_arena_files(storage: str, dry_run: bool, names, doomed, done) -> List[str]:
  """Arena files of `storage` (regular files of this user, named as arena files are) whose
  server has no segment (or a stale one, in `doomed`). A server creates its segment before its
  arena file and removes the file first, so a file without a segment is an orphan."""
  orphans: list = []
  try:
    entries = sorted(os.listdir(storage))
  except OSError:
    return orphans
  for entry in entries:
    m = _ARENA_FILE_RE.fullmatch(entry)
    path = os.path.join(storage, entry)
    if (m is not None and path not in done and (names is None or m.group(1) in names)
        and (m.group(1) in doomed or not os.path.exists(segment_path(m.group(1))))
        and _owned_regular_file(path)):
      orphans.append(path)
  return _unlink_paths(orphans, dry_run)


def _unlink_paths(paths: Iterable[str], dry_run: bool) -> List[str]:
  """Unlinks (unless dry_run) each of `paths`; those it removed (or would remove)."""
  removed = []
  for path in paths:
    if not dry_run:
      try:
        os.unlink(path)
      except OSError:
        continue
    removed.append(path)
  return removed


def allocated_bytes(path: str) -> int:
  """Bytes of /dev/shm (or disk) that file `path` holds (its allocated blocks; 0 if gone).

  A segment's file size is the most it may grow to; only the allocated part uses memory.
  """
  try:
    return os.stat(path).st_blocks * 512
  except OSError:
    return 0


def _reverb_files() -> Dict[str, int]:
  """Allocated bytes of every reverb_shm file of SHM_DIR (segments, aliases, sidecars)."""
  try:
    entries = os.listdir(SHM_DIR)
  except OSError:
    return {}
  return {os.path.join(SHM_DIR, e): allocated_bytes(os.path.join(SHM_DIR, e))
          for e in entries if e.startswith(_PREFIX[:-1])}


def reclaim_dead(names: Optional[Iterable[str]] = None,
                 storage: Optional[str] = None) -> Tuple[List[str], int]:
  """Removes what servers whose owner process is dead left on this host; logs what it freed.

  Segments of live servers, and segments still being created (their creation lock is held),
  are never touched (see the module docstring). Runs when any Server starts, and as
  `reverb-shm gc`.

  Args:
    names: if given, only the files of these servers are considered.
    storage: a disk-tier directory whose orphaned arena files go too (see remove_stale).

  Returns:
    (removed paths, bytes of /dev/shm and of `storage` they held).
  """
  sizes = _reverb_files()
  if storage is not None:
    storage = _storage_dir(storage)
    try:
      for entry in os.listdir(storage):
        if _ARENA_FILE_RE.fullmatch(entry):
          sizes[os.path.join(storage, entry)] = allocated_bytes(os.path.join(storage, entry))
    except OSError:
      pass
  removed = remove_stale(names=names, storage=storage)
  freed = sum(sizes.get(path, 0) for path in removed)
  if removed:
    log.info("reclaimed %.1f MiB of %s held by %d file(s) of dead reverb_shm servers: %s",
             freed / _MiB, SHM_DIR, len(removed), ", ".join(removed))
  return removed, freed


def sidecar_path(name: str, kind: str) -> str:
  """Path of a small per-server file of `kind` (e.g. 'checkpointer') beside the segment.

  A server writes its sidecars after creating its segment and removes them before unlinking
  it, so a sidecar whose segment is gone belongs to a dead server (remove_stale prunes it).
  """
  return os.path.join(SHM_DIR, f"{_PREFIX[:-1]}-{kind}.{validate_server_name(name)}")


def _prune_orphan_sidecars(dry_run: bool, names, doomed: Iterable[str] = ()) -> List[str]:
  """Sidecars whose segment is gone (or in `doomed`: stale segments being removed), and the
  disk tier's arena files that storage sidecars among them name."""
  files = []

  def is_stale(entry: str) -> bool:
    if not entry.startswith(_PREFIX[:-1] + "-") or "." not in entry:
      return False
    name = entry.split(".", 1)[1]
    stale = (bool(_NAME_RE.fullmatch(name)) and (names is None or name in names)
             and (name in doomed or not os.path.exists(segment_path(name)))
             and _owned_regular_file(os.path.join(SHM_DIR, entry)))   # another user's: left alone
    if stale and entry.startswith(_PREFIX[:-1] + "-storage."):
      arena = _arena_file_of_sidecar(os.path.join(SHM_DIR, entry))
      if arena is not None and os.path.exists(arena):
        files.append(arena)
    return stale

  removed = _unlink_stale_files(is_stale, dry_run)
  return removed + _unlink_paths(files, dry_run)
