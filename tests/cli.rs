//! The command line as a user meets it: what `replay` says when a trace does not fit, the
//! values it refuses, the picture it draws, and `rules` for a request of 0 bytes.

use std::process::{Command, Output};

fn cli(args: &[&str]) -> Output {
    // Where the binary was built, unless a bundle moved it elsewhere.
    let exe = std::env::var("VRAM_LEDGER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_vram-ledger").to_string());
    Command::new(exe).args(args).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn a_trace_that_does_not_fit_names_each_mode_out_of_memory_and_marks_none_best() {
    let out = cli(&[
        "replay",
        "tests/data/gpt2-train.pickle.gz",
        "--capacity",
        "1G",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    for mode in ["native", "expandable", "compact", "remap"] {
        assert!(
            s.lines()
                .any(|l| l.trim_start().starts_with(&format!("{mode}: "))
                    && l.contains("allocations did not fit in 1.00 GiB")),
            "{mode} not named:\n{s}"
        );
    }
    assert!(!s.contains("(best)"), "{s}");
    // At the default capacity it fits: nothing is named, and a mode is marked.
    let out = cli(&["replay", "tests/data/gpt2-train.pickle.gz"]);
    let s = text(&out.stdout);
    assert!(
        !s.contains("did not fit") && s.contains("remap (best)"),
        "{s}"
    );
}

#[test]
fn values_that_would_give_empty_figures_are_refused() {
    for (args, says) in [
        (["--capacity", "1"], "--capacity: 1 is less than the 2 MiB"),
        (["--capacity", "0"], "--capacity: 0 is less than the 2 MiB"),
        (["--remap-piece", "0"], "--remap-piece: 0 is no piece"),
        (
            ["--sync-us", "1e300"],
            "--sync-us: 1e300 is not a number of microseconds",
        ),
    ] {
        let out = cli(&[
            "replay",
            "tests/data/streams-train-0.pickle.gz",
            args[0],
            args[1],
        ]);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = text(&out.stderr);
        assert!(err.contains(says) && err.lines().count() == 1, "{err}");
    }
}

#[test]
fn the_picture_is_of_the_mode_marked_best() {
    let svg = std::env::temp_dir().join(format!("vram-ledger-cli-{}.svg", std::process::id()));
    let out = cli(&[
        "replay",
        "tests/data/gpt2-train.pickle.gz",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let picture = std::fs::read_to_string(&svg).unwrap();
    let _ = std::fs::remove_file(&svg);
    assert!(text(&out.stdout).contains("remap (best)"));
    assert!(
        picture.contains("remap mode, fragmentation"),
        "{}",
        &picture[..300.min(picture.len())]
    );
}

#[test]
fn rules_of_a_zero_byte_request_is_no_block() {
    let out = cli(&["rules", "0", "512"]);
    assert!(out.status.success());
    let s = text(&out.stdout);
    let zero = s
        .lines()
        .find(|l| l.trim_start().starts_with("0 "))
        .unwrap();
    assert!(
        zero.contains("none (null)") && !zero.contains("small"),
        "{s}"
    );
    assert!(s
        .lines()
        .any(|l| l.trim_start().starts_with("512 ") && l.contains("small")));
}
