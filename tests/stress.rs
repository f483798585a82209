//! Concurrency stress: 8 threads doing random operations on distinct and shared streams. Every
//! allocation is checked against a shared shadow interval map (no two live allocations
//! overlap); at quiescent points between rounds the ledger's identity holds and equals the
//! shadow's totals. Each allocation queues work on its stream that uses it (some on a second
//! stream too, with `record_stream`), completed now and then: no block may be handed out while
//! another stream's unfinished work uses it, and nothing unmapped under such work
//! (`SimDevice::unsafe_unmaps`). `VRAM_LEDGER_STRESS_OPS` sets the operations per thread per
//! round.

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier, Mutex};

#[macro_use]
#[path = "common/sim.rs"]
mod common;

use common::{moving, sim_on, Rng};
use vram_ledger::driver::sim::SimConfig;
use vram_ledger::driver::StreamId;
use vram_ledger::invariants;
use vram_ledger::units::GIB;
use vram_ledger::{Allocation, SegmentMode, Tag};

/// Live intervals: start -> (end, owner thread).
type Shadow = Mutex<BTreeMap<u64, (u64, usize)>>;

fn claim(shadow: &Shadow, a: &Allocation, who: usize) {
    let mut m = shadow.lock().unwrap();
    if let Some((&s, &(e, w))) = m.range(..a.ptr + a.size).next_back() {
        assert!(
            e <= a.ptr,
            "overlap: [{:#x},{:#x}) of thread {w} and [{:#x},{:#x}) of thread {who}",
            s,
            e,
            a.ptr,
            a.ptr + a.size
        );
    }
    m.insert(a.ptr, (a.ptr + a.size, who));
}

/// 8 threads, three rounds of random operations in `mode`, checked at the end of each round.
fn stress(mode: SegmentMode) {
    stress_with(mode, false);
}

per_mode!(stress);

/// Remap's moves within a stream's own memory without a wait (`Config::unmap_later`): the
/// same, old mappings unmapped only once their stream's work has finished.
#[test]
fn stress_unmapping_later() {
    stress_with(SegmentMode::Remap, true);
}

fn stress_with(mode: SegmentMode, unmap_later: bool) {
    let ops: u64 = std::env::var("VRAM_LEDGER_STRESS_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    let device = SimConfig {
        capacity: 64 * GIB,
        ..Default::default()
    };
    // Threads on other shards take each other's free memory (compact, remap).
    let a = Arc::new(sim_on(device, moving(mode, unmap_later)));
    let shadow: Arc<Shadow> = Arc::default();
    let threads = 8;
    let barrier = Arc::new(Barrier::new(threads));
    let lives: Vec<Arc<Mutex<Vec<Allocation>>>> = (0..threads).map(|_| Arc::default()).collect();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (a, shadow, barrier, live) =
                (a.clone(), shadow.clone(), barrier.clone(), lives[t].clone());
            let dev = a.driver().device().clone();
            let all: Vec<_> = lives.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9 + t as u64 * 7919);
                // Threads 0..4 have a stream each; 4..8 share two streams.
                let own = StreamId(0x100 * (1 + if t < 4 { t as u64 } else { 4 + t as u64 % 2 }));
                for round in 0..3 {
                    for _ in 0..ops {
                        let r = rng.next();
                        let mut mine = live.lock().unwrap();
                        // Bounded: about 150 live allocations per thread at most.
                        if mine.is_empty() || (mine.len() < 150 && r % 100 < 55) {
                            let size = match r % 7 {
                                0..=2 => 1 + (r >> 8) % 8192,
                                3..=5 => (r >> 8) % (4 << 20),
                                _ => (r >> 8) % (64 << 20),
                            };
                            let tag = Tag::ALL[(r >> 3) as usize % 4];
                            let x = a.allocate_tagged(size, own, tag).unwrap();
                            if x.ptr != 0 {
                                claim(&shadow, &x, t);
                                let users = dev.unfinished_users(x.ptr, x.size, own);
                                assert!(
                                    users.is_empty(),
                                    "{x:?} handed out while {users:?} used it"
                                );
                                dev.submit_touching(own, x.ptr, x.size);
                                if r.is_multiple_of(11) {
                                    // Used on another thread's stream as well.
                                    let other = StreamId(0x100 * (1 + (r >> 12) % 6));
                                    a.record_stream(x.ptr, other).unwrap();
                                    dev.submit_touching(other, x.ptr, x.size);
                                }
                                mine.push(x);
                            }
                        } else {
                            let i = (r >> 20) as usize % mine.len();
                            let x = mine.swap_remove(i);
                            shadow.lock().unwrap().remove(&x.ptr);
                            if r.is_multiple_of(3) {
                                a.free(x.ptr).unwrap();
                            } else {
                                a.free_on(x.ptr, x.stream).unwrap();
                            }
                        }
                        drop(mine);
                        if r.is_multiple_of(997) {
                            a.empty_cache().unwrap();
                        }
                        if r.is_multiple_of(13) {
                            dev.complete(own);
                        }
                        if r.is_multiple_of(1009) {
                            let _ = a.snapshot(); // lock-free reads while others allocate
                        }
                    }
                    // Quiescent point: everyone stops, thread 0 checks.
                    barrier.wait();
                    if t == 0 {
                        invariants::check_sim(&a)
                            .unwrap_or_else(|v| panic!("{mode:?} round {round}: {v}"));
                        let shadow_bytes: u64 = all
                            .iter()
                            .flat_map(|l| l.lock().unwrap().clone())
                            .map(|x| x.size)
                            .sum();
                        assert_eq!(a.snapshot().all.allocated_bytes.current, shadow_bytes);
                    }
                    barrier.wait();
                }
                let mine = std::mem::take(&mut *live.lock().unwrap());
                for x in mine {
                    a.free(x.ptr).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let unsafe_unmaps = a.driver().device().unsafe_unmaps();
    assert!(
        unsafe_unmaps.is_empty(),
        "{mode:?}: {}",
        unsafe_unmaps.join("; ")
    );
    a.driver().device().complete_all();
    a.empty_cache().unwrap();
    assert_eq!(a.driver().held_bytes(), 0);
    assert_eq!(a.live_allocations(), 0);
}
