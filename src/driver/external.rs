//! Device memory from an allocator the host names for one pool (PyTorch's
//! `torch.cuda.MemPool(allocator)`): the pool's segments come from it and go back to it, whole,
//! as plain segments; the allocator caches and splits them as it does its own.
//!
//! Like the [`super::Driver`], this is a door to device memory that the allocator only passes
//! through: it calls a source for a segment when a pool that has one grows, and gives the
//! segment back to the same source, whatever happened to the pool meanwhile. The C ABI's
//! source (the host's functions) is in `ffi/pools.rs`.

use std::fmt;
use std::sync::Arc;

use super::{DevicePtr, DriverResult, StreamId};

/// Where a pool's segments come from.
pub trait SegmentSource: Send + Sync + fmt::Debug {
    /// `bytes` of device memory for use on `stream`.
    fn alloc(&self, bytes: u64, stream: StreamId) -> DriverResult<DevicePtr>;
    /// Give back a segment `alloc` returned (`bytes` as it was asked for).
    fn free(&self, ptr: DevicePtr, bytes: u64, stream: StreamId) -> DriverResult<()>;
    /// What makes two sources the same allocator (a pool held again with the same one is
    /// not a different one): by default this object's address.
    fn key(&self) -> [usize; 3] {
        [self as *const Self as *const u8 as usize, 0, 0]
    }
}

/// A source, shared by its pool and every segment it gave.
pub type Source = Arc<dyn SegmentSource>;
