//! Remap mode's growth on the simulated device: where the pieces it moves are mapped, what it
//! keeps in place, what the small pool takes, and how much it asks other streams for. Each case
//! counts the driver calls or the reserved bytes that the policy is there to save.

#[path = "common/sim.rs"]
mod common;

use common::{check, free_all, sim, sim_moving, sim_with};
use vram_ledger::allocator::rules::PoolKind;
use vram_ledger::driver::sim::{SimConfig, SimDriver};
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::units::MIB;
use vram_ledger::{Allocator, Config, SegmentMode};

const S0: StreamId = StreamId::DEFAULT;
const S1: StreamId = StreamId(0x1000);

/// Remap with moves between streams' shards.
fn remap_across_streams() -> Allocator<SimDriver> {
    sim_moving(SegmentMode::Remap, SimConfig::default())
}

#[test]
fn remap_growth_maps_spare_pieces_where_they_fit_before_creating_memory() {
    // A hole in stream 0's reservation, narrower than the piece that stream 1 gives up but
    // holding the request with the free blocks beside it: growth goes where the spare piece
    // fits instead of creating memory for the hole.
    let a = remap_across_streams();
    // [x 16 | y 4] [h 30] [z 16 | w 4]: pieces of 20, 30 and 20 MiB.
    let x = a.allocate(16 * MIB, S0).unwrap();
    let y = a.allocate(4 * MIB, S0).unwrap();
    let h = a.allocate(30 * MIB, S0).unwrap();
    let z = a.allocate(16 * MIB, S0).unwrap();
    let w = a.allocate(4 * MIB, S0).unwrap();
    assert_eq!(
        (y.ptr, h.ptr, z.ptr),
        (x.ptr + 16 * MIB, x.ptr + 20 * MIB, x.ptr + 50 * MIB)
    );
    // Freeing h and asking for more than it holds unmaps h's piece: a hole of 30 MiB.
    a.free(h.ptr).unwrap();
    let q = a.allocate(40 * MIB, S0).unwrap();
    assert!(q.ptr >= x.ptr + 70 * MIB);
    // Stream 1 frees a 56 MiB piece; stream 0 frees the blocks on both sides of the hole.
    let s = a.allocate(56 * MIB, S1).unwrap();
    a.free(s.ptr).unwrap();
    a.free(y.ptr).unwrap();
    a.free(z.ptr).unwrap();
    let before = a.ledger().reserved();
    // 4 + 30 + 16 MiB around the hole hold 44 MiB, but the 56 MiB piece fits only past q.
    let r = a.allocate(44 * MIB, S0).unwrap();
    assert_eq!(
        a.ledger().reserved(),
        before,
        "growth created memory beside a spare piece"
    );
    assert!(r.ptr >= q.ptr + q.size);
    check(&a);
    free_all(&a, [x.ptr, w.ptr, q.ptr, r.ptr]);
}

#[test]
fn remap_growth_keeps_the_free_block_it_extends() {
    // A free block at the end of the mapped memory, too small for the request: growth maps
    // only what the block lacks beside it. Moving memory first must not unmap the block itself
    // (and map its piece back a moment later).
    let a = sim(SegmentMode::Remap);
    let x = a.allocate(20 * MIB, S0).unwrap();
    let y = a.allocate(20 * MIB, S0).unwrap();
    assert_eq!(y.ptr, x.ptr + 20 * MIB);
    a.free(y.ptr).unwrap();
    let before = a.driver_calls();
    let z = a.allocate(30 * MIB, S0).unwrap();
    let calls = a.driver_calls().since(&before);
    assert_eq!(z.ptr, y.ptr, "served where the free block is");
    assert_eq!(
        (calls[DriverCall::Unmap], calls[DriverCall::Map]),
        (0, 1),
        "the free block's piece was moved: {:?}",
        calls.nonzero().collect::<Vec<_>>()
    );
    check(&a);
    free_all(&a, [x.ptr, z.ptr]);
}

#[test]
fn remap_small_pool_growth_moves_no_large_piece() {
    // A free 40 MiB piece of the large pool, and a small request that needs a page. Moving the
    // piece would map all 40 MiB under the small pool (CUDA maps whole handles), where small
    // blocks that live long pin it; the page is new memory instead.
    let a = sim(SegmentMode::Remap);
    let big = a.allocate(40 * MIB, S0).unwrap();
    a.free(big.ptr).unwrap();
    let before = a.driver_calls();
    let small = a.allocate(4096, S0).unwrap();
    let calls = a.driver_calls().since(&before);
    assert_eq!(
        (calls[DriverCall::Unmap], calls[DriverCall::CreatePhysical]),
        (0, 1),
        "{:?}",
        calls.nonzero().collect::<Vec<_>>()
    );
    let mapped = |pool: PoolKind| -> u64 {
        let d = a.dump();
        d.segments
            .iter()
            .filter(|s| s.pool == pool)
            .flat_map(|s| s.mapped.iter().map(|r| r.1))
            .sum()
    };
    assert_eq!(mapped(PoolKind::Small), 2 * MIB);
    assert_eq!(
        mapped(PoolKind::Large),
        40 * MIB,
        "the large piece stays where it is"
    );
    check(&a);
    free_all(&a, [small.ptr]);
}

#[test]
fn with_pieces_of_one_granule_the_small_pool_takes_free_large_pages() {
    // Pieces of one granule: every piece is a page the small pool can map, and small blocks pin
    // it no more than a new page. Small requests after a large block was freed take its free
    // pages instead of new memory, and a large request after the small blocks were freed takes
    // their pages back.
    let a = sim_with(Config {
        remap_piece: Some(2 * MIB),
        ..Config::with_mode(SegmentMode::Remap)
    });
    let big = a.allocate(40 * MIB, S0).unwrap();
    a.free(big.ptr).unwrap();
    let before = a.driver_calls();
    let small: Vec<u64> = (0..64)
        .map(|_| a.allocate(512 * 1024, S0).unwrap().ptr)
        .collect();
    let calls = a.driver_calls().since(&before);
    assert_eq!(
        (calls[DriverCall::CreatePhysical], calls[DriverCall::Unmap]),
        (0, 16),
        "32 MiB of small blocks took 16 of the free pages: {:?}",
        calls.nonzero().collect::<Vec<_>>()
    );
    assert_eq!(a.ledger().reserved(), 40 * MIB);
    check(&a);
    for p in small {
        a.free(p).unwrap();
    }
    let again = a.allocate(40 * MIB, S0).unwrap();
    assert_eq!(
        a.ledger().reserved(),
        40 * MIB,
        "the large block took the small pool's free pages back"
    );
    assert_eq!(a.driver().calls(DriverCall::CreatePhysical), 20);
    check(&a);
    free_all(&a, [again.ptr]);
}

#[test]
fn remap_growth_asks_other_streams_again_for_what_its_final_site_lacks() {
    // Stream 0's growth first picks a 20 MiB hole (with the free block beside it) and asks the
    // other streams for 20 MiB; the first that has free memory gives a 24 MiB piece, too wide
    // for the hole. With that piece alone, growth would map at the end of the reservation and
    // create the 6 MiB the piece lacks there; asked again, the next stream gives its free 20 MiB
    // piece too, and no memory is created.
    let a = remap_across_streams();
    let (b, c, e) = (StreamId(0x2000), StreamId(0x3000), StreamId(0x4000));
    // First uses, in this order, put the streams in shards 0 to 3.
    let [x, y, z, w] = [(); 4].map(|()| a.allocate(20 * MIB, S0).unwrap());
    let b_small = a.allocate(4096, b).unwrap();
    let c_piece = a.allocate(24 * MIB, c).unwrap();
    let e_piece = a.allocate(20 * MIB, e).unwrap();
    assert_eq!(
        a.driver().calls(DriverCall::CreatePhysical),
        7,
        "one piece each"
    );
    // Stream b takes y's piece: a hole of 20 MiB between x and z.
    a.free(y.ptr).unwrap();
    let b_big = a.allocate(20 * MIB, b).unwrap();
    assert!(!a.driver().is_accessible(y.ptr, MIB), "y's piece moved");
    a.free(c_piece.ptr).unwrap();
    a.free(e_piece.ptr).unwrap();
    a.free(z.ptr).unwrap();
    let (reserved, creates) = (
        a.ledger().reserved(),
        a.driver().calls(DriverCall::CreatePhysical),
    );
    let r = a.allocate(30 * MIB, S0).unwrap();
    assert_eq!(
        (
            a.driver().calls(DriverCall::CreatePhysical) - creates,
            a.ledger().reserved()
        ),
        (0, reserved),
        "growth created memory while another stream cached a free piece"
    );
    // The second stream's 20 MiB piece fits the hole after all; the 24 MiB one stays spare.
    assert_eq!(r.ptr, y.ptr, "served at the hole");
    check(&a);
    free_all(&a, [x.ptr, w.ptr, r.ptr, b_small.ptr, b_big.ptr]);
}

#[test]
fn remap_rounds_large_blocks_to_granules_when_cheap_and_the_others_keep_pytorch_sizes() {
    // gpt2-train's 147.2 MiB block: remap makes it 148 MiB, so the block carved after it starts
    // on a granule; a 6.8 MiB block would grow by a sixth and keeps PyTorch's size. The other
    // virtual modes split a block where PyTorch's rounding ends.
    let (odd, small) = (154_361_856u64, 7_130_112u64);
    let a = sim(SegmentMode::Remap);
    let x = a.allocate(odd, S0).unwrap();
    let y = a.allocate(small, S0).unwrap();
    let z = a.allocate(32 * MIB, S0).unwrap();
    assert_eq!((x.size, y.size), (148 * MIB, small));
    assert_eq!((y.ptr - x.ptr) % (2 * MIB), 0, "y starts on a granule");
    assert_eq!(
        a.snapshot().all.requested_bytes.current,
        odd + small + 32 * MIB
    );
    check(&a);
    for p in [x.ptr, y.ptr, z.ptr] {
        a.free(p).unwrap();
    }
    for mode in [SegmentMode::Expandable, SegmentMode::Compact] {
        let a = sim(mode);
        assert_eq!(a.allocate(odd, S0).unwrap().size, odd, "{mode}");
    }
}

#[test]
fn remap_rounding_never_takes_a_request_to_max_split_size() {
    // Under `max_split_size` a request may split a cached block; at or over it, it may take a
    // larger block whole. A request 300 KiB under 32 MiB stays under a 32 MiB limit.
    let a = sim_with(Config {
        max_split_size: Some(32 * MIB),
        ..Config::with_mode(SegmentMode::Remap)
    });
    let size = 32 * MIB - 300 * 1024;
    let x = a.allocate(size, S0).unwrap();
    assert_eq!(x.size, size);
    // With no limit in the way the same request is rounded to the granule.
    assert_eq!(
        sim(SegmentMode::Remap).allocate(size, S0).unwrap().size,
        32 * MIB
    );
    a.free(x.ptr).unwrap();
    check(&a);
}

#[test]
fn a_piece_larger_than_any_device_maps_what_growth_needs_without_overflowing() {
    // A caller's largest piece (u64::MAX, through the C ABI or Python) with moves that wait for
    // nothing: in this debug build an overflow in the piece's arithmetic would panic.
    for later in [false, true] {
        let a = sim_with(Config {
            remap_piece: Some(u64::MAX),
            unmap_later: later,
            move_across_streams: true,
            ..Config::with_mode(SegmentMode::Remap)
        });
        let x = a.allocate(40 * MIB, S0).unwrap();
        let y = a.allocate(20 * MIB, S0).unwrap();
        a.free(x.ptr).unwrap();
        // Growth moves x's free piece and maps it with the new bytes: one piece each time.
        let z = a.allocate(60 * MIB, S0).unwrap();
        let s = a.allocate(30 * MIB, S1).unwrap();
        assert_eq!(a.ledger().reserved(), 110 * MIB, "later={later}");
        assert_eq!(
            a.driver().calls(DriverCall::CreatePhysical),
            4,
            "later={later}"
        );
        check(&a);
        free_all(&a, [y.ptr, z.ptr, s.ptr]);
    }
}
