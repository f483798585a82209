//! How a simulated device is built.

use crate::units::{GIB, MIB};

/// Construction parameters of a simulated device.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Device memory in bytes (default 80 GiB).
    pub capacity: u64,
    /// VMM granularity in bytes (default 2 MiB).
    pub granularity: u64,
    /// Memory charged to each process when it creates its context (default 512 MiB).
    pub context_overhead: u64,
    /// What the host's first wait for the device after the program queued work costs in the
    /// driver-time estimate, in nanoseconds: a stream or device synchronisation, or a segment
    /// free (which synchronises the device). Later waits before more work is queued find the
    /// device drained and cost what they cost idle ([`crate::driver::cost`]). Default `None`:
    /// every wait priced idle.
    pub sync_ns: Option<u64>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            capacity: 80 * GIB,
            granularity: 2 * MIB,
            context_overhead: 512 * MIB,
            sync_ns: None,
        }
    }
}
