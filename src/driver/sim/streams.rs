//! The simulated device's streams: work queued and completed when a test says so, and graph
//! capture, which a synchronise of the capturing stream or a query of an event recorded into
//! the capture spoils, as in CUDA.

use super::{DeviceState, SimDevice, SimDriver};
use crate::driver::{DriverCall, DriverError, DriverErrorKind, DriverResult, EventId, StreamId};

impl SimDevice {
    /// A stream of the device's own making ([`crate::driver::Driver::create_stream`]).
    pub(super) fn new_stream(&self) -> StreamId {
        let mut st = self.state.lock();
        let id = StreamId(super::OWN_STREAMS + st.next_handle);
        st.next_handle += 1;
        st.streams.insert(id, super::StreamState::default());
        id
    }

    /// Destroy a stream that [`SimDevice::new_stream`] made; any other is an error, as a
    /// handle CUDA never gave out would be.
    pub(super) fn drop_stream(&self, stream: StreamId) -> DriverResult<()> {
        let mut st = self.state.lock();
        if stream.0 < super::OWN_STREAMS || st.streams.remove(&stream).is_none() {
            return Err(DriverError::new(
                DriverCall::DestroyStream,
                DriverErrorKind::InvalidValue,
                format!("{stream:?} was not made by create_stream or was destroyed already"),
            ));
        }
        Ok(())
    }

    /// Streams made by `create_stream` and not destroyed.
    pub fn own_streams(&self) -> usize {
        let st = self.state.lock();
        st.streams
            .keys()
            .filter(|s| s.0 >= super::OWN_STREAMS)
            .count()
    }

    /// Queue one unit of work on a stream (it completes when told to).
    pub fn submit(&self, stream: StreamId) {
        self.state.lock().queue_unit(stream);
    }

    /// Queue one unit of work that only [`SimDevice::complete`] completes: synchronising the
    /// device does not (it stands for work the allocator cannot wait out, such as what a
    /// replayed trace says completed later).
    pub fn submit_external(&self, stream: StreamId) {
        let mut st = self.state.lock();
        let s = st.streams.entry(stream).or_default();
        s.submitted += 1;
        s.external = true;
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

    /// Start capturing a graph on `stream`; returns the capture's id.
    pub fn begin_capture(&self, stream: StreamId) -> u64 {
        let mut st = self.state.lock();
        st.next_capture += 1;
        let id = st.next_capture;
        let s = st.streams.entry(stream).or_default();
        s.capture = Some(id);
        s.invalidated = false;
        id
    }

    /// Make `stream` part of the capture running on `capturing` (as waiting on an event
    /// recorded in a capture does in CUDA); its capture ends with that one.
    pub fn join_capture(&self, stream: StreamId, capturing: StreamId) {
        let mut st = self.state.lock();
        let id = st.streams.get(&capturing).and_then(|s| s.capture);
        st.streams.entry(stream).or_default().capture = id;
    }

    /// End the capture on `stream`: whether it stayed valid (nothing synchronised the stream
    /// or queried or waited for an event recorded on it meanwhile).
    pub fn end_capture(&self, stream: StreamId) -> bool {
        let mut st = self.state.lock();
        let id = st.streams.entry(stream).or_default().capture;
        let mut valid = true;
        for s in st.streams.values_mut() {
            if id.is_some() && s.capture == id {
                s.capture = None;
                valid &= !s.invalidated;
            }
        }
        valid && !st.streams[&stream].invalidated
    }
}

impl DeviceState {
    /// Queue one unit of work on `stream`; returns its number there (the stream's submitted
    /// count, which its completed count must reach).
    pub(super) fn queue_unit(&mut self, stream: StreamId) -> u64 {
        let s = self.streams.entry(stream).or_default();
        s.submitted += 1;
        s.submitted
    }

    /// The stream and work count of `event`, for a query or a wait (`call`). An event recorded
    /// into a capture is refused: while the capture runs, asking spoils it; after, the event
    /// still belongs to the graph, not to the stream's work (PyTorch's allocator never asks).
    pub(super) fn recorded(
        &mut self,
        event: EventId,
        call: DriverCall,
    ) -> DriverResult<(StreamId, u64)> {
        let (stream, target, captured) = *self
            .events
            .get(&event.0)
            .ok_or_else(|| SimDriver::invalid(call, "unknown event"))?;
        if captured {
            self.not_while_capturing(stream, call)?;
            return Err(SimDriver::invalid(
                call,
                "an event recorded into a stream capture cannot be queried or waited for",
            ));
        }
        Ok((stream, target))
    }

    /// Refuse `call` on a capturing `stream`, and spoil the capture, as CUDA does.
    pub(super) fn not_while_capturing(
        &mut self,
        stream: StreamId,
        call: DriverCall,
    ) -> DriverResult<()> {
        let s = self.streams.entry(stream).or_default();
        if s.capture.is_some() {
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

impl SimDevice {
    /// A CUDA driver dereferences a stream: an allocator's internal key (a graph pool's, a tag
    /// region's: bits 59 and up), or a stream of `create_stream`'s after `destroy_stream`,
    /// reaching it would crash a real process, so here it panics.
    pub(super) fn real_stream(&self, stream: StreamId) {
        assert!(
            stream.0 >> 59 == 0,
            "the driver was given {stream:?}, an allocator key, not a stream"
        );
        assert!(
            stream.0 < super::OWN_STREAMS || self.state.lock().streams.contains_key(&stream),
            "the driver was given {stream:?} after destroy_stream"
        );
    }
}

#[cfg(test)]
mod tests {
    use crate::driver::sim::SimDriver;
    use crate::driver::{Driver, DriverErrorKind, StreamId};

    #[test]
    fn only_streams_it_made_can_be_destroyed_and_only_once() {
        let d = SimDriver::new();
        let s = d.create_stream().unwrap();
        d.sync_stream(s).unwrap();
        assert_eq!(d.device().own_streams(), 1);
        d.destroy_stream(s).unwrap();
        assert_eq!(d.device().own_streams(), 0);
        for bad in [s, StreamId(0x10)] {
            let e = d.destroy_stream(bad).unwrap_err();
            assert_eq!(e.kind, DriverErrorKind::InvalidValue, "{e}");
        }
    }

    #[test]
    #[should_panic(expected = "after destroy_stream")]
    fn a_destroyed_stream_is_never_used_again() {
        let d = SimDriver::new();
        let s = d.create_stream().unwrap();
        d.destroy_stream(s).unwrap();
        let _ = d.sync_stream(s);
    }

    #[test]
    #[should_panic(expected = "an allocator key")]
    fn an_allocator_key_never_reaches_the_driver() {
        let _ = SimDriver::new().sync_stream(StreamId(1 << 63));
    }
}
