/*
 * A fake libascendcl.so for CPU CI.
 *
 * It exports the AscendCL symbols the NPU backend binds, compiled against the
 * declarations in acl_rt_decls.h (each traced there to the CANN document it
 * was read from), performs real memcpy on host addresses (the tests' "device"
 * memory is host memory too), rejects what the runtime documents as invalid,
 * and records what it was called with so the tests can check the ABI as the C
 * side sees it (struct size, field order, enum values).
 *
 * Validation of a batch, as CANN documents it: non-NULL arrays, attrsIndexes[0]
 * == 0 and strictly increasing, numAttrs <= numBatches, zeroed rsv, one of H2D
 * or D2H per attribute, and per copy: non-NULL pointers, 0 < size <= destMax.
 * Once a test declares "device" memory (fake_add_device_memory), every pointer
 * is also checked against its side: the device side of an attribute must lie
 * in memory of the attribute's device id, the host side outside all device
 * memory (so a host-to-host or device-to-device copy is rejected), and
 * aclrtMemcpyAsync's kind must match its pointers the same way.
 *
 * Compile-time variants:
 *   -DFAKE_NO_V2      do not export aclrtMemcpyBatchAsyncV2 (CANN 8.3 - 9.0)
 *   -DFAKE_NO_V1      do not export the 10-argument aclrtMemcpyBatchAsync (V2 only)
 *   -DFAKE_FAIL_INDEX=n  the 10-argument batch fails at descriptor n (when it exists)
 *   -DFAKE_BATCH_UNSUPPORTED  the batch symbols exist but answer
 *                     ACL_ERROR_RT_FEATURE_NOT_SUPPORT without copying, as on chips
 *                     without batch copy (Atlas training 910, inference 310P, 200I/500 A2)
 *   -DFAKE_NO_GET_VERSION  do not export aclrtGetVersion
 * Build both NO flags for a runtime without any batch symbol (per-copy fallback).
 *
 * At run time, fake_fail_call(n, code) makes the n-th copy call (batch or
 * per-copy, counted from now, 1-based) return `code` without copying, and
 * fake_set_malloc_host_limit(n) makes every aclrtMallocHost call asking for more
 * than n bytes answer ACL_ERROR_RT_MEMORY_ALLOCATION, as one call above about
 * 200-250 GB does on Atlas A2 (910B) (0: no limit). The fake counts
 * aclrtMallocHost calls, the largest size one asked for, and the host
 * allocations not freed yet.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "acl_rt_decls.h"

#define LOC_HOST ACL_MEM_LOCATION_TYPE_HOST
#define LOC_DEVICE ACL_MEM_LOCATION_TYPE_DEVICE
#define MAX_DEVICE_RANGES 64

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static long g_v1_calls, g_v2_calls, g_copy_calls, g_total_calls;
static long g_live_host_allocs;
static size_t g_malloc_host_limit, g_max_malloc_host_size; /* limit 0: none */
static long g_malloc_host_calls;
static size_t g_max_num_batches, g_last_num_batches, g_last_num_attrs, g_last_attr_index0;
static uint8_t g_last_attr[sizeof(aclrtMemcpyBatchAttr)];
static uintptr_t g_last_stream;
static int g_last_kind = -1;
static unsigned g_delay_us;
static long g_attempts, g_fail_nth; /* copy calls tried since fake_fail_call; 0 = never fail */
static int g_fail_code;
static long g_sync_calls, g_sync_after_calls; /* g_total_calls at the last synchronize */
static uintptr_t g_last_sync_stream;
static long g_unsupported_calls; /* batch calls answered ACL_ERROR_RT_FEATURE_NOT_SUPPORT */
static struct { uintptr_t lo, hi; uint32_t device; } g_device[MAX_DEVICE_RANGES];
static int g_num_device; /* 0: pointers are not classified (tests of plain buffers) */

/* ----------------------------------------------------------- test hooks */
int fake_attr_size(void) { return (int)sizeof(aclrtMemcpyBatchAttr); }
long fake_v1_calls(void) { return g_v1_calls; }
long fake_v2_calls(void) { return g_v2_calls; }
long fake_copy_calls(void) { return g_copy_calls; }
long fake_total_calls(void) { return g_total_calls; }
long fake_live_host_allocs(void) { return g_live_host_allocs; }
long fake_malloc_host_calls(void) { return g_malloc_host_calls; }
size_t fake_max_malloc_host_size(void) { return g_max_malloc_host_size; }
void fake_set_malloc_host_limit(size_t limit) { g_malloc_host_limit = limit; }
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
long fake_unsupported_calls(void) { return g_unsupported_calls; }

/* Declare [base, base + size) as memory of NPU `device`; returns 0, or -1 when full. */
int fake_add_device_memory(void *base, size_t size, uint32_t device) {
    pthread_mutex_lock(&g_lock);
    int ok = g_num_device < MAX_DEVICE_RANGES;
    if (ok) {
        g_device[g_num_device].lo = (uintptr_t)base;
        g_device[g_num_device].hi = (uintptr_t)base + size;
        g_device[g_num_device++].device = device;
    }
    pthread_mutex_unlock(&g_lock);
    return ok ? 0 : -1;
}

/* The device owning [p, p + n), -1 for host memory, -2 for a range that straddles. */
static long device_of(const void *p, size_t n) {
    uintptr_t lo = (uintptr_t)p, hi = lo + n;
    for (int i = 0; i < g_num_device; i++) {
        if (lo >= g_device[i].lo && hi <= g_device[i].hi) return g_device[i].device;
        if (lo < g_device[i].hi && hi > g_device[i].lo) return -2;
    }
    return -1;
}

/* Does a copy's pointer lie where `loc` says? Always true before memory is declared. */
static int on_side(const void *p, size_t n, aclrtMemLocation loc) {
    if (g_num_device == 0) return 1;
    long dev = device_of(p, n);
    return loc.type == LOC_HOST ? dev == -1 : dev == (long)loc.id;
}

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
    g_unsupported_calls = 0;
    g_num_device = 0;
    g_malloc_host_limit = g_max_malloc_host_size = 0;
    g_malloc_host_calls = 0; /* not g_live_host_allocs: memory may outlive a reset */
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
    pthread_mutex_lock(&g_lock);
    g_malloc_host_calls++;
    if (size > g_max_malloc_host_size) g_max_malloc_host_size = size;
    int over = g_malloc_host_limit > 0 && size > g_malloc_host_limit;
    pthread_mutex_unlock(&g_lock);
    if (over) return ACL_ERROR_RT_MEMORY_ALLOCATION; /* nothing allocated */
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
                          aclrtMemcpyKind kind, aclrtStream stream) {
    if (dst == NULL || src == NULL || count > destMax) return ACL_ERROR_INVALID_PARAM;
    /* H2D or D2H only: the runtime fails host-to-host copies in this call. */
    if (kind != ACL_MEMCPY_HOST_TO_DEVICE && kind != ACL_MEMCPY_DEVICE_TO_HOST)
        return ACL_ERROR_INVALID_PARAM;
    if (g_num_device > 0) { /* the pointers must be on the sides the kind names */
        int h2d = kind == ACL_MEMCPY_HOST_TO_DEVICE;
        long d = device_of(h2d ? dst : src, count), h = device_of(h2d ? src : dst, count);
        if (d < 0 || h != -1) return ACL_ERROR_RT_PARAM_INVALID;
    }
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
#ifdef FAKE_BATCH_UNSUPPORTED
    /* Checked before anything else and nothing is copied: the chip has no batch engine. */
    (void)dsts; (void)destMaxs; (void)srcs; (void)sizes; (void)numBatches; (void)attrs;
    (void)attrsIndexes; (void)numAttrs; (void)stream; (void)counter;
    __atomic_add_fetch(&g_unsupported_calls, 1, __ATOMIC_SEQ_CST);
    return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
#endif
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
    for (size_t k = 0; k < numBatches; k++) {
        if (!dsts[k] || !srcs[k] || sizes[k] == 0 || sizes[k] > destMaxs[k]) {
            if (failIndex) *failIndex = k;
            return ACL_ERROR_INVALID_PARAM;
        }
        /* The attribute covering copy k: the last a with attrsIndexes[a] <= k. */
        size_t a = numAttrs - 1;
        while (a > 0 && attrsIndexes[a] > k) a--;
        if (!on_side(dsts[k], sizes[k], attrs[a].dstLoc) ||
            !on_side(srcs[k], sizes[k], attrs[a].srcLoc)) {
            if (failIndex) *failIndex = k;
            return ACL_ERROR_RT_PARAM_INVALID;
        }
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
