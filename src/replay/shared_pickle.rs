//! A decoder for pickles whose values share parts, as PyTorch's snapshots do when they record
//! Python frames: an allocation's `frames` list is the same object in its `alloc`,
//! `free_requested` and `free_completed` entries, so the pickle writes it once and fetches it
//! from the memo twice more. serde-pickle counts a memo entry's references in the stream, not
//! how often conversion visits it: an entry inside a shared value is visited once per visit of
//! that value, runs out of count, and is reported as a "recursive structure". This decoder is
//! used when serde-pickle reports that.
//!
//! Values are built as shared nodes, so a fetch from the memo is the same node (Python's own
//! semantics), and converted to serde-pickle's values once, at the end, shared parts copied.
//! A dict's `frames` (the Python stack of an allocation) is converted to an empty list: replay
//! reads no frames, and copying the shared ones into every entry took 3.2 GB and 8 s for a
//! snapshot of 345,728 entries (2.4 MB gzipped).
//!
//! Invariants:
//! - It runs only on a pickle [`super::pickle_guard::check`] accepted: the values it builds,
//!   shared parts counted in full, are bounded; nesting is at most `MAX_DEPTH` deep; no value
//!   changes after a reference to it was fetched, so no value can come to hold itself through
//!   the memo. `DUP`, and memoising a value that is in the memo already, copy it, as serde-pickle
//!   does (the guard measures them so), so no two memo entries share a node and no cycle can
//!   come from either; conversion still stops at a depth bound rather than trusting that.
//! - It knows the opcodes Python's pickler writes for plain data (dicts, lists, tuples, sets,
//!   strings, bytes, numbers, booleans, `None`); any other is an error naming it, never a
//!   guess.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::rc::Rc;

use serde_pickle::{HashableValue, Value};
use thiserror::Error;

use super::pickle_guard::MAX_DEPTH;

/// Why a pickle with shared parts was not decoded.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SharedPickleError {
    #[error("opcode 0x{op:02x} at byte {at} is not one of plain data's")]
    Unsupported { op: u8, at: usize },
    #[error("it ends inside opcode 0x{op:02x} at byte {at}")]
    Truncated { op: u8, at: usize },
    #[error("opcode 0x{op:02x} at byte {at} finds {what}")]
    Malformed {
        op: u8,
        at: usize,
        what: &'static str,
    },
    #[error("it ends without a STOP")]
    NoStop,
    #[error("a dict key or set member is a {0}, which cannot be hashed")]
    Unhashable(&'static str),
    #[error("its values nest more than {MAX_DEPTH} deep")]
    TooDeep,
}

type Node = Rc<RefCell<Item>>;

enum Item {
    Scalar(Value),
    List(Vec<Node>),
    Tuple(Vec<Node>),
    Dict(Vec<(Node, Node)>),
    Set(Vec<Node>),
    FrozenSet(Vec<Node>),
}

fn node(item: Item) -> Node {
    Rc::new(RefCell::new(item))
}

/// Decode `data`, a whole pickle.
pub(crate) fn decode(data: &[u8]) -> Result<Value, SharedPickleError> {
    let mut m = Machine {
        data,
        at: 0,
        op: 0,
        op_at: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
    };
    loop {
        let Some(&op) = data.get(m.at) else {
            return Err(SharedPickleError::NoStop);
        };
        (m.op, m.op_at) = (op, m.at);
        m.at += 1;
        if op == b'.' {
            let top = m.pop()?;
            if m.at != data.len() {
                return Err(m.malformed("bytes after the STOP"));
            }
            return convert(&top, 0);
        }
        m.apply(op)?;
    }
}

struct Machine<'a> {
    data: &'a [u8],
    at: usize,
    /// The opcode being applied, and where it is (for errors).
    op: u8,
    op_at: usize,
    stack: Vec<Node>,
    /// Where the stack stood at each open mark.
    marks: Vec<usize>,
    memo: HashMap<u32, Node>,
}

impl Machine<'_> {
    fn truncated(&self) -> SharedPickleError {
        SharedPickleError::Truncated {
            op: self.op,
            at: self.op_at,
        }
    }

    fn malformed(&self, what: &'static str) -> SharedPickleError {
        SharedPickleError::Malformed {
            op: self.op,
            at: self.op_at,
            what,
        }
    }

    fn bytes(&mut self, n: usize) -> Result<&[u8], SharedPickleError> {
        if n > self.data.len() - self.at {
            return Err(self.truncated());
        }
        let b = &self.data[self.at..self.at + n];
        self.at += n;
        Ok(b)
    }

    fn uint(&mut self, n: usize) -> Result<u64, SharedPickleError> {
        let b = self.bytes(n)?;
        Ok(b.iter().rev().fold(0u64, |a, &x| (a << 8) | u64::from(x)))
    }

    fn counted(&mut self, n: usize) -> Result<Vec<u8>, SharedPickleError> {
        let len = usize::try_from(self.uint(n)?).map_err(|_| self.truncated())?;
        Ok(self.bytes(len)?.to_vec())
    }

    fn text(&mut self, n: usize) -> Result<Value, SharedPickleError> {
        let b = self.counted(n)?;
        String::from_utf8(b)
            .map(Value::String)
            .map_err(|_| self.malformed("a string that is not UTF-8"))
    }

    fn line(&mut self) -> Result<&str, SharedPickleError> {
        let rest = &self.data[self.at..];
        let end = rest
            .iter()
            .position(|&c| c == b'\n')
            .ok_or(self.truncated())?;
        self.at += end + 1;
        let line = &rest[..end];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        std::str::from_utf8(line).map_err(|_| self.malformed("a line that is not UTF-8"))
    }

    fn pop(&mut self) -> Result<Node, SharedPickleError> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return Err(self.malformed("a mark where a value should be"));
        }
        self.stack.pop().ok_or(self.malformed("an empty stack"))
    }

    fn top(&self) -> Result<&Node, SharedPickleError> {
        self.stack.last().ok_or(self.malformed("an empty stack"))
    }

    /// Everything above the last mark, the mark taken off.
    fn pop_mark(&mut self) -> Result<Vec<Node>, SharedPickleError> {
        let at = self.marks.pop().ok_or(self.malformed("no mark"))?;
        Ok(self.stack.split_off(at))
    }

    fn push(&mut self, item: Item) {
        self.stack.push(node(item));
    }

    fn scalar(&mut self, v: Value) {
        self.push(Item::Scalar(v));
    }

    /// `items` added to the container on top: appended to a list, set in a dict (key, value
    /// pairs), added to a set.
    fn add_to_top(&mut self, items: Vec<Node>) -> Result<(), SharedPickleError> {
        let top = self.top()?.clone();
        let mut top = top.borrow_mut();
        match &mut *top {
            Item::List(v) | Item::Set(v) => v.extend(items),
            Item::Dict(d) => {
                if !items.len().is_multiple_of(2) {
                    return Err(self.malformed("a key without a value"));
                }
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.push((k, v));
                }
            }
            _ => return Err(self.malformed("no container to add to")),
        }
        Ok(())
    }

    fn memo_index(&mut self, n: usize) -> Result<u32, SharedPickleError> {
        let v = self.uint(n)?;
        u32::try_from(v).map_err(|_| self.malformed("a memo index past 32 bits"))
    }

    /// The top value memoised as entry `id`. A value that is in the memo already (fetched, or
    /// memoised under another index) is copied first, as serde-pickle does and as the guard
    /// measured it: two entries never share a node, so a change through one (which the guard
    /// allows while that entry is unfetched) cannot reach a value fetched through the other.
    fn put(&mut self, id: u32) -> Result<(), SharedPickleError> {
        let top = self.top()?.clone();
        let entry = if Rc::strong_count(&top) > 1 {
            let copy = deep_copy(&top, 0)?;
            *self.stack.last_mut().expect("the top exists") = copy.clone();
            copy
        } else {
            top
        };
        self.memo.insert(id, entry);
        Ok(())
    }

    fn get(&mut self, id: u32) -> Result<(), SharedPickleError> {
        let n = self
            .memo
            .get(&id)
            .ok_or(self.malformed("a memo entry never written"))?
            .clone();
        self.stack.push(n);
        Ok(())
    }

    fn apply(&mut self, op: u8) -> Result<(), SharedPickleError> {
        match op {
            0x80 => {
                self.uint(1)?;
            }
            0x95 => {
                self.uint(8)?;
            }
            b'(' => self.marks.push(self.stack.len()),
            b'0' => {
                self.pop()?;
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let copy = deep_copy(self.top()?, 0)?;
                self.stack.push(copy);
            }
            b'N' => self.scalar(Value::None),
            0x88 => self.scalar(Value::Bool(true)),
            0x89 => self.scalar(Value::Bool(false)),
            b'K' => {
                let v = self.uint(1)?;
                self.scalar(Value::I64(v as i64));
            }
            b'M' => {
                let v = self.uint(2)?;
                self.scalar(Value::I64(v as i64));
            }
            b'J' => {
                let v = self.uint(4)? as u32 as i32;
                self.scalar(Value::I64(i64::from(v)));
            }
            0x8a => {
                let b = self.counted(1)?;
                self.scalar(long(&b));
            }
            0x8b => {
                let b = self.counted(4)?;
                self.scalar(long(&b));
            }
            b'G' => {
                let b = self.bytes(8)?;
                let f = f64::from_bits(u64::from_be_bytes(b.try_into().expect("8 bytes")));
                self.scalar(Value::F64(f));
            }
            0x8c => {
                let v = self.text(1)?;
                self.scalar(v);
            }
            b'X' => {
                let v = self.text(4)?;
                self.scalar(v);
            }
            0x8d => {
                let v = self.text(8)?;
                self.scalar(v);
            }
            b'C' => {
                let b = self.counted(1)?;
                self.scalar(Value::Bytes(b));
            }
            b'B' => {
                let b = self.counted(4)?;
                self.scalar(Value::Bytes(b));
            }
            0x8e => {
                let b = self.counted(8)?;
                self.scalar(Value::Bytes(b));
            }
            b']' => self.push(Item::List(Vec::new())),
            b'}' => self.push(Item::Dict(Vec::new())),
            b')' => self.push(Item::Tuple(Vec::new())),
            0x8f => self.push(Item::Set(Vec::new())),
            b'l' => {
                let items = self.pop_mark()?;
                self.push(Item::List(items));
            }
            b't' => {
                let items = self.pop_mark()?;
                self.push(Item::Tuple(items));
            }
            0x91 => {
                let items = self.pop_mark()?;
                self.push(Item::FrozenSet(items));
            }
            b'd' => {
                let items = self.pop_mark()?;
                self.push(Item::Dict(Vec::new()));
                self.add_to_top(items)?;
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                if self.stack.len() < n + self.marks.last().copied().unwrap_or(0) {
                    return Err(self.malformed("too few values for a tuple"));
                }
                let items = self.stack.split_off(self.stack.len() - n);
                self.push(Item::Tuple(items));
            }
            b'a' => {
                let x = self.pop()?;
                self.add_to_top(vec![x])?;
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                self.add_to_top(vec![k, v])?;
            }
            b'e' | b'u' | 0x90 => {
                let items = self.pop_mark()?;
                self.add_to_top(items)?;
            }
            0x94 => {
                let id = u32::try_from(self.memo.len())
                    .map_err(|_| self.malformed("a memo past 32 bits"))?;
                self.put(id)?;
            }
            b'q' => {
                let id = self.memo_index(1)?;
                self.put(id)?;
            }
            b'r' => {
                let id = self.memo_index(4)?;
                self.put(id)?;
            }
            b'h' => {
                let id = self.memo_index(1)?;
                self.get(id)?;
            }
            b'j' => {
                let id = self.memo_index(4)?;
                self.get(id)?;
            }
            b'p' | b'g' => {
                let id = self
                    .line()?
                    .parse::<u32>()
                    .map_err(|_| self.malformed("a memo index that is not a number"))?;
                if op == b'p' {
                    self.put(id)?;
                } else {
                    self.get(id)?;
                }
            }
            _ => return Err(SharedPickleError::Unsupported { op, at: self.op_at }),
        }
        Ok(())
    }
}

/// A little-endian two's-complement integer, as serde-pickle gives it: `I64` where it fits.
fn long(b: &[u8]) -> Value {
    let n = num_bigint::BigInt::from_signed_bytes_le(b);
    match i64::try_from(&n) {
        Ok(v) => Value::I64(v),
        Err(_) => Value::Int(n),
    }
}

fn deep_copy(n: &Node, depth: u32) -> Result<Node, SharedPickleError> {
    if depth > MAX_DEPTH {
        return Err(SharedPickleError::TooDeep);
    }
    let all = |v: &[Node]| -> Result<Vec<Node>, SharedPickleError> {
        v.iter().map(|x| deep_copy(x, depth + 1)).collect()
    };
    let item = match &*n.borrow() {
        Item::Scalar(v) => Item::Scalar(v.clone()),
        Item::List(v) => Item::List(all(v)?),
        Item::Tuple(v) => Item::Tuple(all(v)?),
        Item::Set(v) => Item::Set(all(v)?),
        Item::FrozenSet(v) => Item::FrozenSet(all(v)?),
        Item::Dict(d) => Item::Dict(
            d.iter()
                .map(|(k, v)| Ok((deep_copy(k, depth + 1)?, deep_copy(v, depth + 1)?)))
                .collect::<Result<_, SharedPickleError>>()?,
        ),
    };
    Ok(node(item))
}

fn convert(n: &Node, depth: u32) -> Result<Value, SharedPickleError> {
    if depth > MAX_DEPTH {
        return Err(SharedPickleError::TooDeep);
    }
    let all = |v: &[Node]| -> Result<Vec<Value>, SharedPickleError> {
        v.iter().map(|x| convert(x, depth + 1)).collect()
    };
    let set = |v: &[Node]| -> Result<BTreeSet<HashableValue>, SharedPickleError> {
        v.iter().map(|x| hashable(convert(x, depth + 1)?)).collect()
    };
    Ok(match &*n.borrow() {
        Item::Scalar(v) => v.clone(),
        Item::List(v) => Value::List(all(v)?),
        Item::Tuple(v) => Value::Tuple(all(v)?),
        Item::Set(v) => Value::Set(set(v)?),
        Item::FrozenSet(v) => Value::FrozenSet(set(v)?),
        Item::Dict(d) => {
            let mut map = BTreeMap::new();
            for (k, v) in d {
                let key = hashable(convert(k, depth + 1)?)?;
                let value = if matches!(&key, HashableValue::String(k) if k == "frames") {
                    Value::List(Vec::new())
                } else {
                    convert(v, depth + 1)?
                };
                map.insert(key, value);
            }
            Value::Dict(map)
        }
    })
}

fn hashable(v: Value) -> Result<HashableValue, SharedPickleError> {
    let kind = match &v {
        Value::List(_) => "list",
        Value::Dict(_) => "dict",
        Value::Set(_) => "set",
        _ => "value",
    };
    v.into_hashable()
        .map_err(|_| SharedPickleError::Unhashable(kind))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Python's pickle (protocol 4) of `f = [{"name": "a", "line": 1}]; {"x": [f, f], "y": f}`.
    const SHARED: &[u8] = b"\x80\x04\x950\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01x\x94]\x94(]\x94}\x94(\x8c\x04name\x94\x8c\x01a\x94\x8c\x04line\x94K\x01uah\x03e\x8c\x01y\x94h\x03u.";

    fn s(v: &str) -> HashableValue {
        HashableValue::String(v.into())
    }

    #[test]
    fn a_value_shared_three_times_decodes_to_three_copies() {
        let frame = Value::Dict(BTreeMap::from([
            (s("name"), Value::String("a".into())),
            (s("line"), Value::I64(1)),
        ]));
        let f = Value::List(vec![frame]);
        let want = Value::Dict(BTreeMap::from([
            (s("x"), Value::List(vec![f.clone(), f.clone()])),
            (s("y"), f),
        ]));
        assert_eq!(decode(SHARED).unwrap(), want);
        // What this decoder is for: serde-pickle runs out of count for the frame dict.
        assert!(matches!(
            serde_pickle::value_from_slice(SHARED, serde_pickle::DeOptions::new()),
            Err(serde_pickle::Error::Syntax(
                serde_pickle::ErrorCode::Recursive
            ))
        ));
    }

    #[test]
    fn a_value_memoised_twice_is_two_values() {
        // `( D ]q0 q1 h0 a h0 a t .`: the list memoised as 0, then as 1 (a copy), fetched
        // twice as 0 and appended to through 1: [[], []] are the list fetched, and the list
        // built through entry 1 holds them; nothing holds itself.
        let mut p = SHARED[..SHARED.len() - 1].to_vec();
        p.insert(11, b'(');
        p.extend_from_slice(b"]q\x64q\x65h\x64ah\x64at.");
        let v = decode(&p).unwrap();
        let Value::Tuple(items) = v else {
            panic!("{v:?}")
        };
        assert_eq!(
            items[1],
            Value::List(vec![Value::List(vec![]), Value::List(vec![])])
        );
    }

    #[test]
    fn truncated_or_foreign_pickles_are_errors() {
        let mut extra = SHARED.to_vec();
        extra.push(b'N');
        assert!(decode(&extra).is_err(), "bytes after the STOP");
        for cut in 1..SHARED.len() {
            assert!(decode(&SHARED[..cut]).is_err(), "cut at {cut}");
        }
        let global = b"\x80\x04c__builtin__\nset\n.";
        assert!(matches!(
            decode(global),
            Err(SharedPickleError::Unsupported { op: b'c', .. })
        ));
    }
}
