"""Finite priorities whose weights could sum to an infinite sum-tree total are rejected.

The cap on one Prioritized weight is float64 max / (2 * sum-tree leaves), one leaf per record
(max_size + 1); the invariant checker flags a non-finite total.
"""
import collections
import sys

import numpy as np
import pytest

import reverb_shm
from reverb_shm import rate_limiters, selectors
from reverb_shm._core import lib
from reverb_shm._internal._lib import last_error

from test_core_table import FIFO, PRIORITIZED, UNIFORM, Segment, insert_ok, sample_ok

pytestmark = pytest.mark.timeout(60)
DBL_MAX = sys.float_info.max


def _leaves(max_size):
  return (max_size + 1 + 7) // 8 * 8     # one leaf per record, in whole groups of 8


def _cap(max_size):
  return DBL_MAX / (2 * _leaves(max_size))


@pytest.mark.parametrize("sampler,remover", [(PRIORITIZED, FIFO), (UNIFORM, PRIORITIZED)])
def test_weight_above_the_cap_is_rejected_on_insert_and_update(sampler, remover):
  seg = Segment(max_size=100, sampler=sampler, remover=remover)
  cap = _cap(100)
  insert_ok(seg, [1, 2], [1.0, cap])            # exactly the cap is accepted
  before = seg.items()
  for bad in (np.nextafter(cap, np.inf), 1e308):
    assert seg.insert([3, 4], [1.0, bad]) == (lib.RS_EINVAL, 0)
    message = last_error()
    assert "priority [1]" in message and f"cap {cap:g}" in message
    assert f"{_leaves(100)} sum-tree leaves" in message
    assert seg.mutate(updates=[(1, 2.0), (2, bad)])[0] == lib.RS_EINVAL
    assert seg.items() == before
  seg.check()


def test_exponent_scales_the_weight_checked_against_the_cap():
  seg = Segment(max_size=4, sampler=PRIORITIZED, sampler_exponent=2.0)
  assert seg.insert([1], [1e154]) == (lib.RS_EINVAL, 0)    # weight 1e308 > cap 1.1e307
  insert_ok(seg, [1], [1e150])                             # weight 1e300 is under it
  seg.check()


def test_checker_flags_a_non_finite_total():
  seg = Segment(max_size=4, sampler=PRIORITIZED)     # capacity 5: a sum tree of 8 leaves
  marks = [1.5, 2.5, 3.25]
  insert_ok(seg, [1, 2, 3], marks)
  words = np.frombuffer(seg.mm, np.float64)
  # tree[0] is the total (8 leaves: one internal entry), tree[8 + r] the leaf of record r;
  # records hold the same priorities.
  starts = [i for i in np.flatnonzero(words == 7.25) if list(words[i + 8:i + 11]) == marks]
  assert len(starts) == 1
  tree = words[starts[0]:starts[0] + 16]
  for i in np.flatnonzero(np.isin(words, marks)):   # record priorities (and the leaves)
    words[i] = 1e308
  with np.errstate(over="ignore"):                  # a consistent root: the sum of the leaves
    leaves = tree[8:16]
    tree[0] = (((leaves[0] + leaves[1]) + (leaves[2] + leaves[3])) +
               ((leaves[4] + leaves[5]) + (leaves[6] + leaves[7])))
  assert tree[0] == np.inf
  with pytest.raises(AssertionError, match="sum-tree total is inf, expected a finite sum"):
    seg.check()


def test_shared_table_rejects_the_reproducer_and_samples_correctly(server_factory):
  table = reverb_shm.Table("p", selectors.Prioritized(1.0), selectors.Fifo(), 100,
                           rate_limiters.MinSize(1))
  st = server_factory([table]).shared_table("p")
  with pytest.raises(ValueError, match="above the cap"):
    st.insert({"x": np.arange(3, dtype=np.int32)}, [1e308, 1e308, 1.0])
  assert st.size == 0
  keys = st.insert({"x": np.arange(3, dtype=np.int32)}, [1.0, 1.0, 2.0])
  with pytest.raises(ValueError, match="above the cap"):
    st.update_priorities(keys[:2], [1e306, 1e306])   # cap 7.0e305
  samples = st.sample(4000)
  counts = collections.Counter(int(s.data[0]) for s in samples)
  assert {s.info.probability for s in samples} == {0.25, 0.5}
  assert abs(counts[2] / 4000 - 0.5) < 0.05
  st.segment.check()
