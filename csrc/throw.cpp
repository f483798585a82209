// Throwing from the allocation hook. PyTorch's pluggable allocator does not check the pointer
// its hook returns: a NULL becomes a tensor at address 0, and the first kernel that touches it
// ends the CUDA context. A C++ exception thrown from the hook instead reaches Python, and the
// process keeps working. Rust cannot throw one, so the Rust hook calls this when it has
// nothing to return.
//
// Out of memory is thrown as PyTorch's own c10::OutOfMemoryError when PyTorch's libraries are
// loaded in the process, so that Python sees torch.OutOfMemoryError (what tools that retry
// with a smaller batch catch) with PyTorch's message. This library does not link PyTorch: it
// finds c10's symbols at run time and builds the exception with c10's own constructor, so the
// object is laid out by the c10 that catches it. When the type or the constructor is missing
// (no PyTorch, or one whose c10::Error has another constructor), a std::runtime_error carries
// the same message.
#include <cxxabi.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <typeinfo>

namespace {

// c10::SourceLocation, as c10/util/Exception.h declares it (passed by value to the
// constructor).
struct SourceLocation {
    const char* function;
    const char* file;
    uint32_t line;
};

// c10::Error::Error(SourceLocation, std::string), called on storage for the object.
using ErrorCtor = void (*)(void* self, SourceLocation where, std::string msg);
using Dtor = void (*)(void*);

// The libraries that may define the symbols, by soname; only ones already loaded are used.
const char* const kLibraries[] = {"libc10.so", "libc10_cuda.so", "libtorch_cuda.so",
                                  "libtorch_python.so", "libtorch.so"};

void* find(const char* symbol) {
    if (void* p = dlsym(RTLD_DEFAULT, symbol)) return p;
    for (const char* name : kLibraries) {
        void* lib = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);
        if (!lib) continue;
        void* p = dlsym(lib, symbol);
        dlclose(lib);  // RTLD_NOLOAD took a reference; the library stays loaded by its owner.
        if (p) return p;
    }
    return nullptr;
}

struct TorchOom {
    std::type_info* type = nullptr;
    ErrorCtor ctor = nullptr;
    Dtor dtor = nullptr;
    void** vtable = nullptr;  // OutOfMemoryError's, or null to keep c10::Error's
    bool inherited = false;   // `ctor` is OutOfMemoryError's own
    bool ready() const { return type && ctor; }
};

const TorchOom& torch_oom() {
    // Looked up on the first out of memory, once: PyTorch is loaded by then if it ever is.
    static const TorchOom found = [] {
        TorchOom t;
        t.type = static_cast<std::type_info*>(find("_ZTIN3c1016OutOfMemoryErrorE"));
        // OutOfMemoryError's inherited constructor where a library emitted it (it sets the
        // vtable itself); else c10::Error's complete-object or base-object constructor (the
        // same code for a class without virtual bases; a library may export either), after
        // which the vtable is set here.
        t.ctor = reinterpret_cast<ErrorCtor>(
            find("_ZN3c1016OutOfMemoryErrorCI1NS_5ErrorEENS_14SourceLocationENSt7__cxx1112basic_"
                 "stringIcSt11char_traitsIcESaIcEEE"));
        if (t.ctor) t.inherited = true;
        if (!t.ctor)
            t.ctor = reinterpret_cast<ErrorCtor>(
                find("_ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_"
                     "traitsIcESaIcEEE"));
        if (!t.ctor)
            t.ctor = reinterpret_cast<ErrorCtor>(
                find("_ZN3c105ErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_"
                     "traitsIcESaIcEEE"));
        // An exported destructor where there is one; PyTorch's libraries keep c10::Error's
        // implicit destructor hidden, and then the object's own vtable gives it (below).
        t.dtor = reinterpret_cast<Dtor>(find("_ZN3c1016OutOfMemoryErrorD1Ev"));
        if (!t.dtor) t.dtor = reinterpret_cast<Dtor>(find("_ZN3c105ErrorD1Ev"));
        t.vtable = static_cast<void**>(find("_ZTVN3c1016OutOfMemoryErrorE"));
        return t;
    }();
    return found;
}

// Room for a c10::Error, whatever its version: the constructor lays it out, this only gives
// it storage (c10::OutOfMemoryError adds no members).
constexpr std::size_t kErrorRoom = 1024;

[[noreturn]] void throw_torch_oom(const TorchOom& t, const std::string& msg) {
    void* obj = __cxxabiv1::__cxa_allocate_exception(kErrorRoom);
    std::memset(obj, 0, kErrorRoom);
    t.ctor(obj, SourceLocation{"vram_ledger_malloc_or_throw", "vram-ledger", 0}, msg);
    if (t.vtable && !t.inherited) {
        // What OutOfMemoryError's inherited constructor does after c10::Error's: its own
        // vtable (past the offset to top and the type_info pointer).
        *static_cast<void**>(obj) = t.vtable + 2;
    }
    // The Itanium ABI puts a class's complete-object destructor first among its virtual
    // functions when the first virtual function it inherits is a destructor, as
    // std::exception's is: the object's own vtable then holds the destructor of its type.
    Dtor dtor = t.dtor ? t.dtor : reinterpret_cast<Dtor>((*static_cast<void***>(obj))[0]);
    __cxxabiv1::__cxa_throw(obj, t.type, dtor);
}

}  // namespace

extern "C" [[noreturn]] void vram_ledger_throw(int out_of_memory, const char* why) {
    // "CUDA out of memory." is how PyTorch's message starts, and what tools look for.
    std::string msg = out_of_memory ? "CUDA out of memory. " : "vram-ledger could not allocate: ";
    msg += why ? why : "(no message)";
    if (out_of_memory) {
        const TorchOom& t = torch_oom();
        if (t.ready()) throw_torch_oom(t, msg);
    }
    throw std::runtime_error(msg);
}
