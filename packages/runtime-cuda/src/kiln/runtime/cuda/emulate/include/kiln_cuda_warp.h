// kiln CUDA emulation: warp shuffles (__shfl_*_sync) for the block reductions kiln renders (render/cuda.py's kiln_warp_*).
// A shuffle is a collective of the whole block here: every thread leaves its value in a per-block slot, a barrier, each reads
// its source lane's slot, a barrier (the slots are reused by the next shuffle). So it needs what kiln's rendered code gives it:
// every thread of the block calls the same shuffles in the same order (on a GPU only the warp's lanes in `mask` must). A source
// lane outside `mask` (a value the GPU leaves undefined) aborts, so a wrong mask shows up here instead of as garbage.
#pragma once
#include <cstdlib>

namespace kiln_emu {
struct alignas(8) ShflSlot { unsigned char b[8]; };
#ifdef KILN_EMU_OS_THREADS
static ShflSlot shfl_slots[1024];  // one block at a time
#else
static thread_local ShflSlot shfl_slots[1024];  // one block per host thread at a time
#endif
static inline int flat_tid() { return (int)(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)); }
// lane `src` of this thread's warp (within segments of `width` lanes), as CUDA defines it for each shuffle
template <typename T> static inline T shfl_exchange(unsigned mask, T v, int src, int width) {
  static_assert(sizeof(T) <= sizeof(ShflSlot));
  int t = flat_tid(), lane = t & 31, seg = lane & ~(width - 1);
  if (!((mask >> lane) & 1u)) std::abort();  // a thread outside its own mask
  std::memcpy(shfl_slots[t].b, &v, sizeof(T));
  sync();
  int from = (src & (width - 1)) + seg;
  if (!((mask >> from) & 1u)) std::abort();  // reading a lane that does not take part
  T r;
  std::memcpy(&r, shfl_slots[(t & ~31) | from].b, sizeof(T));
  sync();
  return r;
}
}  // namespace kiln_emu

template <typename T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) { return kiln_emu::shfl_exchange(mask, v, src, width); }
template <typename T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  int lane = kiln_emu::flat_tid() & 31;
  int src = lane ^ lane_mask;
  // a later segment is out of reach: CUDA returns the thread's own value
  return kiln_emu::shfl_exchange(mask, v, (src & ~(width - 1)) > (lane & ~(width - 1)) ? lane : src, width);
}
template <typename T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  int lane = kiln_emu::flat_tid() & 31, src = lane + (int)delta;
  return kiln_emu::shfl_exchange(mask, v, (src & ~(width - 1)) != (lane & ~(width - 1)) ? lane : src, width);  // past the segment: own value
}
template <typename T> static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  int lane = kiln_emu::flat_tid() & 31, src = lane - (int)delta;
  return kiln_emu::shfl_exchange(mask, v, src < (lane & ~(width - 1)) ? lane : src, width);
}

// ---- atomics on global memory (the grid stage's done count): host atomics, sequentially consistent ----
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
