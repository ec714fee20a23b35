"""The local Client and TrajectoryWriter tests, re-run through a gRPC bridge on loopback.

Every test of test_client.py / test_trajectory_writer.py that only needs the `client` (or
`writer`) fixture runs here again with `client` a RemoteClient of an in-process bridge. Test
helpers that inspect tables through `client.shared_table` still read them locally.
"""
import inspect

import pytest

pytest.importorskip("grpc")

import test_client  # pylint: disable=g-bad-import-order
import test_trajectory_writer

from reverb_shm.bridge import BridgeConfig, RemoteClient

pytestmark = pytest.mark.timeout(60)

# Tests whose subject is the local transport itself.
_LOCAL_ONLY = {"test_client_pickles_as_its_address", "test_checkpoint_is_not_implemented_yet",
               "test_insert_stores_data_once_for_several_tables",
               "test_close_releases_every_chunk",
               # Remote writers confirm items asynchronously (as Reverb's do): these assert that
               # an admitted item is in its table when create_item returns, or that a 1-5 ms
               # flush suffices; test_bridge_pipeline.py checks the remote behaviour instead.
               "test_flush_times_out_on_full_queue_table",
               "test_flush_waits_for_a_sampler_to_make_room",
               "test_flush_block_until_num_items_leaves_that_many_queued",
               "test_end_episode_timeout_still_ends_the_episode",
               "test_extend_and_create_items_batched_fast_path"}


def _remote(server):
  client = RemoteClient(server.bridge_address, reconnect_timeout_s=2.0)
  client.shared_table = server.shared_table   # inspection helpers read shared memory
  return client


def _rerun(module, prefix):
  for name, fn in vars(module).items():
    if not name.startswith("test_") or name in _LOCAL_ONLY or not callable(fn):
      continue
    params = set(inspect.signature(fn).parameters)
    if params & {"client", "writer"} and not params & {"server", "server_factory"}:
      globals()[f"test_{prefix}_{name[5:]}"] = fn


_rerun(test_client, "client")
_rerun(test_trajectory_writer, "writer")


@pytest.fixture
def client(request, server_factory):
  if request.function.__module__ == test_client.__name__:
    tables = [test_client._uniform("dist"), test_client._uniform("dist2"),  # pylint: disable=protected-access
              test_client.reverb_shm.Table.queue("queue", 10)]
  else:
    m = test_trajectory_writer
    tables = [m._uniform("dist"), m._uniform("dist2"), m.reverb_shm.Table.queue("queue", 1),  # pylint: disable=protected-access
              m._uniform("sig", signature={"x": m.TensorSpec([2], m.np.float32)})]  # pylint: disable=protected-access
  return _remote(server_factory(tables, bridge=BridgeConfig()))


@pytest.fixture
def writer(client):
  w = client.trajectory_writer(5)
  yield w
  w.close()
