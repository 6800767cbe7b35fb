// defines: smem_address, cp_async16, cp_async4, cp_async_commit, cp_async_wait, ldsm_x4, mma_bf16
// The PTX the tensor-core kernels share (flash_attention.cu, grouped_mma.cu and the register-
// resident casts in cast/): asynchronous global -> shared copies, ldmatrix and the BF16 mma.sync.
// Each wraps one instruction; the kernels own their tiling and swizzles.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace fourbit::ops::cuda {

// The shared-state-space address of a pointer into shared memory.
__device__ __forceinline__ uint32_t smem_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// cp.async (sm_80+): copies src_bytes (0 or the full width) of src to shared address dst and zero-
// fills the rest, so src_bytes = 0 reads nothing and writes zeros. Completed by cp_async_wait.
// 16 bytes go through L2 only (.cg); 4 bytes must use .ca.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  cp_async16(smem_address(dst), src, src_bytes);
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {
  cp_async4(smem_address(dst), src, src_bytes);
}
// Closes the thread's current group of copies.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most kPending of the thread's committed groups are still in flight (the newest).
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ldmatrix .x4: four 8x8 BF16 matrices, lane l giving the shared address of row l % 8 of matrix
// l / 8. Plain, lane l receives (row l / 4, cols 2 (l % 4) ..) of each; .trans, (rows 2 (l % 4) ..,
// col l / 4), i.e. the transposed matrix's fragment.
template <bool Trans>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
template <bool Trans>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
  ldsm_x4<Trans>(r, smem_address(p));
}

// C (16x8, FP32) += A (16x16, BF16, row) * B (16x8, BF16, col): PTX's m16n8k16 fragments, with
// gid = lane / 4 and tig = lane % 4: a = {(gid, 2tig..), (gid+8, 2tig..), (gid, 2tig+8..),
// (gid+8, 2tig+8..)}, b = {(k 2tig.., n gid), (k 2tig+8.., n gid)}, c = {(gid, 2tig), (gid, 2tig+1),
// (gid+8, 2tig), (gid+8, 2tig+1)}. The lower k index of a pair sits in the low 16 bits. A pure
// function of its operands (not volatile), so the compiler may schedule it freely.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace fourbit::ops::cuda
