/* A stand-in libcuda.so.1 for running the REAL pycuda (its C++ context stack, its abort at exit, its out-of-thread rules)
 * over kiln's CUDA runtime on a machine without a GPU. It is not a GPU: memory is host memory, and a launch "runs" only the
 * kernels named below (enough to check that kiln's packed argument buffer reaches the kernel intact).
 *
 * Modelled on the CUDA driver API: a per-thread stack of current contexts (cuCtxPushCurrent/cuCtxPopCurrent), one primary
 * context per device, CUDA_ERROR_INVALID_CONTEXT for work without a current context, a launch of a function from another
 * context's module refused, frees and copies checked against the current context, and a sticky error: a kernel whose name
 * starts with "fault" sets CUDA_ERROR_ILLEGAL_ADDRESS on its context, returned by every later call there.
 * Devices: $FAKE_CUDA_NDEV (default 2), compute capability 9.0. Every other cu* entry point pycuda links is in
 * fake_libcuda_rest.c and returns CUDA_ERROR_NOT_SUPPORTED.
 * cuGetProcAddress_v2 (how NVIDIA's cuda-python finds every entry point) answers from this library's own symbols, newest
 * version suffix first (cuMemAlloc -> cuMemAlloc_v2).
 * Build: see check_real_pycuda.sh beside this file. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <dlfcn.h>

#define MAXDEV 8
#define MAXALLOC 4096
struct CUctx_st { int dev; CUresult sticky; };
struct CUmod_st { struct CUctx_st *ctx; };
struct CUfunc_st { struct CUmod_st *mod; char name[128]; };
struct CUevent_st { int recorded; };

static struct CUctx_st ctxs[MAXDEV];
static struct { char *p; size_t n; struct CUctx_st *ctx; } allocs[MAXALLOC];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static __thread struct CUctx_st *stack[64];
static __thread int depth;
static long n_launch, n_free, n_alloc;

static int ndev(void) { const char *e = getenv("FAKE_CUDA_NDEV"); int n = e ? atoi(e) : 2; return n < 1 ? 1 : n > MAXDEV ? MAXDEV : n; }
static struct CUctx_st *cur(void) { return depth ? stack[depth - 1] : NULL; }
#define NEED_CTX(c) struct CUctx_st *c = cur(); if (!c) return CUDA_ERROR_INVALID_CONTEXT; if (c->sticky) return c->sticky

static int find_alloc(CUdeviceptr p, size_t n) {
  for (int i = 0; i < MAXALLOC; i++)
    if (allocs[i].p && (char *)p >= allocs[i].p && (char *)p + n <= allocs[i].p + allocs[i].n) return i;
  return -1;
}

__attribute__((destructor)) static void report(void) {
  if (getenv("FAKE_CUDA_REPORT")) fprintf(stderr, "fake libcuda: %ld allocs, %ld frees, %ld launches\n", n_alloc, n_free, n_launch);
}

CUresult cuInit(unsigned int flags) { (void)flags; for (int i = 0; i < MAXDEV; i++) ctxs[i].dev = i; return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *n) { *n = ndev(); return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int i) { if (i < 0 || i >= ndev()) return CUDA_ERROR_INVALID_DEVICE; *d = i; return CUDA_SUCCESS; }
CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice d) { (void)d; *major = 9; *minor = 0; return CUDA_SUCCESS; }
CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d) {
  (void)d;
  *v = a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR ? 9 : a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR ? 0 : 0;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice d) { snprintf(name, len, "fake GPU %d", d); return CUDA_SUCCESS; }
CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) { (void)d; *b = (size_t)1 << 34; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
  if (d < 0 || d >= ndev()) return CUDA_ERROR_INVALID_DEVICE;
  *c = &ctxs[d];
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; return CUDA_SUCCESS; }
/* pycuda's context destructor detaches through the base class (cuCtxDetach) even for a primary context: accepted here */
CUresult cuCtxDetach(CUcontext c) { (void)c; return CUDA_SUCCESS; }
CUresult cuCtxPushCurrent_v2(CUcontext c) { if (!c || depth == 64) return CUDA_ERROR_INVALID_VALUE; stack[depth++] = c; return CUDA_SUCCESS; }
CUresult cuCtxPopCurrent_v2(CUcontext *c) {
  if (!depth) return CUDA_ERROR_INVALID_CONTEXT;
  struct CUctx_st *t = stack[--depth];
  if (c) *c = t;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext *c) { *c = cur(); return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *d) { struct CUctx_st *c = cur(); if (!c) return CUDA_ERROR_INVALID_CONTEXT; *d = c->dev; return CUDA_SUCCESS; }
CUresult cuCtxGetApiVersion(CUcontext c, unsigned int *v) { (void)c; *v = 13000; return CUDA_SUCCESS; }
CUresult cuCtxSynchronize(void) { NEED_CTX(c); (void)c; return CUDA_SUCCESS; }

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  NEED_CTX(c);
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXALLOC; i++)
    if (!allocs[i].p) {
      allocs[i].p = calloc(1, n ? n : 1); allocs[i].n = n; allocs[i].ctx = c;
      *p = (CUdeviceptr)allocs[i].p; n_alloc++;
      pthread_mutex_unlock(&mu);
      return CUDA_SUCCESS;
    }
  pthread_mutex_unlock(&mu);
  return CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  struct CUctx_st *c = cur();
  if (!c) return CUDA_ERROR_INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  int i = find_alloc(p, 0);
  if (i < 0 || allocs[i].p != (char *)p || allocs[i].ctx != c) { pthread_mutex_unlock(&mu); return CUDA_ERROR_INVALID_VALUE; }
  free(allocs[i].p); allocs[i].p = NULL; n_free++;
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}
CUresult cuMemGetInfo_v2(size_t *f, size_t *t) { *f = *t = (size_t)1 << 34; return CUDA_SUCCESS; }
static CUresult check_range(struct CUctx_st *c, CUdeviceptr p, size_t n) {
  pthread_mutex_lock(&mu);
  int i = find_alloc(p, n);
  CUresult r = (i < 0 || allocs[i].ctx != c) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
  pthread_mutex_unlock(&mu);
  return r;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) {
  NEED_CTX(c); CUresult r = check_range(c, d, n); if (r) return r;
  memcpy((void *)d, s, n); return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) {
  NEED_CTX(c); CUresult r = check_range(c, s, n); if (r) return r;
  memcpy(d, (void *)s, n); return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) {
  NEED_CTX(c); CUresult r = check_range(c, d, n); if (r) return r; r = check_range(c, s, n); if (r) return r;
  memmove((void *)d, (void *)s, n); return CUDA_SUCCESS;
}

CUresult cuModuleLoadData(CUmodule *m, const void *img) {
  (void)img; NEED_CTX(c);
  struct CUmod_st *x = calloc(1, sizeof *x); x->ctx = c; *m = x; return CUDA_SUCCESS;
}
CUresult cuModuleLoadDataEx(CUmodule *m, const void *img, unsigned int n, CUjit_option *o, void **v) {
  (void)n; (void)o; (void)v; return cuModuleLoadData(m, img);
}
CUresult cuModuleUnload(CUmodule m) { free(m); return CUDA_SUCCESS; }
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
  NEED_CTX(c);
  if (m->ctx != c) return CUDA_ERROR_INVALID_HANDLE;
  struct CUfunc_st *x = calloc(1, sizeof *x); x->mod = m; snprintf(x->name, sizeof x->name, "%s", name); *f = x;
  return CUDA_SUCCESS;
}
CUresult cuFuncSetBlockShape(CUfunction f, int x, int y, int z) { (void)f; (void)x; (void)y; (void)z; return CUDA_SUCCESS; }

/* "scale2"(float *out, const float *in, int n): out[i] = 2 * in[i] for i < n, over the whole grid. */
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                        CUstream s, void **params, void **extra) {
  (void)gy; (void)gz; (void)by; (void)bz; (void)shmem; (void)s; (void)params;
  NEED_CTX(c);
  if (f->mod->ctx != c) return CUDA_ERROR_INVALID_HANDLE;
  char *buf = NULL; size_t len = 0;
  for (int i = 0; extra && extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
    if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) buf = extra[i + 1];
    else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE) len = *(size_t *)extra[i + 1];
  }
  __sync_fetch_and_add(&n_launch, 1);
  if (!strncmp(f->name, "fault", 5)) { c->sticky = CUDA_ERROR_ILLEGAL_ADDRESS; return CUDA_SUCCESS; }  /* reported later */
  if (!strcmp(f->name, "scale2")) {
    if (!buf || len != 20) return CUDA_ERROR_INVALID_VALUE;
    float *out, *in; int n;
    memcpy(&out, buf, 8); memcpy(&in, buf + 8, 8); memcpy(&n, buf + 16, 4);
    if (check_range(c, (CUdeviceptr)out, 4 * (size_t)n) || check_range(c, (CUdeviceptr)in, 4 * (size_t)n)) {
      c->sticky = CUDA_ERROR_ILLEGAL_ADDRESS; return CUDA_SUCCESS;
    }
    for (long i = 0; i < (long)gx * bx && i < n; i++) out[i] = 2.0f * in[i];
  }
  return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent *e, unsigned int flags) { (void)flags; NEED_CTX(c); (void)c; *e = calloc(1, sizeof(struct CUevent_st)); return CUDA_SUCCESS; }
CUresult cuEventRecord(CUevent e, CUstream s) { (void)s; NEED_CTX(c); (void)c; e->recorded = 1; return CUDA_SUCCESS; }
CUresult cuEventSynchronize(CUevent e) { (void)e; NEED_CTX(c); (void)c; return CUDA_SUCCESS; }
CUresult cuEventQuery(CUevent e) { (void)e; return CUDA_SUCCESS; }
CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) { (void)a; (void)b; *ms = 0.25f; return CUDA_SUCCESS; }
CUresult cuEventDestroy_v2(CUevent e) { free(e); return CUDA_SUCCESS; }

CUresult cuGetErrorString(CUresult e, const char **s) {
  switch (e) {
    case CUDA_SUCCESS: *s = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "out of memory"; break;
    case CUDA_ERROR_INVALID_DEVICE: *s = "invalid device ordinal"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *s = "invalid device context"; break;
    case CUDA_ERROR_INVALID_HANDLE: *s = "invalid resource handle"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered"; break;
    case CUDA_ERROR_NO_BINARY_FOR_GPU: *s = "no kernel image is available for execution on the device"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "operation not supported"; break;
    default: *s = "unknown error"; break;
  }
  return CUDA_SUCCESS;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, CUdriverProcAddressQueryResult *status) {
  (void)version; (void)flags;
  static void *self;
  if (!self) self = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  static const char *suffix[] = {"_v4", "_v3", "_v2", ""};
  char name[256];
  *pfn = NULL;
  for (int i = 0; i < 4 && self && !*pfn; i++) { snprintf(name, sizeof name, "%s%s", symbol, suffix[i]); *pfn = dlsym(self, name); }
  if (status) *status = *pfn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
