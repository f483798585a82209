// The allocator PyTorch's C++ code sees under install(extension=True). It is PyTorch's own
// pluggable allocator (the library's malloc and free behind its hooks) with the entry points
// that C++ calls on the current allocator directly, which the pluggable one refuses and which
// no Python patch can reach:
//
// - recordHistory (torch::cuda::_record_memory_history): the library's history is started and
//   stopped by the package's Python (`_torch_stats.py`, as its own entry points do); the stacks
//   are gathered here with the recorder C++ passed in, so they are PyTorch's CapturedTraceback
//   objects and PyTorch's C++ snapshot can symbolize them.
// - snapshot (torch::cuda::_memory_snapshot_pickled): the library's segments and history, as
//   the package reads them, turned into PyTorch's SnapshotInfo.
// - pushCompileContext / popCompileContext: the "Torch-Compiled Region" that torch.compile's
//   code is running in, recorded on allocation entries (and frees with context "all") as
//   PyTorch's allocator records it.
// - enable / isEnabled (torch.cuda.caching_allocator_enable): with caching off, allocations
//   bypass the library as they bypass PyTorch's allocator.
// - getCheckpointState / setCheckpointPoolState / checkPoolLiveAllocations: a graph pool's
//   checkpoint and its restore (inductor's CUDA-graph trees), done by the library
//   (`vram_ledger_pool_checkpoint`, `vram_ledger_pool_restore`) through the package's Python.
//
// Invariants:
// - A context id handed to the library has bit 62 set (the Python recorder's never do, so
//   `resolve` can tell them apart), and names an entry of `contexts` until the history ends or
//   is cleared, a snapshot of every recording device no longer names it (`keep`), or it is the
//   oldest past kKept.
// - Nothing here holds `mu` while it waits for the GIL or runs a recorder: the recorder takes
//   the GIL itself, and the snapshot takes the GIL before `mu`.
// - Nothing thrown here crosses into the library: the context source catches everything.
// - A pointer is in `uncached_` exactly while it is live and came from cudaMalloc here, and
//   `uncached_count_` is its size.
// - Every live block the library handed out through this allocator has an entry in the base
//   class's `allocation_metadata_` (its free needs it): a restore drops the entries of the
//   blocks it freed and adds those of the blocks it made, from the checkpoint's copies. The
//   entries are only ever copied here, never constructed (their constructors are not exported).
#include <torch/extension.h>

#include <ATen/record_function.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

// torch/csrc/profiler/python/combined_traceback.h declares it, but that header needs
// nlohmann/json, which PyTorch's wheels do not ship.
namespace torch {
TORCH_API std::vector<pybind11::object> py_symbolize(std::vector<CapturedTraceback*>& to_symbolize);
}  // namespace torch

namespace {

namespace CCA = c10::cuda::CUDACachingAllocator;
namespace CDA = c10::CachingDeviceAllocator;
namespace py = pybind11;

using MallocFn = void* (*)(ssize_t, int, cudaStream_t);
using FreeFn = void (*)(void*, ssize_t, int, cudaStream_t);
using InitFn = void (*)(int);
using ResetFn = void (*)();
using FractionFn = void (*)(double, int);
using RecordStreamFn = void (*)(void*, cudaStream_t);

// The package's history keeps as many of its own stacks between snapshots (`_frames._KEPT`).
constexpr size_t kKept = 1000000;
constexpr uint64_t kCppId = uint64_t{1} << 62;
// The library's kinds: allocations (0) and frees (1).
constexpr int kFree = 1;

struct Context {
    std::shared_ptr<c10::GatheredContext> stack;
    bool in_history;  // the history's entry shows it (a block's always does)
    std::string compile;
};

struct State {
    std::mutex mu;
    CCA::CreateContextFn recorder;
    CCA::RecordContext when = CCA::RecordContext::NEVER;
    // A history started from C++ (this file's source names its entries).
    bool recording = false;
    // Any history, however it was started (isHistoryEnabled), as the package keeps it.
    bool history_enabled = false;
    at::CallbackHandle compile_handle = 0;
    std::unordered_map<uint64_t, Context> contexts;
    std::deque<uint64_t> order;
    uint64_t next = 1;
    // The package's functions: record(enabled, max_entries, context, clear, skip_actions,
    // source), raw_snapshot(device, pool, include_traces), checkpoint(device, pool) -> (text,
    // live addresses) and restore(device, pool, text) -> (freed, made addresses).
    py::object record;
    py::object raw_snapshot;
    py::object checkpoint;
    py::object restore;
};

using Metadata = torch::cuda::CUDAPluggableAllocator::_AllocationMetadata;

// A pool's checkpoint: the library's record of its allocated blocks, and PyTorch's metadata of
// each (its size and stream, which its free passes back).
struct PoolState : CCA::AllocatorState {
    c10::DeviceIndex device = 0;
    c10::cuda::MempoolId_t pool{0, 0};
    std::string text;
    std::unordered_map<void*, Metadata> metadata;
};

// Never destroyed: the allocator outlives Python's objects at exit, and a py::object dropped
// after the interpreter is gone would crash.
State& state() {
    static State* s = new State();
    return *s;
}

// Per thread, as torch.compile's regions nest on the thread that runs them. A pointer, never
// freed, because a free during a thread's exit (after its thread-locals are destroyed) may
// still ask for the top.
thread_local std::vector<std::string>* compile_stack_ = nullptr;

std::vector<std::string>& compile_stack() {
    if (compile_stack_ == nullptr) {
        compile_stack_ = new std::vector<std::string>();
    }
    return *compile_stack_;
}

std::string compile_top() {
    return compile_stack_ == nullptr || compile_stack_->empty() ? std::string() : compile_stack_->back();
}

// The library's context source (see vram_ledger_set_context_source): runs on the allocating
// or freeing thread before the library takes any lock.
uint64_t source(int kind) noexcept {
    try {
        State& s = state();
        CCA::CreateContextFn recorder;
        bool in_history = false;
        {
            std::lock_guard<std::mutex> g(s.mu);
            // Frees only with "all": otherwise the library gives a free's entry its
            // allocation's id, whose stack PyTorch shows there too (and whose compile context,
            // where PyTorch would name the one the free ran in).
            if (!s.recording || (kind == kFree && s.when != CCA::RecordContext::ALL)) {
                return 0;
            }
            if (s.when != CCA::RecordContext::NEVER) {
                recorder = s.recorder;
            }
            in_history = kind == kFree || s.when == CCA::RecordContext::ALL || s.when == CCA::RecordContext::ALLOC;
        }
        std::string region = compile_top();
        if (!recorder && region.empty()) {
            return 0;
        }
        std::shared_ptr<c10::GatheredContext> stack;
        if (recorder) {
            stack = recorder();
        }
        in_history = in_history && stack != nullptr;
        std::lock_guard<std::mutex> g(s.mu);
        uint64_t id = s.next++ | kCppId;
        s.contexts.emplace(id, Context{std::move(stack), in_history, std::move(region)});
        s.order.push_back(id);
        while (s.order.size() > kKept) {
            s.contexts.erase(s.order.front());
            s.order.pop_front();
        }
        return id;
    } catch (...) {
        return 0;
    }
}

void forget_contexts(State& s) {
    std::lock_guard<std::mutex> g(s.mu);
    s.contexts.clear();
    s.order.clear();
}

const char* context_name(CCA::RecordContext when) {
    switch (when) {
        case CCA::RecordContext::STATE:
            return "state";
        case CCA::RecordContext::ALLOC:
            return "alloc";
        case CCA::RecordContext::ALL:
            return "all";
        default:
            return nullptr;
    }
}

// The compile contexts of torch.compile's regions, as PyTorch registers them for its own
// allocator (a global RecordFunction callback on "Torch-Compiled Region: ..." functions).
bool is_compiled_region(const at::RecordFunction& fn) {
    // Called for every operator while the callback is registered: no allocation.
    static constexpr char kPrefix[] = "Torch-Compiled Region";
    const char* name = fn.name();
    return name != nullptr && std::strncmp(name, kPrefix, sizeof(kPrefix) - 1) == 0;
}

void set_compile_contexts(bool on) {
    State& s = state();
    std::lock_guard<std::mutex> g(s.mu);
    if (on && s.compile_handle == 0) {
        s.compile_handle = at::addGlobalCallback(
            at::RecordFunctionCallback(
                [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
                    if (is_compiled_region(fn)) {
                        compile_stack().emplace_back(fn.name());
                    }
                    return nullptr;
                },
                [](const at::RecordFunction& fn, at::ObserverContext*) {
                    if (is_compiled_region(fn) && !compile_stack().empty()) {
                        compile_stack().pop_back();
                    }
                })
                .scopes({at::RecordScope::FUNCTION}));
    } else if (!on && s.compile_handle != 0) {
        at::removeCallback(s.compile_handle);
        s.compile_handle = 0;
    }
}

template <typename T>
T item(const py::dict& d, const char* key, T otherwise) {
    return d.contains(key) ? d[key].cast<T>() : otherwise;
}

std::shared_ptr<c10::GatheredContext> stack_of(State& s, uint64_t id, std::string* compile = nullptr, bool block = true) {
    if ((id & kCppId) == 0) {
        return nullptr;
    }
    std::lock_guard<std::mutex> g(s.mu);
    auto it = s.contexts.find(id);
    if (it == s.contexts.end()) {
        return nullptr;
    }
    if (compile != nullptr) {
        *compile = it->second.compile;
    }
    return block || it->second.in_history ? it->second.stack : nullptr;
}

CDA::SegmentInfo segment_of(State& s, const py::dict& seg, const char* key) {
    CDA::SegmentInfo out;
    out.device = static_cast<c10::DeviceIndex>(item<int>(seg, "device", 0));
    out.address = item<size_t>(seg, "address", 0);
    out.total_size = item<size_t>(seg, "total_size", 0);
    out.requested_size = item<size_t>(seg, "requested_size", 0);
    out.allocated_size = item<size_t>(seg, "allocated_size", 0);
    out.active_size = item<size_t>(seg, "active_size", 0);
    out.stream = reinterpret_cast<void*>(item<uintptr_t>(seg, "stream", 0));
    out.is_large = item<std::string>(seg, "segment_type", "large") == "large";
    out.is_expandable = item<bool>(seg, "is_expandable", false);
    if (seg.contains("segment_pool_id")) {
        auto pool = seg["segment_pool_id"].cast<py::tuple>();
        out.owner_private_pool_id = {pool[0].cast<c10::CaptureId_t>(), pool[1].cast<c10::CaptureId_t>()};
    }
    for (auto handle : seg["blocks"].cast<py::list>()) {
        auto block = handle.cast<py::dict>();
        CDA::BlockInfo b;
        b.size = item<size_t>(block, "size", 0);
        b.requested_size = item<size_t>(block, "requested_size", 0);
        auto state_name = item<std::string>(block, "state", "inactive");
        b.allocated = state_name == "active_allocated";
        b.active = b.allocated || state_name == "active_pending_free";
        b.context_when_allocated = stack_of(s, item<uint64_t>(block, key, 0));
        out.blocks.push_back(std::move(b));
    }
    return out;
}

CDA::TraceEntry entry_of(State& s, const py::dict& e, c10::DeviceIndex device, const char* key) {
    std::string compile = "N/A";
    auto stack = stack_of(s, item<uint64_t>(e, key, 0), &compile, false);
    if (compile.empty()) {
        compile = "N/A";
    }
    CDA::TraceEntry out(
        CDA::parseTraceEntryAction(item<std::string>(e, "action", "")),
        device,
        item<size_t>(e, "addr", 0),
        item<size_t>(e, "size", 0),
        reinterpret_cast<void*>(item<uintptr_t>(e, "stream", 0)),
        {0, 0},
        0,
        std::move(stack),
        std::move(compile),
        item<std::string>(e, "user_metadata", ""));
    // The library's clock: microseconds since its history started (PyTorch converts its own
    // approximate clock to wall time here; the viewers only compare entries' times).
    out.time_.t_ = item<time_t>(e, "time_us", 0);
    return out;
}

class LedgerAllocator : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
    using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

  public:
    using CUDAPluggableAllocator::CUDAPluggableAllocator;

    // torch.cuda.caching_allocator_enable(False): as with PyTorch's allocator, what is
    // allocated meanwhile comes from cudaMalloc and goes back to cudaFree, so the library
    // never sees it (its figures count it as memory outside the allocator).
    void enable(bool value) override {
        caching_.store(value);
    }

    bool isEnabled() const override {
        return caching_.load();
    }

    c10::DataPtr allocate(size_t size) override {
        if (size == 0 || caching_.load(std::memory_order_relaxed)) {
            return Base::allocate(size);
        }
        c10::DeviceIndex device = c10::cuda::current_device();
        void* p = uncached_alloc(size);
        return {p, p, raw_deleter(), c10::Device(c10::DeviceType::CUDA, device)};
    }

    void* raw_alloc(size_t nbytes) override {
        if (nbytes == 0 || caching_.load(std::memory_order_relaxed)) {
            return Base::raw_alloc(nbytes);
        }
        return uncached_alloc(nbytes);
    }

    void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
        if (nbytes == 0 || caching_.load(std::memory_order_relaxed)) {
            return Base::raw_alloc_with_stream(nbytes, stream);
        }
        return uncached_alloc(nbytes);
    }

    // Every free passes here (the tensors' deleter calls it too); a pointer from cudaMalloc
    // goes back to cudaFree whether or not caching is on again by then.
    void raw_delete(void* ptr) override {
        if (uncached_count_.load(std::memory_order_relaxed) != 0) {
            std::unique_lock<std::mutex> g(uncached_mu_);
            if (uncached_.erase(ptr) != 0) {
                uncached_count_.fetch_sub(1, std::memory_order_relaxed);
                g.unlock();
                C10_CUDA_CHECK(cudaFree(ptr));
                return;
            }
        }
        Base::raw_delete(ptr);
    }

    bool isHistoryEnabled() override {
        State& s = state();
        std::lock_guard<std::mutex> g(s.mu);
        return s.history_enabled;
    }

    void recordHistory(
        bool enabled,
        CCA::CreateContextFn recorder,
        size_t max_entries,
        CCA::RecordContext when,
        bool clear,
        const std::vector<std::string>& skip_actions) override {
        State& s = state();
        {
            // The package first: if it refuses, nothing here has changed.
            py::gil_scoped_acquire gil;
            const char* context = context_name(when);
            s.record(
                enabled,
                max_entries,
                context == nullptr ? py::object(py::none()) : py::object(py::str(context)),
                clear,
                skip_actions,
                reinterpret_cast<uintptr_t>(&source));
        }
        {
            std::lock_guard<std::mutex> g(s.mu);
            s.recording = enabled;
            s.recorder = enabled ? std::move(recorder) : nullptr;
            s.when = enabled ? when : CCA::RecordContext::NEVER;
        }
        if (!enabled || clear) {
            forget_contexts(s);
        }
    }

    void pushCompileContext(std::string& md) override {
        compile_stack().push_back(md);
    }

    void popCompileContext() override {
        if (!compile_stack().empty()) {
            compile_stack().pop_back();
        }
    }

    CCA::SnapshotInfo snapshot(c10::cuda::MempoolId_t pool, bool include_traces) override {
        State& s = state();
        CCA::SnapshotInfo info;
        py::gil_scoped_acquire gil;
        c10::DeviceIndex device = c10::cuda::current_device();
        py::dict snap = s.raw_snapshot(device, py::make_tuple(pool.first, pool.second), include_traces);
        std::string key = snap.contains("context_key") ? snap["context_key"].cast<std::string>() : "";
        for (auto seg : snap["segments"].cast<py::list>()) {
            info.segments.push_back(segment_of(s, seg.cast<py::dict>(), key.c_str()));
        }
        for (auto trace : snap["device_traces"].cast<py::list>()) {
            std::vector<CDA::TraceEntry> entries;
            for (auto e : trace.cast<py::list>()) {
                entries.push_back(entry_of(s, e.cast<py::dict>(), device, key.c_str()));
            }
            info.device_traces.push_back(std::move(entries));
        }
        info.config_metadata.garbage_collection_threshold = 0;
        info.config_metadata.max_split_size = SIZE_MAX;
        info.config_metadata.pinned_num_register_threads = 0;
        info.config_metadata.expandable_segments = item<bool>(snap, "expandable_segments", false);
        info.config_metadata.release_lock_on_malloc = false;
        info.config_metadata.pinned_use_host_register = false;
        info.config_metadata.graph_capture_record_stream_reuse = false;
        info.config_metadata.last_allocator_settings = "";
        return info;
    }

    std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override {
        auto out = std::make_shared<PoolState>();
        out->device = device;
        out->pool = id;
        std::vector<uintptr_t> live;
        {
            py::gil_scoped_acquire gil;
            py::tuple r = state().checkpoint(device, py::make_tuple(id.first, id.second));
            out->text = r[0].cast<std::string>();
            live = r[1].cast<std::vector<uintptr_t>>();
        }
        std::lock_guard<std::mutex> g(allocator_mutex_);
        for (uintptr_t p : live) {
            void* ptr = reinterpret_cast<void*>(p);
            auto it = allocation_metadata_.find(ptr);
            TORCH_CHECK(it != allocation_metadata_.end(), "vram-ledger: the pool's block at ", ptr, " was not allocated through PyTorch");
            out->metadata.emplace(ptr, it->second);
        }
        return out;
    }

    CCA::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device, std::shared_ptr<CCA::AllocatorState> as) override {
        auto pps = std::dynamic_pointer_cast<PoolState>(as);
        TORCH_CHECK(pps != nullptr, "vram-ledger: this checkpoint was not taken by vram-ledger's allocator");
        TORCH_CHECK(pps->device == device, "vram-ledger: this checkpoint is of device ", int(pps->device), ", not ", int(device));
        std::vector<uintptr_t> freed;
        std::vector<uintptr_t> made;
        {
            py::gil_scoped_acquire gil;
            py::tuple r = state().restore(device, py::make_tuple(pps->pool.first, pps->pool.second), pps->text);
            freed = r[0].cast<std::vector<uintptr_t>>();
            made = r[1].cast<std::vector<uintptr_t>>();
        }
        CCA::CheckpointDelta delta;
        std::lock_guard<std::mutex> g(allocator_mutex_);
        for (uintptr_t p : freed) {
            void* ptr = reinterpret_cast<void*>(p);
            allocation_metadata_.erase(ptr);
            delta.ptrs_freed.push_back(ptr);
        }
        for (uintptr_t p : made) {
            void* ptr = reinterpret_cast<void*>(p);
            // The library made exactly the checkpoint's blocks, whose metadata it copied.
            allocation_metadata_.insert_or_assign(ptr, pps->metadata.at(ptr));
            delta.dataptrs_allocd.emplace_back(ptr, ptr, raw_deleter(), c10::Device(c10::DeviceType::CUDA, device));
        }
        return delta;
    }

    bool checkPoolLiveAllocations(
        c10::DeviceIndex device,
        c10::cuda::MempoolId_t id,
        const std::unordered_set<void*>& expected) override {
        std::vector<uintptr_t> live;
        {
            py::gil_scoped_acquire gil;
            py::tuple r = state().checkpoint(device, py::make_tuple(id.first, id.second));
            live = r[1].cast<std::vector<uintptr_t>>();
        }
        if (live.size() != expected.size()) {
            return false;
        }
        for (uintptr_t p : live) {
            if (expected.count(reinterpret_cast<void*>(p)) == 0) {
                return false;
            }
        }
        return true;
    }

  private:
    void* uncached_alloc(size_t nbytes) {
        void* p = nullptr;
        C10_CUDA_CHECK(cudaMalloc(&p, nbytes));
        std::lock_guard<std::mutex> g(uncached_mu_);
        uncached_.insert(p);
        uncached_count_.fetch_add(1, std::memory_order_relaxed);
        return p;
    }

    std::atomic<bool> caching_{true};
    // Written only while caching is off or such pointers are live; read on every free.
    std::atomic<size_t> uncached_count_{0};
    std::mutex uncached_mu_;
    std::unordered_set<void*> uncached_;
};

template <typename F>
F as_fn(uintptr_t address) {
    return reinterpret_cast<F>(address);
}

void install(
    uintptr_t malloc_fn,
    uintptr_t free_fn,
    uintptr_t init_fn,
    uintptr_t reset_fn,
    uintptr_t fraction_fn,
    uintptr_t record_stream_fn,
    py::object record,
    py::object raw_snapshot,
    py::object checkpoint,
    py::object restore) {
    TORCH_CHECK(malloc_fn != 0 && free_fn != 0, "vram-ledger: the allocator needs its malloc and free");
    auto m = as_fn<MallocFn>(malloc_fn);
    auto f = as_fn<FreeFn>(free_fn);
    auto allocator = std::make_shared<LedgerAllocator>(
        [m](size_t size, int device, cudaStream_t stream) { return m(static_cast<ssize_t>(size), device, stream); },
        [f](void* ptr, size_t size, int device, cudaStream_t stream) { f(ptr, static_cast<ssize_t>(size), device, stream); });
    if (init_fn != 0) {
        auto i = as_fn<InitFn>(init_fn);
        allocator->set_init_fn([i](int devices) { i(devices); });
    }
    if (reset_fn != 0) {
        auto r = as_fn<ResetFn>(reset_fn);
        allocator->set_reset_fn([r]() { r(); });
    }
    if (fraction_fn != 0) {
        auto fr = as_fn<FractionFn>(fraction_fn);
        allocator->set_memory_fraction_fn([fr](double fraction, int device) { fr(fraction, device); });
    }
    if (record_stream_fn != 0) {
        auto rs = as_fn<RecordStreamFn>(record_stream_fn);
        allocator->set_record_stream_fn([rs](void* ptr, cudaStream_t stream) { rs(ptr, stream); });
    }
    State& s = state();
    s.record = std::move(record);
    s.raw_snapshot = std::move(raw_snapshot);
    s.checkpoint = std::move(checkpoint);
    s.restore = std::move(restore);
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
}

// For the package's own snapshot (torch.cuda.memory._snapshot) of a history recorded from
// C++: each id's frames (PyTorch's symbolized list, [] without a stack), whether the history's
// entry shows them, and its compile context ("" none); None for an id that names nothing.
py::list resolve(const std::vector<uint64_t>& ids) {
    State& s = state();
    std::vector<Context> found;
    std::vector<bool> known;
    {
        std::lock_guard<std::mutex> g(s.mu);
        for (uint64_t id : ids) {
            auto it = s.contexts.find(id);
            known.push_back(it != s.contexts.end());
            found.push_back(it != s.contexts.end() ? it->second : Context{});
        }
    }
    std::vector<torch::CapturedTraceback*> stacks;
    for (const auto& c : found) {
        if (c.stack) {
            stacks.push_back(torch::getCapturedTracebackFromContext(c.stack));
        }
    }
    auto frames = torch::py_symbolize(stacks);
    py::list out;
    size_t next = 0;
    for (size_t i = 0; i < found.size(); i++) {
        if (!known[i]) {
            out.append(py::none());
            continue;
        }
        py::object f = found[i].stack ? frames.at(next++) : py::list();
        out.append(py::make_tuple(f, found[i].in_history, found[i].compile));
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "vram-ledger's allocator as PyTorch's C++ sees it (install(extension=True))";
    m.def("install", &install);
    m.def("source_address", []() { return reinterpret_cast<uintptr_t>(&source); });
    m.def("set_compile_contexts", &set_compile_contexts);
    m.def("compile_context", &compile_top);
    m.def("resolve", &resolve);
    // The package went on with, restarted or stopped the history itself: the recorder C++
    // passed is done with; what it gathered is kept unless `forget` (the history ended or was
    // cleared).
    m.def("stopped", [](bool forget) {
        State& s = state();
        {
            std::lock_guard<std::mutex> g(s.mu);
            s.recording = false;
            s.recorder = nullptr;
            s.when = CCA::RecordContext::NEVER;
        }
        if (forget) {
            forget_contexts(s);
        }
    });
    m.def("set_history_enabled", [](bool on) {
        State& s = state();
        std::lock_guard<std::mutex> g(s.mu);
        s.history_enabled = on;
    });
    // Forget every context but these (those a snapshot of every recording device still names).
    m.def("keep", [](const std::vector<uint64_t>& ids) {
        State& s = state();
        std::unordered_set<uint64_t> wanted(ids.begin(), ids.end());
        std::lock_guard<std::mutex> g(s.mu);
        std::deque<uint64_t> order;
        for (uint64_t id : s.order) {
            if (wanted.count(id) != 0) {
                order.push_back(id);
            } else {
                s.contexts.erase(id);
            }
        }
        s.order.swap(order);
    });
}
