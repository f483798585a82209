//! What tests and callers may do to, and learn about, a simulated process besides the
//! driver calls: memory behind the allocator's back, usage visibility, what it holds.

use super::{DriverCall, DriverResult, SimDevice, SimDriver};
use crate::driver::DevicePtr;

impl SimDriver {
    /// Allocate memory behind the allocator's back (a library calling cudaMalloc directly).
    pub fn alloc_external(&self, bytes: u64) -> DriverResult<()> {
        let mut st = self.device.state.lock();
        self.check_room(&st, bytes, DriverCall::AllocSegment)?;
        st.processes
            .get_mut(&self.pid)
            .expect("process exists")
            .external += bytes;
        Ok(())
    }

    /// Free memory allocated with [`SimDriver::alloc_external`].
    pub fn free_external(&self, bytes: u64) {
        let mut st = self.device.state.lock();
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        p.external = p.external.saturating_sub(bytes);
    }

    /// Whether `process_usage` can see this process (false models PID namespaces).
    pub fn set_usage_visible(&self, visible: bool) {
        self.device
            .state
            .lock()
            .processes
            .get_mut(&self.pid)
            .expect("process exists")
            .usage_visible = visible;
    }

    /// This process's device usage as the device counts it (context, memory behind the
    /// allocator's back, and what it holds), whether or not `process_usage` may see it: what a
    /// test checks the allocator against. Unlike `process_usage` it is no driver call, so it is
    /// neither counted nor failed by an injected fault.
    pub fn usage_now(&self) -> u64 {
        self.device.state.lock().processes[&self.pid].usage()
    }

    /// Bytes of plain segments plus physical handles this process holds through the driver
    /// (what an allocator on it has reserved), excluding context and external memory.
    pub fn held_bytes(&self) -> u64 {
        let st = self.device.state.lock();
        let p = &st.processes[&self.pid];
        let held = p.segments.values().sum::<u64>() + p.phys.values().map(|h| h.bytes).sum::<u64>();
        // The room checks use the running total: every test that reads this checks it.
        assert_eq!(
            held, p.held,
            "the simulated device's running total of held bytes"
        );
        held
    }

    /// Number of live driver objects: segments, physical handles, reservations, mappings.
    pub fn live_objects(&self) -> usize {
        let st = self.device.state.lock();
        let p = &st.processes[&self.pid];
        p.segments.len() + p.phys.len() + p.reservations.len() + p.mappings.len()
    }

    /// Whether `[ptr, ptr+bytes)` lies inside this process's accessible device memory.
    pub fn is_accessible(&self, ptr: DevicePtr, bytes: u64) -> bool {
        let st = self.device.state.lock();
        let p = &st.processes[&self.pid];
        if let Some((&base, &size)) = p.segments.iter().find(|(&b, &s)| ptr >= b && ptr < b + s) {
            return ptr + bytes <= base + size;
        }
        // Walk mappings covering the range in address order.
        let mut cursor = ptr;
        let end = ptr + bytes;
        while cursor < end {
            match p.mappings.range(..=cursor).next_back() {
                Some((&va, m)) if cursor < va + m.bytes && m.accessible => cursor = va + m.bytes,
                _ => return false,
            }
        }
        true
    }
}

impl SimDevice {
    /// Bytes of segments and physical handles that processes still held when they exited
    /// (their driver was dropped): memory only the exit gave back.
    pub fn reclaimed_at_exit(&self) -> u64 {
        self.state.lock().reclaimed_at_exit
    }
}
