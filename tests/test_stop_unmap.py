"""What server.stop() leaves mapped in the owner's process: nothing the Server holds itself.

The segment's memory goes back as soon as no object of the process uses the mapping, even
while the stopped Server object lives on; arrays sampled before the stop keep it (and stay
intact), and handles taken before the stop keep it and raise TableClosedError, never touch
unmapped memory. Runs in a private /dev/shm, so the space it holds is measured exactly.
"""
import json
import textwrap

import pytest

from conftest import run_in_private_shm

pytestmark = pytest.mark.timeout(120)

_CODE = textwrap.dedent("""
    import gc, json, os
    import numpy as np
    import reverb_shm
    from reverb_shm import errors, rate_limiters, selectors

    def used():
      st = os.statvfs("/dev/shm")
      return (st.f_blocks - st.f_bfree) * st.f_frsize

    def mapped(name):
      with open("/proc/self/maps") as f:
        return any(("rvshm." + name) in line for line in f)

    def closed_error(fn):
      try:
        fn()
      except errors.TableClosedError as e:
        return str(e)
      return None

    base = used()
    t = reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(), 1000, rate_limiters.MinSize(1))
    server = reverb_shm.Server([t], name="stopme", max_procs=4)
    client = server.localhost_client()
    for i in range(64):                                   # 32 MiB of payload: the arena grows
      client.insert({"x": np.full(1 << 16, float(i))}, {"t": 1.0})
    grown = used()
    sample = client.shared_table("t").sample(1, timeout_ms=1000)[0]
    value = float(sample.data[0][0][0])
    handle = server.localhost_client().shared_table("t")  # a handle taken before the stop
    handle.size                                           # (attached)
    del client
    server.stop()
    after_stop = used()
    # The sampled array keeps the mapping: still readable and intact.
    intact = bool(np.all(sample.data[0][0] == value))
    errs = dict(
        handle=closed_error(lambda: handle.sample(1, timeout_ms=100)),
        insert=closed_error(lambda: handle.insert({"x": np.zeros((1, 1 << 16))}, 1.0)),
        segment=closed_error(lambda: server.segment),
        shared_table=closed_error(lambda: server.shared_table("t")),
        checkpoint=closed_error(lambda: server.checkpoint()))
    still_mapped = mapped("stopme")
    del sample, handle
    gc.collect()
    print("RESULT " + json.dumps(dict(
        base=base, grown=grown, after_stop=after_stop, intact=intact, errs=errs,
        still_mapped=still_mapped, mapped_after=mapped("stopme"), freed=used(),
        server_alive=repr(server), shm_files=os.listdir("/dev/shm"))))
""")


def test_stop_lets_the_mapping_go_once_nothing_uses_it_and_stale_handles_raise():
  out = run_in_private_shm(_CODE, size_mib=128)
  r = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
  assert r["grown"] - r["base"] > 32 << 20, r
  # Unlinked at stop, but a sampled array still maps it: memory held, data intact.
  assert r["still_mapped"] and r["after_stop"] > r["base"] + (32 << 20), r
  assert r["intact"], r
  for what, err in r["errs"].items():
    assert err is not None, (what, r)
  assert "stopped" in r["errs"]["segment"], r
  # Once the array and the handle are gone, the segment is unmapped and its memory back,
  # while the stopped Server object still exists.
  assert "stopped=True" in r["server_alive"], r
  assert not r["mapped_after"], r
  assert r["freed"] - r["base"] < 1 << 20, r
  assert not [f for f in r["shm_files"] if "stopme" in f], r
