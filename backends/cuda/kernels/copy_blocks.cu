// The copy kernel of the CUDA backend: KV blocks between GPU memory and registered
// host memory, moved by the GPU's own threads over unified virtual addressing.
//
// For KV blocks of tens of KiB, cuMemcpyBatchAsync spends microseconds of driver time
// per descriptor; one launch of this kernel moves every descriptor of a batch at the
// PCIe link's rate (docs/cuda.md has the measurements).
//
// table: one array of 3 * count unsigned 64-bit words, [dsts | srcs | sizes] (the
// layout of the backend's descriptor arrays), in registered host memory the kernel
// reads in place. Each thread block takes descriptors blockIdx.x, + gridDim.x, ...
//
// The backend ships this file's PTX (../_kernel_ptx.py), generated with
//   nvcc -ptx -arch=compute_75 -O3 copy_blocks.cu -o copy_blocks.ptx
// and its header lowered to `.version 7.0` / `.target sm_70`: the body uses nothing
// newer, so drivers from CUDA 11.0 on compile it for their GPU at load time.

typedef unsigned long long u64;

extern "C" __global__ void kvoffload_copy_blocks(const u64* __restrict__ table, u64 count) {
    for (u64 i = blockIdx.x; i < count; i += gridDim.x) {
        const u64 dst = table[i], src = table[count + i], size = table[2 * count + i];
        if (((dst | src | size) & 15) == 0) {  // the usual case: 16-byte words
            const uint4* s = reinterpret_cast<const uint4*>(src);
            uint4* d = reinterpret_cast<uint4*>(dst);
            for (u64 k = threadIdx.x; k < size / 16; k += blockDim.x) d[k] = s[k];
        } else {
            const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
            unsigned char* d = reinterpret_cast<unsigned char*>(dst);
            for (u64 k = threadIdx.x; k < size; k += blockDim.x) d[k] = s[k];
        }
    }
}
