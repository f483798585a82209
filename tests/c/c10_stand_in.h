// A stand-in for the part of PyTorch's c10/util/Exception.h that the throwing hook relies on:
// c10::Error built from (SourceLocation, std::string) and c10::OutOfMemoryError inheriting that
// constructor. tests/throw.rs builds it as a library whose soname is PyTorch's (libc10.so).
#include <cstdint>
#include <exception>
#include <string>

namespace c10 {
struct SourceLocation {
    const char* function;
    const char* file;
    uint32_t line;
};

class __attribute__((visibility("default"))) Error : public std::exception {
    std::string msg_;
    std::string function_;

  public:
    Error(SourceLocation where, std::string msg);
    // The destructor is implicit, as c10's is: inline, so a library built with
    // -fvisibility-inlines-hidden (as PyTorch's are) exports none.
    const char* what() const noexcept override;
    const std::string& function() const { return function_; }
};

class __attribute__((visibility("default"))) OutOfMemoryError : public Error {
  public:
    using Error::Error;
};
}  // namespace c10
