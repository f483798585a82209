//! Where the simulated device puts plain segments. By default one after the other, with a gap,
//! upwards from 1 TiB. A replay can plan them instead: the addresses the CUDA driver gave a
//! recording's segments, in order. The address order matters to a replay that means to make
//! the same decisions as the recording: a caching allocator's best fit takes the lowest address
//! among free blocks of one size, and CUDA's addresses do not rise with each allocation (51 of
//! the 105 steps between one recorded training run's segments went down).
//!
//! Invariants:
//! - A planned address is used only for an allocation of the planned size, only when it
//!   overlaps no live segment of any process and none of the rising addresses handed out so
//!   far; otherwise the plan ends there, and every later segment rises as usual. Once a plan
//!   was used, rising addresses skip past the segments it placed.

use std::collections::VecDeque;

use super::{DeviceState, SimDevice};
use crate::driver::DevicePtr;

/// Where plain segments go next.
#[derive(Default)]
pub(super) struct Placement {
    planned: VecDeque<(u64, DevicePtr)>,
    /// Some segment got a planned address.
    used: bool,
}

impl SimDevice {
    /// Give plain segments the addresses of `plan` ((bytes, address), in order of allocation)
    /// for as long as the allocations follow it.
    pub fn plan_segment_addresses(&self, plan: impl IntoIterator<Item = (u64, DevicePtr)>) {
        self.state.lock().placement.planned = plan.into_iter().collect();
    }
}

impl DeviceState {
    /// The address for a new segment of `bytes`, `align`-aligned.
    pub(super) fn segment_addr(&mut self, bytes: u64, align: u64) -> DevicePtr {
        if let Some((want, at)) = self.placement.planned.pop_front() {
            let rising = (1 << 40)..self.next_addr;
            let fits = at.checked_add(bytes).is_some_and(|end| {
                at != 0 && at % 512 == 0 && (end <= rising.start || at >= rising.end)
            });
            if want == bytes && fits && self.unused(at, bytes) {
                self.placement.used = true;
                return at;
            }
            self.placement.planned.clear();
        }
        loop {
            let at = self.bump_addr(bytes, align);
            if !self.placement.used || self.unused(at, bytes) {
                return at;
            }
        }
    }

    /// No live segment of any process overlaps `bytes` at `at`.
    fn unused(&self, at: DevicePtr, bytes: u64) -> bool {
        let end = at.saturating_add(bytes);
        self.processes
            .values()
            .flat_map(|p| p.segments.iter())
            .all(|(&s, &b)| end <= s || s.saturating_add(b) <= at)
    }
}

#[cfg(test)]
mod tests {
    use crate::driver::sim::SimDriver;
    use crate::driver::{Driver, StreamId};
    use crate::units::MIB;

    #[test]
    fn segments_take_planned_addresses_until_the_plan_is_left() {
        let d = SimDriver::new();
        let s = StreamId(0);
        let (a, b) = (0x7f00_4000_0000, 0x7f00_0000_0000);
        d.device()
            .plan_segment_addresses([(2 * MIB, a), (20 * MIB, b), (2 * MIB, a + (4 << 20))]);
        assert_eq!(d.alloc_segment(2 * MIB, s).unwrap(), a);
        assert_eq!(
            d.alloc_segment(20 * MIB, s).unwrap(),
            b,
            "lower than the one before"
        );
        // Another size than planned: the plan ends, addresses rise from 1 TiB again.
        let c = d.alloc_segment(4 * MIB, s).unwrap();
        assert!(c >= 1 << 40);
        assert!(d.alloc_segment(2 * MIB, s).unwrap() > c);
    }

    #[test]
    fn a_planned_address_that_a_live_segment_overlaps_ends_the_plan() {
        let d = SimDriver::new();
        let s = StreamId(0);
        let a = 0x7f00_0000_0000;
        d.device()
            .plan_segment_addresses([(20 * MIB, a), (2 * MIB, a + 2 * MIB)]);
        assert_eq!(d.alloc_segment(20 * MIB, s).unwrap(), a);
        let next = d.alloc_segment(2 * MIB, s).unwrap();
        assert!(next >= 1 << 40, "{next:#x} overlaps the live segment");
    }
}
