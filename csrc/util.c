/* Errors, clocks, the per-process random number generator, and rs_copy_stream. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <pthread.h>
#include <sys/random.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "rs_internal.h"

static __thread char rs_errbuf[1024];

int rs_set_error(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rs_errbuf, sizeof rs_errbuf, fmt, ap);
  va_end(ap);
  return code;
}

const char *rs_last_error(void) { return rs_errbuf; }

int64_t rs_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t rs_realtime_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* xoshiro256** (Blackman & Vigna), one state per thread, reseeded in a forked child so it never
 * replays its parent's stream: a fork handler clears the forking thread's `seeded` flag (the only
 * thread the child has), which costs nothing per number, unlike a getpid() per call. */
static __thread uint64_t rng_s[4];
static __thread int rng_seeded;
static pthread_once_t rng_once = PTHREAD_ONCE_INIT;

static void rng_child_after_fork(void) { rng_seeded = 0; }
static void rng_register_fork_handler(void) { pthread_atfork(NULL, NULL, rng_child_after_fork); }

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t splitmix(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static void rng_seed(void) {
  uint64_t seed = 0;
  if (getrandom(&seed, sizeof seed, 0) != (ssize_t)sizeof seed)
    seed = (uint64_t)rs_now_ns() ^ ((uint64_t)getpid() << 32);
  for (int i = 0; i < 4; i++) rng_s[i] = splitmix(&seed);
  pthread_once(&rng_once, rng_register_fork_handler);
  rng_seeded = 1;
}

static inline uint64_t xoshiro_next(uint64_t *s) {
  const uint64_t result = rotl(s[1] * 5, 7) * 9;
  const uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return result;
}

uint64_t rs_rand_u64(void) {
  if (__builtin_expect(!rng_seeded, 0)) rng_seed();
  return xoshiro_next(rng_s);
}

void rs_rand_fill(uint64_t *out, uint32_t n) {
  if (__builtin_expect(!rng_seeded, 0)) rng_seed();
  uint64_t s[4] = {rng_s[0], rng_s[1], rng_s[2], rng_s[3]};   /* one thread-local access per call */
  for (uint32_t i = 0; i < n; i++) out[i] = xoshiro_next(s);
  for (int i = 0; i < 4; i++) rng_s[i] = s[i];
}

double rs_rand_unit(void) { return (double)(rs_rand_u64() >> 11) * 0x1.0p-53; }

void rs_copy_stream(void *dst, const void *src, uint64_t n) {
#if defined(__SSE2__)
  if (n >= RS_STREAM_MIN_BYTES) {
    uint8_t *d = dst;
    const uint8_t *s = src;
    uint64_t head = (RS_ALIGN - ((uintptr_t)d & (RS_ALIGN - 1))) & (RS_ALIGN - 1);
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= RS_ALIGN; d += RS_ALIGN, s += RS_ALIGN, n -= RS_ALIGN) {
      __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
      __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
      _mm_stream_si128((__m128i *)d, a);
      _mm_stream_si128((__m128i *)(d + 16), b);
      _mm_stream_si128((__m128i *)(d + 32), c);
      _mm_stream_si128((__m128i *)(d + 48), e);
    }
    _mm_sfence();   /* the stores are globally visible before rows is published */
    memcpy(d, s, n);
    return;
  }
#endif
  memcpy(dst, src, n);
}
