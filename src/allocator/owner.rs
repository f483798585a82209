//! Who owns a block: the key every shard files its segments and free lists under.
//!
//! A block belongs to the stream it was allocated on, or, with [`super::Config::separate_tags`],
//! to that stream's region of its tag (so a tag can sleep without touching another tag's
//! memory), or to a CUDA graph pool (memory a capture allocated, kept apart while its graph may
//! replay). Graph pools are never split by tag.
//!
//! Invariant: the driver only ever sees real streams. [`Owner::stream`] is the one way from an
//! owner to a stream, and a graph pool has none: code that must synchronise a pool's memory
//! synchronises the device, and growth for a pool passes the driver the caller's stream.

use crate::driver::StreamId;
use crate::tag::Tag;

/// A graph pool's key in the shards' tables (the registry deals them out, `routes.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PoolKey(pub(crate) u32);

/// The owner of a block, a segment and a set of free lists: a stream's own memory, a stream's
/// memory of one tag (tags kept apart), or a graph pool's memory. Two words, compared as such:
/// the cached path compares owners to find a shard's free lists.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Owner {
    /// The stream, or the pool's key.
    id: u64,
    /// [`STREAM`], [`POOL`], or a region's tag index + 1.
    kind: u32,
}

const STREAM: u32 = 0;
const POOL: u32 = u32::MAX;

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

    /// The stream whose work uses this memory; none for a graph pool (graphs replay on streams
    /// the allocator never sees).
    #[inline]
    pub(crate) fn stream(self) -> Option<StreamId> {
        (self.kind != POOL).then_some(StreamId(self.id))
    }

    /// The tag whose region this is, if it is one.
    #[inline]
    pub(crate) fn region(self) -> Option<Tag> {
        match self.kind {
            STREAM | POOL => None,
            k => Some(Tag::ALL[k as usize - 1]),
        }
    }

    /// This owner's region of `tag` (a graph pool stays whole).
    #[inline]
    pub(crate) fn in_region(self, tag: Tag) -> Owner {
        match self.kind {
            POOL => self,
            _ => Owner {
                id: self.id,
                kind: tag.index() as u32 + 1,
            },
        }
    }

    /// The pool's key, when this is a graph pool.
    #[inline]
    pub(crate) fn pool(self) -> Option<PoolKey> {
        (self.kind == POOL).then_some(PoolKey(self.id as u32))
    }

    #[inline]
    pub(crate) fn is_pool(self) -> bool {
        self.kind == POOL
    }
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.pool(), self.region()) {
            (Some(key), _) => write!(f, "pool {}", key.0),
            (None, Some(t)) => write!(f, "stream {:#x}, {t}", self.id),
            (None, None) => write!(f, "stream {:#x}", self.id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_names_its_tag_and_keeps_its_stream_whatever_the_stream_bits() {
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
        assert_eq!(pool.in_region(Tag::Weights), pool);
        assert_eq!(pool.stream(), None);
        assert_eq!(pool.pool(), Some(PoolKey(3)));
        assert_ne!(pool, Owner::of_stream(StreamId(3)));
        assert_eq!(Owner::of_stream(StreamId(5)).region(), None);
        assert_eq!(Owner::of_stream(StreamId(5)).pool(), None);
    }
}
