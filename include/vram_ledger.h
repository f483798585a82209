/* vram_ledger.h: the C interface of libvram_ledger.so.
 *
 * Generated from the declarations in src/ffi by a test of the crate, which fails when this file
 * differs from them; regenerate it with
 *     VRAM_LEDGER_WRITE_HEADER=1 cargo test --lib ffi::header
 * rather than editing it.
 *
 * An int result is 0 on success and -1 on error, a pointer result NULL on error, unless a
 * function says otherwise; the error's message is then vram_ledger_last_error() on the failing
 * thread. A `char *` result (JSON, Prometheus text) is the caller's, to free with
 * vram_ledger_string_free; a `const char *` one stays the library's. Streams are CUDA streams
 * (cudaStream_t, CUstream) passed as `void *`; NULL is the legacy default stream. No function
 * unwinds into the caller but vram_ledger_malloc_or_throw, which throws a C++ exception.
 * With VRAM_LEDGER_DRIVER=sim in the environment at the first call, every function runs on
 * simulated devices (VRAM_LEDGER_SIM_DEVICES of them, default 1), with no GPU; unset, empty or
 * `cuda`, on the CUDA driver. Any other value (or a device count that is no number from 0 to
 * 1024) fails every call that needs a device, saying so.
 */
#ifndef VRAM_LEDGER_H
#define VRAM_LEDGER_H

#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

/* A host's sink for the failures of C entry points: `level` is on Python's `logging` scale (30,
 * a warning), `message` a NUL-terminated UTF-8 string valid during the call.
 */
typedef void (*vram_ledger_log_callback)(int level, const char *message);

/* A host function naming the context of an allocation (`kind` 0) or a free (`kind` 1) this
 * thread is about to make: an identifier the host resolves later
 * (the Python package's stack frames), or 0 for none. The history's entry for the operation
 * carries it.
 */
typedef uint64_t (*vram_ledger_context_source)(int kind);

/* An observer of out-of-memory failures, as PyTorch's caching allocator calls its own
 * (`torch._C._cuda_attach_out_of_memory_observer`): the device, the bytes asked for, the
 * bytes this allocator has handed out on that device, and the device's free bytes.
 */
typedef void (*vram_ledger_oom_observer)(int device, int64_t size, int64_t allocated, int64_t device_free);

/* A pool's own allocation function, as PyTorch's pluggable allocator takes it: `size` bytes
 * on `device` for use on `stream`, or NULL.
 */
typedef void *(*vram_ledger_pool_alloc)(size_t size, int device, void *stream);

/* A pool's own free function: give back what its allocation function returned. */
typedef void (*vram_ledger_pool_free)(void *ptr, size_t size, int device, void *stream);

/* Whether a profiler that records memory is active on this thread (`c10::memoryProfilingEnabled`;
 * its `bool` read as one byte, 0 or 1).
 */
typedef uint8_t (*vram_ledger_memory_profiling)(void);

/* A memory event (`c10::reportMemoryUsageToProfiler`): the pointer, the bytes allocated
 * (negative for a free), the bytes allocated and reserved on the device after it, and the
 * device as c10 passes a `c10::Device` by value (its type, CUDA = 1, in the low byte and its
 * index in the high byte).
 */
typedef void (*vram_ledger_memory_report)(void *ptr, int64_t size, uint64_t allocated, uint64_t reserved, uint16_t device);

/* ---- src/ffi/boundary.rs ----------------------------------------------------
 * The boundary every C entry point goes through: errors and panics become return values and a
 * per-thread message, failures of entry points that return nothing are logged, and arguments
 * from C are checked.
 */

/* Send the failures of C entry points that return nothing (`void`, such as a free) to
 * `callback` instead of stderr (NULL goes back to stderr); the others' failures are in their
 * results. The Python package hands it `logging`. The callback runs on the failing thread,
 * after the failed call has released every lock of the allocator, and must not unwind. The
 * library's own notes on calls that succeeded (a commit that left the KV cache as it was, say)
 * are not failures: they go to stderr, filtered by `VRAM_LEDGER_LOG` (default `warn`; `off`
 * silences them).
 */
void vram_ledger_set_log_callback(vram_ledger_log_callback callback);

/* The message of the last failure on this thread ("" if none). Valid until the next failure
 * on this thread, and not after the thread exits: copy it to keep it. Never NULL.
 */
const char *vram_ledger_last_error(void);

/* Free a string returned by this library. NULL is ignored.
 *
 * Safety:
 * `s` is NULL or a string this library returned, not freed before.
 */
void vram_ledger_string_free(char *s);

/* The number of this process's devices: CUDA devices, or with `VRAM_LEDGER_DRIVER=sim`
 * simulated ones. 0 without a device; when the backend cannot count them (no driver, or a
 * `VRAM_LEDGER_DRIVER` or `VRAM_LEDGER_SIM_DEVICES` value that names nothing) also 0, and
 * `vram_ledger_last_error` says why.
 */
int vram_ledger_device_count(void);

/* ---- src/ffi/ledger.rs ------------------------------------------------------
 * Configuration, tags, statistics, history and metrics. Functions returning int give 0 or -1.
 * The configuration (`vram_ledger_configure` and the settings beside it) is for allocators not
 * yet created: once any device is in use, a call that would change it is refused (-1), since
 * the allocators in use keep theirs.
 */

/* Choose the segment mode ("native", "expandable", "compact" or "remap") of allocators not yet
 * created (refused once a device is in use, unless it is the mode set already). A device is
 * in use from the first call that names it, queries included (`vram_ledger_cap`,
 * `vram_ledger_stats_json`, …): configure first. `vram_ledger_init`, `vram_ledger_device_count`
 * and `vram_ledger_free` or `vram_ledger_record_stream` of NULL put none in use.
 *
 * Safety:
 * `mode` is NULL (an error) or a NUL-terminated string, readable for the length of the call.
 */
int vram_ledger_configure(const char *mode);

/* Remap mode: unmap a moved piece's old mapping once the stream's earlier work has finished,
 * instead of synchronising the stream before the move (`Config::unmap_later`), in allocators
 * not yet created. Other modes make no such moves and ignore it.
 */
int vram_ledger_unmap_later(int enabled);

/* Remap mode: the largest piece of physical memory one map call covers, in bytes, rounded up
 * to whole granules (`Config::remap_piece`), in allocators not yet created; 0 puts back the
 * default (68 MiB). Other modes ignore it.
 */
int vram_ledger_remap_piece(uint64_t bytes);

/* Compact and remap modes: before growing, also take the free memory other streams' shards
 * hold, after synchronising the device (`Config::move_across_streams`), in allocators not yet
 * created. Off by default; other modes ignore it.
 */
int vram_ledger_move_across_streams(int enabled);

/* Set this thread's tag (weights, activation, kv_cache or kv, untracked).
 *
 * Safety:
 * `name` is NULL (an error) or a NUL-terminated string, readable for the length of the call.
 */
int vram_ledger_set_tag(const char *name);

/* Make `name` this thread's tag until the matching `vram_ledger_pop_tag`.
 *
 * Safety:
 * `name` is NULL (an error) or a NUL-terminated string, readable for the length of the call.
 */
int vram_ledger_push_tag(const char *name);

/* Give this thread back the tag it had before the matching `vram_ledger_push_tag`; -1 when
 * there is none.
 */
int vram_ledger_pop_tag(void);

/* This thread's tag, as a static string (never NULL). */
const char *vram_ledger_current_tag(void);

/* The ledger snapshot as JSON (free with `vram_ledger_string_free`), or NULL. */
char *vram_ledger_stats_json(int device);

/* Statistics under PyTorch's `memory_stats()` keys, plus per-tag keys, as JSON. */
char *vram_ledger_memory_stats_json(int device);

/* Hold this process to `bytes` of device memory in all on `device` (the budget contract:
 * the allocator's bytes plus memory outside it, re-read before every growth); a negative
 * `bytes` lifts the cap. Profiling sets it to the requested memory by itself.
 */
int vram_ledger_set_cap(int device, int64_t bytes);

/* The budget contract of `device` in bytes, -1 when none is set, or -2 on error (with the
 * last error set).
 */
int64_t vram_ledger_cap(int device);

/* Start every peak figure of `device` over from its current value. */
int vram_ledger_reset_peaks(int device);

/* Count `device`'s accumulated statistics (the `allocated` and `freed` totals, retries,
 * out-of-memory failures, device allocations and frees) from now on, as
 * `torch.cuda.reset_accumulated_memory_stats` does; the ledger's own totals are kept.
 */
int vram_ledger_reset_accumulated(int device);

/* Give `device`'s cached, unused memory back to the driver. */
int vram_ledger_empty_cache(int device);

/* Start (`enabled` non-zero; clearing what was recorded, keeping the newest `max_entries`
 * entries, which must be positive) or stop recording `device`'s allocation history
 * (`max_entries` is then not read).
 */
int vram_ledger_record_history(int device, int enabled, int64_t max_entries);

/* Attach `metadata` to `device`'s history entries from now on (NULL or "": none), as
 * PyTorch's `_set_memory_metadata` does; 0 on success, -1 on error.
 *
 * Safety:
 * `metadata` is NULL or a NUL-terminated string, readable for the length of the call.
 */
int vram_ledger_set_history_metadata(int device, const char *metadata);

/* Write `device`'s snapshot (segments now, and the recorded history) to `path` as PyTorch's
 * snapshot pickle (`torch.cuda.memory._dump_snapshot`'s format).
 *
 * Safety:
 * `path` is NULL (an error) or a NUL-terminated string, readable for the length of the call.
 */
int vram_ledger_dump_snapshot(int device, const char *path);

/* Every device in use, in Prometheus' text exposition format (see `crate::metrics` for the
 * names); the caller frees the string with `vram_ledger_string_free`.
 */
char *vram_ledger_metrics(void);

/* ---- src/ffi/pytorch.rs -----------------------------------------------------
 * PyTorch's pluggable-allocator entry points and hooks.
 */

/* `void* alloc(ssize_t size, int device, cudaStream_t stream)`. Size 0 returns NULL (as
 * PyTorch's own allocator does), which is not an error.
 *
 * Safety:
 * On the CUDA backend `stream` is NULL (the legacy default stream) or a live `cudaStream_t` of
 * `device`'s primary context, which stays alive while memory allocated on it is in use: the
 * allocator hands it to the driver (capture queries, and events when the memory is freed).
 * The simulated backend only compares it.
 */
void *vram_ledger_malloc(ssize_t size, int device, void *stream);

/* Name a context for allocations (`kinds` bit 0) and frees (bit 1) through this ABI (NULL:
 * none, the default; other bits of `kinds` are ignored). The source runs on the allocating
 * or freeing thread before the allocator takes any lock, so it may wait on the host's own
 * locks (such as Python's) and call the library; it must not unwind.
 */
void vram_ledger_set_context_source(vram_ledger_context_source source, int kinds);

/* Call `observer` on every out of memory of an allocation through this ABI (NULL: no one),
 * before the allocation's error is returned or thrown. It runs on the failing thread with no
 * lock of the allocator held, so it may call the library (read statistics, give the cache
 * back), and must not unwind.
 */
void vram_ledger_set_oom_observer(vram_ledger_oom_observer observer);

/* `vram_ledger_malloc` for PyTorch's pluggable allocator, which does not check for NULL:
 * when there is nothing to return it throws a C++ exception instead, which PyTorch turns into
 * `torch.OutOfMemoryError` (out of memory, worded as PyTorch's own message, then the
 * breakdown) or a `RuntimeError` (anything else). The process keeps its CUDA context and can
 * go on.
 *
 * Safety:
 * As for `vram_ledger_malloc`; and the caller is C++ that lets exceptions pass (PyTorch).
 */
void *vram_ledger_malloc_or_throw(ssize_t size, int device, void *stream);

/* `void free(void* ptr, ssize_t size, int device, cudaStream_t stream)`. `ptr` is looked up,
 * never dereferenced: NULL is ignored (nothing else is looked at, and no device is put in
 * use), and a pointer this library did not allocate is an error. `size` is what was asked for
 * it, told to the memory reporter as a negative allocation; a negative `size` is an error
 * (after the free: the memory is freed, the reporter told nothing).
 *
 * Safety:
 * `stream` is as for `vram_ledger_malloc`. Work that uses `ptr` is queued on `stream`, or on
 * a stream passed to `vram_ledger_record_stream` for it: the memory is reused once that work
 * completes, and the driver is handed those streams to find out when.
 */
void vram_ledger_free(void *ptr, ssize_t size, int device, void *stream);

/* `void init(int device)`. PyTorch calls it for every device at start-up, also in processes
 * that use only one, so it creates nothing: a device's allocator and profiling baseline come
 * with its first use.
 */
void vram_ledger_init(int device);

/* `void reset(void)`: `torch.cuda.empty_cache()`. */
void vram_ledger_reset(void);

/* `void memory_fraction(double fraction, int device)`: limit what `device`'s allocator reserves
 * to `fraction` (in [0, 1]) of the device's total memory, as PyTorch's
 * `set_per_process_memory_fraction`; 1.0 reserves up to the whole device. Growth past the
 * limit fails as an out-of-memory that names it. A limit on the allocator's own memory,
 * apart from the budget contract (`vram_ledger_set_cap`, the process's whole usage); a
 * fraction outside [0, 1] is an error (logged: the function returns nothing).
 */
void vram_ledger_memory_fraction(double fraction, int device);

/* `void record_stream(void* ptr, cudaStream_t stream)`: `ptr`'s memory is not reused before
 * the work queued on `stream` so far completes. `ptr` is looked up, never dereferenced; NULL
 * (a zero-byte allocation's) is ignored.
 *
 * Safety:
 * On the CUDA backend `stream` is a live `cudaStream_t` of the context of the device that
 * `ptr` belongs to, alive until `ptr` is freed: the allocator records an event on it then.
 */
void vram_ledger_record_stream(void *ptr, void *stream);

/* ---- src/ffi/profile.rs -----------------------------------------------------
 * Profiling scopes: open one on a device, end it with the budget and report as JSON.
 */

/* Open a profiling scope on `device` (its baseline was taken at the device's first use). A
 * negative `margin_bytes` means the default (`Margin::Auto`: 0.25% of the requested memory, in
 * every mode, as room for serving's other placement).
 */
int vram_ledger_profile_begin(int device, double utilization, int64_t margin_bytes);

/* Close the profiling scope of `device`: the result as JSON (free with
 * `vram_ledger_string_free`), or NULL.
 */
char *vram_ledger_profile_end(int device);

/* ---- src/ffi/kv.rs ----------------------------------------------------------
 * The KV cache sized last (see `Allocator::reserve_kv`): reserve it, commit it to what the
 * budget contract leaves after the CUDA graphs are captured, resize it while serving, give it
 * back. Results are JSON (free them with `vram_ledger_string_free`), NULL on error with the
 * reason in `vram_ledger_last_error`.
 */

/* Reserve the KV cache on `device`: address space for `max_bytes` (negative: the device's
 * memory) in blocks of `block_bytes`, `initial_blocks` of them usable now. Returns the KV
 * cache as JSON (`base`, `block_bytes`, `reserved_blocks`, `usable_blocks`, `reserved_bytes`,
 * `mapped_bytes`).
 */
char *vram_ledger_kv_reserve(int device, uint64_t block_bytes, int64_t max_bytes, uint64_t initial_blocks);

/* Map the KV cache up to what the budget contract leaves now (again after serving: sized from
 * what serving reserved at most); returns the KV cache and what was measured (`kv`, `room`,
 * `blocks_before`) as JSON.
 */
char *vram_ledger_kv_commit(int device);

/* Make `blocks` usable; returns the KV cache as JSON. Shrinking needs every block from
 * `free_from` on free (the engine says so; a `free_from` at or above the usable blocks says
 * nothing is); growing past the memory the cache keeps mapped needs the budget contract
 * (profiling, or `vram_ledger_set_cap`), whose room it may not pass. On an error the KV cache
 * is as it was.
 */
char *vram_ledger_kv_resize(int device, uint64_t blocks, uint64_t free_from);

/* The KV cache as JSON, or `null` when none is reserved. */
char *vram_ledger_kv_info(int device);

/* Give the KV cache back: 0, or -1 on error. */
int vram_ledger_kv_release(int device);

/* ---- src/ffi/sleep.rs -------------------------------------------------------
 * Sleep and wake by tag (see `Allocator::sleep`). Tags are given as bit masks: bit `i` is
 * `Tag::ALL[i]` (1 weights, 2 activation, 4 kv_cache, 8 untracked; `vram_ledger_abi_json` gives
 * them to hosts). A negative device means every device in use, one after the other; for the
 * settings (`set_retain_host`, `set_sleep_file`, `set_zero_discarded`), also every device used
 * later.
 */

/* Keep each tag's memory apart (`Config::separate_tags`), which sleep needs, in allocators
 * created from now on (before the first use of any device: refused after, as
 * `vram_ledger_configure`).
 */
int vram_ledger_separate_tags(int enabled);

/* Put the `offload` tags (copied to host memory) and the `discard` tags to sleep.
 * Returns a JSON report per device (free it with `vram_ledger_string_free`), NULL on error.
 * On an error, every tag this call put to sleep is woken again, on every device, so that an
 * error means nothing was left asleep by it (a discarded tag comes back as fresh memory),
 * unless the message says which tags could not be woken again.
 */
char *vram_ledger_sleep(int device, int offload, int discard);

/* Wake the tags of `mask` (0: every sleeping tag). Returns a JSON report per device, NULL on
 * error (the tag that failed stays asleep; wake can be retried).
 */
char *vram_ledger_wake(int device, int mask);

/* Keep (non-zero, page-locked) or free (0, the default) offloaded tags' host memory at wake. */
int vram_ledger_set_retain_host(int device, int retain);

/* Offload to disk: each offloaded tag goes to a new file `PATH.dev<N>.<tag>` (which must not
 * exist; created at sleep and removed at once, its blocks reserved first); NULL (the default):
 * host memory. Takes effect at the next sleep of a tag whose host memory is not retained.
 *
 * Safety:
 * `path` is NULL or a NUL-terminated string, readable for the length of the call.
 */
int vram_ledger_set_sleep_file(int device, const char *path);

/* Fill discarded tags' memory with zeros at wake (non-zero, the default), or leave it as fresh
 * memory comes (0: stale data of this process).
 */
int vram_ledger_set_zero_discarded(int device, int zero);

/* ---- src/ffi/graphs.rs ------------------------------------------------------
 * CUDA graph pools (PyTorch's private pools, which its pluggable allocator does not forward:
 * the Python package calls these around `torch.cuda.CUDAGraph`'s capture and release).
 */

/* Route the capture running on `stream` to graph pool (`pool_a`, `pool_b`), PyTorch's
 * `MempoolId_t`: until `vram_ledger_graph_end`, allocations on streams of that capture come
 * from the pool, and nothing else gets its memory while a graph made from it lives. Counts
 * one reference to the pool. -1 when `stream` is not capturing.
 *
 * Safety:
 * On the CUDA backend `stream` is a live `cudaStream_t` of `device`'s primary context.
 */
int vram_ledger_graph_begin(int device, void *stream, uint64_t pool_a, uint64_t pool_b);

/* Stop routing the capture that began on `stream` into the pool (after the capture has ended
 * and the graph is instantiated); measures what appeared outside the allocator meanwhile.
 * `stream` is only compared.
 */
int vram_ledger_graph_end(int device, void *stream, uint64_t pool_a, uint64_t pool_b);

/* Drop one reference to the pool (a graph made from it was reset or destroyed); with the last
 * one its free memory goes back to the driver.
 */
int vram_ledger_graph_release(int device, uint64_t pool_a, uint64_t pool_b);

/* What the pool (`pool_a`, `pool_b`) holds allocated now, as JSON: `blocks`, each with its
 * `addr`, `size`, `requested` bytes and `tag`, in address order (PyTorch's
 * `getCheckpointState`). NULL when the pool is unknown.
 */
char *vram_ledger_pool_checkpoint(int device, uint64_t pool_a, uint64_t pool_b);

/* Put the pool back to `checkpoint` (the JSON `vram_ledger_pool_checkpoint` gave): every block
 * it holds allocated now is freed and the checkpoint's are allocated again at their addresses
 * (PyTorch's `setCheckpointPoolState`). Returns JSON: `freed`, the addresses freed, and
 * `made`, the blocks allocated (the caller owns them; an address may be in both). NULL, with
 * nothing changed, when the checkpoint is malformed or no longer fits the pool, or while a
 * capture runs.
 *
 * Safety:
 * `checkpoint` is NULL or a NUL-terminated string.
 */
char *vram_ledger_pool_restore(int device, uint64_t pool_a, uint64_t pool_b, const char *checkpoint);

/* ---- src/ffi/pools.rs -------------------------------------------------------
 * Memory pools (PyTorch's `torch.cuda.MemPool` and `use_mem_pool`, which its pluggable
 * allocator does not forward: the Python package calls these for its MemPool), and the
 * allocators of their own that pools may have.
 */

/* Make pool (`pool_a`, `pool_b`) if it is new, and count one reference to it (PyTorch's
 * `createOrIncrefPool`, as a `torch.cuda.MemPool` is made); `vram_ledger_graph_release` drops
 * it. With `alloc` and `free` (both or neither), the pool's segments come from them, in every
 * mode: they must behave as PyTorch's pluggable-allocator functions, may be called from any
 * thread until the pool's last segment is given back, and must not unwind. They run with the
 * allocator's lock held, as PyTorch calls them under its own: they must not call this
 * library, nor take a lock that a thread calling it may hold (the call would wait forever).
 * `flags` is a sum
 * of: 1 (PyTorch's `use_on_oom`), the pool's free blocks serve an allocation that would
 * otherwise run out of memory; 2 (`no_split`), the pool's blocks are never split, so each
 * allocation has a segment of its own (or reuses a whole free block). Other bits are refused
 * (-1). A pool that exists keeps how it was made (another allocator or `no_split` is refused,
 * -1).
 */
int vram_ledger_pool_hold(int device, uint64_t pool_a, uint64_t pool_b, vram_ledger_pool_alloc alloc, vram_ledger_pool_free free, int flags);

/* Route every allocation the calling thread makes on `device` to the pool, on any stream,
 * until `vram_ledger_pool_end` (PyTorch's `beginAllocateToPool` with a filter for the current
 * thread, as `use_mem_pool` begins). Counts one reference, which `vram_ledger_graph_release`
 * drops.
 */
int vram_ledger_pool_begin(int device, uint64_t pool_a, uint64_t pool_b);

/* End the calling thread's last route to the pool (`use_mem_pool`'s end). -1 when the thread
 * has none.
 */
int vram_ledger_pool_end(int device, uint64_t pool_a, uint64_t pool_b);

/* ---- src/ffi/profiler.rs ----------------------------------------------------
 * Memory events for PyTorch's profiler (`torch.profiler.profile(profile_memory=True)` and the
 * memory timeline built on it): PyTorch's caching allocator reports each allocation and free
 * to c10 (`c10::reportMemoryUsageToProfiler`) while a profiler that records memory is active;
 * a pluggable allocator reports nothing. The host names c10's two functions here, and every
 * allocation and free through the PyTorch hooks is reported as PyTorch's allocator reports it.
 */

/* Report allocations and frees through the PyTorch hooks to `report` while `profiling` says
 * so (both NULL: stop). Both run on the allocating or freeing thread with no lock of the
 * allocator held, and must not unwind.
 */
void vram_ledger_set_memory_reporter(vram_ledger_memory_profiling profiling, vram_ledger_memory_report report);

/* ---- src/ffi/abi.rs ---------------------------------------------------------
 * The library describing itself to hosts that bind it at run time (the Python package builds
 * its ctypes bindings from this): the tags, the spellings accepted for them and their bits in
 * sleep and wake masks, the segment modes, and the C signature of every entry point. Tags and
 * modes come from the code that parses and decodes them, so a host never keeps its own copy.
 */

/* The library's description as JSON (free it with `vram_ledger_string_free`), NULL on error:
 * `tags`, each with its `name`, its other accepted spellings (`aliases`) and its `bit` in the
 * masks of `vram_ledger_sleep` and `vram_ledger_wake`; `modes`, each with its `name` and
 * whether it is a virtual-memory mode (`virtual`, which sleep needs); and `functions`, each
 * exported function's `name`, `returns` and `args` as C types.
 */
char *vram_ledger_abi_json(void);

#ifdef __cplusplus
}
#endif

#endif /* VRAM_LEDGER_H */
