//! Arbitrary operation sequences on the allocator over the simulated driver, with the invariant
//! checker after every step; at the end everything can be freed and returned. The KV cache's
//! operations are among them: a commit or resize that maps memory never takes this process past
//! its cap, and a failed one leaves the KV cache as it was.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use vram_ledger::driver::sim::{SimConfig, SimDriver};
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{invariants, Allocation, Allocator, Config, KvCache, Limit, SegmentMode, Tag};

#[derive(Arbitrary, Debug)]
enum Op {
    Alloc {
        size: u32,
        shift: u8,
        stream: u8,
        tag: u8,
    },
    Free {
        pick: u16,
        hinted: bool,
    },
    FreeRaw {
        ptr: u64,
    },
    RecordStream {
        pick: u16,
        stream: u8,
    },
    Submit {
        stream: u8,
    },
    Complete {
        stream: u8,
    },
    EmptyCache,
    Limit {
        mib: Option<u16>,
    },
    ResetPeaks,
    Fault {
        call: u8,
        nth: u8,
    },
    Sleep {
        offload: u8,
        discard: u8,
    },
    Wake {
        mask: u8,
    },
    Cap {
        mib: Option<u16>,
    },
    KvReserve {
        block_kib: u16,
        max_mib: Option<u16>,
        initial: u8,
    },
    KvCommit,
    KvResize {
        blocks: u16,
        free_from: u16,
    },
    KvRelease,
}

fn tags(mask: u8) -> Vec<Tag> {
    Tag::ALL
        .into_iter()
        .filter(|t| mask & (1 << t.index()) != 0)
        .collect()
}

#[derive(Arbitrary, Debug)]
struct Input {
    mode: u8,
    ops: Vec<Op>,
}

const CALLS: [DriverCall; DriverCall::ALL.len()] = DriverCall::ALL;

fn check(a: &Allocator<SimDriver>) {
    let mut d = a.dump();
    d.driver_held = Some(a.driver().held_bytes());
    if let Err(v) = invariants::check(&d) {
        panic!("{v}");
    }
}

/// A KV cache that mapped more keeps this process within its cap (when it had one).
fn kv_grew_within_cap(a: &Allocator<SimDriver>, before: Option<KvCache>, after: KvCache) {
    let grew = before.is_none_or(|b| after.mapped_bytes > b.mapped_bytes);
    if let (true, Some(cap)) = (grew, a.cap()) {
        // Read from the device's own count: a driver call here would be counted, shift the
        // planted faults, and could itself be failed by one.
        let usage = a.driver().usage_now();
        assert!(
            usage <= cap,
            "the KV cache grew to {usage} bytes of usage past the cap {cap}"
        );
    }
}

fuzz_target!(|input: Input| {
    let mode = [
        SegmentMode::Native,
        SegmentMode::Expandable,
        SegmentMode::Compact,
        SegmentMode::Remap,
    ][input.mode as usize % 4];
    let drv = SimDriver::with_config(SimConfig {
        capacity: 2 * GIB,
        context_overhead: 64 * MIB,
        ..Default::default()
    });
    let config = Config {
        mode,
        move_across_streams: input.mode & 4 != 0,
        separate_tags: input.mode & 8 != 0,
        unmap_later: input.mode & 16 != 0,
        // Remap's piece from the top bits: the default, pieces of a few granules (many moves),
        // one byte (rounded up to a granule) and the largest a caller can ask for.
        remap_piece: [
            None,
            Some(2 * MIB),
            Some(4 * MIB),
            Some(6 * MIB),
            Some(20 * MIB),
            Some(1),
            Some(u64::MAX),
            None,
        ][(input.mode >> 5) as usize],
        ..Default::default()
    };
    let a = Allocator::new(drv, config).unwrap();
    let dev = a.driver().device().clone();
    let mut live: Vec<Allocation> = Vec::new();
    // Small inputs: 64 steps, each checked, reach every entry point and its failures; a longer
    // sequence costs a check per step more and finds little that a shorter one does not.
    for op in input.ops.into_iter().take(64) {
        // The invariants read the allocator's state (and what the driver holds for it): an
        // operation that does not call the allocator leaves them as the last check saw them.
        // Planting a fault only arms the simulated driver, and a raw free of a pointer that is
        // live (or NULL) is skipped below: neither calls the allocator either.
        let touched = match op {
            Op::Submit { .. } | Op::Complete { .. } | Op::Fault { .. } => false,
            Op::Free { .. } | Op::RecordStream { .. } => !live.is_empty(),
            Op::FreeRaw { ptr } => ptr != 0 && !live.iter().any(|x| x.ptr == ptr),
            _ => true,
        };
        match op {
            Op::Alloc {
                size,
                shift,
                stream,
                tag,
            } => {
                let size = u64::from(size) << (shift % 12);
                if let Ok(x) = a.allocate_tagged(
                    size,
                    StreamId(u64::from(stream % 4) * 0x100),
                    Tag::ALL[tag as usize % 4],
                ) {
                    live.push(x);
                }
            }
            Op::Free { pick, hinted } if !live.is_empty() => {
                let i = pick as usize % live.len();
                let x = live[i];
                let r = if hinted {
                    a.free_on(x.ptr, x.stream)
                } else {
                    a.free(x.ptr)
                };
                if r.is_ok() {
                    live.swap_remove(i);
                }
            }
            Op::FreeRaw { ptr } => {
                if !live.iter().any(|x| x.ptr == ptr) && ptr != 0 {
                    assert!(a.free(ptr).is_err());
                }
            }
            Op::RecordStream { pick, stream } if !live.is_empty() => {
                let x = live[pick as usize % live.len()];
                if x.ptr != 0 {
                    a.record_stream(x.ptr, StreamId(u64::from(stream % 4) * 0x100))
                        .unwrap();
                }
            }
            // Work on the stream that uses its newest allocation awake, so that an unmap of
            // memory under unfinished work is seen (`unsafe_unmaps`, checked at the end).
            Op::Submit { stream } => {
                let s = StreamId(u64::from(stream % 4) * 0x100);
                let asleep = a.asleep_tags();
                match live
                    .iter()
                    .rev()
                    .find(|x| x.stream == s && x.ptr != 0 && !asleep.contains(&x.tag))
                {
                    Some(x) => dev.submit_touching(s, x.ptr, x.size),
                    None => dev.submit(s),
                }
            }
            Op::Complete { stream } => dev.complete(StreamId(u64::from(stream % 4) * 0x100)),
            Op::EmptyCache => {
                let _ = a.empty_cache();
            }
            Op::Limit { mib } => a
                .set_limit(mib.map(|m| Limit::Bytes(u64::from(m) * MIB)))
                .unwrap(),
            Op::ResetPeaks => a.ledger().reset_peaks(),
            Op::Fault { call, nth } => {
                a.driver().clear_faults();
                a.driver()
                    .fail_nth(CALLS[call as usize % CALLS.len()], u64::from(nth % 4) + 1);
            }
            Op::Sleep { offload, discard } => {
                let _ = a.sleep(&tags(offload), &tags(discard));
            }
            Op::Wake { mask } => {
                let _ = a.wake(&tags(mask));
            }
            Op::Cap { mib } => a.set_cap(mib.map(|m| u64::from(m) * MIB)),
            Op::KvReserve {
                block_kib,
                max_mib,
                initial,
            } => {
                let max = max_mib.map(|m| u64::from(m) * MIB);
                let _ = a.reserve_kv(u64::from(block_kib) * 1024, max, u64::from(initial));
            }
            Op::KvCommit => {
                let before = a.kv_cache();
                match a.commit_kv() {
                    Ok(c) => kv_grew_within_cap(&a, before, c.kv),
                    Err(_) => assert_eq!(a.kv_cache(), before, "a failed commit changes nothing"),
                }
            }
            Op::KvResize { blocks, free_from } => {
                let before = a.kv_cache();
                match a.resize_kv(u64::from(blocks), u64::from(free_from)) {
                    Ok(kv) => kv_grew_within_cap(&a, before, kv),
                    Err(_) => assert_eq!(a.kv_cache(), before, "a failed resize changes nothing"),
                }
            }
            Op::KvRelease => {
                let _ = a.release_kv();
            }
            _ => {}
        }
        if touched {
            check(&a);
        }
    }
    let unsafe_unmaps = dev.unsafe_unmaps();
    assert!(
        unsafe_unmaps.is_empty(),
        "memory unmapped under unfinished work: {unsafe_unmaps:?}"
    );
    a.driver().clear_faults();
    a.set_limit(None).unwrap();
    a.set_cap(None);
    // Frees of sleeping memory are deferred; with the rest given back, what slept fits again.
    for x in live {
        a.free(x.ptr).unwrap();
    }
    dev.complete_all();
    // Giving the cache back retries stranded undos first: then the KV cache's range is free.
    a.empty_cache().unwrap();
    if a.kv_cache().is_some() {
        a.release_kv().unwrap();
    }
    if input.mode & 8 != 0 && mode != SegmentMode::Native {
        a.wake(&[]).unwrap();
        a.empty_cache().unwrap();
    }
    check(&a);
    assert_eq!(a.driver().held_bytes(), 0);
    assert_eq!(a.driver().host_bytes(), 0);
});
