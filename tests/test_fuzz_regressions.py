"""Defects the fuzzer (tests/fuzz/fuzz_core.py) and the sanitizer runs (tests/sanitize.py) found,
each reproduced through the smallest path that shows it."""
import numpy as np
import pytest

import reverb_shm
from reverb_shm import rate_limiters, selectors

pytestmark = pytest.mark.timeout(60)


def _write_episode(client, table, columns, value):
  with client.trajectory_writer(num_keep_alive_refs=1) as writer:
    writer.append({c: np.float32(value) for c in columns})
    writer.create_item(table, 1.0, {c: writer.history[c][-1] for c in columns})
    writer.end_episode()


@pytest.mark.parametrize("max_size,ncols", [(1, 3), (10, 8)])
def test_items_of_many_columns_from_new_episodes_fit_the_episode_map(server_factory, max_size,
                                                                     ncols):
  """The episode map has room for about one episode per item, and an item whose columns are
  chunks of one new episode needs one new entry. Each chunk used to count as a new episode of
  its own, so a table full of items of distinct episodes refused an item with more columns than
  the map's slack ("episode map full"), e.g. the second episode of a 3-column writer into a
  table of max_size 1."""
  server = server_factory([reverb_shm.Table("t", selectors.Uniform(), selectors.Fifo(),
                                            max_size, rate_limiters.MinSize(1))])
  client = server.localhost_client()
  columns = [f"c{i}" for i in range(ncols)]
  for episode in range(max_size + 3):
    _write_episode(client, "t", columns, episode)
  st = server.shared_table("t")
  assert st.size == max_size
  # Fifo: the newest max_size episodes remain, one episode each.
  values = {float(s.data[0]) for s in st.sample(200)}
  assert values == {float(e) for e in range(3, max_size + 3)}
  assert client.server_info()["t"].num_episodes == max_size
  server.segment.check()
