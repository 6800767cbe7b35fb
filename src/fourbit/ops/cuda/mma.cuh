// defines: smem_address, cp_async16, cp_async4, cp_async16_if, cp_async_commit, cp_async_wait,
//          ld_shared_u32, ld_shared_v4, ldsm_x4, mma_bf16,
//          wgmma_desc_sw128, wgmma_desc_sw128_mn, fence_proxy_async, wgmma_fence, wgmma_commit, wgmma_wait,
//          wgmma_m64n128k16, wgmma_m64n256k16, wgmma_m64n64k16_ss, wgmma_m64n32k16_ss, wgmma_m64nNk16_rs,
//          mbarrier_init, fence_mbarrier_init, mbarrier_arrive_expect_tx, mbarrier_wait, mbarrier_arrive_cluster, mbarrier_arrive, named_barrier_sync,
//          named_barrier_arrive, cluster_ctarank, cluster_sync, tensormap_set_address, tensormap_set_dim,
//          tensormap_release, tensormap_acquire, tma_load_2d, tma_load_3d,
//          tma_load_2d_multicast
// The PTX the tensor-core kernels share (flash_attention.cu, grouped_mma.cu and the register-
// resident casts in cast/): asynchronous global -> shared copies, ldmatrix, the BF16 mma.sync and
// Hopper's warpgroup wgmma.
// Each wraps one instruction (or a wait loop on one); the kernels own their tiling and swizzles.
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
// cp_async16 issued only where `issue`: a predicate on the instruction rather than a branch around
// it (which costs a divergent warp its branch and reconvergence).
__device__ __forceinline__ void cp_async16_if(bool issue, uint32_t dst, const void* src, int src_bytes) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16, %2;\n}\n" ::"r"(dst),
      "l"(src), "r"(src_bytes), "r"(int(issue))
      : "memory");
}
// Closes the thread's current group of copies.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most kPending of the thread's committed groups are still in flight (the newest).
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Loads from shared address addr (4 or 16 bytes, aligned). Volatile, as ldsm_x4: kept after the
// waits and barriers that make the data visible.
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
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

// ---- wgmma (sm_90a): warpgroup MMAs reading shared memory through descriptors -----------------

// The descriptor of a K-major BF16 operand at shared address addr (1024-byte aligned at its 8-row
// atom) with 128-byte rows in the 128-byte swizzle (16-byte chunk c of row r stored at chunk
// c ^ (r % 8)): stride 1024 bytes between 8-row groups, the leading offset unused (1). Adding
// 32 bytes to addr moves to the next 16 K values.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t addr) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// The descriptor of an MN-major BF16 operand (read with the instruction's transpose flag) at shared
// address addr (1024-byte aligned): K rows of 64 MN values (128 bytes) in the 128-byte swizzle,
// 8-row K groups 1024 bytes apart (the stride offset) and 64-value MN panels panel_bytes apart (the
// leading offset; the canonical MN-major layout of the PTX ISA's matrix descriptors). Adding 2048
// bytes to addr moves to the next 16 K rows.
__device__ __forceinline__ uint64_t wgmma_desc_sw128_mn(uint32_t addr, uint32_t panel_bytes) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t((panel_bytes & 0x3FFFFu) >> 4) << 16) |
         (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Makes the thread's generic-proxy writes to shared memory (stores, cp.async) visible to the async
// proxy that wgmma reads through; a barrier after it publishes them to the warpgroup.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}

// D (64 x 128 FP32, the warpgroup's 64 registers a thread) (+)= A (64 x 16 BF16) . B (128 x 16
// BF16)^T in 128-byte-swizzled shared memory (descriptors a, b), K-major, or MN-major where kTransA /
// kTransB is 1 (wgmma_desc_sw128_mn); accumulate = 0
// starts the sum (D = A . B). Asynchronous: wgmma_commit / wgmma_wait complete it. Thread t of the
// warpgroup holds, for n8 block j, d[4j .. 4j+3] = (row r, col 8j + 2c), (r, 8j + 2c + 1),
// (r + 8, 8j + 2c), (r + 8, 8j + 2c + 1) with r = 16 (t / 32) + (t % 32) / 4 and c = t % 4.
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
#else
  (void)d, (void)a, (void)b, (void)accumulate;
  __trap();  // wgmma exists on sm_90a only; hosts dispatch here only on such devices
#endif
}

// D (64 x 256 FP32, the warpgroup's 128 registers a thread, n8 block j at d[4j .. 4j+3] as for
// wgmma_m64n128k16) (+)= A (64 x 16 BF16) . B (256 x 16 BF16)^T in 128-byte-swizzled shared memory,
// K-major, or MN-major where kTransB is 1 (four 64-value panels); accumulate = 0 starts the sum. An
// element's products and sums are those of the 128-wide instruction (the tests compare the two).
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t a, uint64_t b, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
#else
  (void)d, (void)a, (void)b, (void)accumulate;
  __trap();
#endif
}

// The accumulator operands of a 64 x 8J wgmma tile held as float[J][4] (n8 block j: the four
// values listed above): "+f" operand lists of 8 and 64 registers.
#define FOURBIT_WG_ACC8(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define FOURBIT_WG_ACC64(d, j)                                                                           \
  FOURBIT_WG_ACC8(d, j), FOURBIT_WG_ACC8(d, j + 1), FOURBIT_WG_ACC8(d, j + 2), FOURBIT_WG_ACC8(d, j + 3), \
      FOURBIT_WG_ACC8(d, j + 4), FOURBIT_WG_ACC8(d, j + 5), FOURBIT_WG_ACC8(d, j + 6), FOURBIT_WG_ACC8(d, j + 7)

// D (64 x 64 FP32, float[8][4] a thread as above) (+)= A (64 x 16) . B (64 x 16)^T, both K-major
// in 128-byte-swizzled shared memory (wgmma_desc_sw128); accumulate = 0 starts the sum.
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t a, uint64_t b, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : FOURBIT_WG_ACC64(d, 0)
      : "l"(a), "l"(b), "r"(accumulate));
#else
  (void)d, (void)a, (void)b, (void)accumulate;
  __trap();
#endif
}

// D (64 x 32 FP32: 16 registers a thread, n8 block j at d[4j .. 4j+3] as for wgmma_m64n128k16)
// (+)= A (64 x 16) . B (32 x 16)^T, both K-major in 128-byte-swizzled shared memory
// (wgmma_desc_sw128); accumulate = 0 starts the sum. The narrow tile of the grouped kernel's
// decode configuration.
__device__ __forceinline__ void wgmma_m64n32k16_ss(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(accumulate));
#else
  (void)d, (void)a, (void)b, (void)accumulate;
  __trap();
#endif
}

// D (64 x N FP32, float[N / 8][4]) += A (64 x 16 BF16 from registers: each warp's 16 rows as
// mma_bf16's A fragment) . B (16 x N), B MN-major in 128-byte-swizzled shared memory
// (wgmma_desc_sw128_mn). N = 64 or 128.
template <int N>
__device__ __forceinline__ void wgmma_m64nNk16_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b) {
  static_assert(N == 64 || N == 128, "wgmma_m64nNk16_rs: N is 64 or 128");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (N == 64)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : FOURBIT_WG_ACC64(d, 0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
  else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : FOURBIT_WG_ACC64(d, 0), FOURBIT_WG_ACC64(d, 8)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
#else
  (void)d, (void)a, (void)b;
  __trap();
#endif
}

// ---- mbarriers, clusters and TMA (sm_90a): the grouped kernel's TMA main loop -----------------
// An mbarrier is a 64-bit shared-memory object counting arrivals and (tx) bytes in phases; a
// phase completes when its arrivals and its expected bytes are all in, and its parity flips.

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
#else
  (void)bar, (void)arrivals;
  __trap();
#endif
}
// Makes the initialisations visible to the cluster (before the cluster barrier that publishes them).
__device__ __forceinline__ void fence_mbarrier_init() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// One arrival that also expects `bytes` more of asynchronous copies in the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#else
  (void)bar, (void)bytes;
  __trap();
#endif
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#else
  (void)bar, (void)parity;
  __trap();
#endif
}
// One arrival on the mbarrier at CTA-relative address bar of cluster CTA `cta` (this one or a
// peer), with the instruction's default CTA-scope release. It releases a stage whose only reads
// were wgmma's, complete at the wgmma wait before it, to TMA writes: nothing the thread wrote
// needs ordering at cluster scope, and .release.cluster costs a memory barrier (MEMBAR) an arrival
// that stalls the arriving warp, and so its warpgroup's next MMAs, every K tile.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint32_t bar, uint32_t cta) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(cta)
      : "memory");
#else
  (void)bar, (void)cta;
  __trap();
#endif
}
// One arrival on this CTA's mbarrier at bar, with the default CTA-scope release (as above).
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#else
  (void)bar;
  __trap();
#endif
}
// Named barrier `id` (1..15; 0 is __syncthreads') of `threads` threads, a multiple of 32: sync
// waits until that many have arrived (its own warp's included); arrive counts this warp in and goes
// on. Whole warps only.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r = 0;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}
// Every thread of every CTA of the cluster (all threads of each warp) arrives, then waits.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// TMA: the box at (c0 = innermost element, c1 = row) of the tensor map `map` (a __grid_constant__
// parameter) into shared memory at dst, completing `bar`'s expected bytes; multicast: into dst
// (and its mbarrier at bar) of every cluster CTA in cta_mask.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int c0, int c1, uint32_t bar) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
#else
  (void)dst, (void)map, (void)c0, (void)c1, (void)bar;
  __trap();
#endif
}
// Tensor maps made on the GPU (a copy of one the host encoded, then patched): the global address
// and dimension `ord`'s extent of the map at `map` (128-byte aligned, in global memory) replaced;
// the writer's release and each reader's acquire order those generic-proxy writes before the
// copies that read the map (tensormap_acquire: once per map, before the first copy).
__device__ __forceinline__ void tensormap_set_address(void* map, const void* address) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("tensormap.replace.tile.global_address.global.b1024.b64 [%0], %1;\n" ::"l"(map),
               "l"(reinterpret_cast<uint64_t>(address))
               : "memory");
#else
  (void)map, (void)address;
  __trap();
#endif
}
template <int ORD>
__device__ __forceinline__ void tensormap_set_dim(void* map, uint32_t extent) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], %1, %2;\n" ::"l"(map), "n"(ORD), "r"(extent)
               : "memory");
#else
  (void)map, (void)extent;
  __trap();
#endif
}
__device__ __forceinline__ void tensormap_release() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.tensormap::generic.release.gpu;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void tensormap_acquire(const void* map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
#else
  (void)map;
#endif
}
// The same for a 3-D map: the box at (c0, c1, c2), c2 outermost.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, int c0, int c1, int c2, uint32_t bar) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
#else
  (void)dst, (void)map, (void)c0, (void)c1, (void)c2, (void)bar;
  __trap();
#endif
}
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const void* map, int c0, int c1, uint32_t bar,
                                                      uint16_t cta_mask) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
      "%3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask)
      : "memory");
#else
  (void)dst, (void)map, (void)c0, (void)c1, (void)bar, (void)cta_mask;
  __trap();
#endif
}

}  // namespace fourbit::ops::cuda
