/* The C interface through include/vram_ledger.h, on two simulated devices: tags, allocation
 * and free, statistics, profiling and the budget contract, sleep and wake, metrics, errors and
 * the log callback. Every check prints what it saw when it fails; the exit status is the
 * number of failed checks (capped at 100), 0 when all passed.
 *
 * Built and run by tests/c_abi.rs:
 *     cc -std=c11 -Iinclude tests/c/abi_smoke.c -LDIR -lvram_ledger -Wl,-rpath,DIR
 */
#define _POSIX_C_SOURCE 200112L /* setenv */

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vram_ledger.h"

static int checks, failed;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        checks++;                                                                          \
        if (!(cond)) {                                                                     \
            failed++;                                                                      \
            fprintf(stderr, "FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond);             \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fprintf(stderr, " (last error: %s)\n", vram_ledger_last_error());              \
        }                                                                                  \
    } while (0)

static const int64_t MiB = 1 << 20;
static const int64_t GiB = (int64_t)1 << 30;

/* The integer after `"key":` in a JSON text, or -1 when the key is missing (every figure
 * checked here is a byte count or a count, so never negative). The library writes JSON
 * without spaces, and the keys looked up are unique in their texts. */
static int64_t json_int(const char *json, const char *key) {
    char quoted[128];
    snprintf(quoted, sizeof quoted, "\"%s\":", key);
    const char *at = json ? strstr(json, quoted) : NULL;
    if (!at) {
        return -1;
    }
    char *end;
    long long v = strtoll(at + strlen(quoted), &end, 10);
    return end == at + strlen(quoted) ? -1 : (int64_t)v;
}

/* A figure of vram_ledger_memory_stats_json (flat, PyTorch's keys plus tag.<tag>.*). */
static int64_t figure(int device, const char *key) {
    char *json = vram_ledger_memory_stats_json(device);
    CHECK(json != NULL, "memory_stats_json(%d)", device);
    int64_t v = json_int(json, key);
    vram_ledger_string_free(json);
    return v;
}

static int logged, last_level;
static char last_logged[512];

/* The library's failure sink: counts what it is handed. */
static void on_log(int level, const char *message) {
    logged++;
    last_level = level;
    snprintf(last_logged, sizeof last_logged, "%s", message);
}

int main(void) {
    /* The backend is chosen at the library's first call: simulated, whatever the caller's
     * environment says, so that this program never touches a GPU. */
    setenv("VRAM_LEDGER_DRIVER", "sim", 1);
    setenv("VRAM_LEDGER_SIM_DEVICES", "2", 1);
    vram_ledger_set_log_callback(on_log);

    CHECK(vram_ledger_device_count() == 2, "%d devices", vram_ledger_device_count());
    /* Before the first use of a device: a virtual-memory mode, with tags kept apart for sleep. */
    CHECK(vram_ledger_configure("remap") == 0, "configure remap");
    CHECK(vram_ledger_separate_tags(1) == 0, "separate_tags");

    /* An error with a result: -1 and its message on this thread. The caller has it, so it is
     * not reported to the callback as well. */
    CHECK(vram_ledger_configure("nonsense") == -1, "configure nonsense");
    CHECK(strstr(vram_ledger_last_error(), "nonsense") != NULL, "%s", vram_ledger_last_error());
    CHECK(logged == 0, "logged %d: \"%s\"", logged, last_logged);
    /* A void function's failure (a free of a pointer never allocated) has no result to carry
     * it: one report to the callback at WARNING. */
    vram_ledger_free((void *)0x3039, 16, 0, NULL);
    CHECK(logged == 1 && last_level == 30, "logged %d at %d", logged, last_level);
    CHECK(strstr(last_logged, "0x3039") != NULL, "logged \"%s\"", last_logged);

    /* Tags nest per thread; kv is kv_cache's alias. */
    CHECK(strcmp(vram_ledger_current_tag(), "untracked") == 0, "%s", vram_ledger_current_tag());
    CHECK(vram_ledger_push_tag("weights") == 0, "push weights");
    void *w = vram_ledger_malloc(1000, 0, NULL);
    CHECK(w != NULL, "malloc 1000");
    CHECK(vram_ledger_push_tag("kv") == 0, "push kv");
    CHECK(strcmp(vram_ledger_current_tag(), "kv_cache") == 0, "%s", vram_ledger_current_tag());
    void *kv = vram_ledger_malloc(64 * MiB, 0, NULL);
    CHECK(kv != NULL, "malloc 64 MiB");
    CHECK(vram_ledger_pop_tag() == 0 && strcmp(vram_ledger_current_tag(), "weights") == 0, "%s",
          vram_ledger_current_tag());
    CHECK(vram_ledger_pop_tag() == 0 && strcmp(vram_ledger_current_tag(), "untracked") == 0, "%s",
          vram_ledger_current_tag());
    CHECK(vram_ledger_pop_tag() == -1, "pop without a push");
    CHECK(strstr(vram_ledger_last_error(), "without a matching push_tag") != NULL, "%s",
          vram_ledger_last_error());
    CHECK(vram_ledger_push_tag("bogus") == -1, "push bogus");
    CHECK(vram_ledger_malloc(0, 0, NULL) == NULL, "size 0 is NULL");

    /* The ledger: 1000 bytes rounded to 512, per tag and in all. */
    CHECK(figure(0, "tag.weights.allocated_bytes.current") == 1024, "%" PRId64,
          figure(0, "tag.weights.allocated_bytes.current"));
    CHECK(figure(0, "tag.weights.requested_bytes.current") == 1000, "%" PRId64,
          figure(0, "tag.weights.requested_bytes.current"));
    CHECK(figure(0, "tag.kv_cache.allocated_bytes.current") == 64 * MiB, "%" PRId64,
          figure(0, "tag.kv_cache.allocated_bytes.current"));
    CHECK(figure(0, "allocated_bytes.all.current") == 1024 + 64 * MiB, "%" PRId64,
          figure(0, "allocated_bytes.all.current"));
    CHECK(figure(0, "allocation.all.current") == 2, "%" PRId64, figure(0, "allocation.all.current"));
    CHECK(figure(1, "allocated_bytes.all.current") == 0, "device 1 is untouched");
    char *ledger = vram_ledger_stats_json(0);
    CHECK(ledger != NULL && strstr(ledger, "\"per_tag\":{\"weights\":") != NULL, "%s", ledger);
    vram_ledger_string_free(ledger);

    /* A profiled pass: 1 GiB of activations at peak, the KV budget what the rest leaves of the
     * requested half of the device, and the budget contract armed at the requested memory. */
    CHECK(vram_ledger_cap(0) == -1, "no cap before profiling: %" PRId64, vram_ledger_cap(0));
    CHECK(vram_ledger_profile_begin(0, 0.5, 0) == 0, "profile_begin");
    CHECK(vram_ledger_push_tag("activation") == 0, "push activation");
    void *a = vram_ledger_malloc(GiB, 0, NULL);
    CHECK(a != NULL, "malloc 1 GiB");
    vram_ledger_free(a, GiB, 0, NULL);
    CHECK(vram_ledger_pop_tag() == 0, "pop activation");
    char *profile = vram_ledger_profile_end(0);
    CHECK(profile != NULL, "profile_end");
    int64_t requested = json_int(profile, "requested"), kv_budget = json_int(profile, "kv_budget");
    int64_t non_kv = json_int(profile, "non_kv"), margin = json_int(profile, "margin");
    CHECK(json_int(profile, "weights") == 1024, "%s", profile);
    CHECK(json_int(profile, "activation_peak") == GiB, "%s", profile);
    CHECK(margin == 0, "%s", profile);
    CHECK(requested > 0 && non_kv >= GiB + 1024 && kv_budget > 0, "%s", profile);
    /* requested - non_kv - margin, aligned down to 2 MiB (the large-segment rounding). */
    CHECK(kv_budget == (requested - non_kv - margin) / (2 * MiB) * (2 * MiB), "%s", profile);
    CHECK(profile && strstr(profile, "Available KV cache memory") != NULL, "%s", profile);
    vram_ledger_string_free(profile);
    CHECK(vram_ledger_cap(0) == requested, "cap %" PRId64 ", requested %" PRId64,
          vram_ledger_cap(0), requested);
    CHECK(vram_ledger_malloc(requested, 0, NULL) == NULL, "the contract refuses its whole size");
    CHECK(strstr(vram_ledger_last_error(), "budget contract") != NULL, "%s",
          vram_ledger_last_error());
    CHECK(vram_ledger_set_cap(0, -1) == 0 && vram_ledger_cap(0) == -1, "lifted: %" PRId64,
          vram_ledger_cap(0));
    CHECK(vram_ledger_profile_end(0) == NULL, "no scope is open");

    /* Sleep and wake: the KV cache's memory is given back and mapped again at its address. */
    char *slept = vram_ledger_sleep(0, 0, 4 /* kv_cache */);
    CHECK(slept != NULL, "sleep");
    CHECK(json_int(slept, "discarded_bytes") == 64 * MiB, "%s", slept);
    CHECK(json_int(slept, "given_back_bytes") == 64 * MiB, "%s", slept);
    CHECK(json_int(slept, "offloaded_bytes") == 0, "%s", slept);
    vram_ledger_string_free(slept);
    CHECK(figure(0, "tag.kv_cache.allocated_bytes.current") == 64 * MiB, "the allocation lives on");
    char *woken = vram_ledger_wake(0, 0);
    CHECK(woken != NULL, "wake");
    CHECK(json_int(woken, "mapped_bytes") == 64 * MiB, "%s", woken);
    CHECK(json_int(woken, "restored_bytes") == 0, "discarded, nothing to restore: %s", woken);
    vram_ledger_string_free(woken);
    CHECK(vram_ledger_sleep(0, 16, 0) == NULL, "16 is not a mask of tags");

    /* Metrics, by device and tag. */
    char *metrics = vram_ledger_metrics();
    CHECK(metrics && strstr(metrics, "vram_ledger_allocated_bytes{device=\"0\",tag=\"weights\"} 1024\n"),
          "%s", metrics);
    vram_ledger_string_free(metrics);

    /* Frees: the ledger is back to zero; a second free is an error reported to the callback. */
    vram_ledger_free(w, 1000, 0, NULL);
    vram_ledger_free(kv, 64 * MiB, 0, NULL);
    CHECK(figure(0, "allocated_bytes.all.current") == 0, "%" PRId64,
          figure(0, "allocated_bytes.all.current"));
    CHECK(figure(0, "tag.kv_cache.allocated_bytes.current") == 0, "kv freed");
    int before = logged;
    vram_ledger_free(w, 1000, 0, NULL);
    CHECK(logged == before + 1 && strstr(last_logged, "not allocated by this allocator"), "\"%s\"",
          last_logged);
    CHECK(vram_ledger_empty_cache(0) == 0, "empty_cache");
    CHECK(vram_ledger_stats_json(7) == NULL, "device 7 does not exist");

    /* The library's description names what this header declares. */
    char *abi = vram_ledger_abi_json();
    CHECK(abi && strstr(abi, "\"name\":\"vram_ledger_profile_end\",\"returns\":\"char *\""), "%s",
          abi);
    vram_ledger_string_free(abi);
    vram_ledger_string_free(NULL);

    printf("abi_smoke: %d of %d checks passed\n", checks - failed, checks);
    return failed > 100 ? 100 : failed;
}
