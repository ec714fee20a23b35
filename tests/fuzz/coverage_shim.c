/* Edge coverage of gcc-instrumented code for libFuzzer (atheris).
 *
 * gcc has no -fsanitize=fuzzer: its only coverage instrumentation, -fsanitize-coverage=trace-pc,
 * calls __sanitizer_cov_trace_pc() at the start of every basic block. This library defines that
 * function: it hashes the pair (previous block, this block) of the calling thread into one of
 * 65536 one-byte counters (AFL's edge hash), saturating at 255. The sanitizer build of the C core
 * (tests/sanitize.py) preloads it, so every instrumented module resolves the hook here;
 * rs_cov_register() then hands the counters to the fuzzer's libFuzzer
 * (__sanitizer_cov_8bit_counters_init / __sanitizer_cov_pcs_init, looked up by the harness in
 * atheris's module), which counts a new (counter, count bucket) pair as new coverage, exactly as
 * for clang's inline 8-bit counters. Without a registered fuzzer the counters are just written.
 */
#include <stdint.h>

#define NCOUNTERS (1u << 16)

static uint8_t counters[NCOUNTERS] __attribute__((aligned(64)));
static uintptr_t pc_table[2 * NCOUNTERS];   /* (pseudo-pc, flags) per counter */
static __thread uintptr_t prev_block;

__attribute__((no_sanitize_coverage, visibility("default"))) void __sanitizer_cov_trace_pc(void) {
  uintptr_t pc = (uintptr_t)__builtin_return_address(0);
  uintptr_t cur = (pc * 0x9E3779B97F4A7C15ull) >> 48;   /* 16 bits */
  uint8_t *c = &counters[(cur ^ prev_block) & (NCOUNTERS - 1)];
  prev_block = cur >> 1;
  if (*c != 255) (*c)++;
}

typedef void (*counters_init_fn)(uint8_t *start, uint8_t *stop);
typedef void (*pcs_init_fn)(const uintptr_t *start, const uintptr_t *stop);

__attribute__((no_sanitize_coverage, visibility("default")))
void rs_cov_register(void *counters_init, void *pcs_init) {
  for (uint32_t i = 0; i < NCOUNTERS; i++) {
    pc_table[2 * i] = 0x100000u + i;   /* distinct pseudo program counters */
    pc_table[2 * i + 1] = 0;
  }
  ((counters_init_fn)counters_init)(counters, counters + NCOUNTERS);
  if (pcs_init) ((pcs_init_fn)pcs_init)(pc_table, pc_table + 2 * NCOUNTERS);
}

/* Distinct counters set so far (a coverage figure for reports). */
__attribute__((no_sanitize_coverage, visibility("default"))) uint32_t rs_cov_edges(void) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < NCOUNTERS; i++) n += counters[i] != 0;
  return n;
}
