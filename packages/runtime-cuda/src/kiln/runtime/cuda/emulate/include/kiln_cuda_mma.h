// kiln CUDA emulation: the tensor-core and async-copy steps of render/cuda_matmul.py's tiled kernels, as plain C++.
// ldmatrix and mma.sync are warp collectives: like the shuffles (kiln_cuda_warp.h) every thread leaves its operands in a
// per-block slot, a barrier, each computes its own registers from its warp's slots as PTX defines the fragments, a barrier.
// So every thread of the block must make the same calls in the same order (the tiled kernels do). cp.async copies at once
// (commit and wait are no-ops): a missing wait or barrier does not show here; compute-sanitizer's racecheck on a GPU does.
#pragma once
#include <cstring>

namespace kiln_emu {
struct MmaSlot { unsigned u[6]; const unsigned char* p; };
#ifdef KILN_EMU_OS_THREADS
static MmaSlot mma_slots[1024];
#else
static thread_local MmaSlot mma_slots[1024];
#endif
static inline unsigned lo16(unsigned v) { return v & 0xffffu; }
static inline unsigned hi16(unsigned v) { return v >> 16; }
static inline unsigned u32_at(const unsigned char* p) { unsigned v; std::memcpy(&v, p, 4); return v; }
static inline unsigned u16_at(const unsigned char* p) { unsigned short v; std::memcpy(&v, p, 2); return v; }
// x4: lanes 8q..8q+7 give the 8 row addresses of matrix q; lane l gets row l/4, 16-bit columns 2(l%4), 2(l%4)+1 of each
// (.trans: of each matrix's transpose, so original rows 2(l%4) and 2(l%4)+1 at column l/4)
static inline void ldmatrix_x4(unsigned (&r)[4], const void* p, bool trans) {
  int t = flat_tid(), lane = t & 31, w = t & ~31;
  mma_slots[t].p = (const unsigned char*)p;
  sync();
  for (int q = 0; q < 4; q++) {
    if (!trans) r[q] = u32_at(mma_slots[w + 8 * q + lane / 4].p + 4 * (lane % 4));
    else r[q] = u16_at(mma_slots[w + 8 * q + 2 * (lane % 4)].p + 2 * (lane / 4))
              | u16_at(mma_slots[w + 8 * q + 2 * (lane % 4) + 1].p + 2 * (lane / 4)) << 16;
  }
  sync();
}
// d (16x8 float32: lane l holds rows l/4 and l/4+8, columns 2(l%4) and 2(l%4)+1) += A (16xK) B (Kx8), the warp's A and B
// elements read from the lanes' posted fragments by va(slots, row, k) and vb(slots, k, col), as the PTX ISA lays them out
template <int K, typename VA, typename VB>
static inline void mma_warp(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], VA va, VB vb) {
  int t = flat_tid(), lane = t & 31, w = t & ~31;
  for (int i = 0; i < 4; i++) mma_slots[t].u[i] = a[i];
  mma_slots[t].u[4] = b[0]; mma_slots[t].u[5] = b[1];
  sync();
  int g = lane / 4, c2 = (lane % 4) * 2;
  for (int h = 0; h < 4; h++) {
    int row = g + (h / 2) * 8, col = c2 + (h % 2);
    float acc = d[h];
    for (int k = 0; k < K; k++) acc = std::fma(va(mma_slots + w, row, k), vb(mma_slots + w, k, col), acc);
    d[h] = acc;
  }
  sync();
}
// m16n8k16 16-bit: A registers (g, 2t..) (g+8, 2t..) (g, 2t+8..) (g+8, 2t+8..), two values each (low half first); B (k 2t.., n g)
// (k 2t+8.., n g)
template <float (*Cvt)(uint16_t)> static inline void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  auto half = [](unsigned v, int k) { return Cvt((uint16_t)(k % 2 ? hi16(v) : lo16(v))); };
  mma_warp<16>(d, a, b, [&](const MmaSlot* s, int row, int k) { return half(s[(row % 8) * 4 + (k % 8) / 2].u[(row >= 8) + 2 * (k >= 8)], k); },
               [&](const MmaSlot* s, int k, int col) { return half(s[col * 4 + (k % 8) / 2].u[4 + (k >= 8)], k); });
}
// m16n8k8 TF32: A (g, t) (g+8, t) (g, t+4) (g+8, t+4), B (k t, n g) (k t+4, n g), one float32 (already TF32) each
static inline void mma_m16n8k8_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  auto f32 = [](unsigned v) { float x; std::memcpy(&x, &v, 4); return x; };
  mma_warp<8>(d, a, b, [&](const MmaSlot* s, int row, int k) { return f32(s[(row % 8) * 4 + k % 4].u[(row >= 8) + 2 * (k >= 4)]); },
              [&](const MmaSlot* s, int k, int col) { return f32(s[col * 4 + k % 4].u[4 + (k >= 4)]); });
}
}  // namespace kiln_emu

// round to TF32 (10 mantissa bits), to nearest with ties away from zero, as cvt.rna.tf32.f32; NaN and inf pass through
static inline unsigned kiln_tf32(float x) {
  unsigned u; std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return u;
  return (u + 0x1000u) & 0xffffe000u;
}
static inline void kiln_mma_m16n8k8_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) { kiln_emu::mma_m16n8k8_tf32(d, a, b); }

static inline void kiln_cp_async16(void* smem, const void* gmem, bool ok) {
  if (ok) std::memcpy(smem, gmem, 16); else std::memset(smem, 0, 16);
}
static inline void kiln_cp_async_commit() {}
template <int N> static inline void kiln_cp_async_wait() {}
#define KILN_DYNAMIC_SHARED(name, bytes) __shared__ __align__(16) unsigned char name[bytes]
static inline void kiln_ldmatrix_x4(unsigned (&r)[4], const void* p) { kiln_emu::ldmatrix_x4(r, p, false); }
static inline void kiln_ldmatrix_x4_trans(unsigned (&r)[4], const void* p) { kiln_emu::ldmatrix_x4(r, p, true); }
static inline void kiln_mma_m16n8k16_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  kiln_emu::mma_m16n8k16<kiln_emu::f16_to_f32>(d, a, b);
}
static inline void kiln_mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  kiln_emu::mma_m16n8k16<kiln_emu::bf16_to_f32>(d, a, b);
}
