/* plugin_api.h: the C ABI of libcachealloc_plugin.so (PyTorch) and libcachealloc_capi.so.
 *
 * Two libraries export these same symbols and nothing else:
 *
 *   libcachealloc_plugin.so  built against LibTorch's c10. The allocation hooks are meant for
 *                            torch.cuda.memory.CUDAPluggableAllocator; they raise PyTorch errors:
 *                            an allocation that cannot be satisfied throws c10::OutOfMemoryError
 *                            (Python: torch.OutOfMemoryError), any other failure c10::Error
 *                            (Python: RuntimeError). They never return NULL for a failed
 *                            allocation: PyTorch would use the NULL and crash later.
 *   libcachealloc_capi.so    no PyTorch dependency, for ctypes and C programs. The hooks never
 *                            throw: a failed allocation returns NULL, other failures return
 *                            silently; cachealloc_last_error() says what happened.
 *
 * In both, the "Python package API" functions (memory stats, snapshots, ...) never throw: they
 * return a negative value on failure and set the calling thread's last error.
 *
 * Configuration: the environment variable CACHEALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF syntax),
 * read once, when the first hook runs (init, or the first allocation). See README.md.
 *
 * Streams are cudaStream_t passed as void* (the same ABI); 0 is the legacy default stream.
 */
#ifndef CACHEALLOC_PLUGIN_API_H
#define CACHEALLOC_PLUGIN_API_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define CACHEALLOC_EXPORT __attribute__((visibility("default")))
#else
#define CACHEALLOC_EXPORT
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- CUDAPluggableAllocator hooks ------------------------------------------------------- */

/** A block of at least `size` bytes on `device`, usable on `stream`. size 0 returns NULL. */
CACHEALLOC_EXPORT void* cachealloc_alloc(size_t size, int device, void* stream);
/** Frees `ptr` (its block may be reused on `stream` at once, elsewhere once record_stream'ed
 *  streams caught up). Never throws, in either library: PyTorch calls it from destructors. A
 *  pointer this allocator did not hand out (double free, foreign pointer) is logged as an error
 *  and ignored: the allocator's state does not change and the program goes on. */
CACHEALLOC_EXPORT void cachealloc_free(void* ptr, size_t size, int device, void* stream);
/** PyTorch's lazy CUDA initialisation: reads and validates CACHEALLOC_CONF. A bad setting is
 *  printed and raised (c10::Error). Device allocators are still created lazily, on first use. */
CACHEALLOC_EXPORT void cachealloc_init(int device_count);
/** torch.cuda.empty_cache(): returns every wholly free cached segment on every device. */
CACHEALLOC_EXPORT void cachealloc_reset(void);
/** torch.cuda.set_per_process_memory_fraction(fraction, device). */
CACHEALLOC_EXPORT void cachealloc_set_memory_fraction(double fraction, int device);
/** Tensor.record_stream(stream): the block's free waits for work queued on `stream`. */
CACHEALLOC_EXPORT void cachealloc_record_stream(void* ptr, void* stream);
/** The start of the segment holding `ptr`, its length in *size (PyTorch's getBaseAllocation). */
CACHEALLOC_EXPORT void* cachealloc_base_alloc(void* ptr, size_t* size);

/* ---- Python package API (never throw; negative return = error, see last_error) ---------- */

/** Statistics of `device` as a JSON object {"allocated_bytes.all.current": n, ...} with
 *  torch.cuda.memory_stats() key names plus alloc_ns, free_ns, allocator_ns. Writes at most
 *  `len` bytes including the terminating NUL; returns the JSON's length (without NUL), so a
 *  return value >= len means "call again with a bigger buffer". -1 on error. */
CACHEALLOC_EXPORT int64_t cachealloc_memory_stats_json(int device, char* buf, size_t len);
/** What the policy of `device` can tell about its decisions, as a JSON object: policy defrag
 *  gives {"slack_history": [...], "slack_history_dropped": n} (Note [A history of the slack]);
 *  other policies, or a device not used yet, "{}". Buffer and return value as above. */
CACHEALLOC_EXPORT int64_t cachealloc_policy_report_json(int device, char* buf, size_t len);
/** The regions holding the allocator's bookkeeping (Note [Bookkeeping on few pages],
 *  hot_pages.h) as {"mode", "regions", "region_bytes", "bytes_in_use", "bytes_carved",
 *  "fallback_allocations", "huge_bytes"} (huge_bytes from /proc/self/smaps, null where it cannot
 *  be read: milliseconds, a diagnostic). Buffer and return value as above. */
CACHEALLOC_EXPORT int64_t cachealloc_hot_pages_json(char* buf, size_t len);
/** Registered policies as a JSON list of {name, summary, backend, replay_only, config_keys}. */
CACHEALLOC_EXPORT int64_t cachealloc_policies_json(char* buf, size_t len);
/** Peak statistics := current ones, for `device` (< 0: every device). 0 or -1. */
CACHEALLOC_EXPORT int cachealloc_reset_peak(int device);
/** Cumulative statistics and allocator time := 0, for `device` (< 0: every device). 0 or -1. */
CACHEALLOC_EXPORT int cachealloc_reset_accumulated(int device);
/** empty_cache for `device` (< 0: every device). 0 or -1. */
CACHEALLOC_EXPORT int cachealloc_empty_cache(int device);
/** Writes the current segments and the recorded trace (`record:` in CACHEALLOC_CONF; empty
 *  otherwise) to `path` in PyTorch's snapshot format (xz-compressed when it ends in .xz). */
CACHEALLOC_EXPORT int cachealloc_dump_snapshot(const char* path);
/** Nanoseconds spent inside alloc and free on `device` (0 when timing is off or on error). */
CACHEALLOC_EXPORT uint64_t cachealloc_allocator_ns(int device);
/** Checks a CACHEALLOC_CONF string (NULL: the environment variable) without touching a device.
 *  0 when valid, -1 otherwise (last_error holds the message). */
CACHEALLOC_EXPORT int cachealloc_validate_config(const char* conf);
/** Throws nothing; runs every started device's invariant checks. 0, or -1 with the message. */
CACHEALLOC_EXPORT int cachealloc_check_invariants(int device);
/** The policy CACHEALLOC_CONF selects ("" when it is invalid; see last_error). Valid until the
 *  calling thread's next call of this function. */
CACHEALLOC_EXPORT const char* cachealloc_policy_name(void);
/** Devices the runtime manages (starts the runtime: reads CACHEALLOC_CONF). -1 on error. */
CACHEALLOC_EXPORT int cachealloc_device_count(void);
/** 1 once the runtime started (a hook or a stats call ran), else 0. */
CACHEALLOC_EXPORT int cachealloc_is_active(void);
/** 1 in libcachealloc_plugin.so (hooks raise PyTorch errors), 0 in libcachealloc_capi.so. */
CACHEALLOC_EXPORT int cachealloc_is_torch_plugin(void);
/** The message of the calling thread's last error ("" if none). Valid until its next call. */
CACHEALLOC_EXPORT const char* cachealloc_last_error(void);
/** The kind of the calling thread's last error: 0 none, 1 out of memory, 2 configuration,
 *  3 usage (unknown pointer, bad device), 4 device (CUDA) error, 5 other. */
CACHEALLOC_EXPORT int cachealloc_last_error_code(void);
/** Clears the calling thread's last error. */
CACHEALLOC_EXPORT void cachealloc_clear_error(void);
/** "0.1.0". */
CACHEALLOC_EXPORT const char* cachealloc_version(void);

#ifdef __cplusplus
}
#endif

#endif /* CACHEALLOC_PLUGIN_API_H */
