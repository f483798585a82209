//! Property tests: random operation sequences against a shadow model, every invariant checked
//! after every step, in both segment modes, with injected driver faults.
//!
//! Cases per property: `VRAM_LEDGER_CASES` (default 1000).

use std::collections::HashMap;

use proptest::prelude::*;
use vram_ledger::driver::sim::{SimConfig, SimDriver};
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::invariants;
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{Allocation, Allocator, Config, Error, Limit, SegmentMode, Tag};

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: u8, tag: u8 },
    Free { pick: usize, hint: bool },
    RecordStream { pick: usize, stream: u8 },
    Submit { stream: u8 },
    Complete { stream: u8 },
    EmptyCache,
    SetLimit(Option<u64>),
    ResetPeaks,
    ResetTagPeaks(u8),
    Fault { call: usize, nth: u64, sticky: bool },
    ClearFaults,
}

const FAULTABLE: [DriverCall; DriverCall::ALL.len()] = DriverCall::ALL;

fn stream(i: u8) -> StreamId {
    StreamId(u64::from(i) * 0x1000)
}

/// Shards are dealt to streams round-robin on first use. Claim them so that stream 3 shares
/// stream 0's shard (several streams' free lists in one shard) and streams 1 and 2 have their
/// own.
fn place_streams(a: &Allocator<SimDriver>) {
    a.shard_of(stream(0));
    for i in 0..15 {
        a.shard_of(StreamId(0xdead_0000 + i));
    }
    a.shard_of(stream(3));
}

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..=4096,
        4 => 4096u64..=MIB,
        3 => MIB..=10 * MIB,
        2 => 10 * MIB..=120 * MIB,
        1 => Just(0u64),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (size_strategy(), 0u8..4, 0u8..4).prop_map(|(size, stream, tag)| Op::Alloc { size, stream, tag }),
        8 => (any::<usize>(), any::<bool>()).prop_map(|(pick, hint)| Op::Free { pick, hint }),
        2 => (any::<usize>(), 0u8..4).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        2 => (0u8..4).prop_map(|stream| Op::Submit { stream }),
        2 => (0u8..4).prop_map(|stream| Op::Complete { stream }),
        1 => Just(Op::EmptyCache),
        1 => proptest::option::of(64u64..=600).prop_map(|m| Op::SetLimit(m.map(|m| m * MIB))),
        1 => Just(Op::ResetPeaks),
        1 => (0u8..4).prop_map(Op::ResetTagPeaks),
        2 => (0..FAULTABLE.len(), 1u64..4, proptest::bool::weighted(0.2)).prop_map(|(call, nth, sticky)| Op::Fault { call, nth, sticky }),
        1 => Just(Op::ClearFaults),
    ]
}

/// What the test knows independently of the allocator. Peaks are tracked per shard, as the
/// ledger documents them, and as one true global peak, which the summed peaks must bound.
#[derive(Default)]
struct Shadow {
    live: Vec<Allocation>,
    now: HashMap<(usize, usize), u64>,
    peak: HashMap<(usize, usize), u64>,
    global_now: [u64; 4],
    global_peak: [u64; 4],
}

impl Shadow {
    fn add(&mut self, a: Allocation, shard: usize) {
        let k = (shard, a.tag.index());
        let now = self.now.entry(k).or_default();
        *now += a.size;
        let p = self.peak.entry(k).or_default();
        *p = (*p).max(*now);
        let t = a.tag.index();
        self.global_now[t] += a.size;
        self.global_peak[t] = self.global_peak[t].max(self.global_now[t]);
        self.live.push(a);
    }
    fn remove(&mut self, i: usize, shard: usize) -> Allocation {
        let a = self.live.swap_remove(i);
        *self.now.get_mut(&(shard, a.tag.index())).unwrap() -= a.size;
        self.global_now[a.tag.index()] -= a.size;
        a
    }
    fn reset(&mut self, tag: Option<usize>) {
        for (k, p) in self.peak.iter_mut() {
            if tag.is_none_or(|t| t == k.1) {
                *p = self.now[k];
            }
        }
        for t in 0..4 {
            if tag.is_none_or(|x| x == t) {
                self.global_peak[t] = self.global_now[t];
            }
        }
    }
    fn tag_now(&self, t: usize) -> u64 {
        self.global_now[t]
    }
    fn tag_peak(&self, t: usize) -> u64 {
        self.peak
            .iter()
            .filter(|(k, _)| k.1 == t)
            .map(|(_, p)| p)
            .sum()
    }
}

fn check_all(a: &Allocator<SimDriver>, shadow: &Shadow) -> Result<(), TestCaseError> {
    let mut d = a.dump();
    d.driver_held = Some(a.driver().held_bytes());
    invariants::check(&d).map_err(|v| TestCaseError::fail(v.to_string()))?;
    let s = a.snapshot();
    for t in Tag::ALL {
        let i = t.index();
        prop_assert_eq!(
            s.per_tag[t].allocated_bytes.current,
            shadow.tag_now(i),
            "{} current",
            t
        );
        prop_assert_eq!(
            s.per_tag[t].allocated_bytes.peak,
            shadow.tag_peak(i),
            "{} peak",
            t
        );
        prop_assert!(
            s.per_tag[t].allocated_bytes.peak >= shadow.global_peak[i],
            "{} peak below the true peak",
            t
        );
    }
    prop_assert_eq!(
        a.live_allocations(),
        shadow.live.iter().filter(|x| x.ptr != 0).count()
    );
    // No two live allocations overlap, and each lies in accessible device memory.
    let mut live: Vec<_> = shadow.live.iter().filter(|x| x.ptr != 0).collect();
    live.sort_by_key(|x| x.ptr);
    for w in live.windows(2) {
        prop_assert!(
            w[0].ptr + w[0].size <= w[1].ptr,
            "overlap: {:?} and {:?}",
            w[0],
            w[1]
        );
    }
    for x in live {
        prop_assert!(
            a.driver().is_accessible(x.ptr, x.size),
            "{:?} is not in mapped memory",
            x
        );
    }
    Ok(())
}

fn run(mode: SegmentMode, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let drv = SimDriver::with_config(SimConfig {
        capacity: GIB,
        context_overhead: 64 * MIB,
        ..Default::default()
    });
    let a = Allocator::new(
        drv,
        Config {
            mode,
            ..Default::default()
        },
    )
    .unwrap();
    let dev = a.driver().device().clone();
    place_streams(&a);
    let mut shadow = Shadow::default();
    for op in ops {
        match op {
            Op::Alloc {
                size,
                stream: s,
                tag,
            } => {
                let reserved_before = a.snapshot().reserved_bytes.current;
                match a.allocate_tagged(size, stream(s), Tag::ALL[tag as usize]) {
                    Ok(x) => {
                        prop_assert!(x.size >= x.requested && x.requested == size);
                        prop_assert_eq!(x.size % 512, 0);
                        shadow.add(x, a.shard_of(x.stream));
                    }
                    Err(Error::OutOfMemory(r)) => prop_assert_eq!(r.requested, size),
                    Err(Error::Driver(_)) => {}
                    Err(e) => return Err(TestCaseError::fail(format!("unexpected error {e}"))),
                }
                let reserved = a.snapshot().reserved_bytes.current;
                if let Some(limit) = a.limit() {
                    prop_assert!(
                        reserved <= limit.max(reserved_before),
                        "limit {} exceeded: {}",
                        limit,
                        reserved
                    );
                }
            }
            Op::Free { pick, hint } if !shadow.live.is_empty() => {
                let i = pick % shadow.live.len();
                let x = shadow.live[i];
                let r = if hint {
                    a.free_on(x.ptr, x.stream)
                } else {
                    a.free(x.ptr)
                };
                match r {
                    Ok(()) => {
                        shadow.remove(i, a.shard_of(x.stream));
                        // A second free of the same pointer is an error that changes nothing.
                        if x.ptr != 0 {
                            let before = a.snapshot();
                            prop_assert!(matches!(a.free(x.ptr), Err(Error::UnknownPointer(_))));
                            prop_assert_eq!(a.snapshot(), before);
                        }
                    }
                    Err(Error::Driver(e)) => prop_assert_eq!(e.call, DriverCall::RecordEvent),
                    Err(e) => return Err(TestCaseError::fail(format!("free failed: {e}"))),
                }
            }
            Op::Free { .. } => {}
            Op::RecordStream { pick, stream: s } if !shadow.live.is_empty() => {
                let x = shadow.live[pick % shadow.live.len()];
                if x.ptr != 0 {
                    a.record_stream(x.ptr, stream(s))
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
            }
            Op::RecordStream { .. } => {}
            Op::Submit { stream: s } => dev.submit(stream(s)),
            Op::Complete { stream: s } => dev.complete(stream(s)),
            Op::EmptyCache => {
                let _ = a.empty_cache();
            }
            Op::SetLimit(l) => a.set_limit(l.map(Limit::Bytes)).unwrap(),
            Op::ResetPeaks => {
                a.ledger().reset_peaks();
                shadow.reset(None);
            }
            Op::ResetTagPeaks(t) => {
                a.ledger().reset_tag_peaks(Tag::ALL[t as usize]);
                shadow.reset(Some(t as usize));
            }
            Op::Fault { call, nth, sticky } => {
                // One armed fault at a time: each failure path is exercised on its own.
                a.driver().clear_faults();
                if sticky {
                    a.driver().fail_from(FAULTABLE[call], nth);
                } else {
                    a.driver().fail_nth(FAULTABLE[call], nth);
                }
            }
            Op::ClearFaults => a.driver().clear_faults(),
        }
        check_all(&a, &shadow)?;
    }
    // Once faults stop, every byte can be freed and returned to the driver.
    a.driver().clear_faults();
    for x in std::mem::take(&mut shadow.live) {
        a.free(x.ptr)
            .map_err(|e| TestCaseError::fail(format!("final free: {e}")))?;
        shadow.live.push(x);
        let last = shadow.live.len() - 1;
        shadow.remove(last, a.shard_of(x.stream));
    }
    dev.complete_all();
    a.empty_cache()
        .map_err(|e| TestCaseError::fail(format!("final empty_cache: {e}")))?;
    check_all(&a, &shadow)?;
    let s = a.snapshot();
    prop_assert_eq!(s.reserved_bytes.current, 0);
    prop_assert_eq!(s.active_bytes.current, 0);
    prop_assert_eq!(a.driver().held_bytes(), 0);
    prop_assert_eq!(a.driver().live_objects(), 0);
    Ok(())
}

fn cases() -> u32 {
    std::env::var("VRAM_LEDGER_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 4096, ..ProptestConfig::default() })]

    #[test]
    fn model_plain_segments(ops in proptest::collection::vec(op_strategy(), 1..80)) {
        run(SegmentMode::Native, ops)?;
    }

    #[test]
    fn model_expandable_segments(ops in proptest::collection::vec(op_strategy(), 1..80)) {
        run(SegmentMode::Expandable, ops)?;
    }
}

#[test]
fn model_streams_cover_shared_and_distinct_shards() {
    let a = Allocator::new(SimDriver::new(), Config::default()).unwrap();
    place_streams(&a);
    let shard = |i| a.shard_of(stream(i));
    assert_eq!(shard(3), shard(0));
    assert_ne!(shard(1), shard(0));
    assert_ne!(shard(2), shard(0));
    assert_ne!(shard(1), shard(2));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 4096, ..ProptestConfig::default() })]

    #[test]
    fn model_compact_segments(ops in proptest::collection::vec(op_strategy(), 1..80)) {
        run(SegmentMode::Compact, ops)?;
    }

    #[test]
    fn model_remap_segments(ops in proptest::collection::vec(op_strategy(), 1..80)) {
        run(SegmentMode::Remap, ops)?;
    }
}
