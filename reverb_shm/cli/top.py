"""`reverb-shm top`: a live terminal view of one server's tables (needs the `cli` extra: rich).

Each refresh reads the server's counters from shared memory without locking and without
registering a process slot (reverb_shm._internal.counters), so watching never slows or changes the
server. Rates are the change of each total between two refreshes divided by the time between
them.
"""
import contextlib
import os
import select
import sys
import time
from typing import Callable, Optional

from reverb_shm import errors
from reverb_shm._internal import counters, shm

__all__ = ["Rates", "render", "run"]

_MAX_INTERVAL_S = 86400
# Columns left out, in this order, while the view is wider than the terminal; and those
# justified left.
_OPTIONAL = ("del/s", "evict/s", "in/s", "upd/s", "blk ins", "blk smp", "lock p50/p99", "limiter",
             "diff [min, max]")
_LEFT = ("table", "limiter", "diff [min, max]", "state")

# Totals shown as rates per second, and their column titles.
_RATE_KEYS = (("inserts", "ins/s"), ("samples", "smp/s"), ("updates", "upd/s"),
              ("deletes", "del/s"), ("evictions", "evict/s"))


def _rich():
  try:
    import rich  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    raise ImportError("`reverb-shm top` needs rich: pip install 'reverb_shm[cli]'") from e


class Rates:
  """Per-table rates per second between successive server figures (counters.read_server)."""

  def __init__(self):
    self._last = None   # (monotonic time, figures)

  def update(self, figures: dict, now: Optional[float] = None) -> dict:
    """{table: {key: rate per second}} since the previous call (zeros on the first)."""
    now = time.monotonic() if now is None else now
    last, self._last = self._last, (now, figures)
    rates = {}
    for name, t in figures["tables"].items():
      prev = None if last is None else last[1]["tables"].get(name)
      dt = 0.0 if last is None else now - last[0]
      rates[name] = {k: (t[k] - prev[k]) / dt if prev is not None and dt > 0 else 0.0
                     for k, _ in _RATE_KEYS + (("insert_bytes", ""),)}
    return rates


def _size(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return str(n)


def _seconds(s: float) -> str:
  if s <= 0:
    return "-"
  if s < 1e-6:
    return f"{s * 1e9:.0f}ns"
  if s < 1e-3:
    return f"{s * 1e6:.0f}us"
  return f"{s * 1e3:.1f}ms" if s < 1 else f"{s:.2f}s"


def _bound(x: float) -> str:
  return "inf" if x > 1e300 else "-inf" if x < -1e300 else f"{x:g}"


def _rate(r: float) -> str:
  if r >= 1e6:
    return f"{r / 1e6:.2f}M"
  if r >= 1e4:
    return f"{r / 1e3:.1f}k"
  return f"{r:.0f}"


def table_state(t: dict) -> str:
  """'BLOCKED insert' / 'BLOCKED sample' / 'BLOCKED insert+sample' when threads wait on the
  rate limiter now, 'closed', 'full' at max_size, else 'ok'."""
  blocked = [side for side, key in (("insert", "blocked_inserters"), ("sample", "blocked_samplers"))
             if t[key]]
  if blocked:
    return "BLOCKED " + "+".join(blocked)
  if t["closed"]:
    return "closed"
  return "full" if t["full"] else "ok"


def render(figures: dict, rates: dict, interval: float, live: bool = True,
           width: Optional[int] = None):
  """A rich renderable of one refresh: server line, one row per table, processes (and the
  keys that quit, when `live`). With `width` (the terminal's), the columns of _OPTIONAL that do
  not fit are left out (and a line says so), rather than every column squeezed to an ellipsis."""
  from rich.console import Group  # pylint: disable=import-outside-toplevel
  from rich.table import Table
  from rich.text import Text

  procs = [p for p in figures["processes"] if p["alive"]]
  used, total = figures["arena_used_bytes"], figures["arena_bytes"]
  head = Text.assemble(
      ("reverb-shm top ", "bold"), (figures["name"], "bold cyan"),
      f"  owner pid {figures['owner_pid']}  arena {_size(used)} / {_size(total)} "
      f"({100.0 * used / max(total, 1):.1f}% used, {_size(figures['arena_free_bytes'])} free)"
      f"  chunks {figures['chunks']}  processes {len(procs)}/{figures['max_procs']}"
      + (f"  refresh {interval:g}s" if live else ""))
  titles = ("table", "items/max", *(t for _, t in _RATE_KEYS), "in/s", "blk ins", "blk smp",
            "limiter", "diff [min, max]", "lock p50/p99", "state")
  rows, styles = [], []
  for name, t in figures["tables"].items():
    r = rates.get(name, {})
    state = table_state(t)
    styles.append("bold red" if state.startswith("BLOCKED") else "yellow" if state == "full"
                  else "dim" if state == "closed" else "")
    limiter = ("ins " + ("yes" if t["can_insert"] else "NO") + " smp " +
               ("yes" if t["can_sample"] else "NO"))
    rows.append((
        name, f"{t['items']}/{t['max_size']}", *(_rate(r.get(k, 0.0)) for k, _ in _RATE_KEYS),
        _size(r.get("insert_bytes", 0.0)), str(t["blocked_inserters"]),
        str(t["blocked_samplers"]), limiter,
        f"{t['diff']:g} [{_bound(t['min_diff'])}, {_bound(t['max_diff'])}]",
        f"{_seconds(t['lock_hold_p50_seconds'])}/{_seconds(t['lock_hold_p99_seconds'])}",
        state))
  shown_columns = list(range(len(titles)))
  hidden = []

  def needed() -> int:   # (each column: its widest cell; 3 characters between two columns)
    return sum(max(len(c) for c in [titles[i]] + [row[i] for row in rows]) + 3
               for i in shown_columns) - 3
  for title in _OPTIONAL:
    if width is None or needed() <= width:
      break
    shown_columns.remove(titles.index(title))
    hidden.append(title)
  grid = Table(expand=False, show_edge=False, pad_edge=False)
  for i in shown_columns:   # (Text: table names and titles are not rich markup)
    grid.add_column(Text(titles[i]), justify="left" if titles[i] in _LEFT else "right",
                    no_wrap=True)
  for row, style in zip(rows, styles):
    grid.add_row(*(Text(row[i]) for i in shown_columns), style=style)
  shown = sorted(procs, key=lambda p: -p["pins"])[:8]
  proc_line = Text("processes (pid:pins): " + "  ".join(f"{p['pid']}:{p['pins']}" for p in shown)
                   + ("  ..." if len(procs) > len(shown) else ""), style="dim")
  parts: list = [head, grid, proc_line]
  if hidden:
    parts.append(Text(f"columns left out (terminal {width} wide): {', '.join(hidden)}",
                      style="dim"))
  if live:
    parts.append(Text("q or Ctrl-C quits", style="dim"))
  return Group(*parts)


class _Keys:
  """Non-blocking single-key reads from a terminal stdin (cbreak mode, restored on exit)."""

  def __init__(self, stream):
    self._fd = None
    self._saved = None
    try:
      fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
      return
    if not os.isatty(fd):
      return
    import termios  # pylint: disable=import-outside-toplevel
    import tty
    self._fd = fd
    self._saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

  def wait(self, timeout: float) -> str:
    """Sleeps up to `timeout` s; returns the key pressed meanwhile ('' if none)."""
    if self._fd is None:
      time.sleep(timeout)
      return ""
    ready, _, _ = select.select([self._fd], [], [], timeout)
    return os.read(self._fd, 32).decode("utf-8", "replace") if ready else ""

  def close(self) -> None:
    if self._saved is not None:
      import termios  # pylint: disable=import-outside-toplevel
      termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
      self._saved = None


def _ended(seg: shm.Segment) -> Optional[str]:
  """Why the server can no longer be watched ('server stopped' / 'server died'), or None."""
  if seg.is_closed():
    return "server stopped"
  return None if seg.owner_alive() else "server died"


def run(name: str, interval: float = 1.0, iterations: Optional[int] = None,
        console=None, keys_from=None, on_exit: Optional[Callable[[str], None]] = None) -> str:
  """Shows the live view of server `name` until q / Ctrl-C or the server stops.

  Args:
    name: server name (resolve 'localhost:PORT' with shm.resolve_address first).
    interval: seconds between refreshes (> 0, at most a day).
    iterations: stop after this many refreshes (None: until quit); with 1 the view is printed
      once, without the live screen.
    console: a rich Console (default: stdout).
    keys_from: stream whose terminal gives the keys (default sys.stdin).
    on_exit: called with the reason before returning.

  Returns:
    Why it ended: 'quit', 'interrupted', 'server stopped', 'server died' (its process is gone
    without stopping it) or 'done'.

  Raises:
    ServerUnavailableError / DeadOwnerError: no live server of that name.
    ImportError: rich is not installed.
  """
  _rich()
  from rich.console import Console  # pylint: disable=import-outside-toplevel
  from rich.live import Live
  if not 0 < interval <= _MAX_INTERVAL_S:   # (select() takes no longer wait)
    raise ValueError(f"interval must be > 0 and at most {_MAX_INTERVAL_S} seconds, got "
                     f"{interval!r}")
  seg = shm.Segment.attach(name)
  if console is None:   # piped output (--once into a file): wide enough for every column
    console = Console(width=None if sys.stdout.isatty() else 240)
  rates = Rates()
  figures = counters.read_server(seg)
  if iterations == 1:
    console.print(render(figures, rates.update(figures), interval, live=False,
                         width=console.width))
    return "done"
  frame = render(figures, rates.update(figures), interval, width=console.width)
  reason = "done"
  keys = _Keys(keys_from if keys_from is not None else sys.stdin)
  try:
    with Live(frame, console=console, auto_refresh=False, transient=False) as live:
      count = 1
      while iterations is None or count < iterations:
        key = keys.wait(interval)
        if "q" in key.lower():
          reason = "quit"
          break
        ended = _ended(seg)
        if ended is not None:
          reason = ended
          break
        try:
          figures = counters.read_server(seg)
        except errors.ReverbError:
          reason = _ended(seg) or "server stopped"
          break
        live.update(render(figures, rates.update(figures), interval, width=console.width),
                    refresh=True)
        count += 1
  except KeyboardInterrupt:
    reason = "interrupted"
  finally:
    keys.close()
    with contextlib.suppress(Exception):
      seg.close()
  if not console.is_terminal:   # (Live ends its last frame without a newline there)
    console.line()
  if on_exit is not None:
    on_exit(reason)
  return reason
