/* Polling a descriptor for a message due soon, without blocking: a thread that blocks lets its
 * CPU go idle, and waking an idle CPU is what a round trip mostly costs on a quiet virtual
 * machine. Called with the GIL released, so other Python threads run meanwhile. */
#define _GNU_SOURCE
#include <poll.h>
#include <sched.h>

#include "rs_internal.h"

int rs_spin_readable(int fd, int64_t spin_ns) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  int64_t end = rs_now_ns() + spin_ns;
  for (;;) {
    int rc = poll(&p, 1, 0);
    if (rc > 0) return 1;
    if (rc < 0 || rs_now_ns() >= end) return 0;
    sched_yield();
  }
}
