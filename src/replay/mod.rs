//! Replay of PyTorch memory snapshots through the allocator on a simulated device: does a
//! workload fit, and how fragmented does it get, compared with what PyTorch recorded.

mod addr_hash;
mod before;
pub mod engine;
mod error;
pub mod input;
pub mod peak;
mod pickle_guard;
mod shared_pickle;
pub mod snapshot;
pub mod svg;
pub mod trace;

pub use before::Before;
pub use engine::{at_peak, replay, ReplayOptions, ReplayResult};
pub use input::{Limits, MAX_INPUT_BYTES};
pub use peak::PeakBreakdown;
pub use pickle_guard::{Refusal, MAX_DEPTH};
pub use shared_pickle::SharedPickleError;
pub use trace::{read_file, read_file_with, FieldError, Trace, TraceError, MAX_STREAMS};
