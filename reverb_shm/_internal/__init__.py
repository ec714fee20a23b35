"""Private machinery of reverb_shm (no stable API; import the public modules instead).

  _lib        the C core's bindings (cffi `ffi`/`lib`, the `_hot` fast paths) and `check`, the one
              place C return codes become exceptions
  shm         server segments: create, attach, name registry, pins, reaping dead processes
  chunks      chunk allocation in the segment's arena, row writes, item descriptors
  hot_plans   one-call insert plans for the C fast paths
  structure   nests (dm-tree order): flatten, unflatten, paths, leaves to arrays
  structured  StructuredWriter configurations (patterns, conditions)
  columns     nests to columns and the checks of dtypes, shapes, priorities, signatures
  history     the trajectory writer's columns, cell refs and TrajectoryColumn windows
  items       item encoding (descriptors of chunk slices) for the trajectory writer
  keys        random item keys and episode ids
  table_info  TableInfo, the snapshot of a table's configuration and counters
  addresses   which client serves an address (local shared memory or the bridge)
  timeouts    deadlines and wait slices (milliseconds in the API, nanoseconds in C)
"""
