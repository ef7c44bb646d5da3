// kiln CUDA emulation launcher: included after the kernel (with KILN_EMU_KERNEL naming it); exports kiln_emu_launch.
#pragma once
#include <cstdlib>
#include <type_traits>
#include <utility>

thread_local uint3 threadIdx, blockIdx;
thread_local dim3 blockDim, gridDim;
thread_local kiln_emu::Barrier* kiln_emu::tl_bar;

namespace kiln_emu {
// each kernel parameter from one int64 slot: pointers (buffers, in globals order) then int vars
template <typename P> static inline P arg_as(int64_t v) {
  if constexpr (std::is_pointer_v<P>) return reinterpret_cast<P>(static_cast<intptr_t>(v));
  else return static_cast<P>(v);
}
template <typename... A, size_t... I> static inline void call(void (*f)(A...), const int64_t* argv, std::index_sequence<I...>) {
  f(arg_as<A>(argv[I])...);
}
template <typename... A> static inline void call(void (*f)(A...), const int64_t* argv) { call(f, argv, std::index_sequence_for<A...>{}); }
template <typename... A> static constexpr int nargs(void (*)(A...)) { return sizeof...(A); }

static inline uint3 unflatten(long long i, dim3 d) {
  return uint3{(unsigned)(i % d.x), (unsigned)((i / d.x) % d.y), (unsigned)(i / ((long long)d.x * d.y))};
}
struct Grid { const int64_t* argv; dim3 g, b; };
static thread_local const int64_t* tl_argv;
static inline void enter(const Grid& G) { tl_argv = G.argv; gridDim = G.g; blockDim = G.b; }  // every host thread of a launch
static void run_kernel() { call(KILN_EMU_KERNEL, tl_argv); }

#ifdef KILN_EMU_OS_THREADS
void sync() { tl_bar->wait(); }

struct Launch {
  Grid G;
  long long nblocks;
  int nthreads;
  Barrier bars[2], end;
  std::atomic<int> go{0};  // 0: wait until every thread exists, 1: run, -1: thread creation failed, exit
};

// thread t of the block plays threadIdx t for every block, blocks in order
static void block_thread(Launch* L, int t) {
  while (L->go.load(std::memory_order_acquire) == 0) L->go.wait(0, std::memory_order_acquire);
  if (L->go.load() < 0) return;
  enter(L->G);
  threadIdx = unflatten(t, blockDim);
  for (long long b = 0; b < L->nblocks; b++) {
    if (t == 0) L->bars[(b + 1) & 1].reset(L->nthreads);  // nobody uses it until after the end barrier below
    blockIdx = unflatten(b, gridDim);
    tl_bar = &L->bars[b & 1];
    run_kernel();
    tl_bar->leave();
    L->end.wait();
  }
}

static int launch(const Grid& G, long long nblocks, int nthreads, int) {
  Launch L{G, nblocks, nthreads, {}, {}, {0}};
  L.bars[0].reset(nthreads); L.bars[1].reset(nthreads); L.end.reset(nthreads);
  struct Arg { Launch* L; int t; };
  std::vector<pthread_t> ts(nthreads);
  std::vector<Arg> args(nthreads);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 1 << 18);  // 1024 threads: keep stacks small
  int started = 0, rc = 0;
  for (int t = 0; t < nthreads; t++) {
    args[t] = Arg{&L, t};
    if (pthread_create(&ts[t], &attr, [](void* p) -> void* { Arg* a = (Arg*)p; block_thread(a->L, a->t); return nullptr; }, &args[t]) != 0) { rc = -1; break; }
    started++;
  }
  pthread_attr_destroy(&attr);
  L.go.store(rc == 0 ? 1 : -1, std::memory_order_release);  // start only when all exist: a partial block would deadlock
  L.go.notify_all();
  for (int t = 0; t < started; t++) pthread_join(ts[t], nullptr);
  return rc;
}

#else  // fibers
#if !defined(__x86_64__)
#error "kiln CUDA emulation fibers need x86-64; build with -DKILN_EMU_OS_THREADS (mode='threads')"
#endif
// switch stacks: save callee-saved registers on the current stack and its sp in *save, resume the stack at `to`
extern "C" void kiln_emu_switch(void** save, void* to);
asm(R"(
.text
.p2align 4
.globl kiln_emu_switch
.hidden kiln_emu_switch
.type kiln_emu_switch,@function
kiln_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size kiln_emu_switch, .-kiln_emu_switch
)");

struct Fibers {  // one block's threads on one host thread
  int n = 0, cur = 0;
  size_t stack = 0;
  char* mem = nullptr;
  std::vector<void*> sp;
  std::vector<uint3> idx;
  std::vector<char> done;
  void* sched = nullptr;
};
static thread_local Fibers* tl_fibers;

void sync() { Fibers* F = tl_fibers; kiln_emu_switch(&F->sp[F->cur], F->sched); }

static void fiber_entry() {
  run_kernel();
  Fibers* F = tl_fibers;
  F->done[F->cur] = 1;
  kiln_emu_switch(&F->sp[F->cur], F->sched);
  std::abort();  // a finished fiber is never resumed
}

static void run_block(Fibers& F) {
  for (int t = 0; t < F.n; t++) {  // fresh stack: resuming it "returns" into fiber_entry with an ABI-aligned sp
    // stagger the tops (stacks are a power of two apart) so hot stack lines do not all map to the same cache sets
    uintptr_t top = ((uintptr_t)(F.mem + (size_t)(t + 1) * F.stack - (size_t)(t % 64) * 64)) & ~(uintptr_t)15;
    void** s = (void**)(top - 16);
    s[1] = nullptr;
    s[0] = (void*)&fiber_entry;
    F.sp[t] = (void*)(top - 64);  // six zeroed callee-saved registers below the return address
    std::memset(F.sp[t], 0, 48);
    F.done[t] = 0;
  }
  for (int live = F.n; live > 0;) {  // each pass runs every live thread up to its next __syncthreads (or its end)
    for (int t = 0; t < F.n; t++) {
      if (F.done[t]) continue;
      F.cur = t;
      threadIdx = F.idx[t];
      kiln_emu_switch(&F.sched, F.sp[t]);
      if (F.done[t]) live--;
    }
  }
}

static int launch(const Grid& G, long long nblocks, int nthreads, int workers) {
  std::atomic<long long> next{0};
  std::atomic<int> failed{0};
  size_t stack = 64 * 1024;
  if (const char* e = std::getenv("KILN_EMU_STACK_KB")) stack = (size_t)std::atoll(e) * 1024;
  auto work = [&]() {
    enter(G);
    Fibers F;
    F.n = nthreads; F.stack = stack;
    F.mem = (char*)std::malloc(stack * nthreads);
    if (!F.mem) { failed = 1; return; }
    F.sp.resize(nthreads); F.done.resize(nthreads); F.idx.resize(nthreads);
    for (int t = 0; t < nthreads; t++) F.idx[t] = unflatten(t, blockDim);
    tl_fibers = &F;
    for (long long b; (b = next.fetch_add(1)) < nblocks;) { blockIdx = unflatten(b, gridDim); run_block(F); }
    std::free(F.mem);
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < workers && w < nblocks; w++) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  return failed ? -3 : 0;
}
#endif

// kernels without __syncthreads: each host worker runs whole blocks, their threads one after another
static int launch_serial(const Grid& G, long long nblocks, int nthreads, int workers) {
  std::atomic<long long> next{0};
  auto work = [&]() {
    enter(G);
    for (long long b; (b = next.fetch_add(1)) < nblocks;) {
      blockIdx = unflatten(b, gridDim);
      for (int t = 0; t < nthreads; t++) { threadIdx = unflatten(t, blockDim); run_kernel(); }
    }
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < workers && w < nblocks; w++) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  return 0;
}
}  // namespace kiln_emu

// grid g*, block b*. concurrent: the kernel uses __syncthreads (fibers or OS threads, as built), else serial threads per block.
// Returns 0; -1 host threads could not be started; -2 wrong argument count; -3 out of memory for fiber stacks.
extern "C" int kiln_emu_launch(const int64_t* argv, int nargv, int gx, int gy, int gz, int bx, int by, int bz, int concurrent, int workers) {
  using namespace kiln_emu;
  if (nargv != nargs(KILN_EMU_KERNEL)) return -2;
  Grid G{argv, dim3{(unsigned)gx, (unsigned)gy, (unsigned)gz}, dim3{(unsigned)bx, (unsigned)by, (unsigned)bz}};
  long long nblocks = (long long)gx * gy * gz;
  int nthreads = bx * by * bz;
  return concurrent ? launch(G, nblocks, nthreads, workers) : launch_serial(G, nblocks, nthreads, workers);
}
