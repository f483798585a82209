//! The C ABI as src/ffi declares it, read from the source: the signature table (abi.rs) and the
//! C header (header.rs) are held to what this reads, so neither can drift from the code.

use std::collections::BTreeMap;

use super::abi::{
    CONTEXT_SOURCE, LOG_CALLBACK, MEMORY_PROFILING, MEMORY_REPORT, OOM_OBSERVER, POOL_ALLOC,
    POOL_FREE,
};

/// An exported `vram_ledger_*` function, or a `pub type` naming an `extern "C" fn`.
#[derive(Debug, PartialEq)]
pub(super) struct Declared {
    pub name: String,
    /// Each parameter's name and Rust type (whitespace squeezed).
    pub params: Vec<(String, String)>,
    /// The Rust return type, "" for none.
    pub returns: String,
    /// The `///` lines above it, without the marker.
    pub doc: Vec<String>,
}

/// The C spelling of a parameter or return type as src/ffi writes it in Rust, as the signature
/// table has it.
pub(super) fn c_type(rust: &str) -> Option<&'static str> {
    Some(match rust {
        "" => "void",
        "c_int" => "int",
        "i64" => "int64_t",
        "u64" => "uint64_t",
        "c_double" => "double",
        "isize" => "ssize_t",
        "*mut c_void" => "void *",
        "*const c_char" => "const char *",
        "*mut c_char" => "char *",
        "Option<LogCallback>" => LOG_CALLBACK,
        "Option<OomObserver>" => OOM_OBSERVER,
        "Option<ContextSource>" => CONTEXT_SOURCE,
        "Option<PoolAlloc>" => POOL_ALLOC,
        "Option<PoolFree>" => POOL_FREE,
        "usize" => "size_t",
        "u8" => "uint8_t",
        "u16" => "uint16_t",
        "Option<MemoryProfiling>" => MEMORY_PROFILING,
        "Option<MemoryReport>" => MEMORY_REPORT,
        _ => return None,
    })
}

/// The files of src/ffi by name, with their text.
pub(super) fn sources() -> BTreeMap<String, String> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/ffi");
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            out.insert(name, std::fs::read_to_string(&path).unwrap());
        }
    }
    out
}

/// How many `#[no_mangle]` items `source` has: every one must be read by [`exported`].
pub(super) fn no_mangle_count(source: &str) -> usize {
    source
        .lines()
        .filter(|l| l.trim() == "#[no_mangle]")
        .count()
}

/// The leading `//!` lines of `source`, without the marker.
pub(super) fn module_doc(source: &str) -> Vec<String> {
    source
        .lines()
        .map_while(|l| l.strip_prefix("//!"))
        .map(|l| l.strip_prefix(' ').unwrap_or(l).to_owned())
        .collect()
}

/// The `vram_ledger_*` functions that `source` exports, in their order. Imports (an `extern`
/// block's `fn`, not `pub`) are skipped.
pub(super) fn exported(source: &str) -> Vec<Declared> {
    let mut out = Vec::new();
    for (at, _) in source.match_indices("fn vram_ledger_") {
        let line = line_start(source, at);
        let head = source[line..at].trim();
        if !(head.starts_with("pub ") && head.contains("extern \"C")) {
            continue;
        }
        let rest = &source[at + "fn ".len()..];
        let open = rest.find('(').expect("a parameter list");
        let (params, returns) = signature(&rest[open..], '{');
        out.push(Declared {
            name: rest[..open].trim().to_owned(),
            params,
            returns,
            doc: doc_above(source, line),
        });
    }
    out
}

/// The `pub type NAME = [unsafe] extern "C" fn(...)` aliases of `source`: callback types.
pub(super) fn callback_types(source: &str) -> Vec<Declared> {
    let mut out = Vec::new();
    for (at, _) in source.match_indices("pub type ") {
        let line = line_start(source, at);
        let rest = &source[at + "pub type ".len()..];
        // An item begins its line; the name is an identifier.
        let Some((name, definition)) = rest.split_once('=') else {
            continue;
        };
        let name = name.trim();
        if !source[line..at].trim().is_empty()
            || !name.chars().all(|c| c.is_alphanumeric() || c == '_')
        {
            continue;
        }
        let definition = definition.trim_start();
        let definition = definition.strip_prefix("unsafe ").unwrap_or(definition);
        let Some(f) = definition
            .strip_prefix("extern \"C\" fn")
            .or_else(|| definition.strip_prefix("extern \"C-unwind\" fn"))
        else {
            continue;
        };
        let (params, returns) = signature(f.trim_start(), ';');
        out.push(Declared {
            name: name.to_owned(),
            params,
            returns,
            doc: doc_above(source, line),
        });
    }
    out
}

fn line_start(source: &str, at: usize) -> usize {
    source[..at].rfind('\n').map_or(0, |i| i + 1)
}

/// The `///` lines just above the line starting at `line`, past its attributes.
fn doc_above(source: &str, line: usize) -> Vec<String> {
    let mut doc: Vec<String> = source[..line]
        .lines()
        .rev()
        .map(str::trim)
        .skip_while(|l| l.starts_with("#["))
        .map_while(|l| l.strip_prefix("///"))
        .map(|l| l.strip_prefix(' ').unwrap_or(l).to_owned())
        .collect();
    doc.reverse();
    doc
}

/// The parameters and return type of the signature `text` starts with (at its `(`); the return
/// type ends at `end` (a body's `{`, an alias's `;`).
fn signature(text: &str, end: char) -> (Vec<(String, String)>, String) {
    let mut depth = 0;
    let close = text
        .char_indices()
        .find(|&(_, c)| {
            depth += match c {
                '(' => 1,
                ')' => -1,
                _ => 0,
            };
            depth == 0
        })
        .expect("a closed parameter list")
        .0;
    let params = top_level(&text[1..close])
        .into_iter()
        .map(|p| {
            let (name, ty) = p.split_once(':').expect("`name: type`");
            (name.trim().to_owned(), squeeze(ty))
        })
        .collect();
    let after = text[close + 1..].trim_start();
    let returns = after.strip_prefix("->").map_or(String::new(), |r| {
        squeeze(&r[..r.find(end).expect("the end of the signature")])
    });
    (params, returns)
}

/// Split `s` at the commas outside brackets.
fn top_level(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut from) = (Vec::new(), 0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' | '<' | '[' => depth += 1,
            ')' | '>' | ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[from..i]);
                from = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[from..]);
    out.into_iter().filter(|p| !p.trim().is_empty()).collect()
}

fn squeeze(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|&(n, t)| (n.to_owned(), t.to_owned()))
            .collect()
    }

    #[test]
    fn the_reader_sees_unsafe_unwinding_multi_line_and_documented_declarations() {
        let source = "//! The module.\n//!\n//! More.\n\
            extern \"C-unwind\" {\n    fn vram_ledger_import(a: c_int) -> !;\n}\n\
            /// First line.\n///\n/// # Safety\n/// Second.\n\
            #[no_mangle]\npub unsafe extern \"C-unwind\" fn vram_ledger_a(\n    size: isize,\n    \
            _f: Option<LogCallback>,\n) -> *mut c_void {\n}\n\
            #[no_mangle]\npub extern \"C\" fn vram_ledger_b() {}\n";
        assert_eq!(
            exported(source),
            vec![
                Declared {
                    name: "vram_ledger_a".to_owned(),
                    params: owned(&[("size", "isize"), ("_f", "Option<LogCallback>")]),
                    returns: "*mut c_void".to_owned(),
                    doc: ["First line.", "", "# Safety", "Second."]
                        .map(String::from)
                        .into(),
                },
                Declared {
                    name: "vram_ledger_b".to_owned(),
                    params: vec![],
                    returns: String::new(),
                    doc: vec![],
                },
            ]
        );
        assert_eq!(no_mangle_count(source), 2);
        assert_eq!(module_doc(source), ["The module.", "", "More."]);
    }

    #[test]
    fn the_reader_sees_callback_types() {
        let source = "/// A sink.\npub type Sink = unsafe extern \"C\" fn(level: c_int, \
            message: *const c_char);\npub type Other = u32;\n";
        assert_eq!(
            callback_types(source),
            vec![Declared {
                name: "Sink".to_owned(),
                params: owned(&[("level", "c_int"), ("message", "*const c_char")]),
                returns: String::new(),
                doc: vec!["A sink.".to_owned()],
            }]
        );
    }
}
