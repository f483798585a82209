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

/// The owner of a block, a segment and a set of free lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Owner {
    /// A stream's own memory.
    Stream(StreamId),
    /// A stream's memory of one tag (tags kept apart).
    Region(StreamId, Tag),
    /// A graph pool's memory.
    Pool(PoolKey),
}

impl Owner {
    /// The stream whose work uses this memory; none for a graph pool (graphs replay on streams
    /// the allocator never sees).
    #[inline]
    pub(crate) fn stream(self) -> Option<StreamId> {
        match self {
            Owner::Stream(s) | Owner::Region(s, _) => Some(s),
            Owner::Pool(_) => None,
        }
    }

    /// The tag whose region this is, if it is one.
    #[inline]
    pub(crate) fn region(self) -> Option<Tag> {
        match self {
            Owner::Region(_, t) => Some(t),
            Owner::Stream(_) | Owner::Pool(_) => None,
        }
    }

    /// This owner's region of `tag` (a graph pool stays whole).
    #[inline]
    pub(crate) fn in_region(self, tag: Tag) -> Owner {
        match self {
            Owner::Stream(s) | Owner::Region(s, _) => Owner::Region(s, tag),
            Owner::Pool(_) => self,
        }
    }

    #[inline]
    pub(crate) fn is_pool(self) -> bool {
        matches!(self, Owner::Pool(_))
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
                let r = Owner::Stream(s).in_region(tag);
                assert_ne!(r, Owner::Stream(s));
                assert_eq!(r.region(), Some(tag));
                assert_eq!(r.stream(), Some(s));
                assert!(!r.is_pool());
            }
        }
        let pool = Owner::Pool(PoolKey(3));
        assert_eq!(pool.in_region(Tag::Weights), pool);
        assert_eq!(pool.stream(), None);
        assert_eq!(Owner::Stream(StreamId(5)).region(), None);
    }
}
