//! What an allocation is for: weights, activation, KV cache, or untracked (the default).
//!
//! The current tag is thread-local and set by nestable scope guards, so an engine can wrap a
//! phase (`let _g = tag::scope(Tag::Weights);`) without threading a tag through every call.
//! Threads that never set one (autograd's backward threads, say) allocate as `Untracked`.

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What an allocation is for.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum Tag {
    Weights = 0,
    Activation = 1,
    KvCache = 2,
    #[default]
    Untracked = 3,
}

impl Tag {
    pub const COUNT: usize = 4;
    pub const ALL: [Tag; Tag::COUNT] =
        [Tag::Weights, Tag::Activation, Tag::KvCache, Tag::Untracked];

    pub const fn index(self) -> usize {
        self as usize
    }

    pub const fn name(self) -> &'static str {
        match self {
            Tag::Weights => "weights",
            Tag::Activation => "activation",
            Tag::KvCache => "kv_cache",
            Tag::Untracked => "untracked",
        }
    }

    /// The other spellings accepted for the tag.
    pub const fn aliases(self) -> &'static [&'static str] {
        match self {
            Tag::Activation => &["activations"],
            Tag::KvCache => &["kv"],
            Tag::Weights | Tag::Untracked => &[],
        }
    }

    /// This thread's current tag.
    pub fn current() -> Tag {
        CURRENT.with(Cell::get)
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A tag name that is not one of `weights`, `activation`, `kv_cache` (or `kv`), `untracked`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown tag {0:?}: expected one of weights, activation, kv_cache (or kv), untracked")]
pub struct UnknownTag(pub String);

impl FromStr for Tag {
    type Err = UnknownTag;

    fn from_str(s: &str) -> Result<Tag, UnknownTag> {
        Tag::ALL
            .into_iter()
            .find(|t| t.name() == s || t.aliases().contains(&s))
            .ok_or_else(|| UnknownTag(s.to_owned()))
    }
}

thread_local! {
    static CURRENT: Cell<Tag> = const { Cell::new(Tag::Untracked) };
}

/// Restores the previous tag of this thread when dropped. Not `Send`: it belongs to the thread
/// whose tag it changed.
#[must_use = "the tag is reset as soon as the guard is dropped"]
pub struct TagScope {
    previous: Tag,
    _thread_bound: PhantomData<*const ()>,
}

/// Make `tag` this thread's current tag until the guard is dropped. Scopes nest.
pub fn scope(tag: Tag) -> TagScope {
    let previous = CURRENT.with(|c| c.replace(tag));
    TagScope {
        previous,
        _thread_bound: PhantomData,
    }
}

impl Drop for TagScope {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.previous));
    }
}

/// Set this thread's tag without a guard (for the C ABI, whose callers manage their own
/// nesting); returns the previous tag.
pub fn set_current(tag: Tag) -> Tag {
    CURRENT.with(|c| c.replace(tag))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_restore() {
        assert_eq!(Tag::current(), Tag::Untracked);
        {
            let _w = scope(Tag::Weights);
            assert_eq!(Tag::current(), Tag::Weights);
            {
                let _kv = scope(Tag::KvCache);
                assert_eq!(Tag::current(), Tag::KvCache);
            }
            assert_eq!(Tag::current(), Tag::Weights);
        }
        assert_eq!(Tag::current(), Tag::Untracked);
    }

    #[test]
    fn tags_are_per_thread() {
        let _w = scope(Tag::Weights);
        let other = std::thread::spawn(Tag::current).join().unwrap();
        assert_eq!(other, Tag::Untracked);
        assert_eq!(Tag::current(), Tag::Weights);
    }

    #[test]
    fn parse_names() {
        for t in Tag::ALL {
            assert_eq!(t.name().parse::<Tag>().unwrap(), t);
        }
        assert_eq!("kv".parse::<Tag>().unwrap(), Tag::KvCache);
        assert_eq!("activations".parse::<Tag>().unwrap(), Tag::Activation);
        let err = "weight".parse::<Tag>().unwrap_err();
        assert!(err.to_string().contains("weight"));
        assert!("".parse::<Tag>().is_err());
    }
}
