"""PyTorch's own caching allocator, host-side latency per alloc+free pair, measured in C++
(raw_alloc / raw_delete) so that Python's overhead is not counted; plus torch.empty + del
from Python. Prints one JSON object per line."""

import json
import time

import torch
from torch.utils.cpp_extension import load_inline

CPP = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <chrono>
#include <vector>

double pair_ns(int64_t size, int64_t iters) {
    namespace A = c10::cuda::CUDACachingAllocator;
    A::raw_delete(A::raw_alloc(size));
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iters; ++i) {
        void* p = A::raw_alloc(size);
        A::raw_delete(p);
    }
    auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / iters;
}

double mixed_ns(std::vector<int64_t> sizes, int64_t rounds) {
    namespace A = c10::cuda::CUDACachingAllocator;
    std::vector<void*> ptrs(sizes.size());
    auto round = [&]() {
        for (size_t i = 0; i < sizes.size(); ++i) ptrs[i] = A::raw_alloc(sizes[i]);
        for (size_t i = 1; i < sizes.size(); i += 2) A::raw_delete(ptrs[i]);
        for (size_t i = 0; i < sizes.size(); i += 2) A::raw_delete(ptrs[i]);
    };
    round();
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < rounds; ++r) round();
    auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / (rounds * sizes.size());
}
"""


def mixed_sizes():
    state = 0x2545F4914F6CDD1D
    mask = (1 << 64) - 1
    out = []
    for _ in range(64):
        state ^= (state << 13) & mask
        state ^= state >> 7
        state ^= (state << 17) & mask
        exp = 9 + state % 15
        out.append((1 << exp) + (state >> 40) % (1 << exp))
    return out


def main():
    mod = load_inline("torch_alloc_bench", CPP, functions=["pair_ns", "mixed_ns"], with_cuda=True, verbose=False)
    torch.cuda.init()
    for name, n in [("512B", 512), ("1MiB", 1 << 20), ("20MiB", 20 << 20)]:
        print(json.dumps({"what": "PyTorch native raw_alloc+raw_delete", "size": name, "ns_per_pair": round(mod.pair_ns(n, 2_000_000), 1)}))
    print(json.dumps({"what": "PyTorch native mixed 64", "ns_per_pair": round(mod.mixed_ns(mixed_sizes(), 50_000), 1)}))
    n = 1 << 20
    for _ in range(1000):
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        del x
    t = time.perf_counter()
    iters = 200_000
    for _ in range(iters):
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        del x
    print(json.dumps({"what": "PyTorch native torch.empty+del", "ns_per_pair": round((time.perf_counter() - t) / iters * 1e9, 1)}))


if __name__ == "__main__":
    main()
