//! include/vram_ledger.h, generated from the declarations in src/ffi: their names, C types and
//! doc comments. The checked-in header must be what they give, so a function added or changed
//! without regenerating it fails `cargo test`. To regenerate:
//!
//! ```text
//! VRAM_LEDGER_WRITE_HEADER=1 cargo test --lib ffi::header
//! ```

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::abi::{
    CONTEXT_SOURCE, LOG_CALLBACK, MEMORY_PROFILING, MEMORY_REPORT, OOM_OBSERVER, POOL_ALLOC,
    POOL_FREE, SIGNATURES,
};
use super::declarations::{c_type, callback_types, exported, module_doc, sources, Declared};

/// The header, from the repository's root.
const PATH: &str = "include/vram_ledger.h";

/// The files of src/ffi whose functions the header declares, in the header's order: how a C
/// program uses the library, from its errors to the description of itself.
const FILES: &[&str] = &[
    "boundary.rs",
    "ledger.rs",
    "pytorch.rs",
    "profile.rs",
    "kv.rs",
    "sleep.rs",
    "graphs.rs",
    "pools.rs",
    "profiler.rs",
    "abi.rs",
];

const PREAMBLE: &str = "\
/* vram_ledger.h: the C interface of libvram_ledger.so.
 *
 * Generated from the declarations in src/ffi by a test of the crate, which fails when this file
 * differs from them; regenerate it with
 *     VRAM_LEDGER_WRITE_HEADER=1 cargo test --lib ffi::header
 * rather than editing it.
 *
 * An int result is 0 on success and -1 on error, a pointer result NULL on error, unless a
 * function says otherwise; the error's message is then vram_ledger_last_error() on the failing
 * thread. A `char *` result (JSON, Prometheus text) is the caller's, to free with
 * vram_ledger_string_free; a `const char *` one stays the library's. Streams are CUDA streams
 * (cudaStream_t, CUstream) passed as `void *`; NULL is the legacy default stream. No function
 * unwinds into the caller but vram_ledger_malloc_or_throw, which throws a C++ exception.
 * With VRAM_LEDGER_DRIVER=sim in the environment at the first call, every function runs on
 * simulated devices (VRAM_LEDGER_SIM_DEVICES of them, default 1), with no GPU; unset, empty or
 * `cuda`, on the CUDA driver. Any other value (or a device count that is no number from 0 to
 * 1024) fails every call that needs a device, saying so.
 */
#ifndef VRAM_LEDGER_H
#define VRAM_LEDGER_H

#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern \"C\" {
#endif
";

const POSTAMBLE: &str = "
#ifdef __cplusplus
}
#endif

#endif /* VRAM_LEDGER_H */
";

/// The C name of a callback type: `LogCallback` is `vram_ledger_log_callback`.
fn typedef_name(rust: &str) -> String {
    let mut out = String::from("vram_ledger");
    for c in rust.chars() {
        if c.is_uppercase() {
            out.push('_');
        }
        out.extend(c.to_lowercase());
    }
    out
}

/// Rust doc text as C comment text: intra-doc links lose their brackets (`[`x`]` is `x`), and
/// the `# Safety` heading becomes "Safety:".
fn c_doc(line: &str) -> String {
    assert!(
        !line.contains("*/"),
        "a doc comment would end the C comment: {line}"
    );
    if line.trim() == "# Safety" {
        return "Safety:".to_owned();
    }
    let mut out = String::new();
    let mut rest = line;
    while let Some(open) = rest.find("[`") {
        let Some(len) = rest[open + 2..].find("`]") else {
            break;
        };
        out.push_str(&rest[..open]);
        out.push('`');
        out.push_str(&rest[open + 2..open + 2 + len]);
        out.push('`');
        rest = &rest[open + 2 + len + 2..];
    }
    out.push_str(rest);
    out
}

fn comment(out: &mut String, lines: &[String]) {
    if lines.is_empty() {
        return;
    }
    out.push_str("/*");
    for (i, line) in lines.iter().enumerate() {
        let text = c_doc(line);
        let lead = if i == 0 { " " } else { " * " };
        if i > 0 {
            out.push('\n');
        }
        if text.is_empty() {
            out.push_str(lead.trim_end());
        } else {
            out.push_str(lead);
            out.push_str(&text);
        }
    }
    out.push_str(if lines.len() == 1 { " */\n" } else { "\n */\n" });
}

/// `type name`, with the pointer's star against the name.
fn declarator(ty: &str, name: &str) -> String {
    if ty.ends_with('*') {
        format!("{ty}{name}")
    } else {
        format!("{ty} {name}")
    }
}

/// The C type of a Rust parameter or return type, callback types by their typedef.
fn header_type(rust: &str, callbacks: &BTreeMap<String, String>) -> String {
    let inner = rust
        .strip_prefix("Option<")
        .and_then(|r| r.strip_suffix('>'))
        .unwrap_or(rust);
    if let Some(c) = callbacks.get(inner) {
        return c.clone();
    }
    c_type(rust)
        .unwrap_or_else(|| panic!("no C spelling for the Rust type `{rust}`; add one"))
        .to_owned()
}

fn parameters(f: &Declared, callbacks: &BTreeMap<String, String>) -> String {
    if f.params.is_empty() {
        return "void".to_owned();
    }
    f.params
        .iter()
        .map(|(name, ty)| declarator(&header_type(ty, callbacks), name.trim_start_matches('_')))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The header, from the sources of src/ffi (file name -> text).
fn generate(sources: &BTreeMap<String, String>) -> String {
    for (file, source) in sources {
        let declares = !exported(source).is_empty() || !callback_types(source).is_empty();
        assert!(
            !declares || FILES.contains(&file.as_str()),
            "src/ffi/{file} exports functions: add it to FILES in src/ffi/header.rs"
        );
    }
    let files: Vec<(&str, &String)> = FILES
        .iter()
        .map(|&f| {
            let source = sources.get(f).unwrap_or_else(|| panic!("no src/ffi/{f}"));
            (f, source)
        })
        .collect();
    let aliases: Vec<Declared> = files.iter().flat_map(|(_, s)| callback_types(s)).collect();
    let callbacks: BTreeMap<String, String> = aliases
        .iter()
        .map(|a| (a.name.clone(), typedef_name(&a.name)))
        .collect();

    let mut out = String::from(PREAMBLE);
    for a in &aliases {
        out.push('\n');
        comment(&mut out, &a.doc);
        let returns = header_type(&a.returns, &callbacks);
        let name = format!("(*{})", callbacks[&a.name]);
        writeln!(
            out,
            "typedef {}({});",
            declarator(&returns, &name),
            parameters(a, &callbacks)
        )
        .unwrap();
    }
    for (file, source) in files {
        // The module's first paragraph says what its functions are for.
        let about: Vec<String> = module_doc(source)
            .into_iter()
            .take_while(|l| !l.is_empty())
            .collect();
        assert!(
            !about.is_empty(),
            "src/ffi/{file} has no module doc to head its section"
        );
        let rule = format!("/* ---- src/ffi/{file} ");
        writeln!(out, "\n{rule:-<80}").unwrap();
        for line in &about {
            writeln!(out, " * {}", c_doc(line)).unwrap();
        }
        out.push_str(" */\n");
        for f in exported(source) {
            out.push('\n');
            comment(&mut out, &f.doc);
            let returns = header_type(&f.returns, &callbacks);
            let name = format!("{}({})", f.name, parameters(&f, &callbacks));
            writeln!(out, "{};", declarator(&returns, &name)).unwrap();
        }
    }
    out.push_str(POSTAMBLE);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> std::path::PathBuf {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    #[test]
    fn the_header_in_include_is_what_src_ffi_declares() {
        let want = generate(&sources());
        let path = root().join(PATH);
        if std::env::var_os("VRAM_LEDGER_WRITE_HEADER").is_some() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &want).unwrap();
            return;
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        if have != want {
            let (n, (h, w)) = have
                .lines()
                .chain(std::iter::repeat("<end of file>"))
                .zip(want.lines().chain(std::iter::repeat("<end of file>")))
                .enumerate()
                .find(|(_, (h, w))| h != w)
                .expect("texts that differ differ in a line");
            panic!(
                "{PATH} is not what src/ffi declares; first difference at line {}:\n  \
                 {PATH}: {h}\n  generated: {w}\nregenerate it: \
                 VRAM_LEDGER_WRITE_HEADER=1 cargo test --lib ffi::header",
                n + 1
            );
        }
    }

    /// The header's prototypes, read back: name -> (parameter types, return type), in the
    /// signature table's spelling.
    fn prototypes(header: &str) -> BTreeMap<String, (Vec<String>, String)> {
        let spelled = |ty: &str| {
            let ty = ty.trim();
            if ty == typedef_name("LogCallback") {
                LOG_CALLBACK.to_owned()
            } else if ty == typedef_name("OomObserver") {
                OOM_OBSERVER.to_owned()
            } else if ty == typedef_name("ContextSource") {
                CONTEXT_SOURCE.to_owned()
            } else if ty == typedef_name("PoolAlloc") {
                POOL_ALLOC.to_owned()
            } else if ty == typedef_name("PoolFree") {
                POOL_FREE.to_owned()
            } else if ty == typedef_name("MemoryProfiling") {
                MEMORY_PROFILING.to_owned()
            } else if ty == typedef_name("MemoryReport") {
                MEMORY_REPORT.to_owned()
            } else if let Some(base) = ty.strip_suffix('*') {
                format!("{} *", base.trim())
            } else {
                ty.to_owned()
            }
        };
        // `type name`: the name is the last identifier, the type what comes before it.
        let split = |decl: &str| {
            let decl = decl.trim();
            let at = decl
                .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                .map_or(0, |i| i + 1);
            (spelled(&decl[..at]), decl[at..].to_owned())
        };
        let mut out = BTreeMap::new();
        let is_prototype = |l: &&str| {
            l.ends_with(");") && !l.starts_with(['/', ' ', '#']) && !l.starts_with("typedef")
        };
        for line in header.lines().filter(is_prototype) {
            let Some(open) = line.find("(") else {
                continue;
            };
            let (returns, name) = split(&line[..open]);
            let args = line[open + 1..]
                .strip_suffix(");")
                .expect("one line per prototype");
            let args = if args == "void" {
                vec![]
            } else {
                args.split(", ").map(|a| split(a).0).collect()
            };
            assert!(out.insert(name, (args, returns)).is_none(), "{line}");
        }
        out
    }

    #[test]
    fn the_header_declares_the_signature_tables_functions_with_its_types() {
        let header = generate(&sources());
        let table: BTreeMap<String, (Vec<String>, String)> = SIGNATURES
            .iter()
            .map(|s| {
                let args = s.args.iter().map(|a| a.to_string()).collect();
                (s.name.to_owned(), (args, s.returns.to_owned()))
            })
            .collect();
        assert_eq!(prototypes(&header), table);
        assert!(header
            .contains("typedef void (*vram_ledger_log_callback)(int level, const char *message);"));
        assert!(header.contains("\nint vram_ledger_set_cap(int device, int64_t bytes);\n"));
        assert!(header.contains("\nchar *vram_ledger_abi_json(void);\n"));
        // A Rust parameter's leading underscore (unused) is not part of its C name.
        assert!(header.contains(
            "\nvoid vram_ledger_free(void *ptr, ssize_t size, int device, void *stream);\n"
        ));
    }

    #[test]
    fn a_change_to_a_declaration_changes_the_header() {
        let mut changed = sources();
        let ledger = changed.get_mut("ledger.rs").unwrap();
        *ledger = ledger.replace(
            "fn vram_ledger_set_cap(device: c_int, bytes: i64)",
            "fn vram_ledger_set_cap(device: c_int, bytes: u64)",
        );
        let header = generate(&changed);
        assert!(header.contains("\nint vram_ledger_set_cap(int device, uint64_t bytes);\n"));
        assert_ne!(header, generate(&sources()));
    }

    #[test]
    fn doc_text_becomes_c_comment_text() {
        assert_eq!(
            c_doc("As for [`vram_ledger_malloc`]; see [`crate::metrics`]."),
            "As for `vram_ledger_malloc`; see `crate::metrics`."
        );
        assert_eq!(c_doc("# Safety"), "Safety:");
        assert_eq!(
            c_doc("a [link without a tick] stays"),
            "a [link without a tick] stays"
        );
        let mut out = String::new();
        comment(&mut out, &["One.".to_owned()]);
        comment(
            &mut out,
            &["Two,".to_owned(), String::new(), "three.".to_owned()],
        );
        assert_eq!(out, "/* One. */\n/* Two,\n *\n * three.\n */\n");
        assert_eq!(typedef_name("LogCallback"), "vram_ledger_log_callback");
    }
}
