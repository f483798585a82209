//! The C header used from C: tests/c/abi_smoke.c compiled against include/vram_ledger.h with
//! the system's C compiler (`CC`, default `cc`), strict warnings as errors, linked to the
//! cdylib cargo built with these tests, and run on simulated devices; and a C++ program linked
//! the same way, which finds the functions only if the header declares them `extern "C"`.
//! Skipped, saying so, on a machine without the compiler.
//!
//! Paths are relative to the working folder, the package's root under cargo and the bundle's
//! under scripts/gpu-bundle.sh's run-all.sh (which carries include/ and tests/c/), as the
//! tests reading tests/data do.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The folder holding the libvram_ledger.so built with this test: cargo builds the library's
/// crate types together, into deps/ beside this executable, and copies it one folder up.
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let found = [deps, deps.parent().unwrap()]
        .into_iter()
        .find(|d| d.join("libvram_ledger.so").is_file());
    found
        .unwrap_or_else(|| panic!("no libvram_ledger.so in {} or its parent", deps.display()))
        .to_owned()
}

/// A new, empty folder for one test's build, under the system's temporary folder (the bundle
/// has no cargo target folder).
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vram-ledger-c-abi-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The compiler named by `var` (else `default`), if it runs.
fn compiler(var: &str, default: &str) -> Option<String> {
    let cc = std::env::var(var).unwrap_or_else(|_| default.to_owned());
    let runs = Command::new(&cc)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    runs.then_some(cc)
}

/// Compile `sources` with `cc` and `flags` into `out`, against the header and the library.
fn build(cc: &str, flags: &[&str], sources: &[&Path], out: &Path) {
    let lib = library_dir();
    let status = Command::new(cc)
        .args(flags)
        .arg("-Iinclude")
        .args(sources)
        .arg("-o")
        .arg(out)
        .arg(format!("-L{}", lib.display()))
        .arg("-lvram_ledger")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .status()
        .unwrap();
    assert!(status.success(), "{cc} failed on {sources:?}");
}

fn run(exe: &Path) -> String {
    // The program chooses the simulated backend itself; nothing here may point it elsewhere.
    let out = Command::new(exe)
        .env_remove("VRAM_LEDGER_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{} exited with {}:\n{stdout}\n{}",
        exe.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn a_c_program_uses_the_library_through_the_header() {
    let Some(cc) = compiler("CC", "cc") else {
        println!("skipped: no C compiler (set CC, or install cc) to build tests/c/abi_smoke.c");
        return;
    };
    let dir = scratch("c");
    let exe = dir.join("abi_smoke");
    let source = Path::new("tests/c/abi_smoke.c");
    let flags = [
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Wpedantic",
        "-Wstrict-prototypes",
        "-Werror",
    ];
    build(&cc, &flags, &[source], &exe);
    let out = run(&exe);
    print!("{out}");
    let passed = out
        .strip_prefix("abi_smoke: ")
        .and_then(|r| r.split_once(" of "))
        .and_then(|(p, r)| {
            Some((
                p.parse::<u32>().ok()?,
                r.split(' ').next()?.parse::<u32>().ok()?,
            ))
        });
    // Its exit status counts failed checks; the summary shows that checks ran at all.
    let Some((passed, total)) = passed else {
        panic!("abi_smoke printed no summary: {out}");
    };
    assert!(passed == total && total > 0, "{out}");
    // Kept after a failure, to look into.
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_cpp_program_links_to_the_headers_declarations() {
    let Some(cxx) = compiler("CXX", "c++") else {
        println!(
            "skipped: no C++ compiler (set CXX, or install c++) to check the header's extern \"C\""
        );
        return;
    };
    let dir = scratch("cpp");
    let source = dir.join("header_in_cpp.cpp");
    // Without extern "C" these names would be mangled, and the link would fail.
    std::fs::write(
        &source,
        "#include \"vram_ledger.h\"\n#include <cstdio>\n\
         int main() {\n\
             char *abi = vram_ledger_abi_json();\n\
             int ok = abi != nullptr && *vram_ledger_last_error() == 0;\n\
             vram_ledger_string_free(abi);\n\
             std::printf(\"%d\\n\", ok);\n\
             return !ok;\n\
         }\n",
    )
    .unwrap();
    let exe = dir.join("header_in_cpp");
    build(
        &cxx,
        &["-std=c++17", "-Wall", "-Wextra", "-Werror"],
        &[&source],
        &exe,
    );
    assert_eq!(run(&exe), "1\n");
    let _ = std::fs::remove_dir_all(&dir);
}
