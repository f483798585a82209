//! The throwing allocation hook, called from C++ as PyTorch calls it: out of memory arrives as
//! PyTorch's `c10::OutOfMemoryError` when c10 is loaded (here a stand-in, tests/c), else as a
//! `std::runtime_error`, with PyTorch's wording and then the breakdown; other failures as a
//! `std::runtime_error` that says so; and the library keeps working afterwards. C++ programs
//! (built here with g++) load the library on simulated devices and call it.

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

/// Where the programs are built: cargo's scratch folder for these tests, or (run from a bundle,
/// on a machine where that folder does not exist) the system's.
fn build_dir() -> PathBuf {
    let cargo = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    if cargo.is_dir() {
        return cargo;
    }
    let dir = std::env::temp_dir().join(format!("vram-ledger-throw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Run g++ (C++17) with `args`; its errors are the failure's message.
fn gxx(args: &[std::ffi::OsString]) {
    let built = Command::new("g++")
        .arg("-std=c++17")
        .args(args)
        .output()
        .expect("g++ runs");
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
}

/// Build `program` (C++) into `name` with `extra` arguments for g++ and run it on the library
/// with one simulated device; returns its stdout and stderr.
fn run(name: &str, program: &str, extra: &[&str]) -> (String, String) {
    let dir = build_dir();
    let (src, exe) = (dir.join(format!("{name}.cpp")), dir.join(name));
    std::fs::write(&src, program).unwrap();
    let mut args = vec![
        "-O1".into(),
        "-o".into(),
        exe.clone().into_os_string(),
        src.into(),
    ];
    args.extend(extra.iter().map(Into::into));
    args.push("-ldl".into());
    gxx(&args);
    let out = Command::new(&exe)
        .arg(library())
        .env("VRAM_LEDGER_DRIVER", "sim")
        .env("VRAM_LEDGER_SIM_DEVICES", "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    (stdout, stderr)
}

fn line(stdout: &str, tag: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(tag))
        .unwrap_or_else(|| panic!("no {tag} line in {stdout}"))
        .to_string()
}

/// How PyTorch's own out-of-memory message begins, for an 80 GiB device.
const TORCH_BEGINNING: &str = "CUDA out of memory. Tried to allocate 1024.00 GiB. GPU 0 has a total capacity of 80.00 GiB of which ";

#[test]
fn abi_throwing_hook_raises_out_of_memory_as_a_cpp_exception() {
    // No PyTorch in the process: a std::runtime_error with PyTorch's wording.
    let (stdout, stderr) = run("throw_hook", PROGRAM, &[]);
    let oom = line(&stdout, "OOM|");
    assert!(oom.starts_with(TORCH_BEGINNING), "{oom}");
    assert!(oom.contains("Allocated by tag"), "{oom}");
    let other = line(&stdout, "OTHER|");
    assert!(
        other.starts_with("vram-ledger could not allocate: "),
        "{other}"
    );
    assert!(other.contains("no device with ordinal 7"), "{other}");
    assert_eq!(line(&stdout, "AFTER|"), "ok");
    assert_eq!(line(&stdout, "ZERO|"), "null");
    // One message per failure: the exception carries it, and nothing repeats it on stderr.
    assert!(
        !stderr.contains("out of memory") && !stderr.contains("ordinal 7"),
        "the failures were also printed: {stderr}"
    );
}

/// A program linked with a stand-in for PyTorch's c10 (tests/c/c10_stand_in.*), catching as
/// PyTorch's Python binding does: c10::OutOfMemoryError first.
const WITH_C10: &str = r#"
#include <dlfcn.h>
#include <cstdio>
#include <stdexcept>
#include <sys/types.h>
#include "c10_stand_in.h"
typedef void* (*alloc_fn)(ssize_t, int, void*);
int main(int, char** argv) {
    void* lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) { std::printf("dlopen: %s\n", dlerror()); return 2; }
    auto alloc = (alloc_fn)dlsym(lib, "vram_ledger_malloc_or_throw");
    for (int i = 0; i < 2; i++) {
        try { alloc(ssize_t(1) << 40, 0, nullptr); std::printf("no exception\n"); return 1; }
        catch (const c10::OutOfMemoryError& e) { std::printf("TORCH_OOM|%s|%s\n", e.function().c_str(), e.what()); }
        catch (const std::exception& e) { std::printf("OTHER|%s\n", e.what()); }
    }
    // Other failures stay std::runtime_error.
    try { alloc(4096, 7, nullptr); }
    catch (const c10::Error&) { std::printf("NOT_OOM|c10\n"); }
    catch (const std::runtime_error&) { std::printf("NOT_OOM|runtime_error\n"); }
    return 0;
}
"#;

#[test]
fn abi_throwing_hook_raises_pytorchs_out_of_memory_error_when_c10_is_loaded() {
    let dir = build_dir();
    // Relative to the working folder: the package's root under cargo, the bundle's under
    // scripts/gpu-bundle.sh's run-all.sh (which carries tests/c).
    let c = std::env::current_dir().unwrap().join("tests/c");
    // With every symbol exported (the inherited constructor and the destructors too); as
    // PyTorch's libraries are (inline functions hidden: neither the inherited constructor nor
    // any destructor to find, only c10::Error's constructor, the type and the vtable); and
    // naming the type only.
    for (variant, flags) in [
        ("full", vec![]),
        ("inlines_hidden", vec!["-fvisibility-inlines-hidden"]),
        ("type_only", vec!["-DTYPE_ONLY"]),
    ] {
        let libdir = dir.join(format!("c10_{variant}"));
        std::fs::create_dir_all(&libdir).unwrap();
        let mut args: Vec<std::ffi::OsString> = ["-shared", "-fPIC", "-Wl,-soname,libc10.so"]
            .map(Into::into)
            .into();
        args.extend(flags.iter().map(Into::into));
        args.extend([
            "-o".into(),
            libdir.join("libc10.so").into(),
            c.join("c10_stand_in.cpp").into(),
        ]);
        gxx(&args);
        if variant == "inlines_hidden" {
            // As torch 2.11's libraries: c10::Error's constructor, OutOfMemoryError's type and
            // vtable, and no destructor or inherited constructor to find.
            let nm = Command::new("nm")
                .args(["-D", "--defined-only"])
                .arg(libdir.join("libc10.so"))
                .output()
                .expect("nm runs");
            let exported = String::from_utf8_lossy(&nm.stdout);
            assert!(
                exported.contains("_ZN3c105ErrorC1ENS_14SourceLocation"),
                "{exported}"
            );
            assert!(
                exported.contains("_ZTVN3c1016OutOfMemoryErrorE"),
                "{exported}"
            );
            assert!(!exported.contains("ErrorD1Ev"), "{exported}");
            assert!(!exported.contains("OutOfMemoryErrorCI1"), "{exported}");
        }
        let include = format!("-I{}", c.display());
        let link = format!("-L{}", libdir.display());
        let rpath = format!("-Wl,-rpath,{}", libdir.display());
        let name = format!("throw_hook_c10_{variant}");
        let (stdout, _) = run(&name, WITH_C10, &[&include, &link, "-lc10", &rpath]);
        let hits: Vec<&str> = stdout
            .lines()
            .filter(|l| l.starts_with("TORCH_OOM|"))
            .collect();
        assert_eq!(
            hits.len(),
            2,
            "{variant}: caught as c10::OutOfMemoryError, each time: {stdout}"
        );
        for h in hits {
            let mut parts = h.splitn(3, '|').skip(1);
            assert_eq!(
                parts.next(),
                Some("vram_ledger_malloc_or_throw"),
                "{variant}: built by c10's constructor"
            );
            let msg = parts.next().unwrap();
            assert!(msg.starts_with(TORCH_BEGINNING), "{variant}: {msg}");
            assert!(msg.contains("Allocated by tag"), "{variant}: {msg}");
        }
        assert_eq!(line(&stdout, "NOT_OOM|"), "runtime_error", "{variant}");
    }
}
