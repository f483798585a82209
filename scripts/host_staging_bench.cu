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
//   fault    only faulting in N GiB on T threads (the floor of any route that takes fresh host
//            memory)
//
// Each route runs ROUNDS times in one process: the first round may pay for host memory that
// the machine has never handed to this process.
//
// Build: nvcc -O2 -std=c++17 -o host_staging_bench scripts/host_staging_bench.cu -lcuda
// Run:   host_staging_bench [GiB] [threads] [slot MiB] [rounds] [pinpipe|file|stage]
#include <cuda.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
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
// runs while the other's host copy does.
static void stage_out(Ring& r, const char* dev, char* host, size_t n) {
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
      memcpy(host + off, r.slots[s], len);
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

static void route_stage(Dev& dv, Ring& r, int round) {
  size_t n = dv.bytes;
  double t0 = now();
  char* h = map_huge(n);
  stage_out(r, (const char*)dv.d, h, n);
  double t1 = now();
  scribble(dv);
  double w0 = now();
  stage_in(r, (char*)dv.d, h, n);
  double w1 = now();
  munmap(h, n);
  double w2 = now();
  printf("stage round %d (%d workers, %zu MiB slots): sleep %.3f s | wake %.3f s (copy %.3f, unmap %.3f) | bad %llu\n",
         round, r.workers, r.slot >> 20, t1 - t0, w2 - w0, w1 - w0, w2 - w1, verify(dv, 7));
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
      route_stage(dv, r, i);
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
