//! The simulated device's streams: work queued and completed when a test says so, and graph
//! capture, which a synchronise of the capturing stream or a query of an event recorded into
//! the capture spoils, as in CUDA.

use super::{DeviceState, SimDevice};
use crate::driver::{DriverCall, DriverError, DriverErrorKind, DriverResult, StreamId};

impl SimDevice {
    /// Queue one unit of work on a stream (it completes when told to).
    pub fn submit(&self, stream: StreamId) {
        self.state
            .lock()
            .streams
            .entry(stream)
            .or_default()
            .submitted += 1;
    }

    /// Complete all work queued so far on a stream.
    pub fn complete(&self, stream: StreamId) {
        let mut st = self.state.lock();
        let s = st.streams.entry(stream).or_default();
        s.completed = s.submitted;
    }

    /// Complete all work on every stream.
    pub fn complete_all(&self) {
        for s in self.state.lock().streams.values_mut() {
            s.completed = s.submitted;
        }
    }

    /// Start capturing a graph on `stream`.
    pub fn begin_capture(&self, stream: StreamId) {
        let mut st = self.state.lock();
        let s = st.streams.entry(stream).or_default();
        s.capturing = true;
        s.invalidated = false;
    }

    /// End the capture on `stream`: whether it stayed valid (nothing synchronised the stream
    /// or queried or waited for an event recorded on it meanwhile).
    pub fn end_capture(&self, stream: StreamId) -> bool {
        let mut st = self.state.lock();
        let s = st.streams.entry(stream).or_default();
        s.capturing = false;
        !s.invalidated
    }
}

impl DeviceState {
    /// Refuse `call` on a capturing `stream`, and spoil the capture, as CUDA does.
    pub(super) fn not_while_capturing(
        &mut self,
        stream: StreamId,
        call: DriverCall,
    ) -> DriverResult<()> {
        let s = self.streams.entry(stream).or_default();
        if s.capturing {
            s.invalidated = true;
            return Err(DriverError::new(
                call,
                DriverErrorKind::Other(900),
                format!(
                    "operation not permitted when stream {:#x} is capturing",
                    stream.0
                ),
            ));
        }
        Ok(())
    }
}
