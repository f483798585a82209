// What the host side of a sleep costs on this machine, by route, for N GiB of device memory
// (default 16): the offload that sleep does and the restore that wake does, each timed whole,
// contents checked after the round trip.
//
//   pin      fresh anonymous memory with transparent huge pages, faulted in on T threads,
//            registered (cuMemHostRegister), one copy each way, then unregistered and unmapped
//            (what src/driver/pinned.rs does today)
//   stage    a small pinned ring (T workers x 2 slots of S MiB) and pageable destination
//            memory: each worker copies device -> its slot -> pageable (faulting pages in as it
//            goes); wake runs the reverse, then the pageable memory is unmapped
//   pinpipe  the pin route in chunks of C MiB on W threads, each chunk faulted in, registered
//            and copied on its own while other threads work on theirs; wake copies a chunk
//            back, then unregisters and unmaps it while later chunks still copy
//   file     the ring, each worker writing its chunks into a file of its own and reading them
//            back at wake: memfd (tmpfs, where a page is allocated and written in one pass,
//            with no zero-fill first) or a file in a directory named by FILE_DIR (O_DIRECT:
//            the disk's own speed); the files are truncated and closed at the end of wake
//   uffd     the ring into 4 KiB pages that userfaultfd allocates and fills in one pass
//            (UFFDIO_COPY), with no zero-fill; wake as stage, then the memory freed on T threads
//   vmm      no copies: N GiB of device memory in pieces of S MiB created and mapped, then
//            unmapped and released, on 1 and on T threads (what wake and sleep do beside them)
//   fault    only faulting in N GiB on T threads (the floor of any route that takes fresh host
//            memory)
//   vmmhost  host memory that the driver makes (cuMemCreate at a host location, in chunks of
//            S MiB on T threads, each mapped and copied into as soon as it is made): no
//            registration of user pages and no copy on the CPU; wake copies back, then unmaps and
//            releases the chunks on T threads. VMMHOST_NUMA=1 asks for HOST_NUMA, node id 0
//
// Each route runs ROUNDS times in one process: the first round may pay for host memory that
// the machine has never handed to this process.
//
// Build: nvcc -O2 -std=c++17 -o host_staging_bench scripts/host_staging_bench.cu -lcuda
// Run:   host_staging_bench [GiB] [threads] [slot MiB] [rounds] [pinpipe|file|stage|uffd|fault|vmm|vmmhost]
#include <cuda.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(2);                                                                       \
    }                                                                                \
  } while (0)

static const size_t HUGE = 2ul << 20;
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F>
static void on_threads(int n, F f) {
  std::vector<std::thread> ts;
  for (int k = 0; k < n; k++) ts.emplace_back(f, k);
  for (auto& t : ts) t.join();
}

static char* map_huge(size_t size) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    perror("mmap");
    exit(2);
  }
  madvise(p, size, MADV_HUGEPAGE);
  return (char*)p;
}

static void fault_in(char* p, size_t size, int threads) {
  size_t per = (size / threads + HUGE - 1) / HUGE * HUGE;
  on_threads(threads, [&](int k) {
    size_t lo = k * per, hi = std::min(size, lo + per);
    for (size_t o = lo; o < hi; o += 4096) ((volatile char*)p)[o] = 0;
  });
}

// A device pattern: word i holds i * 2654435761 + salt.
__global__ void fill(uint64_t* d, size_t n, uint64_t salt) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    d[i] = i * 2654435761ull + salt;
}
__global__ void check(const uint64_t* d, size_t n, uint64_t salt, unsigned long long* bad) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    if (d[i] != i * 2654435761ull + salt) atomicAdd(bad, 1ull);
}

struct Dev {
  uint64_t* d;
  size_t bytes;
  unsigned long long* bad;
};

static void prepare(Dev& dv, uint64_t salt) {
  fill<<<1024, 256>>>(dv.d, dv.bytes / 8, salt);
  CK(cudaDeviceSynchronize());
}
static unsigned long long verify(Dev& dv, uint64_t salt) {
  CK(cudaMemset(dv.bad, 0, 8));
  check<<<1024, 256>>>(dv.d, dv.bytes / 8, salt, dv.bad);
  unsigned long long b = 0;
  CK(cudaMemcpy(&b, dv.bad, 8, cudaMemcpyDeviceToHost));
  return b;
}
// What sleep discards or offloads leaves the device: here, scribbled over.
static void scribble(Dev& dv) { CK(cudaMemset(dv.d, 0xab, dv.bytes)); CK(cudaDeviceSynchronize()); }

static void route_pin(Dev& dv, int threads, int round) {
  size_t n = dv.bytes;
  double t0 = now();
  char* h = map_huge(n);
  fault_in(h, n, threads);
  double t1 = now();
  if (cuMemHostRegister(h, n, CU_MEMHOSTREGISTER_PORTABLE) != CUDA_SUCCESS) { fprintf(stderr, "register failed\n"); exit(2); }
  double t2 = now();
  CK(cudaMemcpy(h, dv.d, n, cudaMemcpyDeviceToHost));
  double t3 = now();
  scribble(dv);
  double w0 = now();
  CK(cudaMemcpy(dv.d, h, n, cudaMemcpyHostToDevice));
  double w1 = now();
  cuMemHostUnregister(h);
  double w2 = now();
  munmap(h, n);
  double w3 = now();
  printf("pin   round %d: sleep %.3f s (fault %.3f, register %.3f, copy %.3f) | wake %.3f s (copy %.3f, unregister %.3f, unmap %.3f) | bad %llu\n",
         round, t3 - t0, t1 - t0, t2 - t1, t3 - t2, w3 - w0, w1 - w0, w2 - w1, w3 - w2, verify(dv, 7));
}

struct Ring {
  int workers;
  size_t slot;
  std::vector<char*> slots;  // 2 per worker, pinned
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> events;  // one per slot
};

static Ring make_ring(int workers, size_t slot) {
  Ring r{workers, slot, {}, {}, {}};
  for (int i = 0; i < 2 * workers; i++) {
    char* p;
    CK(cudaHostAlloc((void**)&p, slot, cudaHostAllocPortable));
    r.slots.push_back(p);
    cudaEvent_t e;
    CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    r.events.push_back(e);
  }
  for (int w = 0; w < workers; w++) {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    r.streams.push_back(s);
  }
  return r;
}

// Worker w moves chunks w, w + W, w + 2W, ...; its two slots alternate so that one chunk's DMA
// runs while the other's host copy does (`put`, memcpy unless told).
static void host_memcpy(char* dst, const char* src, size_t len) { memcpy(dst, src, len); }
template <class Put = decltype(host_memcpy)>
static void stage_out(Ring& r, const char* dev, char* host, size_t n, Put put = host_memcpy) {
  size_t chunks = (n + r.slot - 1) / r.slot;
  on_threads(r.workers, [&](int w) {
    std::vector<size_t> mine;
    for (size_t c = w; c < chunks; c += r.workers) mine.push_back(c);
    auto issue = [&](size_t i) {
      size_t c = mine[i], off = c * r.slot, len = std::min(r.slot, n - off);
      int s = 2 * w + (i & 1);
      CK(cudaMemcpyAsync(r.slots[s], dev + off, len, cudaMemcpyDeviceToHost, r.streams[w]));
      CK(cudaEventRecord(r.events[s], r.streams[w]));
    };
    if (!mine.empty()) issue(0);
    for (size_t i = 0; i < mine.size(); i++) {
      if (i + 1 < mine.size()) issue(i + 1);
      int s = 2 * w + (i & 1);
      CK(cudaEventSynchronize(r.events[s]));
      size_t off = mine[i] * r.slot, len = std::min(r.slot, n - off);
      put(host + off, r.slots[s], len);
    }
  });
}

static void stage_in(Ring& r, char* dev, const char* host, size_t n) {
  size_t chunks = (n + r.slot - 1) / r.slot;
  on_threads(r.workers, [&](int w) {
    size_t i = 0;
    for (size_t c = w; c < chunks; c += r.workers, i++) {
      int s = 2 * w + (i & 1);
      if (i >= 2) CK(cudaEventSynchronize(r.events[s]));
      size_t off = c * r.slot, len = std::min(r.slot, n - off);
      memcpy(r.slots[s], host + off, len);
      CK(cudaMemcpyAsync(dev + off, r.slots[s], len, cudaMemcpyHostToDevice, r.streams[w]));
      CK(cudaEventRecord(r.events[s], r.streams[w]));
    }
    CK(cudaStreamSynchronize(r.streams[w]));
  });
}

// Give `n` bytes at `h` back to the host: MADV_DONTNEED on `threads` threads (which frees
// pages under the mapping's read lock, so in parallel), then one munmap of what is left.
static void free_host(char* h, size_t n, int threads) {
  if (threads > 1) {
    size_t per = (n / threads + HUGE - 1) / HUGE * HUGE;
    on_threads(threads, [&](int k) {
      size_t lo = k * per, hi = std::min(n, lo + per);
      if (lo < hi) madvise(h + lo, hi - lo, MADV_DONTNEED);
    });
  }
  munmap(h, n);
}

static void route_stage(Dev& dv, Ring& r, int round, int free_threads = 1) {
  size_t n = dv.bytes;
  double t0 = now();
  char* h = map_huge(n);
  stage_out(r, (const char*)dv.d, h, n);
  double t1 = now();
  scribble(dv);
  double w0 = now();
  stage_in(r, (char*)dv.d, h, n);
  double w1 = now();
  free_host(h, n, free_threads);
  double w2 = now();
  printf("stage round %d (%d workers, %zu MiB slots): sleep %.3f s | wake %.3f s (copy %.3f, unmap %.3f on %d threads) | bad %llu\n",
         round, r.workers, r.slot >> 20, t1 - t0, w2 - w0, w1 - w0, w2 - w1, free_threads, verify(dv, 7));
}

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif

// The ring into 4 KiB pages that userfaultfd fills (UFFDIO_COPY): each page is allocated and
// written in one pass, never zero-filled first, where a fault on fresh memory zero-fills it
// and the copy then writes it again.
static void route_uffd(Dev& dv, Ring& r, int round, int free_threads) {
  size_t n = dv.bytes;
  double t0 = now();
  char* h = (char*)mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (h == (char*)MAP_FAILED) { perror("mmap"); exit(2); }
  madvise(h, n, MADV_NOHUGEPAGE);
  int fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY);
  if (fd < 0) fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC);
  if (fd < 0) { perror("userfaultfd"); exit(2); }
  uffdio_api api{};
  api.api = UFFD_API;
  if (ioctl(fd, UFFDIO_API, &api)) { perror("UFFDIO_API"); exit(2); }
  uffdio_register reg{};
  reg.range.start = (unsigned long)h;
  reg.range.len = n;
  reg.mode = UFFDIO_REGISTER_MODE_MISSING;
  if (ioctl(fd, UFFDIO_REGISTER, &reg)) { perror("UFFDIO_REGISTER"); exit(2); }
  stage_out(r, (const char*)dv.d, h, n, [fd](char* dst, const char* src, size_t len) {
    size_t done = 0;
    while (done < len) {
      uffdio_copy c{};
      c.dst = (unsigned long)(dst + done);
      c.src = (unsigned long)(src + done);
      c.len = len - done;
      c.mode = UFFDIO_COPY_MODE_DONTWAKE;
      int rc = ioctl(fd, UFFDIO_COPY, &c);
      if (c.copy > 0) done += c.copy;
      else if (rc && errno != EAGAIN) { perror("UFFDIO_COPY"); exit(2); }
    }
  });
  uffdio_range all{(unsigned long)h, n};
  if (ioctl(fd, UFFDIO_UNREGISTER, &all)) perror("UFFDIO_UNREGISTER");
  close(fd);
  double t1 = now();
  scribble(dv);
  double w0 = now();
  stage_in(r, (char*)dv.d, h, n);
  double w1 = now();
  free_host(h, n, free_threads);
  double w2 = now();
  printf("uffd  round %d (%d workers, %zu MiB slots): sleep %.3f s | wake %.3f s (copy %.3f, unmap %.3f on %d threads) | bad %llu\n",
         round, r.workers, r.slot >> 20, t1 - t0, w2 - w0, w1 - w0, w2 - w1, free_threads, verify(dv, 7));
}

static char* map_aligned(size_t size) {
  char* raw = (char*)mmap(nullptr, size + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == (char*)MAP_FAILED) { perror("mmap"); exit(2); }
  char* p = (char*)(((uintptr_t)raw + HUGE - 1) / HUGE * HUGE);
  if (p > raw) munmap(raw, p - raw);
  size_t tail = (raw + size + HUGE) - (p + size);
  if (tail) munmap(p + size, tail);
  madvise(p, size, MADV_HUGEPAGE);
  return p;
}

static void route_pinpipe(Dev& dv, int workers, size_t chunk, int round) {
  size_t n = dv.bytes, chunks = (n + chunk - 1) / chunk;
  std::vector<char*> host(chunks);
  std::vector<cudaStream_t> streams(workers);
  for (auto& s : streams) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<double> reg(workers, 0), flt(workers, 0);
  std::atomic<size_t> next{0};
  double t0 = now();
  on_threads(workers, [&](int w) {
    for (size_t c; (c = next.fetch_add(1)) < chunks;) {
      size_t off = c * chunk, len = std::min(chunk, n - off);
      double a = now();
      char* h = map_aligned(len);
      for (size_t o = 0; o < len; o += 4096) ((volatile char*)h)[o] = 0;
      double b = now();
      CK(cudaHostRegister(h, len, cudaHostRegisterPortable));
      double e = now();
      flt[w] += b - a;
      reg[w] += e - b;
      host[c] = h;
      CK(cudaMemcpyAsync(h, (char*)dv.d + off, len, cudaMemcpyDeviceToHost, streams[w]));
    }
    CK(cudaStreamSynchronize(streams[w]));
  });
  double t1 = now();
  scribble(dv);
  std::vector<cudaEvent_t> ev(chunks);
  for (auto& e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  double w0 = now();
  // One thread queues every copy back; the workers free each chunk once its copy is done.
  for (size_t c = 0; c < chunks; c++) {
    size_t off = c * chunk, len = std::min(chunk, n - off);
    CK(cudaMemcpyAsync((char*)dv.d + off, host[c], len, cudaMemcpyHostToDevice, streams[c % workers]));
    CK(cudaEventRecord(ev[c], streams[c % workers]));
  }
  // UNREG_AFTER: every copy waited for first, to see whether unregistering scales with
  // threads when no copy is in flight.
  bool after = getenv("UNREG_AFTER") != nullptr;
  if (after) CK(cudaDeviceSynchronize());
  double w1 = now();
  next = 0;
  on_threads(workers, [&](int) {
    for (size_t c; (c = next.fetch_add(1)) < chunks;) {
      size_t len = std::min(chunk, n - c * chunk);
      CK(cudaEventSynchronize(ev[c]));
      CK(cudaHostUnregister(host[c]));
      munmap(host[c], len);
    }
  });
  double w2 = now();
  double fsum = 0, rsum = 0;
  for (int w = 0; w < workers; w++) fsum += flt[w], rsum += reg[w];
  printf("pinpipe round %d (%d workers, %zu MiB chunks): sleep %.3f s (thread-seconds: fault %.3f, register %.3f) | wake %.3f s (%s %.3f) | bad %llu\n",
         round, workers, chunk >> 20, t1 - t0, fsum, rsum, w2 - w0, after ? "copies" : "queue", w1 - w0, verify(dv, 7));
  for (auto& e : ev) cudaEventDestroy(e);
  for (auto& s : streams) cudaStreamDestroy(s);
}

// dir == nullptr: memfd.
static void route_file(Dev& dv, Ring& r, const char* dir, int round) {
  size_t n = dv.bytes, chunks = (n + r.slot - 1) / r.slot;
  std::vector<int> fds(r.workers);
  for (int w = 0; w < r.workers; w++) {
    if (dir) {
      char path[4096];
      snprintf(path, sizeof path, "%s/hsb-%d-%d", dir, getpid(), w);
      fds[w] = open(path, O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
      unlink(path);
    } else {
      fds[w] = memfd_create("hsb", 0);
    }
    if (fds[w] < 0) { perror("open"); exit(2); }
  }
  auto io = [&](bool write, int fd, char* buf, size_t len, off_t off) {
    for (size_t done = 0; done < len;) {
      ssize_t k = write ? pwrite(fd, buf + done, len - done, off + done) : pread(fd, buf + done, len - done, off + done);
      if (k <= 0) { perror(write ? "pwrite" : "pread"); exit(2); }
      done += k;
    }
  };
  double t0 = now();
  on_threads(r.workers, [&](int w) {
    std::vector<size_t> mine;
    for (size_t c = w; c < chunks; c += r.workers) mine.push_back(c);
    auto issue = [&](size_t i) {
      size_t off = mine[i] * r.slot, len = std::min(r.slot, n - off);
      int s = 2 * w + (i & 1);
      CK(cudaMemcpyAsync(r.slots[s], (char*)dv.d + off, len, cudaMemcpyDeviceToHost, r.streams[w]));
      CK(cudaEventRecord(r.events[s], r.streams[w]));
    };
    if (!mine.empty()) issue(0);
    for (size_t i = 0; i < mine.size(); i++) {
      if (i + 1 < mine.size()) issue(i + 1);
      int s = 2 * w + (i & 1);
      CK(cudaEventSynchronize(r.events[s]));
      size_t len = std::min(r.slot, n - mine[i] * r.slot);
      io(true, fds[w], r.slots[s], len, (off_t)(i * r.slot));
    }
  });
  double t1 = now();
  scribble(dv);
  double w0 = now();
  on_threads(r.workers, [&](int w) {
    size_t i = 0;
    for (size_t c = w; c < chunks; c += r.workers, i++) {
      int s = 2 * w + (i & 1);
      if (i >= 2) CK(cudaEventSynchronize(r.events[s]));
      size_t off = c * r.slot, len = std::min(r.slot, n - off);
      io(false, fds[w], r.slots[s], len, (off_t)(i * r.slot));
      CK(cudaMemcpyAsync((char*)dv.d + off, r.slots[s], len, cudaMemcpyHostToDevice, r.streams[w]));
      CK(cudaEventRecord(r.events[s], r.streams[w]));
    }
    CK(cudaStreamSynchronize(r.streams[w]));
  });
  double w1 = now();
  on_threads(r.workers, [&](int w) {
    if (ftruncate(fds[w], 0)) perror("ftruncate");
    close(fds[w]);
  });
  double w2 = now();
  printf("file  round %d (%s, %d workers, %zu MiB slots): sleep %.3f s | wake %.3f s (copy %.3f, free %.3f) | bad %llu\n",
         round, dir ? dir : "memfd", r.workers, r.slot >> 20, t1 - t0, w2 - w0, w1 - w0, w2 - w1, verify(dv, 7));
}

static void route_fault(size_t n, int threads, int round) {
  double t0 = now();
  char* h = map_huge(n);
  fault_in(h, n, threads);
  double t1 = now();
  munmap(h, n);
  double t2 = now();
  printf("fault round %d (%d threads): fault %.3f s (%.1f GB/s), unmap %.3f s\n", round, threads, t1 - t0,
         n / (t1 - t0) / 1e9, t2 - t1);
}

#define CU(x)                                                                  \
  do {                                                                         \
    CUresult r_ = (x);                                                         \
    if (r_ != CUDA_SUCCESS) {                                                  \
      fprintf(stderr, "%s:%d %s: %d\n", __FILE__, __LINE__, #x, (int)r_);      \
      exit(2);                                                                 \
    }                                                                          \
  } while (0)

// What sleep and wake pay on the device side, beside the copies: N GiB as pieces of P MiB,
// each created, mapped and made accessible (wake), then unmapped and released (sleep), on 1
// or T threads (each thread its own share of the pieces).
static void route_vmm(size_t n, size_t piece, int threads, int round) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t gran = 0;
  CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  piece = (piece + gran - 1) / gran * gran;
  size_t count = n / piece;
  CUdeviceptr va = 0;
  CU(cuMemAddressReserve(&va, count * piece, 0, 0, 0));
  std::vector<CUmemGenericAllocationHandle> h(count);
  CUcontext ctx;
  CU(cuCtxGetCurrent(&ctx));
  auto part = [&](int k, auto f) {
    CU(cuCtxSetCurrent(ctx));
    for (size_t i = k; i < count; i += threads) f(i);
  };
  double t0 = now();
  on_threads(threads, [&](int k) {
    part(k, [&](size_t i) {
      CU(cuMemCreate(&h[i], piece, &prop, 0));
      CU(cuMemMap(va + i * piece, piece, 0, h[i], 0));
      CUmemAccessDesc acc{};
      acc.location = prop.location;
      acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      CU(cuMemSetAccess(va + i * piece, piece, &acc, 1));
    });
  });
  double t1 = now();
  on_threads(threads, [&](int k) {
    part(k, [&](size_t i) {
      CU(cuMemUnmap(va + i * piece, piece));
      CU(cuMemRelease(h[i]));
    });
  });
  double t2 = now();
  CU(cuMemAddressFree(va, count * piece));
  printf("vmm   round %d (%zu pieces of %zu MiB, %d threads): map %.4f s | unmap %.4f s\n", round, count,
         piece >> 20, threads, t1 - t0, t2 - t1);
}

// Host memory made by the driver, chunk by chunk, each copied into as soon as it is mapped.
// Timed: the whole sleep, and the time the busiest thread spent making and mapping chunks.
static void route_vmmhost(Dev& dv, int threads, size_t chunk, int round, bool copies) {
  size_t n = dv.bytes;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  bool numa = getenv("VMMHOST_NUMA") && atoi(getenv("VMMHOST_NUMA"));
  prop.location.type = numa ? CU_MEM_LOCATION_TYPE_HOST_NUMA : CU_MEM_LOCATION_TYPE_HOST;
  prop.location.id = 0;
  size_t gran = 0;
  CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  chunk = (chunk + gran - 1) / gran * gran;
  size_t count = (n + chunk - 1) / chunk;
  CUdeviceptr va = 0;
  CU(cuMemAddressReserve(&va, count * chunk, 0, 0, 0));
  std::vector<CUmemGenericAllocationHandle> h(count);
  std::vector<cudaStream_t> st(threads);
  for (auto& s : st) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUcontext ctx;
  CU(cuCtxGetCurrent(&ctx));
  CUmemAccessDesc acc[2]{};
  acc[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc[0].location.id = 0;
  acc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  acc[1].location.type = numa ? CU_MEM_LOCATION_TYPE_HOST_NUMA : CU_MEM_LOCATION_TYPE_HOST;
  acc[1].location.id = 0;
  acc[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  std::vector<double> making(threads, 0.0);
  std::atomic<bool> device_only{false};
  double t0 = now();
  on_threads(threads, [&](int k) {
    CU(cuCtxSetCurrent(ctx));
    for (size_t i = k; i < count; i += threads) {
      double m0 = now();
      size_t len = std::min(chunk, n - i * chunk);
      CU(cuMemCreate(&h[i], chunk, &prop, 0));
      CU(cuMemMap(va + i * chunk, chunk, 0, h[i], 0));
      // Device and host access; the copies name no direction (cudaMemcpyDefault), so they hold
      // whichever access the driver granted.
      if (cuMemSetAccess(va + i * chunk, chunk, acc, 2) != CUDA_SUCCESS) {
        CU(cuMemSetAccess(va + i * chunk, chunk, acc, 1));
        device_only = true;
      }
      making[k] += now() - m0;
      if (copies) CK(cudaMemcpyAsync((void*)(va + i * chunk), (char*)dv.d + i * chunk, len, cudaMemcpyDefault, st[k]));
    }
    CK(cudaStreamSynchronize(st[k]));
  });
  double t1 = now();
  if (copies) scribble(dv);
  double w0 = now();
  if (copies)
    on_threads(threads, [&](int k) {
      CU(cuCtxSetCurrent(ctx));
      for (size_t i = k; i < count; i += threads) {
        size_t len = std::min(chunk, n - i * chunk);
        CK(cudaMemcpyAsync((char*)dv.d + i * chunk, (void*)(va + i * chunk), len, cudaMemcpyDefault, st[k]));
      }
      CK(cudaStreamSynchronize(st[k]));
    });
  double w1 = now();
  on_threads(threads, [&](int k) {
    CU(cuCtxSetCurrent(ctx));
    for (size_t i = k; i < count; i += threads) {
      CU(cuMemUnmap(va + i * chunk, chunk));
      CU(cuMemRelease(h[i]));
    }
  });
  double w2 = now();
  CU(cuMemAddressFree(va, count * chunk));
  for (auto& s : st) CK(cudaStreamDestroy(s));
  double most = 0;
  for (double m : making) most = std::max(most, m);
  printf("vmmhost round %d (%s%s, %zu chunks of %zu MiB, %d threads, %s): sleep %.3f s (making %.3f on the busiest thread) | wake %.3f s (copy %.3f, release %.3f) | bad %llu\n",
         round, numa ? "host numa 0" : "host", device_only ? ", device access only" : "", count, chunk >> 20, threads, copies ? "copies" : "no copies", t1 - t0, most,
         w2 - w0, w1 - w0, w2 - w1, copies ? verify(dv, 7) : 0ull);
}

int main(int argc, char** argv) {
  size_t gib = argc > 1 ? atol(argv[1]) : 16;
  int threads = argc > 2 ? atoi(argv[2]) : 8;
  size_t slot_mib = argc > 3 ? atol(argv[3]) : 32;
  int rounds = argc > 4 ? atoi(argv[4]) : 3;
  Dev dv{nullptr, gib << 30, nullptr};
  CK(cudaSetDevice(0));
  CK(cudaMalloc(&dv.d, dv.bytes));
  CK(cudaMalloc(&dv.bad, 8));
  cuInit(0);
  printf("%zu GiB, %d threads, %zu MiB slots, %d rounds\n", gib, threads, slot_mib, rounds);
  if (argc > 5 && !strcmp(argv[5], "stage")) {
    Ring r = make_ring(threads, slot_mib << 20);
    for (int i = 0; i < rounds; i++) {
      prepare(dv, 7);
      route_stage(dv, r, i, i % 2 ? threads : 1);
    }
    return 0;
  }
  if (argc > 5 && !strcmp(argv[5], "fault")) {
    // Alone: only faulting in, round after round (a machine's first touch of its memory shows
    // in round 0).
    for (int i = 0; i < rounds; i++) route_fault(dv.bytes, threads, i);
    return 0;
  }
  if (argc > 5 && !strcmp(argv[5], "vmm")) {
    // [slot MiB] as the piece size; 1 thread, then T, then 1 again.
    for (int i = 0; i < rounds; i++)
      for (int t : {1, threads, 1}) route_vmm(dv.bytes, slot_mib << 20, t, i);
    return 0;
  }
  if (argc > 5 && !strcmp(argv[5], "vmmhost")) {
    // Making alone, then with copies, at [slot MiB] chunks on T threads and on 1; then the
    // ring in the same process for comparison.
    route_vmmhost(dv, threads, slot_mib << 20, 0, false);
    route_vmmhost(dv, 1, slot_mib << 20, 0, false);
    for (int i = 0; i < rounds; i++) {
      prepare(dv, 7);
      route_vmmhost(dv, threads, slot_mib << 20, i, true);
    }
    for (size_t c : {64ul, 512ul}) {
      prepare(dv, 7);
      route_vmmhost(dv, threads, c << 20, 0, true);
    }
    Ring r = make_ring(16, 2ul << 20);
    for (int i = 0; i < 2; i++) {
      prepare(dv, 7);
      route_stage(dv, r, i, 16);
    }
    return 0;
  }
  if (argc > 5 && !strcmp(argv[5], "uffd")) {
    // Alone in a fresh process: userfaultfd's copies, then the plain ring for comparison.
    Ring r = make_ring(threads, slot_mib << 20);
    for (int i = 0; i < rounds; i++) {
      prepare(dv, 7);
      route_uffd(dv, r, i, threads);
    }
    for (int i = 0; i < rounds; i++) {
      prepare(dv, 7);
      route_stage(dv, r, i, threads);
    }
    return 0;
  }
  if (argc > 5 && !strcmp(argv[5], "file")) {
    // Alone in a fresh process: memfd, then FILE_DIR when set.
    Ring r = make_ring(threads, slot_mib << 20);
    for (int i = 0; i < rounds; i++) {
      prepare(dv, 7);
      route_file(dv, r, nullptr, i);
    }
    if (const char* dir = getenv("FILE_DIR")) {
      prepare(dv, 7);
      route_file(dv, r, dir, 0);
    }
    return 0;
  }
  if (argc > 5 && !strcmp(argv[5], "pinpipe")) {
    // Alone in a fresh process, with [slot MiB] as the chunk size.
    for (int i = 0; i < rounds; i++) {
      prepare(dv, 7);
      route_pinpipe(dv, threads, slot_mib << 20, i);
    }
    return 0;
  }
  // The order matters for the first round: stage first, as a process that never pinned would.
  Ring r = make_ring(threads, slot_mib << 20);
  for (int i = 0; i < rounds; i++) {
    prepare(dv, 7);
    route_stage(dv, r, i);
  }
  for (int w : {16}) {
    for (size_t c : {64ul, 256ul}) {
      prepare(dv, 7);
      route_pinpipe(dv, w, c << 20, 0);
    }
  }
  for (int w : {8}) {
    prepare(dv, 7);
    route_pinpipe(dv, w, 64ul << 20, 0);
  }
  for (size_t s : {8ul, 16ul}) {
    Ring r4 = make_ring(16, s << 20);
    prepare(dv, 7);
    route_stage(dv, r4, 0);
  }
  for (int w : {12}) {
    if (w == threads) continue;
    Ring r2 = make_ring(w, slot_mib << 20);
    prepare(dv, 7);
    route_stage(dv, r2, 0);
  }
  for (size_t s : {8ul}) {
    Ring r3 = make_ring(threads, s << 20);
    prepare(dv, 7);
    route_stage(dv, r3, 0);
  }
  for (int i = 0; i < rounds; i++) {
    prepare(dv, 7);
    route_pin(dv, threads, i);
  }
  for (int t : {8, 16}) route_fault(dv.bytes, t, 0);
  return 0;
}
