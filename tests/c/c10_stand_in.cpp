#include "c10_stand_in.h"

#include <typeinfo>

namespace c10 {
Error::Error(SourceLocation where, std::string msg)
    : msg_(std::move(msg)), function_(where.function) {}
const char* Error::what() const noexcept { return msg_.c_str(); }

#ifndef TYPE_ONLY
// PyTorch's own libraries throw OutOfMemoryError, which makes them carry its type_info, vtable
// and inherited constructor: so does this one.
void stand_in_throws_out_of_memory() { throw OutOfMemoryError({"here", "there", 1}, "x"); }
#else
// A library that only names the type: no inherited constructor or vtable to find, so the hook
// builds a c10::Error and throws it as OutOfMemoryError.
const std::type_info& stand_in_out_of_memory_type() { return typeid(OutOfMemoryError); }
#endif
}  // namespace c10
