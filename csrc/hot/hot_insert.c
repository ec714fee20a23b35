/* Client.insert / SharedTable one-step insert fast path (filled in by the W1 work). */
#include "hot.h"

int hot_insert_init(PyObject *module) { return 0; }
