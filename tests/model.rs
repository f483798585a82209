//! Property tests: random operation sequences against a shadow model, every invariant checked
//! after every step, in every segment mode, with injected driver faults.
//!
//! Cases per property: `VRAM_LEDGER_CASES` (default 1000).

use std::collections::HashMap;

#[macro_use]
#[path = "common/sim.rs"]
mod common;

use common::{fresh_segment, sim, sim_on, sim_with};
#[path = "common/model_ops.rs"]
mod ops;
#[path = "common/model_rules.rs"]
mod rules;
use ops::{op_strategy, stream, tags_of, Op, FAULTABLE};
use proptest::prelude::*;
use rules::{
    check_best_fit, no_unsafe_unmap, out_of_memory_is_owed, use_new_block, Rules, SegmentCalls,
};
use vram_ledger::driver::sim::{SimConfig, SimDriver};
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::invariants;
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{Allocator, Config, Error, Limit, SegmentMode, Tag};

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

/// One live allocation as the shadow knows it: the pointer and the handed-out size come from
/// the allocator (the size only after it passed [`Rules::handed_out`]), the rest from the op.
#[derive(Clone, Copy, Debug)]
struct Live {
    ptr: u64,
    size: u64,
    requested: u64,
    stream: StreamId,
    tag: Tag,
    shard: usize,
    /// Its first word still holds the stamp written at allocation (its tag was not discarded
    /// by a sleep since).
    intact: bool,
}

/// The word written at the start of an allocation (tag-separated runs).
fn stamp(ptr: u64) -> u64 {
    ptr ^ 0x5a5a_0000_0000_a5a5
}

#[derive(Clone, Copy, Debug, Default)]
struct Gauge {
    now: u64,
    peak: u64,
}

impl Gauge {
    fn add(&mut self, n: u64) {
        self.now += n;
        self.peak = self.peak.max(self.now);
    }
    fn sub(&mut self, n: u64) {
        self.now -= n;
    }
    fn reset(&mut self) {
        self.peak = self.now;
    }
}

/// What the test knows independently of the allocator: per tag, the bytes requested (from the
/// ops), the bytes allocated (sizes checked against the rules) and the number of allocations.
/// Peaks are tracked per shard, as the ledger documents them, and as one true global peak,
/// which the summed peaks must bound.
#[derive(Default)]
struct Shadow {
    live: Vec<Live>,
    /// Freed while their tag slept: still allocated until it wakes.
    deferred: Vec<Live>,
    asleep: [bool; 4],
    allocated: HashMap<(usize, usize), Gauge>,
    requested: HashMap<(usize, usize), Gauge>,
    global: [Gauge; 4],
    /// Allocations carry a stamp (tag-separated runs in the virtual-memory modes).
    stamps: bool,
}

impl Shadow {
    fn add(&mut self, x: Live) {
        let k = (x.shard, x.tag.index());
        self.allocated.entry(k).or_default().add(x.size);
        self.requested.entry(k).or_default().add(x.requested);
        self.global[x.tag.index()].add(x.size);
        self.live.push(x);
    }
    fn remove(&mut self, i: usize) -> Live {
        let x = self.live.swap_remove(i);
        self.uncount(&x);
        x
    }
    /// `x` is no longer allocated.
    fn uncount(&mut self, x: &Live) {
        let k = (x.shard, x.tag.index());
        self.allocated.get_mut(&k).unwrap().sub(x.size);
        self.requested.get_mut(&k).unwrap().sub(x.requested);
        self.global[x.tag.index()].sub(x.size);
    }
    fn reset(&mut self, tag: Option<usize>) {
        let hit = |t: usize| tag.is_none_or(|x| x == t);
        for (k, g) in self.allocated.iter_mut().chain(self.requested.iter_mut()) {
            if hit(k.1) {
                g.reset();
            }
        }
        for (t, g) in self.global.iter_mut().enumerate() {
            if hit(t) {
                g.reset();
            }
        }
    }
    /// Σ over shards of (current, peak) for tag `t`.
    fn sums(m: &HashMap<(usize, usize), Gauge>, t: usize) -> (u64, u64) {
        m.iter()
            .filter(|(k, _)| k.1 == t)
            .fold((0, 0), |(n, p), (_, g)| (n + g.now, p + g.peak))
    }
    fn count(&self, t: usize) -> u64 {
        self.live
            .iter()
            .chain(&self.deferred)
            .filter(|x| x.ptr != 0 && x.tag.index() == t)
            .count() as u64
    }
    fn asleep_tags(&self) -> Vec<Tag> {
        Tag::ALL
            .into_iter()
            .filter(|t| self.asleep[t.index()])
            .collect()
    }
    /// `tag` went to sleep; a discarded tag's contents are gone.
    fn slept(&mut self, tag: Tag, discarded: bool) {
        self.asleep[tag.index()] = true;
        if discarded {
            for x in self
                .live
                .iter_mut()
                .chain(self.deferred.iter_mut())
                .filter(|x| x.tag == tag)
            {
                x.intact = false;
            }
        }
    }
    /// `tag` woke: the frees deferred while it slept happen now.
    fn woke(&mut self, tag: Tag) {
        self.asleep[tag.index()] = false;
        let (gone, kept): (Vec<Live>, Vec<Live>) = std::mem::take(&mut self.deferred)
            .into_iter()
            .partition(|x| x.tag == tag);
        self.deferred = kept;
        for x in &gone {
            self.uncount(x);
        }
    }
}

fn check_all(a: &Allocator<SimDriver>, shadow: &Shadow) -> Result<(), TestCaseError> {
    invariants::check_sim(a).map_err(|v| TestCaseError::fail(v.to_string()))?;
    no_unsafe_unmap(a.driver().device())?;
    let s = a.snapshot();
    for t in Tag::ALL {
        let i = t.index();
        let (now, peak) = Shadow::sums(&shadow.allocated, i);
        prop_assert_eq!(s.per_tag[t].allocated_bytes.current, now, "{} current", t);
        prop_assert_eq!(s.per_tag[t].allocated_bytes.peak, peak, "{} peak", t);
        prop_assert!(
            s.per_tag[t].allocated_bytes.peak >= shadow.global[i].peak,
            "{} peak below the true peak",
            t
        );
        let (now, peak) = Shadow::sums(&shadow.requested, i);
        prop_assert_eq!(s.per_tag[t].requested_bytes.current, now, "{} requested", t);
        prop_assert_eq!(
            s.per_tag[t].requested_bytes.peak,
            peak,
            "{} requested peak",
            t
        );
        prop_assert_eq!(
            s.per_tag[t].allocations.current,
            shadow.count(i),
            "{} allocations",
            t
        );
    }
    prop_assert_eq!(
        a.live_allocations(),
        shadow
            .live
            .iter()
            .chain(&shadow.deferred)
            .filter(|x| x.ptr != 0)
            .count()
    );
    prop_assert_eq!(a.asleep_tags(), shadow.asleep_tags());
    // No two live allocations overlap, and each awake one lies in accessible device memory
    // (holding its stamp where one was written and its tag never discarded).
    let mut live: Vec<_> = shadow
        .live
        .iter()
        .filter(|x| x.ptr != 0 && !shadow.asleep[x.tag.index()])
        .collect();
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
        if shadow.stamps && x.intact {
            prop_assert_eq!(
                a.driver().read_word(x.ptr).ok(),
                Some(stamp(x.ptr)),
                "{:?} lost its contents",
                x
            );
        }
    }
    Ok(())
}

/// The simulated device of every sequence: small, so that sequences run out of memory.
const CAPACITY: u64 = GIB;

fn run(mode: SegmentMode, ops: Vec<Op>) -> Result<(), TestCaseError> {
    run_with(mode, None, ops)
}

fn run_with(mode: SegmentMode, max_split: Option<u64>, ops: Vec<Op>) -> Result<(), TestCaseError> {
    run_config(mode, max_split, false, ops)
}

fn run_config(
    mode: SegmentMode,
    max_split: Option<u64>,
    move_across_streams: bool,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    run_full(mode, max_split, move_across_streams, false, false, ops)
}

fn run_full(
    mode: SegmentMode,
    max_split: Option<u64>,
    move_across_streams: bool,
    separate_tags: bool,
    unmap_later: bool,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let device = SimConfig {
        capacity: CAPACITY,
        context_overhead: 64 * MIB,
        ..Default::default()
    };
    let a = sim_on(
        device,
        Config {
            mode,
            max_split_size: max_split,
            move_across_streams,
            separate_tags,
            unmap_later,
            ..Default::default()
        },
    );
    let sleepable = separate_tags && mode != SegmentMode::Native;
    let rules = Rules {
        virtual_memory: mode != SegmentMode::Native,
        remap: mode == SegmentMode::Remap,
        max_split: max_split.unwrap_or(u64::MAX),
    };
    let dev = a.driver().device().clone();
    place_streams(&a);
    let mut shadow = Shadow {
        stamps: sleepable,
        ..Shadow::default()
    };
    for op in ops {
        match op {
            Op::Alloc {
                size,
                stream: s,
                tag,
            } => {
                let reserved_before = a.snapshot().reserved_bytes.current;
                let (st, tag) = (stream(s), Tag::ALL[tag as usize]);
                let rounded = Rules::round(size);
                let calls_before = SegmentCalls::now(&a);
                let struck = a.driver().faults_struck();
                let before = a.dump();
                let driver_before = a.driver_calls().total();
                match a.allocate_tagged(size, st, tag) {
                    Ok(x) => {
                        prop_assert!(x.size >= x.requested && x.requested == size);
                        prop_assert_eq!(x.size % 512, 0);
                        prop_assert_eq!((x.stream, x.tag), (st, tag));
                        let fresh = if mode == SegmentMode::Native {
                            SegmentCalls::fresh_segment(calls_before, SegmentCalls::now(&a))
                        } else {
                            None
                        };
                        if let Some(bytes) = fresh {
                            prop_assert_eq!(
                                bytes,
                                fresh_segment(rounded),
                                "segment for {} bytes",
                                size
                            );
                        }
                        let (least, most) = rules.handed_out(rounded, fresh.is_some());
                        // Served from the cache: no driver call at all (growth maps, allocates
                        // or queries events).
                        if a.driver_calls().total() == driver_before && x.ptr != 0 {
                            check_best_fit(&before, x.ptr, least, &rules)?;
                        }
                        prop_assert!(
                            least <= x.size && x.size <= most,
                            "{} bytes (rounded {}, fresh segment {:?}) handed out as {}, \
                             expected {}..={}",
                            size,
                            rounded,
                            fresh,
                            x.size,
                            least,
                            most
                        );
                        prop_assert!(
                            !shadow.asleep[tag.index()] || size == 0,
                            "{} allocated while asleep",
                            tag
                        );
                        if shadow.stamps && x.ptr != 0 {
                            a.driver()
                                .write_word(x.ptr, stamp(x.ptr))
                                .map_err(|e| TestCaseError::fail(e.to_string()))?;
                        }
                        if x.ptr != 0 {
                            use_new_block(&dev, x.ptr, x.size, st)?;
                        }
                        shadow.add(Live {
                            ptr: x.ptr,
                            size: x.size,
                            requested: size,
                            stream: st,
                            tag,
                            shard: a.shard_of(st),
                            intact: true,
                        });
                    }
                    Err(Error::Asleep(t)) => prop_assert!(t == tag && shadow.asleep[t.index()]),
                    Err(Error::OutOfMemory(r)) => {
                        prop_assert_eq!(r.requested, size);
                        prop_assert!(
                            a.driver().faults_struck() > struck
                                || out_of_memory_is_owed(
                                    &a,
                                    &dev,
                                    CAPACITY,
                                    rounded,
                                    rules.virtual_memory
                                ),
                            "{} bytes refused with room for them and no fault: {}",
                            size,
                            r
                        );
                    }
                    Err(Error::Driver(e)) => prop_assert!(
                        a.driver().faults_struck() > struck,
                        "driver error with no fault injected: {}",
                        e
                    ),
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
                let struck = a.driver().faults_struck();
                let r = if hint {
                    a.free_on(x.ptr, x.stream)
                } else {
                    a.free(x.ptr)
                };
                match r {
                    Ok(()) if shadow.asleep[x.tag.index()] && x.ptr != 0 => {
                        // Deferred: still allocated until its tag wakes.
                        shadow.deferred.push(shadow.live.swap_remove(i));
                        let before = a.snapshot();
                        prop_assert!(matches!(a.free(x.ptr), Err(Error::UnknownPointer(_))));
                        prop_assert_eq!(a.snapshot(), before);
                    }
                    Ok(()) => {
                        shadow.remove(i);
                        // A second free of the same pointer is an error that changes nothing.
                        if x.ptr != 0 {
                            let before = a.snapshot();
                            prop_assert!(matches!(a.free(x.ptr), Err(Error::UnknownPointer(_))));
                            prop_assert_eq!(a.snapshot(), before);
                        }
                    }
                    Err(Error::Driver(e)) => {
                        prop_assert_eq!(e.call, DriverCall::RecordEvent);
                        prop_assert!(a.driver().faults_struck() > struck, "{}", e);
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("free failed: {e}"))),
                }
            }
            Op::Free { .. } => {}
            Op::RecordStream { pick, stream: s } if !shadow.live.is_empty() => {
                let x = shadow.live[pick % shadow.live.len()];
                if x.ptr != 0 {
                    a.record_stream(x.ptr, stream(s))
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    // Work on a tensor whose tag sleeps would fault: its memory is not mapped.
                    if !shadow.asleep[x.tag.index()] {
                        dev.submit_touching(stream(s), x.ptr, x.size);
                    }
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
            Op::Sleep { offload, discard } => {
                let (off, dis) = (tags_of(offload), tags_of(discard));
                let both = off.iter().any(|t| dis.contains(t));
                let newly: Vec<Tag> = off
                    .iter()
                    .chain(&dis)
                    .copied()
                    .filter(|t| !shadow.asleep[t.index()])
                    .fold(Vec::new(), |mut v, t| {
                        if !v.contains(&t) {
                            v.push(t);
                        }
                        v
                    });
                match a.sleep(&off, &dis) {
                    Ok(r) => {
                        prop_assert!(sleepable && !both);
                        prop_assert_eq!(&r.tags, &newly);
                        for &t in &newly {
                            shadow.slept(t, dis.contains(&t));
                        }
                    }
                    Err(Error::InvalidArgument(_)) => prop_assert!(both),
                    Err(Error::SleepNeedsVirtualMemory(_)) => {
                        prop_assert!(mode == SegmentMode::Native && !both)
                    }
                    Err(Error::SleepNeedsSeparateTags) => prop_assert!(!separate_tags && !both),
                    // A failed sleep leaves every offloaded tag awake; a discarded one may have
                    // been given back while the copies ran.
                    Err(Error::Driver(_)) => {
                        prop_assert!(sleepable);
                        let asleep = a.asleep_tags();
                        for &t in newly.iter().filter(|t| asleep.contains(t)) {
                            prop_assert!(dis.contains(&t), "{} asleep after a failed sleep", t);
                            shadow.slept(t, true);
                        }
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("sleep failed: {e}"))),
                }
            }
            Op::Wake { mask } => {
                let wanted: Vec<Tag> = tags_of(mask);
                let expected: Vec<Tag> = Tag::ALL
                    .into_iter()
                    .filter(|t| {
                        (wanted.is_empty() || wanted.contains(t)) && shadow.asleep[t.index()]
                    })
                    .collect();
                match a.wake(&wanted) {
                    Ok(r) => {
                        prop_assert!(sleepable);
                        prop_assert_eq!(&r.tags, &expected);
                        for t in expected {
                            shadow.woke(t);
                        }
                    }
                    // The tag named still sleeps; the others may have woken in any round
                    // (each wholly: the contents check below holds them to it).
                    Err(Error::Wake { tag, .. }) => {
                        prop_assert!(expected.contains(&tag));
                        let asleep = a.asleep_tags();
                        prop_assert!(asleep.contains(&tag));
                        for t in expected.into_iter().filter(|t| !asleep.contains(t)) {
                            shadow.woke(t);
                        }
                    }
                    Err(Error::SleepNeedsVirtualMemory(_)) => {
                        prop_assert!(mode == SegmentMode::Native)
                    }
                    Err(Error::SleepNeedsSeparateTags) => prop_assert!(!separate_tags),
                    Err(e) => return Err(TestCaseError::fail(format!("wake failed: {e}"))),
                }
            }
        }
        check_all(&a, &shadow)?;
    }
    // Once faults stop, every tag can wake, and every byte can be freed and returned to the
    // driver.
    a.driver().clear_faults();
    a.set_limit(None).unwrap();
    if sleepable {
        a.wake(&[])
            .map_err(|e| TestCaseError::fail(format!("final wake: {e}")))?;
        for t in Tag::ALL {
            shadow.woke(t);
        }
        check_all(&a, &shadow)?;
    }
    while let Some(x) = shadow.live.last().copied() {
        a.free(x.ptr)
            .map_err(|e| TestCaseError::fail(format!("final free: {e}")))?;
        shadow.remove(shadow.live.len() - 1);
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
    prop_assert_eq!(
        a.driver().host_bytes(),
        0,
        "page-locked host memory left after wake"
    );
    Ok(())
}

fn cases() -> u32 {
    std::env::var("VRAM_LEDGER_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// `test` on `cases()` random operation sequences, as `proptest!` runs a property: the seeds
/// saved in `tests/model.proptest-regressions` first, then new ones, a failure shrunk.
fn property(test: impl Fn(Vec<Op>) -> Result<(), TestCaseError>) {
    let mut config = proptest::test_runner::contextualize_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 4096,
        ..ProptestConfig::default()
    });
    config.source_file = Some(file!());
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let ops = proptest::collection::vec(op_strategy(), 1..80);
    if let Err(e) = runner.run(&ops, test) {
        panic!("{e}\n{runner}");
    }
}

/// The model in `mode`, with PyTorch's default settings.
fn model_segments(mode: SegmentMode) {
    property(|ops| run(mode, ops));
}

per_mode!(model_segments);

#[test]
fn model_streams_cover_shared_and_distinct_shards() {
    let a = sim(SegmentMode::Native);
    place_streams(&a);
    let shard = |i| a.shard_of(stream(i));
    assert_eq!(shard(3), shard(0));
    assert_ne!(shard(1), shard(0));
    assert_ne!(shard(2), shard(0));
    assert_ne!(shard(1), shard(2));
}

/// With max_split_size (32 MiB, inside the sizes drawn), oversize blocks are never split; in
/// the virtual-memory modes, growth next to a free block that max_split_size keeps from serving
/// (see `expandable_growth_next_to_an_oversize_free_block`).
fn model_segments_max_split(mode: SegmentMode) {
    property(|ops| run_with(mode, Some(32 * MIB), ops));
}

per_mode!(model_segments_max_split);

/// Free memory of other streams' shards taken before growing (streams 1 and 2 have shards of
/// their own).
fn model_moving_across_streams(mode: SegmentMode) {
    property(|ops| run_config(mode, None, true, ops));
}

per_mode!(model_moving_across_streams: compact, remap);

/// Remap's moves within a stream's own memory without a wait (`Config::unmap_later`), with
/// moves between shards, and with tags kept apart, sleep and wake: the old mappings are
/// unmapped only once the work that used them has finished (the model fails on any unmap under
/// unfinished work), and nothing is left at the end.
#[test]
fn model_unmapping_later() {
    property(|ops| run_full(SegmentMode::Remap, None, true, false, true, ops));
}

#[test]
fn model_unmapping_later_with_sleep() {
    property(|ops| run_full(SegmentMode::Remap, None, true, true, true, ops));
}

/// Sleep and wake among every other operation, tags kept apart, in each virtual-memory mode:
/// asleep tags refuse allocations and defer frees, contents written at allocation survive an
/// offload, kept tags are untouched, and faults leave each tag asleep or awake.
fn model_sleep_and_wake_with_tags_kept_apart(mode: SegmentMode) {
    property(|ops| run_full(mode, None, false, true, false, ops));
}

per_mode!(model_sleep_and_wake_with_tags_kept_apart: expandable, compact, remap);

/// Found by `model_segments_max_split::expandable`: a freed 40 MiB block (at least
/// max_split_size) may not serve a 1 MiB + 1 B request, so the allocator grows; the unmapped
/// range after that free block already "holds" the request with it, so nothing is mapped, and
/// the allocator panicked ("nothing mapped means an error"). Growth now serves from that free
/// block, split as virtual segments always may be.
#[test]
fn expandable_growth_next_to_an_oversize_free_block() {
    let a = sim_with(Config {
        mode: SegmentMode::Expandable,
        max_split_size: Some(32 * MIB),
        ..Default::default()
    });
    let s = StreamId::DEFAULT;
    let x = a.allocate_tagged(20 * MIB + 1, s, Tag::Activation).unwrap();
    a.free(x.ptr).unwrap();
    let y = a.allocate_tagged(MIB + 1, s, Tag::Activation).unwrap();
    assert_eq!(y.size, MIB + 512);
    a.free(y.ptr).unwrap();
}
