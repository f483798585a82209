//! CUDA-graph capture on the simulated device, in every segment mode: allocations on a
//! capturing stream move no memory and poll no events, and their out-of-memory retry releases
//! no cache, so the capture stays valid through growth, frees, another stream's allocations
//! and an out-of-memory retry; everything catches up once it is over. The simulated device
//! spoils a capture the way CUDA does (a synchronise of the capturing stream, a query of an
//! event recorded into the capture), so a slip would show.

#[path = "common/sim.rs"]
mod common;

use common::{check, sim, sim_with};
use vram_ledger::driver::sim::SimDriver;
use vram_ledger::driver::DriverCall;
use vram_ledger::units::MIB;
use vram_ledger::{Config, Error, Limit, SegmentMode, StreamId, Tag};

const CAPTURE: StreamId = StreamId(0x100);
const EAGER: StreamId = StreamId(0x200);

#[test]
fn capture_stays_valid_in_every_mode() {
    // Every mode; and remap moving memory without a wait, whose old mappings still wait for
    // the capture stream's work when the capture begins.
    let moving_later = Config {
        unmap_later: true,
        ..Config::with_mode(SegmentMode::Remap)
    };
    let configs = SegmentMode::ALL.map(Config::with_mode);
    for config in configs.into_iter().chain([moving_later]) {
        let (mode, later) = (config.mode, config.unmap_later);
        let a = sim_with(config);
        let dev = a.driver().device().clone();
        // A move on the capture stream while its work still runs (with unmap_later, the old
        // mapping waits for that work): 40 MiB freed under work, then 60 MiB asked for.
        let x = a
            .allocate_tagged(40 * MIB, CAPTURE, Tag::Activation)
            .unwrap();
        let y = a
            .allocate_tagged(20 * MIB, CAPTURE, Tag::Activation)
            .unwrap();
        dev.submit_touching(CAPTURE, x.ptr, x.size);
        a.free(x.ptr).unwrap();
        let z = a
            .allocate_tagged(60 * MIB, CAPTURE, Tag::Activation)
            .unwrap();
        for p in [y.ptr, z.ptr] {
            a.free(p).unwrap();
        }
        let moved_later = a.driver_calls()[DriverCall::RecordEvent] > 0;
        assert_eq!(moved_later, later, "{mode}: a move without a wait");
        // Cached memory on both streams before the capture: free memory that compact and remap
        // would otherwise move, and segments that empty_cache would otherwise release.
        for (stream, sizes) in [
            (CAPTURE, [3 * MIB, 40 * MIB, 700]),
            (EAGER, [5 * MIB, 64 * MIB, 900]),
        ] {
            let xs: Vec<_> = sizes
                .iter()
                .map(|&n| a.allocate_tagged(n, stream, Tag::Activation).unwrap())
                .collect();
            for x in xs {
                a.free(x.ptr).unwrap();
            }
        }
        // An eager block used on the capture stream, freed before the capture: its event is on
        // the capture stream, so polling it during the capture would spoil it.
        let shared = a.allocate_tagged(8 * MIB, EAGER, Tag::Activation).unwrap();
        a.record_stream(shared.ptr, CAPTURE).unwrap();
        dev.submit(CAPTURE);
        a.free(shared.ptr).unwrap();

        dev.begin_capture(CAPTURE);
        let mut graph = Vec::new();
        for n in [100 * MIB, 2 * MIB, 30 * MIB, 512, 150 * MIB] {
            graph.push(a.allocate_tagged(n, CAPTURE, Tag::Activation).unwrap());
        }
        // Freed inside the capture and allocated again: growth and reuse on the capturing
        // stream, while the eager stream allocates (and polls its pending events).
        a.free(graph.remove(0).ptr).unwrap();
        graph.push(
            a.allocate_tagged(120 * MIB, CAPTURE, Tag::Activation)
                .unwrap(),
        );
        let e = a.allocate_tagged(6 * MIB, EAGER, Tag::Activation).unwrap();
        a.free(e.ptr).unwrap();
        // Out of memory inside the capture: the retry releases the cache, but not the capture's.
        a.set_limit(Some(Limit::Bytes(
            a.snapshot().reserved_bytes.current + 4 * MIB,
        )))
        .unwrap();
        let err = a
            .allocate_tagged(256 * MIB, CAPTURE, Tag::Activation)
            .unwrap_err();
        assert!(matches!(err, Error::OutOfMemory(_)), "{mode}: {err}");
        a.set_limit(None).unwrap();
        assert!(
            dev.end_capture(CAPTURE),
            "{mode}: the allocator spoiled the capture"
        );
        check(&a);
        assert!(
            dev.unsafe_unmaps().is_empty(),
            "{mode}: {:?}",
            dev.unsafe_unmaps()
        );

        // After the capture everything is released as usual.
        for x in graph {
            a.free(x.ptr).unwrap();
        }
        dev.complete_all();
        a.empty_cache().unwrap();
        assert_eq!(a.driver().held_bytes(), 0, "{mode}");
        check(&a);
    }
}

#[test]
fn capture_is_spoiled_by_a_synchronise_in_the_simulator() {
    // The simulator's side of the test above: a synchronise or an event query on a capturing
    // stream spoils the capture and fails.
    use vram_ledger::driver::Driver;
    let d = SimDriver::new();
    let dev = d.device().clone();
    dev.begin_capture(CAPTURE);
    assert!(d.is_capturing(CAPTURE));
    assert!(!d.is_capturing(EAGER));
    d.sync_stream(EAGER).unwrap();
    let ev = d.record_event(CAPTURE).unwrap();
    assert!(d.query_event(ev).is_err());
    assert!(!dev.end_capture(CAPTURE));
    dev.begin_capture(CAPTURE);
    assert!(d.sync_stream(CAPTURE).is_err());
    assert!(!dev.end_capture(CAPTURE));
    dev.begin_capture(CAPTURE);
    assert!(
        dev.end_capture(CAPTURE),
        "a capture nothing touched stays valid"
    );
}

#[test]
fn a_block_freed_while_a_stream_that_used_it_captures_waits_for_events_recorded_after() {
    // An event recorded into a capture can never be queried or waited for (during the capture
    // it would spoil it; after, it is the graph's): a block freed while a stream that used it
    // captures is held, unreusable, and its events are recorded once the capture is over, as
    // PyTorch's allocator defers them. The cache then empties without an error.
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let dev = a.driver().device().clone();
        let shared = a.allocate_tagged(8 * MIB, EAGER, Tag::Activation).unwrap();
        a.record_stream(shared.ptr, CAPTURE).unwrap();
        dev.begin_capture(CAPTURE);
        a.free(shared.ptr).unwrap();
        // The eager stream polls its events meanwhile, and cannot take the held block.
        let e = a.allocate_tagged(8 * MIB, EAGER, Tag::Activation).unwrap();
        assert_ne!(
            e.ptr, shared.ptr,
            "{mode}: reused before the capture's stream reached the free"
        );
        a.free(e.ptr).unwrap();
        check(&a);
        assert!(dev.end_capture(CAPTURE), "{mode}: the capture was spoiled");
        a.empty_cache().unwrap_or_else(|e| panic!("{mode}: {e}"));
        assert_eq!(
            a.ledger().reserved(),
            0,
            "{mode}: the held block was given back too"
        );
        check(&a);
    }
}
