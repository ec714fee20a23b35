/* Liveness locks: whether the owner of a segment, or the process of a slot, is alive, judged
 * in a way that holds across pid namespaces.
 *
 * A pid names a process only inside its pid namespace: a client in a container (another pid
 * namespace sharing /dev/shm) sees the server's pid as nobody, and the server sees the client's
 * pid as nobody or as some other process. So each live process also holds an open-file-
 * description read lock (F_OFD_SETLK, F_RDLCK) on one byte of the segment's file: byte 0 for
 * the owner, byte 1 + slot for a registered process. The kernel drops such a lock when the
 * last descriptor of its open file description closes, so when its process ends, however it
 * ends. Anyone with the file open tests a byte with F_OFD_GETLK (which takes nothing): a held
 * byte means alive. A process never sees its own description's locks this way, so callers
 * treat "pid alive" OR "byte held" as alive.
 *
 * This process's descriptor of each mapped segment's file is kept here (base -> fd), for
 * the probes of rs_owner_check, rs_reap and rs_proc_list. Layer 1: calls util.c only.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "rs_internal.h"

#define MAX_LIVE_FDS 256
static struct { void *base; int fd; } live_fds[MAX_LIVE_FDS];
static pthread_mutex_t live_fds_lock = PTHREAD_MUTEX_INITIALIZER;

/* A thread of the parent may hold the lock at fork time; the child (whose only thread is the
 * forking one, and which replaces its fds through rs_forget / rs_set_liveness_fd) starts with
 * it unlocked. */
static void live_fds_after_fork_in_child(void) { pthread_mutex_init(&live_fds_lock, NULL); }
__attribute__((constructor)) static void live_fds_register_atfork(void) {
  pthread_atfork(NULL, NULL, live_fds_after_fork_in_child);
}

void rs_forget_liveness_fd(void *base, int fd) {
  pthread_mutex_lock(&live_fds_lock);
  for (int i = 0; i < MAX_LIVE_FDS; i++)
    if (live_fds[i].base == base && live_fds[i].fd == fd) live_fds[i].base = NULL, live_fds[i].fd = -1;
  pthread_mutex_unlock(&live_fds_lock);
}

int rs_set_liveness_fd(void *base, int fd) {
  if (!base || fd < 0) return rs_set_error(RS_EINVAL, "rs_set_liveness_fd: NULL base or no fd");
  pthread_mutex_lock(&live_fds_lock);
  int at = -1;
  for (int i = 0; i < MAX_LIVE_FDS; i++)
    if (live_fds[i].base == base) at = i;
  for (int i = 0; i < MAX_LIVE_FDS && at < 0; i++)
    if (!live_fds[i].base) at = i;
  if (at < 0) {
    pthread_mutex_unlock(&live_fds_lock);
    return rs_set_error(RS_EFULL, "more than %d segments mapped in this process", MAX_LIVE_FDS);
  }
  live_fds[at].base = base;
  live_fds[at].fd = fd;
  pthread_mutex_unlock(&live_fds_lock);
  return RS_OK;
}

int rs_live_lock(int fd, uint64_t byte, int hold) {
  struct flock fl;
  memset(&fl, 0, sizeof fl);
  fl.l_type = hold ? F_RDLCK : F_UNLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = (off_t)byte;
  fl.l_len = 1;
  if (fcntl(fd, F_OFD_SETLK, &fl) == 0) return RS_OK;
  return rs_set_error(RS_ESYS, "liveness lock on byte %llu of a segment file: %s",
                      (unsigned long long)byte, strerror(errno));
}

int rs_live_probe(int fd, uint64_t byte) {
  struct flock fl;
  memset(&fl, 0, sizeof fl);   /* l_pid must be 0 for OFD requests */
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = (off_t)byte;
  fl.l_len = 1;
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return -1;
  return fl.l_type != F_UNLCK;
}

int rs_live_probe_base(void *base, uint64_t byte) {
  pthread_mutex_lock(&live_fds_lock);
  int fd = -1;
  for (int i = 0; i < MAX_LIVE_FDS; i++)
    if (live_fds[i].base == base) fd = live_fds[i].fd;
  /* probed under the lock: the fd cannot be forgotten (and closed) meanwhile */
  int held = fd < 0 ? -1 : rs_live_probe(fd, byte);
  pthread_mutex_unlock(&live_fds_lock);
  return held;
}

int rs_live_lock_base(void *base, uint64_t byte, int hold) {
  pthread_mutex_lock(&live_fds_lock);
  int fd = -1;
  for (int i = 0; i < MAX_LIVE_FDS; i++)
    if (live_fds[i].base == base) fd = live_fds[i].fd;
  int rc = fd < 0 ? RS_OK : rs_live_lock(fd, byte, hold);   /* no fd: pids alone judge */
  pthread_mutex_unlock(&live_fds_lock);
  return rc;
}
