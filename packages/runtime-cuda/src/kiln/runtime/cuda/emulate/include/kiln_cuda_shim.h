// kiln CUDA emulation shim: lets the host C++ compiler build a rendered CUDA C kernel.
// Every CUDA thread of a block gets its own host stack, so __syncthreads is a real barrier and __shared__ is per block:
//  fibers (default): the block's threads are fibers on one host thread, switched at __syncthreads; blocks run in parallel
//                    on a pool of host threads, __shared__ is thread_local (one block per host thread at a time).
//  KILN_EMU_OS_THREADS: one host (p)thread per CUDA thread, __syncthreads a barrier; blocks run one after another.
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
#include <cstdlib>  // the launcher's (kiln_cuda_launch.h) too: the precompiled header holds every standard header
#include <type_traits>
#include <utility>
#include <pthread.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#ifdef KILN_EMU_OS_THREADS
#define __shared__ static  // one block runs at a time: its threads share the static
#else
#define __shared__ static thread_local  // one block per host thread at a time: its fibers share it
#endif
#define __constant__ static const
#define __align__(n) __attribute__((aligned(n)))

struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };
extern thread_local uint3 threadIdx, blockIdx;
extern thread_local dim3 blockDim, gridDim;  // per host thread, so concurrent launches do not share them
static const int warpSize = 32;

// ---- __syncthreads: a barrier over the block's live threads (a thread that returned no longer counts) ----
namespace kiln_emu {
struct Barrier {
  std::mutex m;
  int count = 0, live = 0;
  std::atomic<unsigned> gen{0};
  void reset(int n) { count = 0; live = n; }
  void release(std::unique_lock<std::mutex>& l) { count = 0; gen.fetch_add(1, std::memory_order_acq_rel); l.unlock(); gen.notify_all(); }
  void wait() {
    std::unique_lock<std::mutex> l(m);
    unsigned g = gen.load(std::memory_order_acquire);
    if (++count >= live) { release(l); return; }
    l.unlock();
    while (gen.load(std::memory_order_acquire) == g) gen.wait(g, std::memory_order_acquire);
  }
  void leave() {
    std::unique_lock<std::mutex> l(m);
    --live;
    if (count > 0 && count >= live) release(l);
  }
};
extern thread_local Barrier* tl_bar;
void sync();
}  // namespace kiln_emu
static inline void __syncthreads() { kiln_emu::sync(); }
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// ---- bit casts ----
template <typename T, typename F> static inline T kiln_bitcast(F f) { static_assert(sizeof(T) == sizeof(F)); T t; std::memcpy(&t, &f, sizeof(T)); return t; }
static inline float __int_as_float(int x) { return kiln_bitcast<float>(x); }
static inline int __float_as_int(float x) { return kiln_bitcast<int>(x); }
static inline float __uint_as_float(unsigned int x) { return kiln_bitcast<float>(x); }
static inline unsigned int __float_as_uint(float x) { return kiln_bitcast<unsigned int>(x); }
static inline double __longlong_as_double(long long x) { return kiln_bitcast<double>(x); }
static inline long long __double_as_longlong(double x) { return kiln_bitcast<long long>(x); }

// ---- half: IEEE binary16, conversions round to nearest even; arithmetic in float, rounded once (exact for + - * / sqrt) ----
namespace kiln_emu {
static inline uint16_t f32_to_f16(float f) {
  uint32_t x = kiln_bitcast<uint32_t>(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0));  // inf / nan (quiet)
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to >= 65520: overflow to inf
  if (ax < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero, round to nearest even
    if (ax < 0x33000000u) return (uint16_t)sign;  // < 2^-25: rounds to zero
    uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e;  // value = m * 2^(e-150); half ulp unit 2^-24
    uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = ax - 0x38000000u;  // rebias exponent 127 -> 15
  uint32_t h = r >> 13, rem = r & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++;
  return (uint16_t)(sign | h);
}
static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return kiln_bitcast<float>(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    if (m == 0) return kiln_bitcast<float>(sign);
    float v = std::ldexp((float)m, -24);
    return sign ? -v : v;
  }
  return kiln_bitcast<float>(sign | ((e + 112) << 23) | (m << 13));
}
static inline uint16_t f32_to_bf16(float f) {
  uint32_t x = kiln_bitcast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // nan stays nan (quiet)
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
static inline float bf16_to_f32(uint16_t b) { return kiln_bitcast<float>((uint32_t)b << 16); }
}  // namespace kiln_emu

#define KILN_EMU_16BIT_TYPE(T, TO, FROM)                                                                          \
  struct T {                                                                                                      \
    uint16_t x;                                                                                                   \
    T() = default;                                                                                                \
    T(float f) : x(kiln_emu::TO(f)) {}                                                                            \
    T(double f) : x(kiln_emu::TO((float)f)) {}                                                                    \
    T(int i) : x(kiln_emu::TO((float)i)) {}                                                                       \
    T(unsigned int i) : x(kiln_emu::TO((float)i)) {}                                                              \
    T(long long i) : x(kiln_emu::TO((float)i)) {}                                                                 \
    T(unsigned long long i) : x(kiln_emu::TO((float)i)) {}                                                        \
    T(short i) : x(kiln_emu::TO((float)i)) {}                                                                     \
    T(unsigned short i) : x(kiln_emu::TO((float)i)) {}                                                            \
    T(bool b) : x(kiln_emu::TO(b ? 1.0f : 0.0f)) {}                                                               \
    operator float() const { return kiln_emu::FROM(x); }                                                          \
    static T raw(uint16_t bits) { T t; t.x = bits; return t; }                                                    \
    T& operator+=(T o) { return *this = T(float(*this) + float(o)); }                                            \
    T& operator-=(T o) { return *this = T(float(*this) - float(o)); }                                            \
    T& operator*=(T o) { return *this = T(float(*this) * float(o)); }                                            \
    T& operator/=(T o) { return *this = T(float(*this) / float(o)); }                                            \
  };                                                                                                              \
  static inline T operator+(T a, T b) { return T(float(a) + float(b)); }                                          \
  static inline T operator-(T a, T b) { return T(float(a) - float(b)); }                                          \
  static inline T operator*(T a, T b) { return T(float(a) * float(b)); }                                          \
  static inline T operator/(T a, T b) { return T(float(a) / float(b)); }                                          \
  static inline T operator-(T a) { return T::raw((uint16_t)(a.x ^ 0x8000u)); }                                    \
  static inline bool operator<(T a, T b) { return float(a) < float(b); }                                          \
  static inline bool operator>(T a, T b) { return float(a) > float(b); }                                          \
  static inline bool operator<=(T a, T b) { return float(a) <= float(b); }                                        \
  static inline bool operator>=(T a, T b) { return float(a) >= float(b); }                                        \
  static inline bool operator==(T a, T b) { return float(a) == float(b); }                                        \
  static inline bool operator!=(T a, T b) { return float(a) != float(b); }

KILN_EMU_16BIT_TYPE(__half, f32_to_f16, f16_to_f32)
KILN_EMU_16BIT_TYPE(__nv_bfloat16, f32_to_bf16, bf16_to_f32)
typedef __half half;
typedef __nv_bfloat16 nv_bfloat16;
struct __half2 { __half x, y; };
typedef __half2 half2;
static inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
struct __nv_bfloat162 { __nv_bfloat16 x, y; };

static inline __half __float2half(float f) { return __half(f); }
static inline __half __float2half_rn(float f) { return __half(f); }
static inline __half __double2half(double d) { return __half((float)d); }  // nvcc also goes through float here
static inline float __half2float(__half h) { return float(h); }
static inline __half __int2half_rn(int i) { return __half((float)i); }
static inline short __half_as_short(__half h) { return (short)h.x; }
static inline unsigned short __half_as_ushort(__half h) { return h.x; }
static inline __half __short_as_half(short s) { return __half::raw((uint16_t)s); }
static inline __half __ushort_as_half(unsigned short s) { return __half::raw(s); }
static inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
static inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16((float)d); }
static inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
static inline short __bfloat16_as_short(__nv_bfloat16 b) { return (short)b.x; }
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
static inline __nv_bfloat16 __short_as_bfloat16(short s) { return __nv_bfloat16::raw((uint16_t)s); }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short s) { return __nv_bfloat16::raw(s); }

#define KILN_EMU_16BIT_MATH(T, P)                                                                     \
  static inline T P##sqrt(T a) { return T(sqrtf(float(a))); }                                         \
  static inline T P##exp2(T a) { return T(exp2f(float(a))); }                                         \
  static inline T P##log2(T a) { return T(log2f(float(a))); }                                         \
  static inline T P##sin(T a) { return T(sinf(float(a))); }                                           \
  static inline T P##trunc(T a) { return T(truncf(float(a))); }                                       \
  static inline T P##rcp(T a) { return T(1.0f / float(a)); }
KILN_EMU_16BIT_MATH(__half, h)
KILN_EMU_16BIT_MATH(__nv_bfloat16, h)
static inline __half __hadd(__half a, __half b) { return a + b; }
static inline __half __hsub(__half a, __half b) { return a - b; }
static inline __half __hmul(__half a, __half b) { return a * b; }
static inline __half __hdiv(__half a, __half b) { return a / b; }
static inline __half __hneg(__half a) { return -a; }
static inline __half __hmax(__half a, __half b) { return __half(fmaxf(float(a), float(b))); }
static inline __half __hmin(__half a, __half b) { return __half(fminf(float(a), float(b))); }
static inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(fmaxf(float(a), float(b))); }
static inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16(fminf(float(a), float(b))); }

// ---- CUDA's overloaded device min/max ----
#define KILN_EMU_MINMAX(T) \
  static inline T max(T a, T b) { return a > b ? a : b; } \
  static inline T min(T a, T b) { return a < b ? a : b; }
KILN_EMU_MINMAX(int) KILN_EMU_MINMAX(unsigned int) KILN_EMU_MINMAX(long long) KILN_EMU_MINMAX(unsigned long long)
KILN_EMU_MINMAX(long) KILN_EMU_MINMAX(unsigned long)
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline float min(float a, float b) { return fminf(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __saturatef(float a) { return a != a ? 0.0f : fminf(fmaxf(a, 0.0f), 1.0f); }
static inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
static inline double rsqrt(double a) { return 1.0 / sqrt(a); }
static inline int __mul24(int a, int b) { return (int)(((long long)(a << 8 >> 8)) * (b << 8 >> 8)); }
static inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
static inline unsigned int __umulhi(unsigned int a, unsigned int b) { return (unsigned int)(((unsigned long long)a * b) >> 32); }
#include "kiln_cuda_warp.h"
