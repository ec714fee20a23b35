#!/usr/bin/env python3
"""Builds the C core under a sanitizer and runs tests of the core against it.

    python tests/sanitize.py asan              # AddressSanitizer + UndefinedBehaviorSanitizer
    python tests/sanitize.py tsan              # ThreadSanitizer (the multi-threaded paths)
    python tests/sanitize.py asan --quick      # a few test files (what the default suite runs)
    python tests/sanitize.py asan -- -k gather # extra arguments after -- go to pytest
    python tests/sanitize.py fuzz ops --seconds 600      # the fuzzer (tests/fuzz/fuzz_core.py)
    python tests/sanitize.py fuzz corrupt --seconds 600  # ... over corrupted segments

The working tree (tracked and untracked, not ignored, files) is copied to
build/sanitize/<mode>/ and both extension modules (cffi `reverb_shm._core`, setuptools
`reverb_shm._hot`) are compiled there with the sanitizer, so the in-tree .so files are never
touched. pytest then runs in that copy, with the sanitizer runtime of the compiler that built
the modules preloaded into the (uninstrumented) Python, every report of every process (tests
start child processes) written to build/sanitize/<mode>/reports/, and any report fails the run.
Exit status: 0 when pytest passed and no process reported anything, else 1.

Python itself is not instrumented, so only memory the C core and the fast paths touch is
checked. The settings below and the reasons for each are the only exemptions.
"""
import argparse
import glob
import os
import pathlib
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Test files run by each mode: the core, tables, arena, writers, crash and fork tests.
ASAN_TESTS = [
    "tests/test_core_arena.py", "tests/test_core_table.py", "tests/test_batched_core.py",
    "tests/test_shared_table.py", "tests/test_trajectory_writer.py",
    "tests/test_trajectory_writer_batched.py", "tests/test_crash_server.py", "tests/test_fork.py",
    "tests/test_chunks.py", "tests/test_open_chunks.py", "tests/test_hot_insert.py",
    "tests/test_hot_writer.py", "tests/test_fast_paths.py", "tests/test_checkpoint.py",
    "tests/test_priority_overflow.py", "tests/test_priority_cap_paths.py",
    "tests/test_selectors.py", "tests/test_rate_limiters.py", "tests/test_bad_input.py",
    "tests/test_step_inserter.py", "tests/test_column_writer.py", "tests/test_legacy_writer.py",
    "tests/test_gc_race.py", "tests/test_client.py", "tests/test_server.py",
    "tests/test_differential.py", "tests/test_structured_writer.py", "tests/test_metadata.py",
    "tests/test_corrupt_segment.py", "tests/test_fuzz_core.py", "tests/test_gather_copy.py",
]
# The short run of the default suite: a few files over the core, under two minutes here.
ASAN_QUICK = ["tests/test_core_arena.py", "tests/test_batched_core.py",
              "tests/test_shared_table.py", "tests/test_corrupt_segment.py"]
# ThreadSanitizer: the tests with several threads in one process (sampling next to inserts,
# blocked waiters woken by other threads, the server's reaper, writers and their flushes).
# Forking tests are left out: TSan does not support fork() in a multi-threaded process.
TSAN_TESTS = [
    "tests/test_core_table.py", "tests/test_batched_core.py", "tests/test_shared_table.py",
    "tests/test_trajectory_writer.py", "tests/test_hot_insert.py", "tests/test_server.py",
    "tests/test_tsan_threads.py", "tests/test_gather_copy.py",
]
TSAN_QUICK = ["tests/test_tsan_threads.py"]
# Timing assertions do not hold under instrumentation (ASan's checks, TSan's shadow memory).
DESELECT = {"asan": ["tests/test_core_table.py::test_batched_sampling_is_fast"]}
# TSan: the tests that fork (TSan does not support fork() in a process that has threads, and
# the forked child's kill timing assumes uninstrumented speed).
DESELECT["tsan"] = DESELECT["asan"] + [
    "tests/test_core_table.py::test_killed_lock_owner_is_repaired_and_table_stays_consistent",
    "tests/test_hot_insert.py::test_forked_child_makes_its_own_plan",
    "tests/test_hot_insert.py::test_plan_declines_after_a_fork_without_python_hooks",
    "tests/test_shared_table.py::test_four_writer_processes_and_a_verifying_sampler",
    "tests/test_gather_copy.py::test_forked_child_starts_its_own_helper",
    "tests/test_server.py::test_stale_segment_of_dead_owner_is_reclaimed",
    # timing: a writer's __del__ after stop must return in < 2 s (TSan slows it past that)
    "tests/test_trajectory_writer.py::test_del_after_server_stop_returns_promptly",
]

FLAGS = {
    # -fno-sanitize-recover: the first UBSan finding aborts (UBSan otherwise prints and goes on).
    # -fsanitize-coverage=trace-pc: edge coverage for the fuzzer (tests/fuzz/coverage_shim.c),
    # so that one build serves the test campaign and the fuzzer.
    "asan": "-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1"
            " -fsanitize-coverage=trace-pc",
    "tsan": "-fsanitize=thread -fno-omit-frame-pointer -g -O1",
}
RUNTIMES = {"asan": ["libasan.so", "libubsan.so"], "tsan": ["libtsan.so"]}


def runtime_options(mode: str, reports: pathlib.Path) -> dict:
  """Environment of the sanitized test run (every process inherits it)."""
  common = f"log_path={reports}/{mode}:halt_on_error=1:print_stacktrace=1"
  env = {
      # detect_leaks=0: CPython does not free everything at exit (interned strings, static
      # types, module state, the objects of the last garbage cycle); LeakSanitizer reports those
      # allocations, made by the interpreter and not by our code, by the thousand. The core's
      # own leaks show up as growing arena/RSS figures in bench/soak.py instead.
      # abort_on_error=0: exit with an error code so that the report is written (and logged).
      "ASAN_OPTIONS": f"{common}:detect_leaks=0:abort_on_error=0:detect_odr_violation=0"
                      ":allocator_may_return_null=1",
      # detect_odr_violation=0 above: the interpreter and numpy load several extension modules
      # that each define the same few globals; that is how CPython extensions are built.
      # allocator_may_return_null=1: tests ask for impossibly large buffers on purpose and
      # expect MemoryError (malloc returning NULL), which ASan would otherwise treat as fatal.
      "UBSAN_OPTIONS": f"{common}",
      # second_deadlock_stack: both stacks of a lock-order report.
      "TSAN_OPTIONS": f"{common}:second_deadlock_stack=1",
      # Python's objects through malloc, so ASan sees the bounds of the buffers (bytes,
      # arrays) that Python hands to the core instead of one large pymalloc arena.
      "PYTHONMALLOC": "malloc",
      "REVERB_SHM_SANITIZER": mode,
  }
  return env


def runtime_paths(mode: str) -> list:
  """Paths of the sanitizer runtime libraries of the C compiler that builds the modules."""
  cc = os.environ.get("CC", "gcc")
  out = []
  for lib in RUNTIMES[mode]:
    path = subprocess.run([cc, f"-print-file-name={lib}"], capture_output=True, text=True,
                          check=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
      raise SystemExit(f"{cc} has no {lib} (install the compiler's sanitizer runtime)")
    out.append(os.path.realpath(path))
  return out


def copy_tree(dest: pathlib.Path) -> None:
  """Copies the working tree's files (tracked + untracked, not ignored) to dest, keeping the
  modification times so that an unchanged source is not recompiled."""
  files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split("\0")
  for name in filter(None, files):
    src = ROOT / name
    if not src.is_file():
      continue
    dst = dest / name
    if dst.exists() and dst.stat().st_mtime_ns == src.stat().st_mtime_ns \
        and dst.stat().st_size == src.stat().st_size:
      continue
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)


def build(mode: str, dest: pathlib.Path) -> None:
  """Compiles reverb_shm._core and reverb_shm._hot with the sanitizer into the copy at dest."""
  copy_tree(dest)
  env = dict(os.environ)
  env["CFLAGS"] = FLAGS[mode]
  env["LDFLAGS"] = FLAGS[mode].split(" -fno-sanitize-recover")[0].split(" -fno-omit")[0]
  if mode == "asan":
    shim = dest / "libcovshim.so"
    src = ROOT / "tests" / "fuzz" / "coverage_shim.c"
    if not shim.exists() or shim.stat().st_mtime < src.stat().st_mtime:
      subprocess.run([os.environ.get("CC", "gcc"), "-O2", "-shared", "-fPIC", "-o", str(shim),
                      str(src)], check=True)
  t0 = time.monotonic()
  stamp = dest / "build-flags.txt"   # a change of flags recompiles everything
  force = [] if stamp.exists() and stamp.read_text() == FLAGS[mode] else ["--force"]
  proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", *force], cwd=dest,
                        env=env, capture_output=True, text=True)
  if proc.returncode != 0:
    sys.stderr.write(proc.stdout + proc.stderr)
    raise SystemExit(f"sanitizer build ({mode}) failed")
  stamp.write_text(FLAGS[mode])
  for mod in ("_core", "_hot"):
    so = glob.glob(str(dest / "reverb_shm" / f"{mod}.*so"))
    if not so:
      raise SystemExit(f"sanitizer build ({mode}) made no reverb_shm/{mod} module")
    needed = subprocess.run(["readelf", "-d", so[0]], capture_output=True, text=True).stdout
    if ("libtsan" if mode == "tsan" else "libasan") not in needed:
      raise SystemExit(f"{so[0]} is not linked with the {mode} runtime")
  print(f"sanitize: built {mode} modules in {dest} ({time.monotonic() - t0:.0f} s)", flush=True)


def reports_in(reports: pathlib.Path) -> list:
  return sorted(p for p in reports.glob("*") if p.is_file() and p.stat().st_size > 0)


# What a sanitizer prints when it reports: some reports reach stderr rather than log_path (the
# UBSan runtime loaded next to ASan's), so the output is scanned for these too.
MARKERS = ("runtime error:", "ERROR: AddressSanitizer", "WARNING: ThreadSanitizer",
           "ERROR: ThreadSanitizer", "SUMMARY: UndefinedBehaviorSanitizer")


def run_scanned(cmd, cwd, env) -> tuple:
  """Runs cmd, echoing its output; returns (exit status, output lines with a sanitizer marker)."""
  proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace")
  marked = []
  for line in proc.stdout:
    sys.stdout.write(line)
    if any(m in line for m in MARKERS):
      marked.append(line.rstrip())
  sys.stdout.flush()
  return proc.wait(), marked


def prepare(mode: str, build_dir: pathlib.Path = None):
  """Builds the copy; returns (its directory, an empty report directory, the environment)."""
  dest = (build_dir or ROOT / "build" / "sanitize" / mode).resolve()
  dest.mkdir(parents=True, exist_ok=True)
  build(mode, dest)
  reports = dest / "reports"
  shutil.rmtree(reports, ignore_errors=True)
  reports.mkdir()
  env = dict(os.environ)
  env.update(runtime_options(mode, reports))
  preload = runtime_paths(mode)
  if mode == "asan":
    preload.append(str(dest / "libcovshim.so"))   # defines the coverage hook the modules call
  env["LD_PRELOAD"] = " ".join(preload + [env.get("LD_PRELOAD", "")]).strip()
  # The copy first on every process's path, whatever its working directory (scripts run by
  # path would otherwise import the editable install's uninstrumented modules).
  env["PYTHONPATH"] = str(dest)
  where = subprocess.run([sys.executable, "-c", "import reverb_shm._core, reverb_shm._hot; "
                          "print(reverb_shm._core.__file__); print(reverb_shm._hot.__file__)"],
                         cwd="/", env=env, capture_output=True, text=True)
  if where.returncode or any(not line.startswith(str(dest)) for line in where.stdout.split()):
    raise SystemExit(f"the sanitized modules are not the ones imported: {where.stdout}"
                     f"{where.stderr}")
  return dest, reports, env


def show_reports(reports: pathlib.Path) -> list:
  found = reports_in(reports)
  for path in found:
    sys.stderr.write(f"==== {path.name}\n{path.read_text(errors='replace')}\n")
  return found


def fuzz(target: str, seconds: float, fuzzer_args: list, build_dir: pathlib.Path = None,
         replay: list = None) -> int:
  """Runs tests/fuzz/fuzz_core.py in the ASan + UBSan copy for `seconds` (or once over the
  `replay` input files); 0 when no input failed and no process reported anything."""
  dest, reports, env = prepare("asan", build_dir)
  if replay:
    env["REVERB_SHM_FUZZ_TRACE"] = "1"
    cmd = [sys.executable, "tests/fuzz/fuzz_core.py", target,
           *[str(pathlib.Path(p).resolve()) for p in replay]]
    rc, marked = run_scanned(cmd, dest, env)
    found = show_reports(reports)
    return 0 if rc == 0 and not found and not marked else 1
  corpus = dest / "fuzz-corpus" / target
  corpus.mkdir(parents=True, exist_ok=True)
  seeds = dest / "tests" / "fuzz" / "corpus" / target
  cmd = [sys.executable, "tests/fuzz/fuzz_core.py", target, str(corpus)]
  if seeds.is_dir():
    cmd.append(str(seeds))
  # -len_control=0 -max_len=600: sequences of up to 48 operations from the start (libFuzzer
  # otherwise grows inputs a few bytes at a time, i.e. a few operations).
  cmd += [f"-max_total_time={int(seconds)}", f"-artifact_prefix={reports}/crash-",
          "-rss_limit_mb=4096", "-timeout=30", "-print_final_stats=1", "-len_control=0",
          "-max_len=600", *fuzzer_args]
  print(f"sanitize: {' '.join(cmd[1:])}", flush=True)
  rc, marked = run_scanned(cmd, dest, env)
  found = show_reports(reports)
  print(f"sanitize: fuzz {target}: exit {rc}, {len(found)} report file(s), {len(marked)} "
        f"sanitizer line(s) in the output", flush=True)
  return 0 if rc == 0 and not found and not marked else 1


def run(mode: str, quick: bool, pytest_args: list, build_dir: pathlib.Path = None) -> int:
  dest, reports, env = prepare(mode, build_dir)
  if mode == "asan":
    tests = ASAN_QUICK if quick else ASAN_TESTS
  else:
    tests = TSAN_QUICK if quick else TSAN_TESTS
  tests = [t for t in tests if (dest / t).exists()]
  # -p no:cacheprovider: nothing written into the copy's tree; the copy's own reverb_shm is
  # first on sys.path since pytest runs from the copy (python -m puts the cwd first).
  cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests,
         *[f"--deselect={t}" for t in DESELECT[mode]], *pytest_args]
  t0 = time.monotonic()
  print(f"sanitize: {' '.join(cmd[3:])}", flush=True)
  rc, marked = run_scanned(cmd, dest, env)
  found = show_reports(reports)
  print(f"sanitize: {mode}: pytest exit {rc}, {len(found)} report file(s), {len(marked)} "
        f"sanitizer line(s) in the output, {time.monotonic() - t0:.0f} s", flush=True)
  return 0 if rc == 0 and not found and not marked else 1


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("mode", choices=sorted(FLAGS) + ["fuzz"])
  parser.add_argument("--quick", action="store_true", help="the short run of the default suite")
  parser.add_argument("--seconds", type=float, default=60, help="fuzz: how long")
  parser.add_argument("--replay", nargs="+", default=None,
                      help="fuzz: run these inputs once, printing every operation")
  parser.add_argument("--build-only", action="store_true")
  parser.add_argument("--build-dir", type=pathlib.Path, default=None)
  parser.add_argument("extra", nargs="*", help="fuzz: ops or corrupt first; after --: arguments "
                      "for pytest (or libFuzzer)")
  args = parser.parse_args(argv)
  if args.mode == "fuzz":
    target, extra = "ops", args.extra
    if extra and extra[0] in ("ops", "corrupt"):
      target, extra = extra[0], extra[1:]
    return fuzz(target, args.seconds, extra, args.build_dir, args.replay)
  if args.build_only:
    build(args.mode, args.build_dir or ROOT / "build" / "sanitize" / args.mode)
    return 0
  return run(args.mode, args.quick, args.extra, args.build_dir)


if __name__ == "__main__":
  sys.exit(main())
