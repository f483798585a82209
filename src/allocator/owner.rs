//! Who owns a block: the key every shard files its segments and free lists under.
//!
//! A block belongs to the stream it was allocated on, or to a CUDA graph pool (memory a capture
//! allocated, kept apart while its graph may replay); with [`super::Config::separate_tags`], to
//! that stream's or that pool's region of its tag (so a tag can sleep without touching another
//! tag's memory, and its captured graphs' memory sleeps with it).
//!
//! Invariant: the driver only ever sees real streams. [`Owner::stream`] is the one way from an
//! owner to a stream, and a graph pool has none: code that must synchronise a pool's memory
//! synchronises the device, and growth for a pool passes the driver the caller's stream.

use crate::driver::StreamId;
use crate::tag::Tag;

/// A graph pool's key in the shards' tables (the registry deals them out, `routes.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PoolKey(pub(crate) u32);

/// The owner of a block, a segment and a set of free lists: a stream's own memory or a graph
/// pool's, or (tags kept apart) its region of one tag. Two words, compared as such:
/// the cached path compares owners to find a shard's free lists.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Owner {
    /// The stream, or the pool's key.
    id: u64,
    /// [`STREAM`], a stream region's tag index + 1, [`POOL`], or [`POOL`] − 1 − a pool
    /// region's tag index.
    kind: u32,
}

const STREAM: u32 = 0;
const POOL: u32 = u32::MAX;
/// The lowest kind of a pool or pool region.
const POOL_REGIONS: u32 = POOL - Tag::COUNT as u32;
/// No owner: a free-list slot given up, for the next owner to take.
const VACANT: u32 = POOL_REGIONS - 1;

impl Owner {
    /// A stream's own memory.
    #[inline]
    pub(crate) const fn of_stream(s: StreamId) -> Owner {
        Owner {
            id: s.0,
            kind: STREAM,
        }
    }

    /// A graph pool's memory.
    #[inline]
    pub(crate) const fn of_pool(key: PoolKey) -> Owner {
        Owner {
            id: key.0 as u64,
            kind: POOL,
        }
    }

    /// No one's: a free-list slot that a retired pool gave up. Compares equal to no owner of
    /// a stream or a pool; it has no stream, region or pool.
    #[inline]
    pub(crate) const fn vacant() -> Owner {
        Owner {
            id: u64::MAX,
            kind: VACANT,
        }
    }

    #[inline]
    pub(crate) fn is_vacant(self) -> bool {
        self.kind == VACANT
    }

    /// The stream whose work uses this memory; none for a graph pool (graphs replay on streams
    /// the allocator never sees).
    #[inline]
    pub(crate) fn stream(self) -> Option<StreamId> {
        (!self.is_pool() && !self.is_vacant()).then_some(StreamId(self.id))
    }

    /// The tag whose region (of a stream or of a pool) this is, if it is one.
    #[inline]
    pub(crate) fn region(self) -> Option<Tag> {
        match self.kind {
            STREAM | POOL | VACANT => None,
            k if k >= POOL_REGIONS => Some(Tag::ALL[(POOL - 1 - k) as usize]),
            k => Some(Tag::ALL[k as usize - 1]),
        }
    }

    /// This owner's region of `tag`: its stream's, or its pool's.
    #[inline]
    pub(crate) fn in_region(self, tag: Tag) -> Owner {
        Owner {
            id: self.id,
            kind: if self.is_pool() {
                POOL - 1 - tag.index() as u32
            } else {
                tag.index() as u32 + 1
            },
        }
    }

    /// The pool's key, when this is a graph pool or one of its regions.
    #[inline]
    pub(crate) fn pool(self) -> Option<PoolKey> {
        self.is_pool().then_some(PoolKey(self.id as u32))
    }

    #[inline]
    pub(crate) fn is_pool(self) -> bool {
        self.kind >= POOL_REGIONS
    }
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_vacant() {
            return f.write_str("vacant");
        }
        match (self.pool(), self.region()) {
            (Some(key), Some(t)) => write!(f, "pool {}, {t}", key.0),
            (Some(key), None) => write!(f, "pool {}", key.0),
            (None, Some(t)) => write!(f, "stream {:#x}, {t}", self.id),
            (None, None) => write!(f, "stream {:#x}", self.id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_names_its_tag_and_keeps_its_stream_or_pool_whatever_the_bits() {
        for tag in Tag::ALL {
            for s in [
                StreamId(0),
                StreamId(7),
                StreamId(u64::MAX),
                StreamId(1 << 63),
            ] {
                let r = Owner::of_stream(s).in_region(tag);
                assert_ne!(r, Owner::of_stream(s));
                assert_eq!(r.region(), Some(tag));
                assert_eq!(r.stream(), Some(s));
                assert!(!r.is_pool());
            }
        }
        let pool = Owner::of_pool(PoolKey(3));
        assert_eq!(pool.region(), None);
        for tag in Tag::ALL {
            let r = pool.in_region(tag);
            assert_ne!(r, pool);
            assert_eq!(r.region(), Some(tag), "a pool's region names its tag");
            assert_eq!(r.pool(), Some(PoolKey(3)), "and keeps its pool");
            assert_eq!(r.stream(), None);
            assert!(r.is_pool());
            assert_eq!(r.in_region(tag), r);
            assert_ne!(r, Owner::of_stream(StreamId(3)).in_region(tag));
        }
        assert_eq!(pool.stream(), None);
        assert_eq!(pool.pool(), Some(PoolKey(3)));
        assert_ne!(pool, Owner::of_stream(StreamId(3)));
        assert_eq!(Owner::of_stream(StreamId(5)).region(), None);
        assert_eq!(Owner::of_stream(StreamId(5)).pool(), None);
    }
}
