/* Extents: reserving the pages of a growable segment's further extents, and the disk tier's
 * arena files (the per-process table of the files mapped over arenas, used to grow them).
 *
 * A growable segment is a sparse file mapped whole by every process; rs_reserve makes a range
 * of it real before anyone writes there: MADV_POPULATE_WRITE on /dev/shm (allocated now, or a
 * clean error when /dev/shm or the memory limit is full, never a SIGBUS later), or
 * posix_fallocate on the disk tier's file (blocks allocated, no page dirtied). Layer 1: calls
 * util.c only.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "rs_internal.h"

#define PAGE 4096ull
#define DISK_SLACK (1ull << 20)   /* bytes the disk tier leaves free on its file system */

/* Arena files of this process's mappings (disk tier): base -> fd. Growth and mapping only. */
#define MAX_ARENA_FILES 256
static struct { void *base; int fd; } arena_files[MAX_ARENA_FILES];
static pthread_mutex_t arena_files_lock = PTHREAD_MUTEX_INITIALIZER;

static int arena_file_fd(void *base) {
  int fd = -1;
  pthread_mutex_lock(&arena_files_lock);
  for (int i = 0; i < MAX_ARENA_FILES; i++)
    if (arena_files[i].base == base) fd = arena_files[i].fd;
  pthread_mutex_unlock(&arena_files_lock);
  return fd;
}

int rs_map_arena_file(void *base, uint64_t arena_off, uint64_t len, int fd) {
  if (!base || arena_off % PAGE || fd < 0)
    return rs_set_error(RS_EINVAL, "arena file: offset %llu is not page-aligned, or no file",
                        (unsigned long long)arena_off);
  len = rs_align_up(len, PAGE);
  pthread_mutex_lock(&arena_files_lock);
  int slot = -1;
  for (int i = 0; i < MAX_ARENA_FILES && slot < 0; i++)
    if (!arena_files[i].base || arena_files[i].base == base) slot = i;
  if (slot < 0) {
    pthread_mutex_unlock(&arena_files_lock);
    return rs_set_error(RS_EFULL, "more than %d disk-backed segments mapped in this process", MAX_ARENA_FILES);
  }
  void *at = mmap(rs_at(base, arena_off), len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  if (at == MAP_FAILED) {
    int err = errno;
    pthread_mutex_unlock(&arena_files_lock);
    return rs_set_error(RS_ESYS, "mapping the arena file: %s", strerror(err));
  }
  arena_files[slot].base = base;
  arena_files[slot].fd = fd;
  pthread_mutex_unlock(&arena_files_lock);
  return RS_OK;
}

void rs_unmap_arena_file(void *base) {
  pthread_mutex_lock(&arena_files_lock);
  for (int i = 0; i < MAX_ARENA_FILES; i++)
    if (arena_files[i].base == base) arena_files[i].base = NULL, arena_files[i].fd = -1;
  pthread_mutex_unlock(&arena_files_lock);
}

void rs_segment_set_arena_file(void *base) { rs_seg(base)->arena_file = 1; }

int rs_reserve(void *base, uint64_t off, uint64_t len, const char *what) {
  rs_seg_hdr *h = rs_seg(base);
  if (!h->growable || len == 0) return RS_OK;
  if (h->arena_file && off >= h->arena_off && off < h->arena_off + h->arena_max) {
    /* Disk tier: allocate the file's blocks (no page is dirtied), so that a full disk is an
     * error here and never a SIGBUS when the new extent is written. */
    int fd = arena_file_fd(base), err = fd < 0 ? EBADF : posix_fallocate(fd, (off_t)(off - h->arena_off), (off_t)len);
    /* Leave DISK_SLACK free on the file system: writing into fallocated (unwritten) extents
     * through the mapping still needs a few metadata blocks, and a disk with none left answers
     * that write with a SIGBUS. */
    struct statvfs vfs;
    int no_slack = !err && fstatvfs(fd, &vfs) == 0 && (uint64_t)vfs.f_bavail * vfs.f_frsize < DISK_SLACK;
    if (!err && !no_slack) return RS_OK;
    if (fd >= 0) {
      /* Give back what this step got (a failed posix_fallocate may keep the blocks it found
       * before the disk filled up): the whole pages of the range, which lies beyond everything
       * published, so nobody reads it (a page shared with published data stays). */
      uint64_t first = rs_align_up(off - h->arena_off, PAGE), stop = off - h->arena_off + len;
      uint64_t end = rs_align_up(stop, PAGE) <= h->arena_max ? rs_align_up(stop, PAGE) : stop & ~(PAGE - 1);
      if (first < end)
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)first, (off_t)(end - first));
    }
    if (no_slack)
      return rs_set_error(RS_ENOSPC,
                          "cannot grow %s by %llu KiB in its file (in the server's storage= "
                          "directory): that would leave that disk %llu KiB free, below the %llu KiB "
                          "kept free for the file system; free disk space there, or create the "
                          "server with a smaller max_bytes",
                          what, (unsigned long long)((len + 1023) >> 10),
                          (unsigned long long)((uint64_t)vfs.f_bavail * vfs.f_frsize >> 10),
                          (unsigned long long)(DISK_SLACK >> 10));
    return rs_set_error(RS_ENOSPC,
                        "cannot grow %s by %llu KiB in its file (in the server's storage= "
                        "directory): %s; free disk space there, or create the server with a "
                        "smaller max_bytes",
                        what, (unsigned long long)((len + 1023) >> 10), strerror(err));
  }
  uint64_t start = off & ~(PAGE - 1), end = rs_align_up(off + len, PAGE);
  if (end > h->total_size) end = h->total_size;
  if (madvise(rs_at(base, start), end - start, MADV_POPULATE_WRITE) == 0) return RS_OK;
  int err = errno;
  /* The pages populated before the failure hold memory nobody will use: give them back (the
   * range lies beyond everything published, so no process reads it). */
  uint64_t first = rs_align_up(off, PAGE);   /* whole pages of the range only: never a live byte */
  if (err != EINVAL && first < end) madvise(rs_at(base, first), end - first, MADV_REMOVE);
  return rs_set_error(RS_ENOSPC,
                      "cannot grow %s by %llu KiB: %s; give /dev/shm more room (docker run --shm-size),"
                      " stop other servers, or pre-size the server (arena_bytes) so that it does not need"
                      " to grow",
                      what, (unsigned long long)((len + 1023) >> 10),
                      err == EINVAL ? "this kernel lacks MADV_POPULATE_WRITE (Linux >= 5.14)"
                      : err == EFAULT || err == ENOSPC || err == ENOMEM
                          ? "/dev/shm is full, or the memory limit is reached"
                          : strerror(err));
}

void rs_prefetch_file_rows(const void *p, uint64_t len) {
  uintptr_t start = (uintptr_t)p & ~(uintptr_t)(PAGE - 1), end = (uintptr_t)p + len;
  if (len) madvise((void *)start, end - start, MADV_WILLNEED);   /* a hint: errors change nothing */
}
