//! Typed errors. Out of memory is a value carrying the whole picture, never a panic.

use std::fmt;

use thiserror::Error;

use crate::driver::{DevicePtr, DriverError};
use crate::ledger::PerTag;
use crate::tag::UnknownTag;
use crate::units::Bytes;

/// Everything known when an allocation could not be served, after the cache was released and
/// the allocation retried.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct OomReport {
    /// Bytes the caller asked for.
    pub requested: u64,
    /// What the allocator needed from the driver for it.
    pub needed: u64,
    pub device_total: u64,
    pub device_free: u64,
    /// This process's usage as the driver reports it, when it can.
    pub process_usage: Option<u64>,
    /// Bytes allocated to awake tags (an asleep tag's allocations hold no device memory; they
    /// are in `asleep`).
    pub allocated: u64,
    pub reserved: u64,
    /// Reserved but unallocated.
    pub cached: u64,
    /// process usage − reserved: context, libraries, memory allocated behind our back.
    pub non_allocator: Option<u64>,
    pub per_tag: PerTag<u64>,
    /// Bytes of each tag given back to the driver while it sleeps (its allocations stay
    /// allocated, in `per_tag`).
    pub asleep: PerTag<u64>,
    pub limit: Option<u64>,
    /// The budget contract: what this process as a whole may use, when one is set.
    pub cap: Option<u64>,
    /// The allocator's segment mode ([`crate::SegmentMode::name`]).
    pub mode: &'static str,
    /// Why the last attempt failed.
    #[serde(serialize_with = "as_text")]
    pub cause: OomCause,
}

/// How every out-of-memory message begins.
pub const OUT_OF_MEMORY: &str = "out of device memory.";

/// Why the allocator could not get more memory for a request.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum OomCause {
    /// Growing would pass the allocator's limit.
    #[error("{} more would exceed the allocator's limit of {} ({} held)", Bytes(*wanted), Bytes(*limit), Bytes(*held))]
    Limit { wanted: u64, held: u64, limit: u64 },
    /// Growing would take this process past its budget contract (the memory it requested).
    #[error(
        "{} more would take this process to {} ({} held by the allocator, {} outside it), past the {} it requested (its budget contract)",
        Bytes(*wanted), Bytes(held + wanted + outside), Bytes(*held), Bytes(*outside), Bytes(*cap)
    )]
    Cap {
        wanted: u64,
        held: u64,
        outside: u64,
        cap: u64,
    },
    /// The KV cache would grow past what the budget contract (and the allocator's limit)
    /// leaves it: to `to` bytes mapped in all, `wanted` more than it has.
    #[error(
        "growing it to {} ({} more) is past the {} left to it ({})",
        Bytes(*to), Bytes(*wanted), Bytes(room.room), room
    )]
    KvRoom {
        to: u64,
        wanted: u64,
        room: Box<crate::allocator::KvRoom>,
    },
    /// The driver has no memory for it.
    #[error(transparent)]
    Device(DriverError),
    /// A virtual segment's reservation has no unmapped range left that could hold it.
    #[error("the virtual segment's address space is exhausted")]
    AddressSpace,
    /// Memory was mapped, but it does not adjoin enough free memory to hold the request.
    #[error("the mapped memory is not contiguous with enough free memory")]
    NotContiguous,
}

fn as_text<S: serde::Serializer>(cause: &OomCause, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(cause)
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{OUT_OF_MEMORY} Tried to allocate {} (needing {} more from the driver). \
             The device has a total capacity of {} of which {} is free.",
            Bytes(self.requested),
            Bytes(self.needed),
            Bytes(self.device_total),
            Bytes(self.device_free)
        )?;
        self.details(f)
    }
}

/// How [`OomReport::torch_message`] begins, as PyTorch's own message does after its "CUDA out
/// of memory." (which the throwing hook puts first).
pub const TORCH_OUT_OF_MEMORY: &str = "Tried to allocate ";

impl OomReport {
    /// The report as PyTorch words an out-of-memory on GPU `device` ("Tried to allocate X. GPU
    /// N has a total capacity of Y of which Z is free."), then vram-ledger's breakdown.
    pub fn torch_message(&self, device: i32) -> String {
        let mut s = format!(
            "{TORCH_OUT_OF_MEMORY}{}. GPU {device} has a total capacity of {} of which {} is free. \
             vram-ledger needed {} more from the driver.",
            Bytes(self.requested),
            Bytes(self.device_total),
            Bytes(self.device_free),
            Bytes(self.needed)
        );
        let _ = self.details(&mut s);
        s
    }

    /// Everything after the request and the device's figures: this process's usage, the
    /// allocator's and each tag's bytes, the limit and the contract, the last failure.
    fn details(&self, f: &mut impl fmt::Write) -> fmt::Result {
        if let Some(p) = self.process_usage {
            write!(f, " This process has {} in use.", Bytes(p))?;
        }
        write!(
            f,
            " Of it, {} is allocated by vram-ledger and {} is reserved but unallocated (cached)",
            Bytes(self.allocated),
            Bytes(self.cached)
        )?;
        match self.non_allocator {
            Some(n) => write!(
                f,
                "; {} is outside the allocator (context, libraries).",
                Bytes(n)
            )?,
            None => write!(
                f,
                "; memory outside the allocator is unknown (the driver cannot see this process)."
            )?,
        }
        write!(f, " Allocated by tag:")?;
        for t in crate::tag::Tag::ALL {
            write!(f, " {} {}", t, Bytes(self.per_tag[t]))?;
        }
        write!(f, ".")?;
        if self.asleep.0.iter().any(|&b| b > 0) {
            write!(f, " Asleep (given back to the driver until they wake):")?;
            for t in crate::tag::Tag::ALL
                .into_iter()
                .filter(|&t| self.asleep[t] > 0)
            {
                write!(f, " {} {}", t, Bytes(self.asleep[t]))?;
            }
            write!(f, ".")?;
        }
        if let Some(l) = self.limit {
            write!(f, " The allocator's limit is {}.", Bytes(l))?;
        }
        if let Some(c) = self.cap {
            write!(
                f,
                " This process holds itself to the {} it requested (its budget contract).",
                Bytes(c)
            )?;
        }
        write!(f, " Last failure: {}.", self.cause)?;
        // What is still cached after the release could not be given back: free memory beside
        // live blocks (or in graph pools, which keep theirs).
        if self.cached > self.needed {
            if self.mode == crate::SegmentMode::Native.name() {
                write!(
                    f,
                    " Much is cached but fragmented: a virtual-memory mode (expandable, compact or remap) may help."
                )?;
            } else {
                write!(
                    f,
                    " Much is cached but pinned beside live blocks or held by graph pools."
                )?;
            }
        }
        Ok(())
    }
}

#[derive(Debug, Error)]
pub enum Error {
    #[error("{0}")]
    OutOfMemory(Box<OomReport>),

    #[error("pointer {0:#x} was not allocated by this allocator, or was already freed")]
    UnknownPointer(DevicePtr),

    // PyTorch's allocator words this refusal "Tried to allocate more than 1EB memory", which
    // tools and PyTorch's own tests look for.
    #[error(
        "Tried to allocate more than 1EB memory: a request of {0} bytes (at least 2^60) is refused"
    )]
    SizeTooLarge(u64),

    #[error("invalid memory limit: {0}")]
    InvalidLimit(String),

    #[error(transparent)]
    UnknownTag(#[from] UnknownTag),

    #[error("no device with ordinal {ordinal}: {available} device(s) available")]
    NoSuchDevice { ordinal: usize, available: usize },

    #[error(
        "device {ordinal} is a {active} device, not a {wanted} one (VRAM_LEDGER_DRIVER chooses)"
    )]
    WrongBackend {
        ordinal: usize,
        wanted: &'static str,
        active: &'static str,
    },

    #[error(transparent)]
    Driver(#[from] DriverError),

    #[error("stream {0:?} is not capturing a CUDA graph")]
    NotCapturing(crate::driver::StreamId),

    #[error("no capture or graph is known for graph pool {0:?}")]
    UnknownGraphPool(crate::driver::GraphPool),

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("tag {0} is asleep: wake it before allocating its memory")]
    Asleep(crate::tag::Tag),

    #[error(
        "sleep needs a virtual-memory mode (expandable, compact or remap); this allocator is {0}"
    )]
    SleepNeedsVirtualMemory(&'static str),

    #[error("sleep needs the tags' memory kept apart (Config::separate_tags, or sleep=True in Python) from the allocator's start")]
    SleepNeedsSeparateTags,

    #[error("cannot {0} while a CUDA graph is being captured")]
    Capturing(&'static str),

    #[error("the KV cache cannot grow: {0}")]
    KvShort(Box<OomCause>),

    #[error("the graph pool's checkpoint cannot be restored: {0}")]
    StaleCheckpoint(String),

    #[error("no KV cache is reserved on this device")]
    NoKvCache,

    #[error("could not wake {tag}: {source}")]
    Wake {
        tag: crate::tag::Tag,
        #[source]
        source: Box<Error>,
    },

    #[error(
        "allocator shard {shard} was left inconsistent by a panic during an earlier operation; \
         its streams' memory can no longer be used (other shards still work)"
    )]
    Poisoned { shard: usize },

    /// Profiling failed ([`crate::profile`]); an allocator or driver error met while
    /// profiling is that error itself, not this.
    #[error(transparent)]
    Profile(Box<crate::profile::ProfileError>),
}

/// So that one `?` serves an engine's start-up, profiling included, in a function that returns
/// [`Result`].
impl From<crate::profile::ProfileError> for Error {
    fn from(e: crate::profile::ProfileError) -> Error {
        match e {
            crate::profile::ProfileError::Alloc(e) => e,
            crate::profile::ProfileError::Driver(e) => Error::Driver(e),
            e => Error::Profile(Box::new(e)),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
