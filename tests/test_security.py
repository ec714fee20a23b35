"""Security: segment permissions, other users, name validation, no pickle on data paths."""
import ast
import grp
import os
import pathlib
import pwd
import stat

import pytest

import reverb_shm
from reverb_shm import errors, rate_limiters, selectors
from reverb_shm._internal import shm

from conftest import run_in_fork

PACKAGE_DIR = pathlib.Path(reverb_shm.__file__).resolve().parent


def _table():
  return reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 10, rate_limiters.MinSize(1))


def _mode(path: str) -> int:
  return stat.S_IMODE(os.stat(path).st_mode)


def _alias(port: int) -> str:
  return os.path.join(shm.SHM_DIR, f"rvshm.port.{port}")


# ---- mode bits

def test_segment_and_port_alias_are_owner_only_by_default(server_factory):
  old_umask = os.umask(0)      # the mode must not depend on a permissive umask
  try:
    server = server_factory([_table()])
  finally:
    os.umask(old_umask)
  assert _mode(shm.segment_path(server.name)) == 0o600
  assert _mode(_alias(server.port)) == 0o600


def test_group_mode_is_an_explicit_option(server_factory):
  server = server_factory([_table()], mode=0o660)
  assert _mode(shm.segment_path(server.name)) == 0o660
  assert _mode(_alias(server.port)) == 0o660


@pytest.mark.parametrize("mode", [0o666, 0o644, 0o777, 0o400, -1, "0600", 0o600 + 0.0, True])
def test_other_modes_are_refused_before_anything_is_created(server_name, mode):
  with pytest.raises(ValueError, match="mode must be 0o600"):
    reverb_shm.Server([_table()], name=server_name, arena_bytes=1 << 20, mode=mode)
  assert not os.path.exists(shm.segment_path(server_name))


# ---- another user

def _other_ids():
  """(uid, gid) of an unused account, or None when not root. Root may setuid/setgid to any
  number, so no user is created (the machine is left as it was)."""
  if os.geteuid() != 0:
    return None
  uid = next(u for u in range(40_000, 60_000) if not _exists(pwd.getpwuid, u))
  gid = next(g for g in range(40_000, 60_000) if not _exists(grp.getgrgid, g))
  return uid, gid


def _exists(lookup, ident) -> bool:
  try:
    lookup(ident)
  except KeyError:
    return False
  return True


def _attach_as(uid: int, gid: int, name: str) -> str:
  """Forks, drops to uid/gid (no exec: the interpreter may not be readable by that user) and
  tries to attach to server `name`; returns 'ATTACHED' or 'REFUSED <message>'."""
  def attach():
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    try:
      shm.Segment.attach(name)
    except errors.ServerUnavailableError as e:
      return f"REFUSED {e}"
    return "ATTACHED"
  out = run_in_fork(attach)
  assert out.startswith("OK "), out
  return out[3:]


@pytest.mark.timeout(120)
def test_process_of_another_user_cannot_attach(server_factory):
  ids = _other_ids()
  if ids is None:
    pytest.skip("needs root to run a process as a second user")
  uid, gid = ids
  private = server_factory([_table()])
  out = _attach_as(uid, gid, private.name)
  assert out.startswith("REFUSED") and "No permission" in out and "mode=0o660" in out, out
  # Group mode lets processes of the segment's group in; the default mode still does not.
  shared = server_factory([_table()], mode=0o660)
  os.chown(shm.segment_path(shared.name), -1, gid)
  assert _attach_as(uid, gid, shared.name) == "ATTACHED"
  assert _attach_as(uid, gid, private.name).startswith("REFUSED")


# ---- names

@pytest.mark.parametrize("name", [
    "", "/", "a/b", "../etc", "..", ".", "a" * 65, "x\x00y", "with space", "\u00e9t\u00e9",
    "/dev/shm/x", "a\nb", 5, b"bytes"])
def test_malformed_server_names_never_reach_the_filesystem(name):
  for call in (lambda: shm.validate_server_name(name),
               lambda: shm.Segment.attach(name),
               lambda: reverb_shm.Server([_table()], name=name, arena_bytes=1 << 20)):
    with pytest.raises((ValueError, TypeError), match="server name|name"):
      call()


@pytest.mark.parametrize("address", ["shm://../x", "shm://a/b", "shm://", "localhost:../1",
                                     "localhost:-1", "localhost:1/2"])
def test_malformed_addresses_are_refused(address):
  with pytest.raises(ValueError):
    shm.resolve_address(address)


def test_segment_paths_stay_inside_the_namespace():
  for name in ("a", "a.b", "A-_9", "x" * 64):
    path = pathlib.Path(shm.segment_path(shm.validate_server_name(name)))
    assert path.parent == pathlib.Path(shm.SHM_DIR) and path.name.startswith("rvshm.")


# ---- no pickle

def _imported_modules(path: pathlib.Path):
  tree = ast.parse(path.read_text(), str(path))
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      yield node.module
    elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__":
      yield "__import__"


def test_no_module_of_the_package_imports_pickle_or_marshal():
  offenders = {}
  for path in PACKAGE_DIR.rglob("*.py"):
    bad = {m for m in _imported_modules(path)
           if m.split(".")[0] in ("pickle", "cPickle", "marshal", "dill", "cloudpickle", "shelve",
                                  "__import__")}
    if bad:
      offenders[path.name] = bad
  assert not offenders, f"data paths must not unpickle: {offenders}"


def test_msgpack_decoding_never_uses_ext_hooks_that_build_objects():
  """Object columns and table configs are decoded with plain msgpack (no object_hook/ext_hook)."""
  for path in PACKAGE_DIR.rglob("*.py"):
    text = path.read_text()
    assert "ext_hook" not in text and "object_hook" not in text, path.name
    assert "eval(" not in text and "exec(" not in text, path.name


def test_object_column_round_trips_through_msgpack_only(server_factory):
  server = server_factory([_table()])
  st = server.shared_table("t")
  import numpy as np  # pylint: disable=g-import-not-at-top
  payload = np.array([b"\x80\x04\x95K\x01."], dtype=object)   # a pickle of 1, stored as bytes
  st.insert({"o": payload}, 1.0)
  assert st.sample(1)[0].data[0].item() == b"\x80\x04\x95K\x01."
