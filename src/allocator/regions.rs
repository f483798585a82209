//! Tag regions. With [`super::Config::separate_tags`] each tag's memory lives in segments and
//! free lists of its own, so that a tag can sleep without touching another tag's memory. The
//! region is part of the owner key the shards already file memory under (a stream, or a graph
//! pool's key): the tag's index plus one in bits 59-61. Graph pools are never split (their
//! memory stays awake), and streams are pointers far below bit 59.
//!
//! Invariant: the driver only ever sees real streams; every path from an owner key to a
//! driver call strips the region ([`stream_of`]).

use super::graphs::is_pool_key;
use crate::driver::StreamId;
use crate::tag::Tag;

const SHIFT: u32 = 59;
const MASK: u64 = 0b111 << SHIFT;

/// `owner`'s region of `tag` (a graph pool stays whole).
#[inline]
pub(crate) fn with_region(owner: StreamId, tag: Tag) -> StreamId {
    if is_pool_key(owner) {
        owner
    } else {
        StreamId(owner.0 | ((tag.index() as u64 + 1) << SHIFT))
    }
}

/// The tag whose region `owner` is, if it is one.
#[inline]
pub(crate) fn region_of(owner: StreamId) -> Option<Tag> {
    if is_pool_key(owner) {
        return None;
    }
    match (owner.0 & MASK) >> SHIFT {
        0 => None,
        i => Tag::ALL.get(i as usize - 1).copied(),
    }
}

/// The stream behind an owner key (a graph pool's key is returned as it is).
#[inline]
pub(crate) fn stream_of(owner: StreamId) -> StreamId {
    if is_pool_key(owner) {
        owner
    } else {
        StreamId(owner.0 & !MASK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_names_its_tag_and_keeps_its_stream() {
        for tag in Tag::ALL {
            for s in [StreamId(0), StreamId(7), StreamId(0x7fff_ffff_f000)] {
                let r = with_region(s, tag);
                assert_ne!(r, s);
                assert_eq!(region_of(r), Some(tag));
                assert_eq!(stream_of(r), s);
            }
        }
        assert_eq!(region_of(StreamId(5)), None);
    }
}
