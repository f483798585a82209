//! Shared set-up of the tests on the simulated device (nothing here needs a GPU or cudarc, so a
//! test binary that includes only this file compiles fast): allocators on a fresh simulated
//! device, the invariant check, the shipped traces, PyTorch's segment sizes as the tests state
//! them, a small deterministic generator, the sleep tests' engine, and [`per_mode!`], which runs a case in every segment
//! mode as one test per mode.
//!
//! Included as `#[macro_use] #[path = "common/sim.rs"] mod common;` by the simulated tests, and
//! as `common::sim` by the GPU tests' `tests/common/mod.rs`.

#![allow(dead_code, unused_macros)]

use std::path::Path;

use vram_ledger::driver::sim::{SimConfig, SimDriver};
use vram_ledger::replay::engine::H200_CAPACITY;
use vram_ledger::replay::{self, ReplayOptions, ReplayResult, Trace};
use vram_ledger::units::MIB;
use vram_ledger::{invariants, Allocation, Allocator, Config, SegmentMode};

/// One `#[test]` per segment mode for the case `fn $case(mode: SegmentMode)`, each named by the
/// mode's own name ([`SegmentMode::name`]) in a module named for the case, so that a failure
/// names its mode: `per_mode!(stress);` gives `stress::native`, `stress::expandable`,
/// `stress::compact` and `stress::remap`. `per_mode!(case: compact, remap);` keeps to the modes
/// named.
macro_rules! per_mode {
    ($case:ident) => {
        per_mode!($case: native, expandable, compact, remap);
    };
    ($case:ident: $($mode:ident),+ $(,)?) => {
        mod $case {
            $(
                #[test]
                fn $mode() {
                    super::$case(stringify!($mode).parse().expect("a segment mode's name"));
                }
            )+
        }
    };
}

// `per_mode!` without a list names every mode.
const _: () = assert!(SegmentMode::ALL.len() == 4, "per_mode! lists four modes");

/// An allocator in `mode`, with the default settings, on a fresh simulated device.
pub fn sim(mode: SegmentMode) -> Allocator<SimDriver> {
    sim_with(Config::with_mode(mode))
}

/// An allocator with `config` on a fresh simulated device.
pub fn sim_with(config: Config) -> Allocator<SimDriver> {
    sim_on(SimConfig::default(), config)
}

/// An allocator with `config` on a fresh simulated device made as `device` says.
pub fn sim_on(device: SimConfig, config: Config) -> Allocator<SimDriver> {
    Allocator::new(SimDriver::with_config(device), config).unwrap()
}

/// An allocator in `mode` that moves free memory between streams' shards before growing
/// (compact, remap), on a fresh simulated device made as `device` says.
pub fn sim_moving(mode: SegmentMode, device: SimConfig) -> Allocator<SimDriver> {
    sim_on(device, moving(mode, false))
}

/// The settings of [`sim_moving`], with remap's moves without a wait (`Config::unmap_later`)
/// as `unmap_later` says.
pub fn moving(mode: SegmentMode, unmap_later: bool) -> Config {
    Config {
        move_across_streams: true,
        unmap_later,
        ..Config::with_mode(mode)
    }
}

/// An allocator in `mode` on the replay's device: an H200's memory, no context overhead.
pub fn h200(mode: SegmentMode) -> Allocator<SimDriver> {
    let device = SimConfig {
        capacity: H200_CAPACITY,
        context_overhead: 0,
        ..Default::default()
    };
    sim_on(device, Config::with_mode(mode))
}

/// Every invariant of `a` holds.
#[track_caller]
pub fn check(a: &Allocator<SimDriver>) {
    invariants::check_sim(a).unwrap();
}

/// Frees `ptrs` and empties the cache: the driver then holds nothing for `a`.
#[track_caller]
pub fn free_all(a: &Allocator<SimDriver>, ptrs: impl IntoIterator<Item = u64>) {
    for p in ptrs {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.driver().held_bytes(), 0, "bytes left with the driver");
}

/// A trace of `tests/data` by name (`gpt2-train` for `tests/data/gpt2-train.pickle.gz`).
pub fn trace(name: &str) -> Trace {
    replay::read_file(Path::new(&format!("tests/data/{name}.pickle.gz")), None).unwrap()
}

/// `t` replayed in `mode` with the default options.
pub fn replay_in(t: &Trace, mode: SegmentMode) -> ReplayResult {
    let opts = ReplayOptions {
        mode,
        ..Default::default()
    };
    replay::replay(t, &opts, |_| {}).unwrap()
}

/// The plain segment PyTorch's rules give a request rounded to `rounded` bytes when nothing is
/// cached: 2 MiB for the small pool (at most 1 MiB), 20 MiB below 10 MiB, otherwise the request
/// rounded up to 2 MiB.
pub fn fresh_segment(rounded: u64) -> u64 {
    if rounded <= MIB {
        2 * MIB
    } else if rounded < 10 * MIB {
        20 * MIB
    } else {
        rounded.div_ceil(2 * MIB) * 2 * MIB
    }
}

/// A small deterministic generator, so that a failing sequence can be replayed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The virtual-memory modes, which sleep needs.
pub const VIRTUAL: [SegmentMode; 3] = [
    SegmentMode::Expandable,
    SegmentMode::Compact,
    SegmentMode::Remap,
];

/// An allocator in `mode` with tags kept apart (as sleep needs), on a device of `capacity`
/// bytes.
pub fn tags_apart(mode: SegmentMode, capacity: u64) -> Allocator<SimDriver> {
    let device = SimConfig {
        capacity,
        ..SimConfig::default()
    };
    let config = Config {
        separate_tags: true,
        ..Config::with_mode(mode)
    };
    sim_on(device, config)
}

/// [`check`], and two independent accounts of graph memory: the ledger's gauge, kept as memory
/// is mapped and unmapped, against a walk of the segments now.
pub fn check_graphs(a: &Allocator<SimDriver>) {
    check(a);
    assert_eq!(
        a.snapshot().graph_reserved_bytes.current,
        a.graph_memory().reserved,
        "graph gauge against the walk"
    );
}

/// Distinct words at the start and end of an allocation's requested bytes.
pub fn stamp(a: &Allocator<SimDriver>, x: &Allocation, seed: u64) {
    let d = a.driver();
    d.write_word(x.ptr, seed).unwrap();
    d.write_word(x.ptr + x.requested / 8 * 8 - 8, !seed)
        .unwrap();
}

/// Whether [`stamp`]'s words with `seed` are there.
pub fn stamped(a: &Allocator<SimDriver>, x: &Allocation, seed: u64) -> bool {
    let d = a.driver();
    d.read_word(x.ptr).ok() == Some(seed)
        && d.read_word(x.ptr + x.requested / 8 * 8 - 8).ok() == Some(!seed)
}

/// Whether memory is mapped behind the allocation's start.
pub fn readable(a: &Allocator<SimDriver>, x: &Allocation) -> bool {
    a.driver().read_word(x.ptr).is_ok()
}

/// A sleeping engine's memory (the sleep tests'): weights of several sizes (small and large
/// pool), a KV cache, an activation kept alive, on streams 0x10 and 0x20, each stamped from
/// 0x1000 in that order (the activation 0x1007); freed activations leave cache behind.
pub struct Engine {
    pub weights: Vec<Allocation>,
    pub kv: Vec<Allocation>,
    pub act: Allocation,
}

pub fn engine(a: &Allocator<SimDriver>) -> Engine {
    use vram_ledger::driver::StreamId;
    use vram_ledger::Tag;
    let (s, other) = (StreamId(0x10), StreamId(0x20));
    let w = |n, s| a.allocate_tagged(n, s, Tag::Weights).unwrap();
    let weights = vec![
        w(4096, s),
        w(700 << 10, s),
        w(30 * MIB, s),
        w(130 * MIB + 512, s),
        w(3 * MIB, other),
    ];
    let kv = vec![
        a.allocate_tagged(200 * MIB, s, Tag::KvCache).unwrap(),
        a.allocate_tagged(64 * MIB, other, Tag::KvCache).unwrap(),
    ];
    let act = a.allocate_tagged(5 * MIB, s, Tag::Activation).unwrap();
    let tmp = a.allocate_tagged(50 * MIB, s, Tag::Activation).unwrap();
    a.free(tmp.ptr).unwrap();
    for (i, x) in weights.iter().chain(&kv).chain([&act]).enumerate() {
        stamp(a, x, 0x1000 + i as u64);
    }
    Engine { weights, kv, act }
}

impl Engine {
    /// Whether every weight holds what [`engine`] stamped into it.
    pub fn weights_intact(&self, a: &Allocator<SimDriver>) -> bool {
        self.weights
            .iter()
            .enumerate()
            .all(|(i, x)| stamped(a, x, 0x1000 + i as u64))
    }
}
