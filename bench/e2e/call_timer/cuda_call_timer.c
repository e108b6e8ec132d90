/* cuda_call_timer.c: LD_PRELOAD library that times the CUDA runtime's allocation calls made by
 * PyTorch's own allocators, so the end-to-end benchmark can set "time inside the allocator" of
 * backend:cudaMallocAsync (and native's cudaMalloc/cudaFree) beside cachealloc's own counter.
 *
 * It interposes cudaMallocAsync, cudaFreeAsync, cudaMallocFromPoolAsync, cudaMalloc and cudaFree,
 * forwards each to the next definition (dlsym RTLD_NEXT) and adds the wall time of the call to a
 * counter. The figure is a LOWER bound of PyTorch's allocator time: PyTorch's own bookkeeping
 * around these calls (locks, maps, stream tracking) is not counted. Read the counters from
 * Python with ctypes: CDLL(path).cachealloc_call_timer_ns(buf) fills
 *   buf[0] ns in cudaMallocAsync + cudaMallocFromPoolAsync   buf[1] their calls
 *   buf[2] ns in cudaFreeAsync                               buf[3] its calls
 *   buf[4] ns in cudaMalloc + cudaFree                       buf[5] their calls
 * Build: cc -O2 -shared -fPIC -I<cuda>/include cuda_call_timer.c -o libcuda_call_timer.so -ldl
 */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

static _Atomic uint64_t counters[6];

static inline uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void *next_symbol(const char *name) {
  void *f = dlsym(RTLD_NEXT, name);
  return f;
}

#define TIMED(slot, call)                                   \
  do {                                                      \
    const uint64_t t0 = now_ns();                           \
    cudaError_t status = (call);                            \
    atomic_fetch_add(&counters[slot], now_ns() - t0);       \
    atomic_fetch_add(&counters[(slot) + 1], 1);             \
    return status;                                          \
  } while (0)

typedef cudaError_t (*malloc_async_fn)(void **, size_t, cudaStream_t);
typedef cudaError_t (*malloc_pool_fn)(void **, size_t, cudaMemPool_t, cudaStream_t);
typedef cudaError_t (*free_async_fn)(void *, cudaStream_t);
typedef cudaError_t (*malloc_fn)(void **, size_t);
typedef cudaError_t (*free_fn)(void *);

cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream) {
  static malloc_async_fn real;
  if (!real) real = (malloc_async_fn)next_symbol("cudaMallocAsync");
  if (!real) return cudaErrorNotSupported;
  TIMED(0, real(ptr, size, stream));
}

cudaError_t cudaMallocFromPoolAsync(void **ptr, size_t size, cudaMemPool_t pool, cudaStream_t stream) {
  static malloc_pool_fn real;
  if (!real) real = (malloc_pool_fn)next_symbol("cudaMallocFromPoolAsync");
  if (!real) return cudaErrorNotSupported;
  TIMED(0, real(ptr, size, pool, stream));
}

cudaError_t cudaFreeAsync(void *ptr, cudaStream_t stream) {
  static free_async_fn real;
  if (!real) real = (free_async_fn)next_symbol("cudaFreeAsync");
  if (!real) return cudaErrorNotSupported;
  TIMED(2, real(ptr, stream));
}

cudaError_t cudaMalloc(void **ptr, size_t size) {
  static malloc_fn real;
  if (!real) real = (malloc_fn)next_symbol("cudaMalloc");
  if (!real) return cudaErrorNotSupported;
  TIMED(4, real(ptr, size));
}

cudaError_t cudaFree(void *ptr) {
  static free_fn real;
  if (!real) real = (free_fn)next_symbol("cudaFree");
  if (!real) return cudaErrorNotSupported;
  TIMED(4, real(ptr));
}

void cachealloc_call_timer_ns(uint64_t out[6]) {
  for (int i = 0; i < 6; ++i) out[i] = atomic_load(&counters[i]);
}
