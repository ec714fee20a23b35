"""Stand-in for dm-launchpad in the acme peer venv (tests/test_acme.py): put
tests/peers/launchpad_stub on PYTHONPATH.

Acme's package __init__ imports acme.environment_loop, whose acme.utils.signals imports
launchpad at module level and calls it only inside its runtime-termination context manager.
dm-launchpad has no wheel for this Python, and the code under test (Acme's Reverb adders and
make_reverb_dataset) never runs a launchpad program, so the import only has to succeed: every
function used raises, so a test that did reach launchpad would fail, not pass silently.
"""


def _unavailable(*args, **kwargs):
  raise NotImplementedError("dm-launchpad is not installed in this venv (tests/peers/"
                            "launchpad_stub stands in for its import only)")


register_stop_handler = unregister_stop_handler = stop = launch = _unavailable
