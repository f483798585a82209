// Throwing from the allocation hook. PyTorch's pluggable allocator does not check the pointer
// its hook returns: a NULL becomes a tensor at address 0, and the first kernel that touches it
// ends the CUDA context. A C++ exception thrown from the hook instead reaches Python as a
// RuntimeError carrying its message, and the process keeps working. Rust cannot throw one, so
// the Rust hook calls this when it has nothing to return.
#include <stdexcept>
#include <string>

extern "C" [[noreturn]] void vram_ledger_throw(int out_of_memory, const char* why) {
    // "CUDA out of memory." is what tools that retry with smaller batches look for.
    std::string msg = out_of_memory ? "CUDA out of memory. " : "vram-ledger could not allocate: ";
    msg += why ? why : "(no message)";
    throw std::runtime_error(msg);
}
