/*
 * A fake CUDA driver (libcuda) for CPU-only CI.
 *
 * It exports the driver functions the kvoffload_hal CUDA backend binds, with the
 * real C signatures, and nothing else (built with -fvisibility=hidden). "Device"
 * memory is host memory, so every copy is a real memmove. It checks what the
 * real driver checks where a mistake would otherwise pass silently: cuInit
 * first, a current context in the calling thread, a non-legacy stream and valid
 * attributes for batches, page-granular overlap of host registrations.
 *
 * Streams run each operation at once, or (fake_set_defer(1)) queue it until an
 * event on the stream is synchronised, a stream waiting on it runs, or
 * fake_run_all() is called; meanwhile cuEventQuery answers NOT_READY.
 *
 * Build variants:
 *   -DFAKE_CUDA_VERSION=12080   (default) 9-argument cuMemcpyBatchAsync (failIdx)
 *   -DFAKE_CUDA_VERSION=13000   also the 8-argument cuMemcpyBatchAsync_v2
 *   -DFAKE_NO_BATCH             no batch entry point (a 12.4 driver)
 *   -DFAKE_NO_PROC_ADDRESS      no cuGetProcAddress_v2 (a pre-12.0 driver)
 * Modules: cuModuleLoadData accepts an image that defines the backend's copy kernel
 * (".entry kvoffload_copy_blocks("), and cuLaunchKernel of it queues the kernel's
 * effect: at run time it reads the descriptor table [dsts | srcs | sizes] its
 * parameters point at, as the GPU would, and memmoves each descriptor. The table
 * must lie in registered host memory (the kernel reads it in place).
 *
 *   -DFAKE_WITH_CUDA_H          use NVIDIA's cuda.h for every type and declaration
 *                               (test_cuda_header_abi.py; the header comes from the
 *                               nvidia-cuda-runtime wheels)
 * Everything the tests read back goes through the fake_* functions at the end.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef FAKE_CUDA_VERSION
#ifdef FAKE_NO_BATCH
#define FAKE_CUDA_VERSION 12040
#else
#define FAKE_CUDA_VERSION 12080
#endif
#endif

#define EXPORT __attribute__((visibility("default")))

#ifdef FAKE_WITH_CUDA_H
/* Compiled against NVIDIA's cuda.h (-I to its directory): every definition below
 * must then match the real declaration, or the build fails. The internal view is
 * the one the driver itself is built with: it declares the legacy entry points
 * too (the 9-argument cuMemcpyBatchAsync beside the 13.0 _v2, cuStreamDestroy
 * beside cuStreamDestroy_v2), so both ABIs the fake exports are checked. */
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>
#if FAKE_CUDA_VERSION > CUDA_VERSION
#error "FAKE_CUDA_VERSION is newer than the cuda.h this build uses"
#endif
#else
/* Standalone: the declarations as this file understands them (what the header
 * build checks against the real ones). */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef int CUdriverProcAddressQueryResult;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef int CUdevice_attribute;

enum {
    CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101, CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400, CUDA_ERROR_NOT_FOUND = 500, CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713, CUDA_ERROR_NOT_SUPPORTED = 801,
};

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    int srcAccessOrder;
    CUmemLocation srcLocHint;
    CUmemLocation dstLocHint;
    unsigned int flags;
} CUmemcpyAttributes;
#endif /* FAKE_WITH_CUDA_H */

/* ------------------------------------------------------------------ state */
enum { OP_COPY, OP_RECORD, OP_WAIT, OP_KERNEL };
typedef struct op {
    int kind;
    void *dst;
    const void *src;
    size_t n;
    struct CUevent_st *event;
    struct op *next;
} op;

struct CUctx_st { int device; int refcount; };
struct CUstream_st { int priority; unsigned flags; int live; op *head, *tail; };
struct CUevent_st { int pending; int live; struct CUstream_st *stream; };
struct CUfunc_st { struct CUmod_st *module; };
struct CUmod_st { int live; struct CUfunc_st copy_blocks; };

#define KERNEL_NAME "kvoffload_copy_blocks"

/* Functions whose calls are counted and logged, in this order of ids. */
static const char *FN_NAMES[] = {
    "cuInit", "cuDriverGetVersion", "cuGetErrorName", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2", "cuCtxSetCurrent", "cuCtxGetStreamPriorityRange",
    "cuStreamCreateWithPriority", "cuStreamDestroy_v2", "cuStreamWaitEvent", "cuStreamSynchronize",
    "cuEventCreate", "cuEventDestroy_v2", "cuEventRecord", "cuEventQuery", "cuEventSynchronize",
    "cuMemHostRegister_v2", "cuMemHostUnregister", "cuMemcpyAsync", "cuGetProcAddress_v2",
    "cuMemcpyBatchAsync", "cuMemcpyBatchAsync_v2", "cuModuleLoadData", "cuModuleGetFunction",
    "cuModuleUnload", "cuLaunchKernel", "cuDeviceGetAttribute",
};
enum {
    F_INIT, F_VERSION, F_ERRNAME, F_DEVGET, F_RETAIN, F_RELEASE, F_SETCUR, F_PRIO, F_SCREATE,
    F_SDESTROY, F_SWAIT, F_SSYNC, F_ECREATE, F_EDESTROY, F_ERECORD, F_EQUERY, F_ESYNC, F_REG,
    F_UNREG, F_MEMCPY, F_PROC, F_BATCH, F_BATCH_V2, F_MODLOAD, F_GETFN, F_MODUNLOAD, F_LAUNCH,
    F_DEVATTR, F_COUNT
};

#define MAX_LOG 65536
#define MAX_RECORDS 4096
#define MAX_STREAMS 1024

typedef struct { int fn; void *stream; void *event; } log_entry;
typedef struct {
    int num_args; int result; size_t count; size_t num_attrs; size_t attrs_idx0;
    int src_access_order; int src_loc_type; int src_loc_id; int dst_loc_type; int dst_loc_id;
    unsigned flags; void *stream;
} batch_record;
typedef struct { int registered; void *ptr; size_t size; } reg_record;
typedef struct {
    int result; unsigned grid[3], block[3], shared_bytes;
    unsigned long long table, count; void *stream;
} launch_record;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_initialized;
static struct CUctx_st g_primary[2] = {{0, 0}, {1, 0}};
static __thread CUcontext t_current;
static struct CUstream_st g_legacy_stream;  /* handle 0 */
static struct CUstream_st *g_streams[MAX_STREAMS];
static int g_num_streams, g_live_streams, g_live_events;
static int g_defer;
static int g_prio_least = 0, g_prio_greatest = -5;  /* an H100's range */
static long g_calls[F_COUNT];
static log_entry g_log[MAX_LOG];
static int g_log_len;
static batch_record g_batches[MAX_RECORDS];
static int g_num_batches;
static reg_record g_regs[MAX_RECORDS];  /* register/unregister history, in order */
static int g_num_regs;
/* Fault injection: an error code (0 = off) and how many good calls come first. */
static int g_batch_error, g_batch_error_after; static size_t g_batch_fail_idx;
static int g_memcpy_error, g_memcpy_error_after;
static int g_query_error;
static int g_register_error, g_register_error_after;
static int g_module_error, g_launch_error, g_launch_error_after, g_live_modules;
static int g_host_pointer_usable = 1;  /* CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM */
static launch_record g_launches[MAX_RECORDS];
static int g_num_launches;

static void note(int fn, void *stream, void *event) {
    g_calls[fn]++;
    if (g_log_len < MAX_LOG) g_log[g_log_len++] = (log_entry){fn, stream, event};
}

static int need_context(void) {
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (t_current == NULL || t_current->refcount <= 0) return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS;
}

static struct CUstream_st *stream_of(CUstream s) { return s ? s : &g_legacy_stream; }

static void execute(op *o) {
    struct CUevent_st *ev;
    switch (o->kind) {
    case OP_COPY: memmove(o->dst, o->src, o->n); break;
    case OP_RECORD: o->event->pending = 0; break;
    case OP_KERNEL: {  /* the copy kernel: the table is read now, as the GPU reads it */
        const unsigned long long *t = o->src;
        for (size_t i = 0; i < o->n; i++)
            memmove((void *)t[i], (const void *)t[o->n + i], t[2 * o->n + i]);
        break;
    }
    case OP_WAIT:  /* run the waited-on stream up to the event: a real dependency */
        ev = o->event;
        while (ev->pending && ev->stream->head) {
            op *h = ev->stream->head;
            ev->stream->head = h->next;
            if (!h->next) ev->stream->tail = NULL;
            execute(h);
            free(h);
        }
        break;
    }
}

/* Run ``s`` until ``until`` (if given) has completed, else until empty. */
static void run_stream(struct CUstream_st *s, struct CUevent_st *until) {
    while (s->head && !(until && !until->pending)) {
        op *h = s->head;
        s->head = h->next;
        if (!h->next) s->tail = NULL;
        execute(h);
        free(h);
    }
}

static void enqueue(CUstream s, op o) {
    op *n = malloc(sizeof(op));
    *n = o;
    n->next = NULL;
    if (!g_defer) { execute(n); free(n); return; }
    struct CUstream_st *fs = stream_of(s);
    if (fs->tail) fs->tail->next = n; else fs->head = n;
    fs->tail = n;
}

#define LOCKED(expr) do { pthread_mutex_lock(&g_lock); CUresult r_ = (expr); \
    pthread_mutex_unlock(&g_lock); return r_; } while (0)

/* -------------------------------------------------------- driver API */
static CUresult init_impl(unsigned flags) {
    note(F_INIT, 0, 0);
    if (flags) return CUDA_ERROR_INVALID_VALUE;
    g_initialized = 1;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuInit(unsigned int flags) { LOCKED(init_impl(flags)); }

EXPORT CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = FAKE_CUDA_VERSION;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorName(CUresult error, const char **out) {
    static const struct { int code; const char *name; } names[] = {
        {0, "CUDA_SUCCESS"}, {1, "CUDA_ERROR_INVALID_VALUE"}, {3, "CUDA_ERROR_NOT_INITIALIZED"},
        {101, "CUDA_ERROR_INVALID_DEVICE"}, {200, "CUDA_ERROR_INVALID_IMAGE"},
        {201, "CUDA_ERROR_INVALID_CONTEXT"}, {222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"},
        {400, "CUDA_ERROR_INVALID_HANDLE"}, {500, "CUDA_ERROR_NOT_FOUND"},
        {600, "CUDA_ERROR_NOT_READY"}, {700, "CUDA_ERROR_ILLEGAL_ADDRESS"},
        {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
        {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"}, {801, "CUDA_ERROR_NOT_SUPPORTED"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (names[i].code == error) { *out = names[i].name; return CUDA_SUCCESS; }
    return CUDA_ERROR_INVALID_VALUE;
}

static CUresult device_get_impl(CUdevice *dev, int ordinal) {
    note(F_DEVGET, 0, 0);
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal > 1) return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal) { LOCKED(device_get_impl(dev, ordinal)); }

/* CUdevice_attribute: UNIFIED_ADDRESSING = 41, CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91;
   any other attribute reads 0. */
static CUresult devattr_impl(int *value, int attribute, CUdevice dev) {
    note(F_DEVATTR, 0, 0);
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev > 1) return CUDA_ERROR_INVALID_DEVICE;
    *value = attribute == 41 ? 1 : attribute == 91 ? g_host_pointer_usable : 0;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attribute, CUdevice dev) {
    LOCKED(devattr_impl(value, (int)attribute, dev));
}

static CUresult retain_impl(CUcontext *ctx, CUdevice dev) {
    note(F_RETAIN, 0, 0);
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev > 1) return CUDA_ERROR_INVALID_DEVICE;
    g_primary[dev].refcount++;
    *ctx = &g_primary[dev];
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) { LOCKED(retain_impl(ctx, dev)); }

static CUresult release_impl(CUdevice dev) {
    note(F_RELEASE, 0, 0);
    if (dev < 0 || dev > 1) return CUDA_ERROR_INVALID_DEVICE;
    if (g_primary[dev].refcount <= 0) return CUDA_ERROR_INVALID_CONTEXT;
    g_primary[dev].refcount--;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) { LOCKED(release_impl(dev)); }

static CUresult set_current_impl(CUcontext ctx) {
    note(F_SETCUR, 0, 0);
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    t_current = ctx;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) { LOCKED(set_current_impl(ctx)); }

static CUresult prio_impl(int *least, int *greatest) {
    note(F_PRIO, 0, 0);
    CUresult r = need_context();
    if (r) return r;
    *least = g_prio_least;
    *greatest = g_prio_greatest;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) { LOCKED(prio_impl(least, greatest)); }

static CUresult screate_impl(CUstream *s, unsigned flags, int priority) {
    note(F_SCREATE, 0, 0);
    CUresult r = need_context();
    if (r) return r;
    if (g_num_streams >= MAX_STREAMS) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *fs = calloc(1, sizeof(*fs));
    /* Out-of-range priorities are clamped, as the driver does. */
    fs->priority = priority < g_prio_greatest ? g_prio_greatest
                 : (priority > g_prio_least ? g_prio_least : priority);
    fs->flags = flags;
    fs->live = 1;
    g_streams[g_num_streams++] = fs;
    g_live_streams++;
    *s = fs;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamCreateWithPriority(CUstream *s, unsigned int flags, int priority) {
    LOCKED(screate_impl(s, flags, priority));
}

static CUresult sdestroy_impl(CUstream s) {
    note(F_SDESTROY, s, 0);
    if (!s || !s->live) return CUDA_ERROR_INVALID_HANDLE;
    run_stream(s, NULL);  /* like the driver: queued work completes first */
    s->live = 0;
    g_live_streams--;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamDestroy_v2(CUstream s) { LOCKED(sdestroy_impl(s)); }

static CUresult swait_impl(CUstream s, CUevent ev, unsigned flags) {
    note(F_SWAIT, s, ev);
    if (!ev || !ev->live || flags) return CUDA_ERROR_INVALID_HANDLE;
    enqueue(s, (op){OP_WAIT, 0, 0, 0, ev, 0});
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamWaitEvent(CUstream s, CUevent ev, unsigned int flags) { LOCKED(swait_impl(s, ev, flags)); }

static CUresult ssync_impl(CUstream s) {
    note(F_SSYNC, s, 0);
    run_stream(stream_of(s), NULL);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamSynchronize(CUstream s) { LOCKED(ssync_impl(s)); }

static CUresult ecreate_impl(CUevent *ev, unsigned flags) {
    note(F_ECREATE, 0, 0);
    CUresult r = need_context();
    if (r) return r;
    struct CUevent_st *e = calloc(1, sizeof(*e));
    e->live = 1;
    g_live_events++;
    *ev = e;
    (void)flags;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventCreate(CUevent *ev, unsigned int flags) { LOCKED(ecreate_impl(ev, flags)); }

static CUresult edestroy_impl(CUevent ev) {
    note(F_EDESTROY, 0, ev);
    if (!ev || !ev->live) return CUDA_ERROR_INVALID_HANDLE;
    ev->live = 0;  /* not freed: a queued record or wait may still point at it */
    g_live_events--;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventDestroy_v2(CUevent ev) { LOCKED(edestroy_impl(ev)); }

static CUresult erecord_impl(CUevent ev, CUstream s) {
    note(F_ERECORD, s, ev);
    if (!ev || !ev->live || (s && !s->live)) return CUDA_ERROR_INVALID_HANDLE;
    ev->pending = 1;
    ev->stream = stream_of(s);
    enqueue(s, (op){OP_RECORD, 0, 0, 0, ev, 0});
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventRecord(CUevent ev, CUstream s) { LOCKED(erecord_impl(ev, s)); }

static CUresult equery_impl(CUevent ev) {
    note(F_EQUERY, 0, ev);
    if (!ev || !ev->live) return CUDA_ERROR_INVALID_HANDLE;
    if (g_query_error) return g_query_error;
    return ev->pending ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}
EXPORT CUresult cuEventQuery(CUevent ev) { LOCKED(equery_impl(ev)); }

static CUresult esync_impl(CUevent ev) {
    note(F_ESYNC, 0, ev);
    if (!ev || !ev->live) return CUDA_ERROR_INVALID_HANDLE;
    if (ev->pending) run_stream(ev->stream, ev);
    return g_query_error ? g_query_error : CUDA_SUCCESS;
}
EXPORT CUresult cuEventSynchronize(CUevent ev) { LOCKED(esync_impl(ev)); }

static CUresult reg_impl(void *p, size_t size, unsigned flags) {
    note(F_REG, 0, 0);
    CUresult r = need_context();
    if (r) return r;
    if (!p || !size || flags) return CUDA_ERROR_INVALID_VALUE;
    if (g_register_error && g_register_error_after-- <= 0) return g_register_error;
    /* The driver pins whole pages: two registrations may not share one. */
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)p / page, hi = ((uintptr_t)p + size - 1) / page;
    for (int i = 0; i < g_num_regs; i++) {
        if (!g_regs[i].registered) continue;
        uintptr_t rlo = (uintptr_t)g_regs[i].ptr / page;
        uintptr_t rhi = ((uintptr_t)g_regs[i].ptr + g_regs[i].size - 1) / page;
        if (lo <= rhi && rlo <= hi) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    }
    if (g_num_regs >= MAX_RECORDS) return CUDA_ERROR_INVALID_VALUE;
    g_regs[g_num_regs++] = (reg_record){1, p, size};
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned int flags) { LOCKED(reg_impl(p, size, flags)); }

static CUresult unreg_impl(void *p) {
    note(F_UNREG, 0, 0);
    CUresult r = need_context();
    if (r) return r;
    for (int i = 0; i < g_num_regs; i++) {
        if (g_regs[i].registered && g_regs[i].ptr == p) {
            g_regs[i].registered = 0;  /* kept in the history, marked released */
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}
EXPORT CUresult cuMemHostUnregister(void *p) { LOCKED(unreg_impl(p)); }

static CUresult memcpy_impl(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    note(F_MEMCPY, s, 0);
    CUresult r = need_context();
    if (r) return r;
    if (g_memcpy_error && g_memcpy_error_after-- <= 0) return g_memcpy_error;
    enqueue(s, (op){OP_COPY, (void *)dst, (const void *)src, n, 0, 0});
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    LOCKED(memcpy_impl(dst, src, n, s));
}

#ifndef FAKE_NO_BATCH
static CUresult batch_impl(int num_args, CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                           size_t count, CUmemcpyAttributes *attrs, size_t *attrs_idxs,
                           size_t num_attrs, size_t *fail_idx, CUstream s) {
    note(num_args == 9 ? F_BATCH : F_BATCH_V2, s, 0);
    if (fail_idx) *fail_idx = SIZE_MAX;
    CUresult r = need_context();
    if (r) return r;
    batch_record rec = {num_args, 0, count, num_attrs, attrs_idxs ? attrs_idxs[0] : 99,
                        -1, -1, -1, -1, -1, 0, s};
    if (attrs && num_attrs) {
        rec.src_access_order = attrs->srcAccessOrder;
        rec.src_loc_type = attrs->srcLocHint.type;
        rec.src_loc_id = attrs->srcLocHint.id;
        rec.dst_loc_type = attrs->dstLocHint.type;
        rec.dst_loc_id = attrs->dstLocHint.id;
        rec.flags = attrs->flags;
    }
    /* The documented argument checks; the legacy default stream is rejected. */
    if (!s || !count || !dsts || !srcs || !sizes || !attrs || !attrs_idxs || !num_attrs ||
        num_attrs > count || attrs_idxs[0] != 0)
        r = CUDA_ERROR_INVALID_VALUE;
    for (size_t k = 0; !r && k < num_attrs; k++)
        if (attrs[k].srcAccessOrder < 1 || attrs[k].srcAccessOrder > 3) r = CUDA_ERROR_INVALID_VALUE;
    if (!r && g_batch_error && g_batch_error_after-- <= 0) {
        r = g_batch_error;
        if (fail_idx) *fail_idx = g_batch_fail_idx;
    }
    rec.result = r;
    if (g_num_batches < MAX_RECORDS) g_batches[g_num_batches++] = rec;
    if (r) return r;
    for (size_t i = 0; i < count; i++)
        enqueue(s, (op){OP_COPY, (void *)dsts[i], (const void *)srcs[i], sizes[i], 0, 0});
    return CUDA_SUCCESS;
}

/* CUDA 12.8 ABI: trailing failIdx. */
EXPORT CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                   size_t count, CUmemcpyAttributes *attrs, size_t *attrs_idxs,
                                   size_t num_attrs, size_t *fail_idx, CUstream s) {
    LOCKED(batch_impl(9, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, s));
}

#if FAKE_CUDA_VERSION >= 13000
/* CUDA 13.0 ABI: no failIdx. */
EXPORT CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                      size_t count, CUmemcpyAttributes *attrs,
                                      size_t *attrs_idxs, size_t num_attrs, CUstream s) {
    LOCKED(batch_impl(8, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, NULL, s));
}
#endif
#endif /* FAKE_NO_BATCH */

/* --------------------------------------------------- modules and launches */
static CUresult modload_impl(CUmodule *module, const void *image) {
    note(F_MODLOAD, 0, 0);
    CUresult r = need_context();
    if (r) return r;
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    if (g_module_error) return g_module_error;
    if (!strstr((const char *)image, ".entry " KERNEL_NAME "(")) return CUDA_ERROR_INVALID_IMAGE;
    struct CUmod_st *m = calloc(1, sizeof(*m));
    m->live = 1;
    m->copy_blocks.module = m;
    g_live_modules++;
    *module = m;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image) { LOCKED(modload_impl(module, image)); }

static CUresult getfn_impl(CUfunction *fn, CUmodule module, const char *name) {
    note(F_GETFN, 0, 0);
    CUresult r = need_context();
    if (r) return r;
    if (!fn || !module || !module->live) return CUDA_ERROR_INVALID_HANDLE;
    if (!name || strcmp(name, KERNEL_NAME)) return CUDA_ERROR_NOT_FOUND;
    *fn = &module->copy_blocks;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleGetFunction(CUfunction *fn, CUmodule module, const char *name) {
    LOCKED(getfn_impl(fn, module, name));
}

static CUresult unload_impl(CUmodule module) {
    note(F_MODUNLOAD, 0, 0);
    CUresult r = need_context();
    if (r) return r;
    if (!module || !module->live) return CUDA_ERROR_INVALID_HANDLE;
    module->live = 0;  /* kept allocated: a stale CUfunction must still read as dead */
    g_live_modules--;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleUnload(CUmodule module) { LOCKED(unload_impl(module)); }

static int registered(unsigned long long p, size_t n) {
    for (int i = 0; i < g_num_regs; i++)
        if (g_regs[i].registered && (uintptr_t)g_regs[i].ptr <= p &&
            p + n <= (uintptr_t)g_regs[i].ptr + g_regs[i].size)
            return 1;
    return 0;
}

static CUresult launch_impl(CUfunction f, const unsigned grid[3], const unsigned block[3],
                            unsigned shared_bytes, CUstream s, void **params, void **extra) {
    note(F_LAUNCH, s, 0);
    CUresult r = need_context();
    if (r) return r;
    launch_record rec = {0, {grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]},
                         shared_bytes, 0, 0, s};
    if (!f || !f->module->live) r = CUDA_ERROR_INVALID_HANDLE;
    else if (!s || !params || extra || !grid[0] || grid[1] != 1 || grid[2] != 1 || !block[0] ||
             block[0] > 1024 || block[1] != 1 || block[2] != 1 || shared_bytes)
        r = CUDA_ERROR_INVALID_VALUE;
    if (!r) {  /* kvoffload_copy_blocks(const u64 *table, u64 count) */
        rec.table = *(unsigned long long *)params[0];
        rec.count = *(unsigned long long *)params[1];
        if (!registered(rec.table, 3 * rec.count * sizeof(unsigned long long)))
            r = CUDA_ERROR_ILLEGAL_ADDRESS;  /* the GPU could not read the table */
    }
    if (!r && g_launch_error && g_launch_error_after-- <= 0) r = g_launch_error;
    rec.result = r;
    if (g_num_launches < MAX_RECORDS) g_launches[g_num_launches++] = rec;
    if (r) return r;
    enqueue(s, (op){OP_KERNEL, 0, (const void *)rec.table, rec.count, 0, 0});
    return CUDA_SUCCESS;
}
EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                               unsigned int gridDimZ, unsigned int blockDimX,
                               unsigned int blockDimY, unsigned int blockDimZ,
                               unsigned int sharedMemBytes, CUstream hStream,
                               void **kernelParams, void **extra) {
    const unsigned grid[3] = {gridDimX, gridDimY, gridDimZ};
    const unsigned block[3] = {blockDimX, blockDimY, blockDimZ};
    LOCKED(launch_impl(f, grid, block, sharedMemBytes, hStream, kernelParams, extra));
}

#ifndef FAKE_NO_PROC_ADDRESS
/* CUdriverProcAddressQueryResult: SUCCESS=0, SYMBOL_NOT_FOUND=1, VERSION_NOT_SUFFICIENT=2 */
static CUresult proc_impl(const char *symbol, void **pfn, int version, cuuint64_t flags,
                          CUdriverProcAddressQueryResult *status) {
    note(F_PROC, 0, 0);
    *pfn = NULL;
    if (status) *status = 1;
    if (flags) return CUDA_ERROR_INVALID_VALUE;
    if (strcmp(symbol, "cuMemcpyBatchAsync") != 0) return CUDA_ERROR_NOT_FOUND;
#ifdef FAKE_NO_BATCH
    (void)version;
    return CUDA_ERROR_NOT_FOUND;
#else
    if (version < 12080) { if (status) *status = 2; return CUDA_ERROR_NOT_FOUND; }
#if FAKE_CUDA_VERSION >= 13000
    if (version >= 13000) { *pfn = (void *)&cuMemcpyBatchAsync_v2; if (status) *status = 0; return 0; }
#endif
    *pfn = (void *)&cuMemcpyBatchAsync;
    if (status) *status = 0;
    return CUDA_SUCCESS;
#endif
}
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                    cuuint64_t flags, CUdriverProcAddressQueryResult *status) {
    LOCKED(proc_impl(symbol, pfn, version, flags, status));
}
#endif

/* ------------------------------------------------- test-only inspection */
static void discard_stream(struct CUstream_st *s) {
    while (s->head) { op *h = s->head; s->head = h->next; free(h); }
    s->tail = NULL;
}
/* Back to a freshly loaded driver. Queued work is dropped, not run: the
   memory it points at may belong to a finished test. */
EXPORT void fake_reset(void) {
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_num_streams; i++) discard_stream(g_streams[i]);
    discard_stream(&g_legacy_stream);
    memset(g_calls, 0, sizeof(g_calls));
    g_log_len = g_num_batches = g_num_regs = 0;
    g_initialized = g_live_streams = g_live_events = 0;
    g_primary[0].refcount = g_primary[1].refcount = 0;
    g_defer = g_batch_error = g_memcpy_error = g_query_error = g_register_error = 0;
    g_module_error = g_launch_error = g_num_launches = g_live_modules = 0;
    g_host_pointer_usable = 1;
    g_prio_least = 0;
    g_prio_greatest = -5;
    pthread_mutex_unlock(&g_lock);
}
EXPORT void fake_set_priority_range(int least, int greatest) {
    pthread_mutex_lock(&g_lock); g_prio_least = least; g_prio_greatest = greatest;
    pthread_mutex_unlock(&g_lock);
}
EXPORT void fake_set_defer(int on) { pthread_mutex_lock(&g_lock); g_defer = on; pthread_mutex_unlock(&g_lock); }
EXPORT void fake_run_all(void) {
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < g_num_streams; i++) run_stream(g_streams[i], NULL);
    run_stream(&g_legacy_stream, NULL);
    pthread_mutex_unlock(&g_lock);
}
EXPORT void fake_fail_batch(int code, size_t fail_idx, int after_calls) {
    pthread_mutex_lock(&g_lock);
    g_batch_error = code; g_batch_fail_idx = fail_idx; g_batch_error_after = after_calls;
    pthread_mutex_unlock(&g_lock);
}
EXPORT void fake_fail_memcpy(int code, int after_calls) {
    pthread_mutex_lock(&g_lock);
    g_memcpy_error = code; g_memcpy_error_after = after_calls;
    pthread_mutex_unlock(&g_lock);
}
EXPORT void fake_fail_query(int code) { pthread_mutex_lock(&g_lock); g_query_error = code; pthread_mutex_unlock(&g_lock); }
EXPORT void fake_fail_register(int code, int after_calls) {
    pthread_mutex_lock(&g_lock);
    g_register_error = code; g_register_error_after = after_calls;
    pthread_mutex_unlock(&g_lock);
}
EXPORT void fake_fail_module_load(int code) {
    pthread_mutex_lock(&g_lock); g_module_error = code; pthread_mutex_unlock(&g_lock);
}
EXPORT void fake_fail_launch(int code, int after_calls) {
    pthread_mutex_lock(&g_lock);
    g_launch_error = code; g_launch_error_after = after_calls;
    pthread_mutex_unlock(&g_lock);
}
EXPORT void fake_set_host_pointer_usable(int on) {
    pthread_mutex_lock(&g_lock); g_host_pointer_usable = on; pthread_mutex_unlock(&g_lock);
}
EXPORT int fake_num_launches(void) { return g_num_launches; }
EXPORT int fake_launch(int i, launch_record *out) {
    if (i < 0 || i >= g_num_launches) return -1;
    *out = g_launches[i];
    return 0;
}
EXPORT int fake_live_modules(void) { return g_live_modules; }
EXPORT long fake_calls(const char *name) {
    for (int i = 0; i < F_COUNT; i++) if (!strcmp(FN_NAMES[i], name)) return g_calls[i];
    return -1;
}
EXPORT int fake_log_len(void) { return g_log_len; }
EXPORT const char *fake_log_entry(int i, void **stream, void **event) {
    if (i < 0 || i >= g_log_len) return NULL;
    *stream = g_log[i].stream;
    *event = g_log[i].event;
    return FN_NAMES[g_log[i].fn];
}
EXPORT int fake_num_batches(void) { return g_num_batches; }
EXPORT int fake_batch(int i, batch_record *out) {
    if (i < 0 || i >= g_num_batches) return -1;
    *out = g_batches[i];
    return 0;
}
EXPORT int fake_num_registrations(void) { return g_num_regs; }
EXPORT int fake_registration(int i, reg_record *out) {
    if (i < 0 || i >= g_num_regs) return -1;
    *out = g_regs[i];
    return 0;
}
EXPORT int fake_live_events(void) { return g_live_events; }
EXPORT int fake_live_streams(void) { return g_live_streams; }
EXPORT int fake_ctx_refcount(int dev) { return g_primary[dev].refcount; }
EXPORT int fake_stream_priority(CUstream s) { return stream_of(s)->priority; }
EXPORT unsigned fake_stream_flags(CUstream s) { return stream_of(s)->flags; }
