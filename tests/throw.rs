//! The throwing allocation hook, called from C++ as PyTorch calls it: out of memory arrives as
//! a `std::runtime_error` whose message starts with "CUDA out of memory." and carries the
//! breakdown, other failures as one that says so, and the library keeps working afterwards.
//! A C++ program (built here with g++) loads the library on simulated devices and calls it.

use std::path::PathBuf;
use std::process::Command;

const PROGRAM: &str = r#"
#include <dlfcn.h>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <sys/types.h>
typedef void* (*alloc_fn)(ssize_t, int, void*);
typedef void (*free_fn)(void*, ssize_t, int, void*);
int main(int, char** argv) {
    void* lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) { std::printf("dlopen: %s\n", dlerror()); return 2; }
    auto alloc = (alloc_fn)dlsym(lib, "vram_ledger_malloc_or_throw");
    auto release = (free_fn)dlsym(lib, "vram_ledger_free");
    if (!alloc || !release) { std::printf("missing symbols\n"); return 2; }
    // Out of memory: 1 TiB on an 80 GiB simulated device.
    try { alloc(ssize_t(1) << 40, 0, nullptr); std::printf("no exception\n"); return 1; }
    catch (const std::runtime_error& e) { std::printf("OOM|%s\n", e.what()); }
    // Another failure: a device that does not exist.
    try { alloc(4096, 7, nullptr); std::printf("no exception\n"); return 1; }
    catch (const std::runtime_error& e) { std::printf("OTHER|%s\n", e.what()); }
    // Still working, and zero bytes is not a failure.
    void* p = alloc(1 << 20, 0, nullptr);
    std::printf("AFTER|%s\n", p ? "ok" : "null");
    release(p, 1 << 20, 0, nullptr);
    std::printf("ZERO|%s\n", alloc(0, 0, nullptr) ? "non-null" : "null");
    return 0;
}
"#;

fn library() -> PathBuf {
    // The cdylib is built beside the test executables (target/<profile>/deps).
    let deps = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let lib = deps.join("libvram_ledger.so");
    assert!(lib.exists(), "{} is missing", lib.display());
    lib
}

#[test]
fn abi_throwing_hook_raises_out_of_memory_as_a_cpp_exception() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let (src, exe) = (dir.join("throw_hook.cpp"), dir.join("throw_hook"));
    std::fs::write(&src, PROGRAM).unwrap();
    let built = Command::new("g++")
        .args(["-std=c++17", "-O1", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-ldl")
        .output()
        .expect("g++ runs");
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let out = Command::new(&exe)
        .arg(library())
        .env("VRAM_LEDGER_DRIVER", "sim")
        .env("VRAM_LEDGER_SIM_DEVICES", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = |tag: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(tag))
            .unwrap_or_else(|| panic!("no {tag} line in {stdout}"))
            .to_string()
    };
    let oom = line("OOM|");
    assert!(
        oom.starts_with("CUDA out of memory. out of device memory."),
        "{oom}"
    );
    assert!(oom.contains("Tried to allocate 1024.00 GiB"), "{oom}");
    assert!(oom.contains("Allocated by tag"), "{oom}");
    let other = line("OTHER|");
    assert!(
        other.starts_with("vram-ledger could not allocate: "),
        "{other}"
    );
    assert!(other.contains("no device with ordinal 7"), "{other}");
    assert_eq!(line("AFTER|"), "ok");
    assert_eq!(line("ZERO|"), "null");
    // One message per failure: the exception carries it, and nothing repeats it on stderr.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("out of memory") && !stderr.contains("ordinal 7"),
        "the failures were also printed: {stderr}"
    );
}
