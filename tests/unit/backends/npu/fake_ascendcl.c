/*
 * A fake libascendcl.so for CPU CI.
 *
 * It exports the AscendCL symbols the NPU backend binds, with their real C
 * signatures, performs real memcpy on host addresses (the tests' "device"
 * memory is host memory too), validates arguments the way the runtime
 * documents, and records what it was called with so the tests can check the
 * ABI as the C side sees it (struct size, field order, enum values).
 *
 * Compile-time variants:
 *   -DFAKE_NO_V2      do not export aclrtMemcpyBatchAsyncV2 (CANN 8.3 - 9.0)
 *   -DFAKE_NO_V1      do not export the 10-argument aclrtMemcpyBatchAsync (V2 only)
 *   -DFAKE_FAIL_INDEX=n  the 10-argument batch fails at descriptor n (when it exists)
 *   -DFAKE_NO_GET_VERSION  do not export aclrtGetVersion
 * Build both NO flags for a runtime without any batch symbol (per-copy fallback).
 *
 * At run time, fake_fail_call(n, code) makes the n-th copy call (batch or
 * per-copy, counted from now, 1-based) return `code` without copying.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int aclError;
typedef void *aclrtStream;

typedef struct {
    uint32_t id;
    int type; /* aclrtMemLocationType */
} aclrtMemLocation;

typedef struct {
    aclrtMemLocation dstLoc;
    aclrtMemLocation srcLoc;
    uint8_t rsv[16];
} aclrtMemcpyBatchAttr;

#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_RT_PARAM_INVALID 107000
#define LOC_HOST 0
#define LOC_DEVICE 1

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static long g_v1_calls, g_v2_calls, g_copy_calls, g_total_calls;
static long g_live_host_allocs;
static size_t g_max_num_batches, g_last_num_batches, g_last_num_attrs, g_last_attr_index0;
static uint8_t g_last_attr[sizeof(aclrtMemcpyBatchAttr)];
static uintptr_t g_last_stream;
static int g_last_kind = -1;
static unsigned g_delay_us;
static long g_attempts, g_fail_nth; /* copy calls tried since fake_fail_call; 0 = never fail */
static int g_fail_code;
static long g_sync_calls, g_sync_after_calls; /* g_total_calls at the last synchronize */
static uintptr_t g_last_sync_stream;

/* ----------------------------------------------------------- test hooks */
int fake_attr_size(void) { return (int)sizeof(aclrtMemcpyBatchAttr); }
long fake_v1_calls(void) { return g_v1_calls; }
long fake_v2_calls(void) { return g_v2_calls; }
long fake_copy_calls(void) { return g_copy_calls; }
long fake_total_calls(void) { return g_total_calls; }
long fake_live_host_allocs(void) { return g_live_host_allocs; }
size_t fake_max_num_batches(void) { return g_max_num_batches; }
size_t fake_last_num_batches(void) { return g_last_num_batches; }
size_t fake_last_num_attrs(void) { return g_last_num_attrs; }
size_t fake_last_attr_index0(void) { return g_last_attr_index0; }
uintptr_t fake_last_stream(void) { return g_last_stream; }
int fake_last_kind(void) { return g_last_kind; }
void fake_last_attr_bytes(uint8_t *out) { memcpy(out, g_last_attr, sizeof g_last_attr); }
void fake_set_delay_us(unsigned us) { g_delay_us = us; }
long fake_sync_calls(void) { return g_sync_calls; }
long fake_sync_after_calls(void) { return g_sync_after_calls; }
uintptr_t fake_last_sync_stream(void) { return g_last_sync_stream; }

void fake_fail_call(long nth, int code) {
    pthread_mutex_lock(&g_lock);
    g_attempts = 0;
    g_fail_nth = nth;
    g_fail_code = code;
    pthread_mutex_unlock(&g_lock);
}

/* The error to return from this copy call, or ACL_SUCCESS. */
static aclError injected_failure(void) {
    pthread_mutex_lock(&g_lock);
    aclError code = (g_fail_nth > 0 && ++g_attempts == g_fail_nth) ? g_fail_code : ACL_SUCCESS;
    pthread_mutex_unlock(&g_lock);
    return code;
}

void fake_reset(void) {
    pthread_mutex_lock(&g_lock);
    g_v1_calls = g_v2_calls = g_copy_calls = g_total_calls = 0;
    g_max_num_batches = g_last_num_batches = g_last_num_attrs = g_last_attr_index0 = 0;
    memset(g_last_attr, 0, sizeof g_last_attr);
    g_last_stream = 0;
    g_last_kind = -1;
    g_delay_us = 0;
    g_attempts = g_fail_nth = 0;
    g_fail_code = 0;
    g_sync_calls = g_sync_after_calls = 0;
    g_last_sync_stream = 0;
    pthread_mutex_unlock(&g_lock);
}

/* ----------------------------------------------------------- version */
#ifndef FAKE_NO_GET_VERSION
#define FAKE_ACL_VERSION_MAJOR 9
#define FAKE_ACL_VERSION_MINOR 1
#define FAKE_ACL_VERSION_PATCH 0
aclError aclrtGetVersion(int32_t *majorVersion, int32_t *minorVersion, int32_t *patchVersion) {
    if (!majorVersion || !minorVersion || !patchVersion) return ACL_ERROR_INVALID_PARAM;
    *majorVersion = FAKE_ACL_VERSION_MAJOR;
    *minorVersion = FAKE_ACL_VERSION_MINOR;
    *patchVersion = FAKE_ACL_VERSION_PATCH;
    return ACL_SUCCESS;
}
#endif

/* ----------------------------------------------------------- host memory */
aclError aclrtMallocHost(void **hostPtr, size_t size) {
    if (hostPtr == NULL || size == 0) return ACL_ERROR_INVALID_PARAM;
    void *p = NULL;
    if (posix_memalign(&p, 64, size) != 0) return ACL_ERROR_INVALID_PARAM;
    __atomic_add_fetch(&g_live_host_allocs, 1, __ATOMIC_SEQ_CST);
    *hostPtr = p;
    return ACL_SUCCESS;
}

aclError aclrtFreeHost(void *hostPtr) {
    if (hostPtr == NULL) return ACL_ERROR_INVALID_PARAM;
    free(hostPtr);
    __atomic_sub_fetch(&g_live_host_allocs, 1, __ATOMIC_SEQ_CST);
    return ACL_SUCCESS;
}

/* ----------------------------------------------------------- streams */
/* Copies finish inside their call here, so there is nothing to wait for: record the call. */
aclError aclrtSynchronizeStream(aclrtStream stream) {
    pthread_mutex_lock(&g_lock);
    g_sync_calls++;
    g_sync_after_calls = g_total_calls;
    g_last_sync_stream = (uintptr_t)stream;
    pthread_mutex_unlock(&g_lock);
    return ACL_SUCCESS;
}

/* ----------------------------------------------------------- copies */
aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                          int kind, aclrtStream stream) {
    if (dst == NULL || src == NULL || count > destMax) return ACL_ERROR_INVALID_PARAM;
    if (kind != 1 && kind != 2) return ACL_ERROR_INVALID_PARAM; /* H2D or D2H only */
    aclError injected = injected_failure();
    if (injected != ACL_SUCCESS) return injected;
    pthread_mutex_lock(&g_lock);
    g_copy_calls++;
    g_total_calls++;
    g_last_kind = kind;
    g_last_stream = (uintptr_t)stream;
    pthread_mutex_unlock(&g_lock);
    memcpy(dst, src, count);
    return ACL_SUCCESS;
}

/* Shared body of both batch forms; *failIndex is written only when failIndex != NULL. */
__attribute__((unused)) static aclError batch(void **dsts, size_t *destMaxs, void **srcs,
                                              size_t *sizes, size_t numBatches,
                                              aclrtMemcpyBatchAttr *attrs, size_t *attrsIndexes,
                                              size_t numAttrs, size_t *failIndex,
                                              aclrtStream stream, long *counter) {
    if (failIndex) *failIndex = SIZE_MAX;
    if (g_delay_us) usleep(g_delay_us);
    if (!dsts || !destMaxs || !srcs || !sizes || !attrs || !attrsIndexes || numBatches == 0)
        return ACL_ERROR_INVALID_PARAM;
    /* Documented rules: attrsIndexes[0] == 0, strictly increasing, numAttrs <= numBatches. */
    if (numAttrs == 0 || numAttrs > numBatches || attrsIndexes[0] != 0)
        return ACL_ERROR_INVALID_PARAM;
    for (size_t a = 0; a < numAttrs; a++) {
        if (a > 0 && attrsIndexes[a] <= attrsIndexes[a - 1]) return ACL_ERROR_INVALID_PARAM;
        for (size_t r = 0; r < sizeof attrs[a].rsv; r++)
            if (attrs[a].rsv[r]) return ACL_ERROR_INVALID_PARAM;
        int src = attrs[a].srcLoc.type, dst = attrs[a].dstLoc.type;
        /* One direction per batch, H2D or D2H: never H2H nor D2D. */
        if (src == dst || (src != LOC_HOST && src != LOC_DEVICE) ||
            (dst != LOC_HOST && dst != LOC_DEVICE)) {
            if (failIndex) *failIndex = attrsIndexes[a];
            return ACL_ERROR_RT_PARAM_INVALID;
        }
    }
#ifdef FAKE_FAIL_INDEX
    if (failIndex && numBatches > (size_t)(FAKE_FAIL_INDEX)) {
        *failIndex = (size_t)(FAKE_FAIL_INDEX);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
#endif
    for (size_t k = 0; k < numBatches; k++)
        if (!dsts[k] || !srcs[k] || sizes[k] > destMaxs[k]) {
            if (failIndex) *failIndex = k;
            return ACL_ERROR_INVALID_PARAM;
        }
    aclError injected = injected_failure();
    if (injected != ACL_SUCCESS) return injected;
    pthread_mutex_lock(&g_lock);
    (*counter)++;
    g_total_calls++;
    g_last_num_batches = numBatches;
    if (numBatches > g_max_num_batches) g_max_num_batches = numBatches;
    g_last_num_attrs = numAttrs;
    g_last_attr_index0 = attrsIndexes[0];
    memcpy(g_last_attr, &attrs[0], sizeof g_last_attr);
    g_last_stream = (uintptr_t)stream;
    pthread_mutex_unlock(&g_lock);
    for (size_t k = 0; k < numBatches; k++) memcpy(dsts[k], srcs[k], sizes[k]);
    return ACL_SUCCESS;
}

#ifndef FAKE_NO_V1
aclError aclrtMemcpyBatchAsync(void **dsts, size_t *destMaxs, void **srcs, size_t *sizes,
                               size_t numBatches, aclrtMemcpyBatchAttr *attrs,
                               size_t *attrsIndexes, size_t numAttrs, size_t *failIndex,
                               aclrtStream stream) {
    if (failIndex == NULL) return ACL_ERROR_INVALID_PARAM;
    return batch(dsts, destMaxs, srcs, sizes, numBatches, attrs, attrsIndexes, numAttrs,
                 failIndex, stream, &g_v1_calls);
}
#endif

#ifndef FAKE_NO_V2
aclError aclrtMemcpyBatchAsyncV2(void **dsts, size_t *destMaxs, void **srcs, size_t *sizes,
                                 size_t numBatches, aclrtMemcpyBatchAttr *attrs,
                                 size_t *attrsIndexes, size_t numAttrs, aclrtStream stream) {
    return batch(dsts, destMaxs, srcs, sizes, numBatches, attrs, attrsIndexes, numAttrs,
                 NULL, stream, &g_v2_calls);
}
#endif
