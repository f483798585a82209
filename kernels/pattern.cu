// Fill a buffer with a pattern derived from each word's address and the buffer's seed, and
// verify it. Two live buffers that overlap overwrite each other's words with values of another
// seed; memory that is not mapped faults. Either way the verify count is not zero.

__device__ __forceinline__ unsigned long long pattern(unsigned long long addr, unsigned long long seed) {
    unsigned long long x = addr ^ (seed * 0x9E3779B97F4A7C15ull);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

extern "C" __global__ void fill_pattern(unsigned long long* p, unsigned long long words, unsigned long long seed) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < words;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        p[i] = pattern((unsigned long long)(p + i), seed);
    }
}

extern "C" __global__ void verify_pattern(const unsigned long long* p, unsigned long long words, unsigned long long seed,
                                          unsigned long long* mismatches) {
    unsigned long long bad = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < words;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        bad += p[i] != pattern((unsigned long long)(p + i), seed);
    }
    if (bad) atomicAdd(mismatches, bad);
}

// Keep a stream busy for about `cycles` clock ticks, reading the buffer at the end: work that
// uses memory long after the host freed it.
extern "C" __global__ void hold(const unsigned long long* p, long long cycles, unsigned long long* sink) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
    if (threadIdx.x == 0 && blockIdx.x == 0) *sink = p[0];
}
