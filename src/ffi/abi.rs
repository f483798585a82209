//! The library describing itself to hosts that bind it at run time (the Python package builds
//! its ctypes bindings from this): the tags, the spellings accepted for them and their bits in
//! sleep and wake masks, the segment modes, and the C signature of every entry point. Tags and
//! modes come from the code that parses and decodes them, so a host never keeps its own copy.

use std::ffi::c_char;

use serde::Serialize;
use serde_json::json;

use super::boundary::*;
use super::sleep::tag_bit;
use crate::{SegmentMode, Tag};

/// One entry point, in C: `returns name(args...)`.
#[derive(Serialize)]
pub(super) struct Signature {
    pub(super) name: &'static str,
    pub(super) returns: &'static str,
    pub(super) args: &'static [&'static str],
}

const fn sig(
    name: &'static str,
    returns: &'static str,
    args: &'static [&'static str],
) -> Signature {
    Signature {
        name,
        returns,
        args,
    }
}

/// What the log callback's parameter is in C (`LogCallback`, or NULL).
pub(super) const LOG_CALLBACK: &str = "void (*)(int, const char *)";

/// What the out-of-memory observer's parameter is in C (`OomObserver`, or NULL).
pub(super) const OOM_OBSERVER: &str = "void (*)(int, int64_t, int64_t, int64_t)";

/// What the context source's parameter is in C (`ContextSource`, or NULL).
pub(super) const CONTEXT_SOURCE: &str = "uint64_t (*)(int)";

/// What a pool's own allocation function is in C (`PoolAlloc`, or NULL).
pub(super) const POOL_ALLOC: &str = "void * (*)(size_t, int, void *)";

/// What a pool's own free function is in C (`PoolFree`, or NULL).
pub(super) const POOL_FREE: &str = "void (*)(void *, size_t, int, void *)";

/// What the profiler's check is in C (`MemoryProfiling`, or NULL).
pub(super) const MEMORY_PROFILING: &str = "uint8_t (*)(void)";

/// What the profiler's memory report is in C (`MemoryReport`, or NULL).
pub(super) const MEMORY_REPORT: &str = "void (*)(void *, int64_t, uint64_t, uint64_t, uint16_t)";

/// Every `vram_ledger_*` function the library exports. A `char *` result is the caller's, to
/// free with `vram_ledger_string_free`; a `const char *` one stays the library's. The test
/// below holds this table to the declarations in src/ffi.
pub(super) const SIGNATURES: &[Signature] = &[
    sig("vram_ledger_abi_json", "char *", &[]),
    sig("vram_ledger_set_log_callback", "void", &[LOG_CALLBACK]),
    sig("vram_ledger_last_error", "const char *", &[]),
    sig("vram_ledger_string_free", "void", &["char *"]),
    sig("vram_ledger_device_count", "int", &[]),
    sig("vram_ledger_configure", "int", &["const char *"]),
    sig("vram_ledger_set_tag", "int", &["const char *"]),
    sig("vram_ledger_push_tag", "int", &["const char *"]),
    sig("vram_ledger_pop_tag", "int", &[]),
    sig("vram_ledger_current_tag", "const char *", &[]),
    sig("vram_ledger_stats_json", "char *", &["int"]),
    sig("vram_ledger_memory_stats_json", "char *", &["int"]),
    sig("vram_ledger_set_cap", "int", &["int", "int64_t"]),
    sig("vram_ledger_cap", "int64_t", &["int"]),
    sig("vram_ledger_reset_peaks", "int", &["int"]),
    sig("vram_ledger_reset_accumulated", "int", &["int"]),
    sig("vram_ledger_empty_cache", "int", &["int"]),
    sig(
        "vram_ledger_record_history",
        "int",
        &["int", "int", "int64_t"],
    ),
    sig("vram_ledger_dump_snapshot", "int", &["int", "const char *"]),
    sig("vram_ledger_metrics", "char *", &[]),
    sig(
        "vram_ledger_graph_begin",
        "int",
        &["int", "void *", "uint64_t", "uint64_t"],
    ),
    sig(
        "vram_ledger_graph_end",
        "int",
        &["int", "void *", "uint64_t", "uint64_t"],
    ),
    sig(
        "vram_ledger_graph_release",
        "int",
        &["int", "uint64_t", "uint64_t"],
    ),
    sig(
        "vram_ledger_pool_checkpoint",
        "char *",
        &["int", "uint64_t", "uint64_t"],
    ),
    sig(
        "vram_ledger_pool_restore",
        "char *",
        &["int", "uint64_t", "uint64_t", "const char *"],
    ),
    sig(
        "vram_ledger_pool_hold",
        "int",
        &["int", "uint64_t", "uint64_t", POOL_ALLOC, POOL_FREE, "int"],
    ),
    sig(
        "vram_ledger_pool_begin",
        "int",
        &["int", "uint64_t", "uint64_t"],
    ),
    sig(
        "vram_ledger_pool_end",
        "int",
        &["int", "uint64_t", "uint64_t"],
    ),
    sig(
        "vram_ledger_profile_begin",
        "int",
        &["int", "double", "int64_t"],
    ),
    sig("vram_ledger_profile_end", "char *", &["int"]),
    sig(
        "vram_ledger_malloc",
        "void *",
        &["ssize_t", "int", "void *"],
    ),
    sig(
        "vram_ledger_malloc_or_throw",
        "void *",
        &["ssize_t", "int", "void *"],
    ),
    sig(
        "vram_ledger_free",
        "void",
        &["void *", "ssize_t", "int", "void *"],
    ),
    sig("vram_ledger_init", "void", &["int"]),
    sig("vram_ledger_reset", "void", &[]),
    sig("vram_ledger_memory_fraction", "void", &["double", "int"]),
    sig("vram_ledger_record_stream", "void", &["void *", "void *"]),
    sig("vram_ledger_set_oom_observer", "void", &[OOM_OBSERVER]),
    sig(
        "vram_ledger_set_memory_reporter",
        "void",
        &[MEMORY_PROFILING, MEMORY_REPORT],
    ),
    sig(
        "vram_ledger_set_context_source",
        "void",
        &[CONTEXT_SOURCE, "int"],
    ),
    sig(
        "vram_ledger_set_history_metadata",
        "int",
        &["int", "const char *"],
    ),
    sig("vram_ledger_separate_tags", "int", &["int"]),
    sig("vram_ledger_unmap_later", "int", &["int"]),
    sig("vram_ledger_remap_piece", "int", &["uint64_t"]),
    sig("vram_ledger_move_across_streams", "int", &["int"]),
    sig("vram_ledger_sleep", "char *", &["int", "int", "int"]),
    sig("vram_ledger_wake", "char *", &["int", "int"]),
    sig("vram_ledger_set_retain_host", "int", &["int", "int"]),
    sig(
        "vram_ledger_set_sleep_file",
        "int",
        &["int", "const char *"],
    ),
    sig("vram_ledger_set_zero_discarded", "int", &["int", "int"]),
    sig(
        "vram_ledger_kv_reserve",
        "char *",
        &["int", "uint64_t", "int64_t", "uint64_t"],
    ),
    sig("vram_ledger_kv_commit", "char *", &["int"]),
    sig(
        "vram_ledger_kv_resize",
        "char *",
        &["int", "uint64_t", "uint64_t"],
    ),
    sig("vram_ledger_kv_info", "char *", &["int"]),
    sig("vram_ledger_kv_release", "int", &["int"]),
];

/// The library's description as JSON (free it with `vram_ledger_string_free`), NULL on error:
/// `tags`, each with its `name`, its other accepted spellings (`aliases`) and its `bit` in the
/// masks of `vram_ledger_sleep` and `vram_ledger_wake`; `modes`, each with its `name` and
/// whether it is a virtual-memory mode (`virtual`, which sleep needs); and `functions`, each
/// exported function's `name`, `returns` and `args` as C types.
#[no_mangle]
pub extern "C" fn vram_ledger_abi_json() -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let tags: Vec<_> = Tag::ALL
            .into_iter()
            .map(|t| json!({ "name": t.name(), "aliases": t.aliases(), "bit": tag_bit(t) }))
            .collect();
        let modes: Vec<_> = SegmentMode::ALL
            .into_iter()
            .map(|m| json!({ "name": m.name(), "virtual": m.is_virtual() }))
            .collect();
        let abi = json!({ "tags": tags, "modes": modes, "functions": SIGNATURES });
        Ok(into_c_string(abi.to_string()))
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::ffi::CStr;

    use super::*;
    use crate::ffi::declarations::{c_type, exported, no_mangle_count, sources};
    use crate::ffi::sleep::tags as tags_of;

    #[test]
    fn the_signature_table_matches_every_exported_function_in_src_ffi() {
        let (mut declared, mut no_mangle) = (BTreeMap::new(), 0);
        for source in sources().values() {
            no_mangle += no_mangle_count(source);
            for f in exported(source) {
                let c = |t: &String| {
                    c_type(t).unwrap_or_else(|| {
                        panic!("{}: no C spelling for the Rust type `{t}`; add one", f.name)
                    })
                };
                let params: Vec<&str> = f.params.iter().map(|(_, t)| c(t)).collect();
                let returns = c(&f.returns);
                let old = declared.insert(f.name.clone(), (params, returns));
                assert!(old.is_none(), "{} is declared twice", f.name);
            }
        }
        assert_eq!(
            no_mangle,
            declared.len(),
            "an exported function in src/ffi is declared in a form this test does not read: \
             {declared:?}"
        );
        let table: BTreeMap<_, _> = SIGNATURES
            .iter()
            .map(|s| (s.name.to_owned(), (s.args.to_vec(), s.returns)))
            .collect();
        assert_eq!(
            table.len(),
            SIGNATURES.len(),
            "a name is in the table twice"
        );
        for (name, decl) in &declared {
            let Some(entry) = table.get(name) else {
                panic!("{name} is exported but missing from the table in src/ffi/abi.rs");
            };
            assert_eq!(
                entry, decl,
                "{name}: the table in src/ffi/abi.rs (left) differs from its declaration (right)"
            );
        }
        for name in table.keys() {
            assert!(
                declared.contains_key(name),
                "{name} is in the table but src/ffi exports no such function"
            );
        }
    }

    fn abi() -> serde_json::Value {
        let p = vram_ledger_abi_json();
        assert!(!p.is_null());
        // SAFETY: a string this library returned, freed once below.
        let text = unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned();
        // SAFETY: as above.
        unsafe { vram_ledger_string_free(p) };
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn tags_are_described_as_they_are_parsed_and_decoded() {
        let abi = abi();
        let tags = abi["tags"].as_array().unwrap();
        assert_eq!(tags.len(), Tag::COUNT);
        for (t, described) in Tag::ALL.into_iter().zip(tags) {
            assert_eq!(described["name"], t.name());
            let bit = described["bit"].as_i64().unwrap() as std::ffi::c_int;
            assert_eq!(tags_of(bit, "mask"), Ok(vec![t]));
            for alias in described["aliases"].as_array().unwrap() {
                assert_eq!(alias.as_str().unwrap().parse::<Tag>(), Ok(t));
            }
        }
        let kv = tags.iter().find(|t| t["name"] == "kv_cache").unwrap();
        assert_eq!(kv["aliases"], json!(["kv"]));
    }

    #[test]
    fn modes_and_functions_are_described() {
        let abi = abi();
        let modes = abi["modes"].as_array().unwrap();
        let names: Vec<&str> = modes.iter().map(|m| m["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["native", "expandable", "compact", "remap"]);
        for m in modes {
            let mode: SegmentMode = m["name"].as_str().unwrap().parse().unwrap();
            assert_eq!(m["virtual"], mode.is_virtual());
        }
        let functions = abi["functions"].as_array().unwrap();
        assert_eq!(functions.len(), SIGNATURES.len());
        let cap = functions
            .iter()
            .find(|f| f["name"] == "vram_ledger_set_cap")
            .unwrap();
        assert_eq!(cap["returns"], "int");
        assert_eq!(cap["args"], json!(["int", "int64_t"]));
    }
}
