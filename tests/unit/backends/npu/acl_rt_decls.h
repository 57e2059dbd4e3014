/*
 * The AscendCL declarations the NPU backend binds, written out because CANN's
 * acl_base.h / acl_rt.h are not installable from a package index.
 *
 * This is the single C statement of the ABI on the Ascend side: the fake
 * runtime (fake_ascendcl.c) is compiled against it, and the ABI test
 * (test_acl_abi.py) compiles a probe against it and compares every ctypes
 * structure's size and field offsets, and every constant, with
 * kvoffload_hal.backends.npu._acl. Each declaration names the CANN version and
 * the document it was read from ("API reference" is the CANN application
 * development guide, C API reference, on hiascend.com). A change here must
 * come from those documents, never from the Python side.
 */
#ifndef KVOFFLOAD_ACL_RT_DECLS_H
#define KVOFFLOAD_ACL_RT_DECLS_H

#include <stddef.h>
#include <stdint.h>

/* acl_base.h, CANN 8.2.RC1 - 9.1.0 API reference, "aclError": a plain int. */
typedef int aclError;

/* acl_base.h, CANN 8.2.RC1 - 9.1.0 API reference, "aclrtStream": an opaque pointer. */
typedef void *aclrtStream;

/* Return codes: acl_base.h (ACL_SUCCESS, ACL_ERROR_INVALID_PARAM) and the runtime
 * return-code list (ACL_ERROR_RT_*), CANN 8.3.RC1 API reference. 207000 is what
 * aclrtMemcpyBatchAsync answers on products its page lists as unsupported. */
#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_RT_PARAM_INVALID 107000
#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
/* rt_error_codes.h, CANN 8.5.0: ACL_ERROR_RT_MEMORY_ALLOCATION. What one aclrtMallocHost
 * call above about 200-250 GB answered on Atlas A2 (910B) with the memory free
 * (LMCache-Ascend issue #242). */
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001

/* acl_rt.h, CANN 8.1.RC1 API reference, "aclrtMemLocationType" (HOST is reserved
 * before 8.1.RC1, supported from it). */
typedef enum aclrtMemLocationType {
    ACL_MEM_LOCATION_TYPE_HOST = 0,
    ACL_MEM_LOCATION_TYPE_DEVICE = 1,
} aclrtMemLocationType;

/* acl_rt.h, CANN 8.3.RC1 API reference, "aclrtMemLocation": id FIRST, then type
 * (the reverse of CUDA's CUmemLocation). From 9.0 the id is "Device ID or NUMA ID". */
typedef struct aclrtMemLocation {
    uint32_t id;
    aclrtMemLocationType type;
} aclrtMemLocation;

/* acl_rt.h, CANN 8.3.RC1 API reference, "aclrtMemcpyBatchAttr": dstLoc FIRST, then
 * srcLoc, then 16 reserved bytes that must be zero (32 bytes in all). */
typedef struct aclrtMemcpyBatchAttr {
    aclrtMemLocation dstLoc;
    aclrtMemLocation srcLoc;
    uint8_t rsv[16];
} aclrtMemcpyBatchAttr;

/* acl_rt.h, CANN 8.2.RC1 - 9.1.0 API reference, "aclrtMemcpyKind" (later releases
 * append kinds after DEVICE_TO_DEVICE; these four keep their values). */
typedef enum aclrtMemcpyKind {
    ACL_MEMCPY_HOST_TO_HOST = 0,
    ACL_MEMCPY_HOST_TO_DEVICE = 1,
    ACL_MEMCPY_DEVICE_TO_HOST = 2,
    ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
} aclrtMemcpyKind;

/* acl_rt.h, CANN 8.2.RC1 - 9.1.0 API reference, "aclrtMallocHost" / "aclrtFreeHost". */
aclError aclrtMallocHost(void **hostPtr, size_t size);
aclError aclrtFreeHost(void *hostPtr);

/* acl_rt.h, CANN 8.2.RC1 - 9.1.0 API reference, "aclrtSynchronizeStream". */
aclError aclrtSynchronizeStream(aclrtStream stream);

/* acl_rt.h, CANN 8.2.RC1 - 9.1.0 API reference, "aclrtMemcpyAsync". */
aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                          aclrtMemcpyKind kind, aclrtStream stream);

/* acl_rt.h, CANN 8.3.RC1 and 8.5.0 API reference, page aclcppdevg_03_1957
 * "aclrtMemcpyBatchAsync" (a trial feature in 8.3 - 9.0; its product table marks
 * Atlas 200I/500 A2, Atlas inference and Atlas training products unsupported).
 * failIndex must not be NULL. */
aclError aclrtMemcpyBatchAsync(void **dsts, size_t *destMaxs, void **srcs, size_t *sizes,
                               size_t numBatches, aclrtMemcpyBatchAttr *attrs,
                               size_t *attrsIndexes, size_t numAttrs, size_t *failIndex,
                               aclrtStream stream);

/* acl_rt.h, CANN 9.1.0 API reference, "aclrtMemcpyBatchAsyncV2": the same without
 * failIndex. */
aclError aclrtMemcpyBatchAsyncV2(void **dsts, size_t *destMaxs, void **srcs, size_t *sizes,
                                 size_t numBatches, aclrtMemcpyBatchAttr *attrs,
                                 size_t *attrsIndexes, size_t numAttrs, aclrtStream stream);

/* acl_rt.h, CANN 8.5.0 API reference, page aclcppdevg_03_0024 "aclrtGetVersion". */
aclError aclrtGetVersion(int32_t *majorVersion, int32_t *minorVersion, int32_t *patchVersion);

#endif /* KVOFFLOAD_ACL_RT_DECLS_H */
