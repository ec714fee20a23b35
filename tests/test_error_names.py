"""Error messages quote table and server names through errors.quoted_name: a name as long as
no valid name can be (a bad argument) appears as its start and its length, not in full."""
import pytest

import reverb_shm
from reverb_shm import cli, errors

pytestmark = pytest.mark.timeout(60)

LONG = "n" * 1000
SHORT_FORM = f"'{'n' * 40}'... (1000 characters)"


def test_quoted_name_abbreviates_only_names_longer_than_any_valid_one():
  assert errors.quoted_name("t") == "'t'"
  assert errors.quoted_name("it's") == '"it\'s"'          # repr, as before
  assert errors.quoted_name("it's", plain=True) == "'it's'"   # as Reverb's own messages
  assert errors.quoted_name("x" * 64) == repr("x" * 64)    # the longest server name
  assert errors.quoted_name("x" * 65) == f"'{'x' * 40}'... (65 characters)"
  assert errors.quoted_name(LONG, plain=True) == SHORT_FORM
  assert errors.quoted_name(7) == "7" and errors.quoted_name(None) == "None"


def _message(call) -> str:
  with pytest.raises(Exception) as info:   # pylint: disable=broad-exception-caught
    call()
  assert isinstance(info.value, (errors.ReverbError, ValueError)), info
  return str(info.value)


def test_long_names_are_abbreviated_in_every_error(server_factory, capsys):
  server = server_factory([reverb_shm.Table.queue("q", 10)])
  client = server.localhost_client()
  calls = {
      "insert": lambda: client.insert([1.0], {LONG: 1.0}),
      "sample": lambda: list(client.sample(LONG, 1)),
      "mutate_priorities": lambda: client.mutate_priorities(LONG, {1: 1.0}),
      "reset": lambda: client.reset(LONG),
      "Table": lambda: reverb_shm.Table.queue(LONG, 10),
      "Server": lambda: reverb_shm.Server([reverb_shm.Table.queue("q", 10)], name=LONG),
  }
  messages = {what: _message(call) for what, call in calls.items()}
  with client.trajectory_writer(1) as writer:
    writer.append([1.0])
    messages["create_item"] = _message(
        lambda: writer.create_item(LONG, 1.0, writer.history[0][-1:]))
  assert cli.main(["info", LONG]) == 2
  messages["reverb-shm info"] = capsys.readouterr().err
  for what, message in messages.items():
    assert SHORT_FORM in message, (what, message)
    assert "n" * 41 not in message and len(message) < 400, (what, message)
  assert messages["sample"].startswith(f"table {SHORT_FORM} not found on server "), messages
  assert messages["create_item"].startswith(f"Unable to create item in table {SHORT_FORM} "
                                            "since the table could not be found."), messages
