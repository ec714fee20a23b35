/* TrajectoryWriter per-step fast path (filled in by the W2 work). */
#include "hot.h"

int hot_writer_init(PyObject *module) { return 0; }
