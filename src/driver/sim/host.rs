//! Simulated page-locked host memory, copies between it and the device, and the contents of
//! device memory: 8-byte words that tests write and read back through mapped addresses, kept
//! per physical handle, so that what sleep offloads and wake restores can be checked.
//!
//! Invariants:
//! - Contents belong to a handle (at an offset into it), not to an address: unmapping keeps
//!   them while the handle lives, and releasing the handle's last mapping drops them.
//! - A word nothing wrote reads as stale data (a value of its offset, never 0), as fresh
//!   physical memory holds what this process left there, unless a fill with zeros covered it
//!   since (and no copy to the device overwrote it after). Copies carry written words only, so
//!   zeros offloaded and restored read stale again: a test can trust zeros, never be fooled by
//!   them.
//! - A copy touches only accessible mapped memory and the inside of one page-locked host
//!   buffer; anything else (pageable memory included) fails as an invalid value and copies
//!   nothing (a real copy would fault, or crawl).
//! - A host copy reads and writes the insides of host buffers of either kind, and neither of
//!   them while a device copy queued on it may still run.
//! - Copies complete when queued (a simulated stream has nothing to overlap them with), but
//!   count as work of their stream until it is synchronised, as a real copy may still run: a
//!   host buffer freed before the stream of its last copy is synchronised is an invalid use.

use std::collections::BTreeMap;

use parking_lot::{Condvar, Mutex};

use super::{SimDevice, SimDriver};
use crate::driver::{
    DevicePtr, DriverCall, DriverError, DriverErrorKind, DriverResult, HostPtr, StreamId,
};

/// Host buffers start here, far from device addresses.
const HOST_BASE: u64 = 1 << 52;

pub(super) struct HostBuf {
    bytes: u64,
    /// Words copied into the buffer, by offset.
    words: BTreeMap<u64, u64>,
    /// The stream of the last copy queued on the buffer, and its work count then: the copy
    /// may run until that stream has completed as much.
    last_copy: Option<(StreamId, u64)>,
    /// Ordinary host memory (`host_alloc_pageable`): no device copy may use it.
    pageable: bool,
}

impl SimDevice {
    /// Hold every copy between host and device at its start (`true`) until released
    /// (`false`); [`SimDevice::copies_held`] counts the copies waiting.
    pub fn hold_copies(&self, hold: bool) {
        self.copies.set(hold);
    }

    pub fn copies_held(&self) -> usize {
        self.copies.waiting()
    }
}

/// Where copies wait while a test holds them.
#[derive(Default)]
pub(super) struct CopyGate {
    held: Mutex<(bool, usize)>,
    changed: Condvar,
}

impl CopyGate {
    pub(super) fn set(&self, hold: bool) {
        self.held.lock().0 = hold;
        self.changed.notify_all();
    }

    pub(super) fn waiting(&self) -> usize {
        self.held.lock().1
    }

    fn pass(&self) {
        let mut g = self.held.lock();
        if g.0 {
            g.1 += 1;
            while g.0 {
                self.changed.wait(&mut g);
            }
            g.1 -= 1;
        }
    }
}

pub(super) enum Direction {
    ToHost,
    ToDevice,
}

impl SimDriver {
    pub(super) fn alloc_host(&self, bytes: u64, pageable: bool) -> DriverResult<HostPtr> {
        if bytes == 0 {
            let call = if pageable {
                DriverCall::HostAllocPageable
            } else {
                DriverCall::HostAlloc
            };
            return Err(Self::invalid(call, "zero-byte host buffer"));
        }
        let mut st = self.device.state.lock();
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        // Leave a gap after each buffer so that two never look contiguous.
        let base = p.host.last_key_value().map_or(HOST_BASE, |(&b, h)| {
            (b + h.bytes).next_multiple_of(1 << 21) + (1 << 21)
        });
        p.host.insert(
            base,
            HostBuf {
                bytes,
                words: BTreeMap::new(),
                last_copy: None,
                pageable,
            },
        );
        Ok(HostPtr(base))
    }

    pub(super) fn free_host(&self, ptr: HostPtr) -> DriverResult<()> {
        let mut st = self.device.state.lock();
        let pending = st
            .processes
            .get(&self.pid)
            .expect("process exists")
            .host
            .get(&ptr.0)
            .and_then(|h| h.last_copy)
            .filter(|&(s, n)| st.streams.get(&s).is_some_and(|s| s.completed < n));
        if let Some((s, _)) = pending {
            return Err(Self::invalid(
                DriverCall::HostFree,
                format!(
                    "{:#x} freed while a copy queued on stream {:#x} may still use it",
                    ptr.0, s.0
                ),
            ));
        }
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        p.host.remove(&ptr.0).map(|_| ()).ok_or_else(|| {
            Self::invalid(
                DriverCall::HostFree,
                format!("{:#x} is not a host buffer", ptr.0),
            )
        })
    }

    /// Copy `bytes` between host `host` and device `dev`, in `dir`.
    pub(super) fn copy(
        &self,
        dir: Direction,
        host: HostPtr,
        dev: DevicePtr,
        bytes: u64,
        stream: StreamId,
    ) -> DriverResult<()> {
        let call = match dir {
            Direction::ToHost => DriverCall::CopyToHost,
            Direction::ToDevice => DriverCall::CopyToDevice,
        };
        self.device.copies.pass();
        self.device.real_stream(stream);
        let mut st = self.device.state.lock();
        if st.streams.get(&stream).is_some_and(|s| s.capture.is_some()) {
            return Err(Self::invalid(call, "copy queued on a capturing stream"));
        }
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        let base = p
            .host
            .range(..=host.0)
            .next_back()
            .filter(|(&b, h)| host.0 + bytes <= b + h.bytes)
            .map(|(&b, _)| b)
            .ok_or_else(|| Self::invalid(call, "host range is not inside one host buffer"))?;
        if p.host[&base].pageable {
            return Err(Self::invalid(
                call,
                "a device copy to or from pageable host memory",
            ));
        }
        let host_off = host.0 - base;
        let pieces = Self::device_pieces(p, call, dev, bytes)?;
        for (handle, dev_off, copy_off, len) in pieces {
            let h = host_off + copy_off;
            match dir {
                Direction::ToHost => {
                    let words: Vec<(u64, u64)> = p
                        .contents
                        .get(&handle)
                        .map(|c| {
                            c.range(dev_off..dev_off + len)
                                .map(|(&o, &w)| (o, w))
                                .collect()
                        })
                        .unwrap_or_default();
                    let hb = p.host.get_mut(&base).expect("found above");
                    hb.words.retain(|&o, _| o < h || o >= h + len);
                    hb.words
                        .extend(words.into_iter().map(|(o, w)| (o - dev_off + h, w)));
                }
                Direction::ToDevice => {
                    let words: Vec<(u64, u64)> = p.host[&base]
                        .words
                        .range(h..h + len)
                        .map(|(&o, &w)| (o, w))
                        .collect();
                    let c = p.contents.entry(handle).or_default();
                    c.retain(|&o, _| o < dev_off || o >= dev_off + len);
                    c.extend(words.into_iter().map(|(o, w)| (o - h + dev_off, w)));
                    if let Some(z) = p.zeroed.get_mut(&handle) {
                        *z = subtract(z, dev_off, dev_off + len);
                    }
                }
            }
        }
        // The copy is the stream's work until the stream is synchronised.
        let s = st.streams.entry(stream).or_default();
        s.submitted += 1;
        let upto = s.submitted;
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        p.host.get_mut(&base).expect("found above").last_copy = Some((stream, upto));
        Ok(())
    }

    /// A sleep file as the CUDA backend makes one: created (it must not exist) and removed at
    /// once, so that a path's errors are real; its contents stay in the buffer's words.
    pub(super) fn make_file(&self, path: &std::path::Path) -> DriverResult<()> {
        let fail = |e: std::io::Error| {
            DriverError::new(
                DriverCall::HostAllocPageable,
                DriverErrorKind::Other(e.raw_os_error().unwrap_or(-1)),
                format!("sleep file {}: {e}", path.display()),
            )
        };
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(fail)?;
        std::fs::remove_file(path).map_err(fail)
    }

    /// Copy `bytes` from host `src` to host `dst`, each inside one buffer, neither used by a
    /// device copy that may still run.
    pub(super) fn copy_host(&self, dst: HostPtr, src: HostPtr, bytes: u64) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::HostCopy;
        let mut st = self.device.state.lock();
        let streams = &st.streams;
        let p = &st.processes[&self.pid];
        let find = |at: HostPtr| {
            let (&b, h) = p
                .host
                .range(..=at.0)
                .next_back()
                .filter(|(&b, h)| at.0.checked_add(bytes).is_some_and(|e| e <= b + h.bytes))
                .ok_or_else(|| Self::invalid(CALL, "host range is not inside one host buffer"))?;
            if let Some((s, n)) = h.last_copy {
                if streams.get(&s).is_some_and(|s| s.completed < n) {
                    return Err(Self::invalid(
                        CALL,
                        format!(
                            "{:#x} copied on the host while a copy queued on stream {:#x} may still use it",
                            at.0, s.0
                        ),
                    ));
                }
            }
            Ok((b, at.0 - b))
        };
        let (db, doff) = find(dst)?;
        let (sb, soff) = find(src)?;
        let words: Vec<(u64, u64)> = p.host[&sb]
            .words
            .range(soff..soff + bytes)
            .map(|(&o, &w)| (o - soff + doff, w))
            .collect();
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        let hb = p.host.get_mut(&db).expect("found above");
        hb.words.retain(|&o, _| o < doff || o >= doff + bytes);
        hb.words.extend(words);
        Ok(())
    }

    /// Write an 8-byte word at `va` (accessible mapped memory), as a kernel would.
    pub fn write_word(&self, va: DevicePtr, value: u64) -> DriverResult<()> {
        let mut st = self.device.state.lock();
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        let (handle, off) = Self::resolve(p, va)?;
        p.contents.entry(handle).or_default().insert(off, value);
        Ok(())
    }

    /// The 8-byte word at `va` (stale data where nothing wrote and no fill zeroed it); an
    /// error where `va` is not accessible mapped memory, which on a GPU would be an illegal
    /// address.
    pub fn read_word(&self, va: DevicePtr) -> DriverResult<u64> {
        let st = self.device.state.lock();
        let p = &st.processes[&self.pid];
        let (handle, off) = Self::resolve(p, va)?;
        if let Some(&w) = p.contents.get(&handle).and_then(|c| c.get(&off)) {
            return Ok(w);
        }
        let zero = p
            .zeroed
            .get(&handle)
            .is_some_and(|z| z.iter().any(|&(lo, hi)| lo <= off && off + 8 <= hi));
        Ok(if zero { 0 } else { stale(off) })
    }

    /// Fill `bytes` at `dev` with zeros: accessible mapped memory only (anything else fails as
    /// an invalid value and fills nothing), and not on a capturing stream.
    pub(super) fn zero(&self, dev: DevicePtr, bytes: u64, stream: StreamId) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::FillZero;
        self.device.real_stream(stream);
        let mut st = self.device.state.lock();
        if st.streams.get(&stream).is_some_and(|s| s.capture.is_some()) {
            return Err(Self::invalid(CALL, "fill queued on a capturing stream"));
        }
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        let pieces = Self::device_pieces(p, CALL, dev, bytes)?;
        for (handle, off, _, len) in pieces {
            if let Some(c) = p.contents.get_mut(&handle) {
                c.retain(|&o, _| o < off || o >= off + len);
            }
            p.zeroed.entry(handle).or_default().push((off, off + len));
        }
        Ok(())
    }

    /// Bytes of page-locked host memory this process holds.
    pub fn host_bytes(&self) -> u64 {
        let st = self.device.state.lock();
        st.processes[&self.pid].host.values().map(|h| h.bytes).sum()
    }

    /// Bytes of this process's page-locked host buffers (of [`SimDriver::host_bytes`]).
    pub fn pinned_host_bytes(&self) -> u64 {
        let st = self.device.state.lock();
        let host = st.processes[&self.pid].host.values();
        host.filter(|h| !h.pageable).map(|h| h.bytes).sum()
    }

    /// `[dev, dev + bytes)` mapping by mapping: (handle, offset in it, offset from `dev`,
    /// length); an error where any of it is not accessible mapped memory.
    fn device_pieces(
        p: &super::Process,
        call: DriverCall,
        dev: DevicePtr,
        bytes: u64,
    ) -> DriverResult<Vec<(u64, u64, u64, u64)>> {
        let mut pieces = Vec::new();
        let mut cursor = dev;
        while cursor < dev + bytes {
            match p.mappings.range(..=cursor).next_back() {
                Some((&va, m)) if cursor < va + m.bytes && m.accessible => {
                    let len = (va + m.bytes).min(dev + bytes) - cursor;
                    pieces.push((m.handle, cursor - va, cursor - dev, len));
                    cursor += len;
                }
                _ => {
                    return Err(Self::invalid(
                        call,
                        format!("{cursor:#x} is not accessible device memory"),
                    ))
                }
            }
        }
        Ok(pieces)
    }

    fn resolve(p: &super::Process, va: DevicePtr) -> DriverResult<(u64, u64)> {
        match p.mappings.range(..=va).next_back() {
            Some((&m, mm)) if va + 8 <= m + mm.bytes && mm.accessible => Ok((mm.handle, va - m)),
            _ => Err(Self::invalid(
                DriverCall::CopyToDevice,
                format!("{va:#x} is not accessible mapped memory"),
            )),
        }
    }
}

/// What a word nothing wrote reads: stale data, never 0.
fn stale(off: u64) -> u64 {
    (off ^ 0x5afe_0ff5_e7d0_0000) | 1
}

/// `ranges` less `[lo, hi)`.
fn subtract(ranges: &[(u64, u64)], lo: u64, hi: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::with_capacity(ranges.len() + 1);
    for &(a, b) in ranges {
        if b <= lo || a >= hi {
            out.push((a, b));
            continue;
        }
        if a < lo {
            out.push((a, lo));
        }
        if b > hi {
            out.push((hi, b));
        }
    }
    out
}
