//! Builds the one piece of C++: the function that throws from the allocation hook (see
//! csrc/throw.cpp).

fn main() {
    println!("cargo:rerun-if-changed=csrc/throw.cpp");
    cc::Build::new()
        .cpp(true)
        .file("csrc/throw.cpp")
        .flag_if_supported("-std=c++17")
        .compile("vram_ledger_throw");
}
