//! A guard against pickles that the decoder (serde-pickle) would choke on. Before anything is
//! decoded, this walks the opcodes as the decoder would, keeping only each value's size (the
//! values it holds, memo references counted in full) and depth (how deeply containers nest in
//! it), and refuses a pickle that would
//! - build more values than a generous bound on its length: every memo fetch copies the
//!   fetched value, so a few hundred bytes can describe billions of values (the fuzzer found
//!   one);
//! - nest values more than [`MAX_DEPTH`] deep, or open more than that many marks at once: the
//!   decoder converts and drops values recursively, so 600 KB of nested lists overflow the
//!   stack, and it allocates a buffer for each open mark. Real snapshots nest 8 deep with stack
//!   frames recorded (the top dict, `segments`, a segment, its `blocks`, a block, its `frames`,
//!   a frame, its fields; 6 in the shipped traces, which have none) and open one mark per level;
//! - hold an integer of more than [`MAX_INT_DIGITS`] decimal digits: the decoder's big
//!   integers take time quadratic in their length to parse from text or to print in a message
//!   (3 MB of digits took 12 s on the development VM);
//! - change a value after a reference to it was fetched from the memo, or write a memo entry
//!   twice: a reference's size and depth are its entry's when it is fetched, and either would
//!   change them behind it. Python's pickler writes neither (it memoises each object once,
//!   before its contents, and fetches only finished objects), except for a recursive
//!   structure, which the decoder refuses anyway.
//!
//! Invariants:
//! - The walk is the decoder's stack machine (serde-pickle 1.2: one stack per open mark; the
//!   memo holds values and the stack references to them, and a change to a reference on top
//!   changes the memo entry), so that every value the decoder builds is measured here.
//! - It never rejects what it does not understand, and stops only where the decoder fails: an
//!   unknown opcode, a truncated argument, a missing memo entry or an empty stack end the walk,
//!   and the decoder reports the problem in its own words.

use std::collections::HashMap;

use thiserror::Error;

const NODES_PER_BYTE: u64 = 4;
const BASE_NODES: u64 = 1 << 20;

/// The deepest nesting of values, and the most marks open at once, that a pickle may have:
/// twelve times what real snapshots use, and shallow enough that the decoder's recursion stays
/// within a few tens of kilobytes of stack.
pub const MAX_DEPTH: u32 = 100;

/// The most decimal digits an integer may have: Python's own bound on converting integers to
/// and from text (`sys.get_int_max_str_digits()`), far above the 20 of a 64-bit value.
pub const MAX_INT_DIGITS: usize = 4300;

/// The most bytes of a binary integer (`LONG4`): the most that hold no integer of more than
/// [`MAX_INT_DIGITS`] digits.
const MAX_INT_BYTES: u64 = 1785;

/// Why a pickle is refused before it is decoded.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum Refusal {
    #[error(
        "it would expand to at least {nodes} values from {len} bytes (memo references and \
         duplicates copied over and over)"
    )]
    TooMany { nodes: u64, len: usize },
    #[error("its values nest more than {MAX_DEPTH} deep")]
    TooDeep,
    #[error("it opens more than {MAX_DEPTH} marks at once")]
    TooManyMarks,
    #[error("it holds an integer of more than {MAX_INT_DIGITS} digits")]
    HugeInteger,
    #[error("it changes memo entry {0} after fetching it (a recursive or shared structure)")]
    ChangedAfterFetch(u32),
    #[error("it writes memo entry {0} twice")]
    MemoRewritten(u32),
    /// The decoder sorts set members and dict keys, and a NaN has no order: its sort panics on
    /// one. No memory snapshot holds a NaN.
    #[error("it holds a float that is not a number (NaN)")]
    NotANumber,
    /// The decoder sorts set members, and its order between floats and integers is not a
    /// total one (it truncates a float to compare it with a large integer one way, and rounds
    /// the integer the other way): a sort panics on it. Without floats its order is total. No
    /// memory snapshot holds a set.
    #[error("it holds both a set and a float, which the decoder cannot order")]
    SetBesideFloat,
}

/// `Err` when decoding `data` would build too many values, or values too deep, or values whose
/// size this cannot follow.
pub(crate) fn check(data: &[u8]) -> Result<(), Refusal> {
    let mut ops = Opcodes { data, at: 0 };
    let mut machine = Machine::new(Budget::for_len(data.len()));
    loop {
        match step(&mut ops, &mut machine) {
            Ok(()) => {}
            Err(End::Stop) => return Ok(()),
            Err(End::Refused(r)) => return Err(r),
        }
    }
}

/// One opcode: its argument read, then its effect on the stack.
fn step(ops: &mut Opcodes, machine: &mut Machine) -> Result<(), End> {
    let op = ops.next()?;
    let memo = ops.operand(op)?;
    machine.apply(op, memo)
}

/// Why the walk ends.
enum End {
    /// A `STOP`, or a point where the decoder fails: the decoder has the last word.
    Stop,
    Refused(Refusal),
}

impl From<Refusal> for End {
    fn from(r: Refusal) -> End {
        End::Refused(r)
    }
}

/// Opcode reading: each opcode and its argument, in order.
struct Opcodes<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Opcodes<'a> {
    fn next(&mut self) -> Result<u8, End> {
        let op = *self.data.get(self.at).ok_or(End::Stop)?;
        self.at += 1;
        Ok(op)
    }

    /// The next `n` bytes.
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], End> {
        if n > self.data.len() - self.at {
            return Err(End::Stop);
        }
        let v = &self.data[self.at..self.at + n];
        self.at += n;
        Ok(v)
    }

    /// An unsigned little-endian integer of `n` bytes.
    fn uint(&mut self, n: usize) -> Result<u64, End> {
        let b = self.bytes(n)?;
        Ok(b.iter().rev().fold(0u64, |a, &x| (a << 8) | u64::from(x)))
    }

    /// A length of `n` bytes, then that many bytes. A four-byte length the decoder reads as
    /// signed is, when negative, a length past the end here: either way the walk ends.
    fn counted(&mut self, n: usize) -> Result<(), End> {
        let len = usize::try_from(self.uint(n)?).map_err(|_| End::Stop)?;
        self.bytes(len).map(|_| ())
    }

    /// A line up to its newline (not included), as the decoder reads it: one `\r` before the
    /// newline dropped.
    fn line(&mut self) -> Result<&'a [u8], End> {
        let rest = &self.data[self.at..];
        let end = rest.iter().position(|&c| c == b'\n').ok_or(End::Stop)?;
        self.at += end + 1;
        let line = &rest[..end];
        Ok(line.strip_suffix(b"\r").unwrap_or(line))
    }

    /// Reads `op`'s argument; returns the memo index it names (for the memo opcodes; 0 for the
    /// others). The decoder's memo indices are 32-bit, and a text one that does not parse as
    /// such is an error there.
    fn operand(&mut self, op: u8) -> Result<u32, End> {
        let index = |v: u64| u32::try_from(v).map_err(|_| End::Stop);
        match op {
            b'h' | b'q' => index(self.uint(1)?),
            b'j' | b'r' => index(self.uint(4)?),
            b'g' | b'p' => {
                let line = self.line()?;
                std::str::from_utf8(line)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or(End::Stop)
            }
            b'K' | 0x80 => self.uint(1).map(|_| 0),
            b'M' => self.uint(2).map(|_| 0),
            b'J' => self.uint(4).map(|_| 0),
            // A binary float, big-endian.
            b'G' => {
                let b = self.bytes(8)?;
                let f = f64::from_bits(u64::from_be_bytes(b.try_into().expect("8 bytes")));
                if f.is_nan() {
                    return Err(Refusal::NotANumber.into());
                }
                Ok(0)
            }
            0x95 => self.uint(8).map(|_| 0),
            b'U' | 0x8c | b'C' | 0x8a => self.counted(1).map(|()| 0),
            b'T' | b'X' | b'B' => self.counted(4).map(|()| 0),
            0x8b => {
                let len = self.uint(4)?;
                self.bytes(usize::try_from(len).map_err(|_| End::Stop)?)?;
                if len > MAX_INT_BYTES {
                    return Err(Refusal::HugeInteger.into());
                }
                Ok(0)
            }
            // A text integer: a sign, digits, an `L` suffix.
            b'L' => {
                let line = self.line()?;
                let line = line.strip_suffix(b"L").unwrap_or(line);
                let digits = line.strip_prefix(b"-").unwrap_or(line);
                let digits = digits.strip_prefix(b"+").unwrap_or(digits);
                if digits.len() > MAX_INT_DIGITS {
                    return Err(Refusal::HugeInteger.into());
                }
                Ok(0)
            }
            0x8d | 0x8e | 0x96 => self.counted(8).map(|()| 0),
            b'F' => {
                let line = self.line()?;
                let text = std::str::from_utf8(line).unwrap_or("").trim();
                if text.parse::<f64>().is_ok_and(f64::is_nan) {
                    return Err(Refusal::NotANumber.into());
                }
                Ok(0)
            }
            b'I' | b'S' | b'V' => self.line().map(|_| 0),
            b'c' | b'i' => self.line().and_then(|_| self.line()).map(|_| 0),
            _ => Ok(0),
        }
    }
}

/// The bound: how many values a pickle of its length may build.
struct Budget {
    limit: u64,
    built: u64,
    len: usize,
}

impl Budget {
    fn for_len(len: usize) -> Budget {
        Budget {
            limit: BASE_NODES.saturating_add(NODES_PER_BYTE.saturating_mul(len as u64)),
            built: 0,
            len,
        }
    }

    /// `nodes` more values built.
    fn spend(&mut self, nodes: u64) -> Result<(), Refusal> {
        self.built = self.built.saturating_add(nodes);
        if self.built > self.limit {
            return Err(Refusal::TooMany {
                nodes: self.built,
                len: self.len,
            });
        }
        Ok(())
    }
}

/// A value on the stack, as far as the guard follows it.
#[derive(Clone, Copy)]
struct Slot {
    /// Values it holds, itself included, memo references counted in full.
    size: u64,
    /// 1 for a scalar or an empty container; one more than its deepest item for the others.
    depth: u32,
    /// The memo entry it is a reference to: a change to the slot is a change to the entry.
    entry: Option<u32>,
}

impl Slot {
    const SCALAR: Slot = Slot {
        size: 1,
        depth: 1,
        entry: None,
    };

    /// A new container of `items` (their total size, their deepest depth).
    fn holding(items: Slot) -> Slot {
        Slot {
            size: items.size.saturating_add(1),
            depth: items.depth.saturating_add(1),
            entry: None,
        }
    }
}

/// Items taken together: their total size and their deepest depth (an empty list of items is
/// size 0, depth 0).
fn together(items: impl IntoIterator<Item = Slot>) -> Slot {
    items.into_iter().fold(
        Slot {
            size: 0,
            depth: 0,
            entry: None,
        },
        |a, s| Slot {
            size: a.size.saturating_add(s.size),
            depth: a.depth.max(s.depth),
            entry: None,
        },
    )
}

/// A memo entry: the value it holds, and whether a reference to it was fetched.
struct Entry {
    size: u64,
    depth: u32,
    fetched: bool,
}

/// The decoder's stack machine, with slots for values: the stack, the stacks below each open
/// mark, and the memo.
struct Machine {
    stack: Vec<Slot>,
    marks: Vec<Vec<Slot>>,
    memo: HashMap<u32, Entry>,
    budget: Budget,
    /// A set, and a float, seen so far ([`Refusal::SetBesideFloat`]).
    set_seen: bool,
    float_seen: bool,
}

impl Machine {
    fn new(budget: Budget) -> Machine {
        Machine {
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
            budget,
            set_seen: false,
            float_seen: false,
        }
    }

    /// A new value; `new` of its `size` values are built for it (the rest exist already).
    fn push(&mut self, slot: Slot, new: u64) -> Result<(), End> {
        if slot.depth > MAX_DEPTH {
            return Err(Refusal::TooDeep.into());
        }
        self.budget.spend(new)?;
        self.stack.push(slot);
        Ok(())
    }

    /// A new container of `items`.
    fn push_holding(&mut self, items: Slot) -> Result<(), End> {
        let c = Slot::holding(items);
        self.push(c, c.size)
    }

    /// The top value, taken off; an empty stack is the decoder's error.
    fn pop(&mut self) -> Result<Slot, End> {
        self.stack.pop().ok_or(End::Stop)
    }

    /// The `n` top values, taken off.
    fn pop_n(&mut self, n: usize) -> Result<Slot, End> {
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(self.pop()?);
        }
        Ok(together(items))
    }

    /// Everything above the last mark, and the mark, taken off.
    fn pop_mark(&mut self) -> Result<Slot, End> {
        let below = self.marks.pop().ok_or(End::Stop)?;
        Ok(together(std::mem::replace(&mut self.stack, below)))
    }

    fn mark(&mut self) -> Result<(), End> {
        if self.marks.len() >= MAX_DEPTH as usize {
            return Err(Refusal::TooManyMarks.into());
        }
        self.marks.push(std::mem::take(&mut self.stack));
        Ok(())
    }

    /// `items` added to the value on top (appended, set, added), and so to the memo entry it
    /// refers to, if any.
    fn add_to_top(&mut self, items: Slot) -> Result<(), End> {
        let top = self.stack.last_mut().ok_or(End::Stop)?;
        top.size = top.size.saturating_add(items.size);
        top.depth = top.depth.max(items.depth.saturating_add(1));
        if top.depth > MAX_DEPTH {
            return Err(Refusal::TooDeep.into());
        }
        if let Some(id) = top.entry {
            let e = self.memo.get_mut(&id).ok_or(End::Stop)?;
            if e.fetched {
                return Err(Refusal::ChangedAfterFetch(id).into());
            }
            (e.size, e.depth) = (top.size, top.depth);
        }
        Ok(())
    }

    /// The top value memoised as entry `id`: the entry holds it (a copy, when the top is a
    /// reference already) and the stack a reference to it.
    fn memo_put(&mut self, id: u32) -> Result<(), End> {
        let top = self.pop()?;
        if let Some(from) = top.entry {
            if !self.memo.contains_key(&from) {
                return Err(End::Stop);
            }
            self.budget.spend(top.size)?;
        }
        if self.memo.contains_key(&id) {
            return Err(Refusal::MemoRewritten(id).into());
        }
        let entry = Entry {
            size: top.size,
            depth: top.depth,
            fetched: false,
        };
        self.memo.insert(id, entry);
        self.stack.push(Slot {
            entry: Some(id),
            ..top
        });
        Ok(())
    }

    /// A reference to entry `id` fetched.
    fn memo_get(&mut self, id: u32) -> Result<(), End> {
        let e = self.memo.get_mut(&id).ok_or(End::Stop)?;
        e.fetched = true;
        let slot = Slot {
            size: e.size,
            depth: e.depth,
            entry: Some(id),
        };
        self.push(slot, slot.size)
    }

    /// What `op` (its argument read, `memo` the index it names) does to the stack, as the
    /// decoder does it.
    fn apply(&mut self, op: u8, memo: u32) -> Result<(), End> {
        match op {
            0x8f | 0x91 => self.set_seen = true,
            b'G' | b'F' => self.float_seen = true,
            _ => {}
        }
        if self.set_seen && self.float_seen {
            return Err(Refusal::SetBesideFloat.into());
        }
        match op {
            b'.' => return Err(End::Stop),
            0x80 | 0x95 => {}
            b'(' => self.mark()?,
            b'0' if self.stack.is_empty() => {
                self.pop_mark()?;
            }
            b'0' => {
                self.pop()?;
            }
            b'1' => {
                self.pop_mark()?;
            }
            // A copy of the value on top (of the entry's value, when it is a reference).
            b'2' => {
                let top = *self.stack.last().ok_or(End::Stop)?;
                let copy = Slot { entry: None, ..top };
                self.push(copy, copy.size)?;
            }
            b'p' | b'q' | b'r' => self.memo_put(memo)?,
            0x94 => self.memo_put(u32::try_from(self.memo.len()).map_err(|_| End::Stop)?)?,
            b'g' | b'h' | b'j' => self.memo_get(memo)?,
            // Scalars and empty containers: constants; numbers and strings, binary and text;
            // a global.
            b'N' | 0x88 | 0x89 | b']' | b'}' | b')' | 0x8f => self.push(Slot::SCALAR, 1)?,
            b'K' | b'M' | b'J' | b'G' | 0x8a | 0x8b => self.push(Slot::SCALAR, 1)?,
            b'U' | 0x8c | b'C' | b'T' | b'X' | b'B' | 0x8d | 0x8e | 0x96 => {
                self.push(Slot::SCALAR, 1)?
            }
            b'I' | b'L' | b'F' | b'S' | b'V' | b'c' => self.push(Slot::SCALAR, 1)?,
            b'a' => {
                let item = self.pop()?;
                self.add_to_top(together([item]))?;
            }
            b's' => {
                let items = self.pop_n(2)?;
                self.add_to_top(items)?;
            }
            b'e' | b'u' | 0x90 => {
                let items = self.pop_mark()?;
                self.add_to_top(items)?;
            }
            b'l' | b'd' | b't' | 0x91 => {
                let items = self.pop_mark()?;
                self.push_holding(items)?;
            }
            0x85..=0x87 => {
                let items = self.pop_n(usize::from(op - 0x84))?;
                self.push_holding(items)?;
            }
            // Objects: what the decoder makes of them is no larger nor deeper than a tuple of
            // their parts.
            b'i' => {
                let items = self.pop_mark()?;
                self.push_holding(items)?;
            }
            b'o' => {
                let args = self.pop_mark()?;
                let class = self.pop()?;
                self.push_holding(together([args, class]))?;
            }
            b'R' | 0x81 | 0x93 => {
                let parts = self.pop_n(2)?;
                self.push_holding(parts)?;
            }
            0x92 => {
                let parts = self.pop_n(3)?;
                self.push_holding(parts)?;
            }
            // The state replaces the object: the state's slot, reference or not, is pushed back.
            b'b' => {
                let state = self.pop()?;
                self.pop()?;
                self.stack.push(state);
            }
            _ => return Err(End::Stop),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Protocol 4's header, `body`, then `STOP`.
    fn pickle(body: &[u8]) -> Vec<u8> {
        let mut p = vec![0x80, 4];
        p.extend_from_slice(body);
        p.push(b'.');
        p
    }

    #[test]
    fn a_memo_bomb_is_refused_and_real_pickles_pass() {
        // A list, then "duplicate the top and pair the two copies" forty times: 2^40 nodes in
        // 84 bytes (the shape the fuzzer found).
        let p = pickle(&[b"]".as_slice(), &b"2\x86".repeat(40)].concat());
        assert!(
            matches!(check(&p), Err(Refusal::TooMany { .. })),
            "a bomb of {} bytes passed",
            p.len()
        );
        // A length near 2^64 is a truncated argument, not an overflow (the fuzzer found this).
        let mut huge = vec![0x80, 4, 0x8d];
        huge.extend_from_slice(&(u64::MAX - 3).to_le_bytes());
        huge.extend_from_slice(b"abc.");
        assert_eq!(check(&huge), Ok(()));
        assert!(crate::replay::trace::read_bytes(&huge, None).is_err());
        let fine = serde_pickle::to_vec(&vec![vec![1u32; 1000]; 100], Default::default()).unwrap();
        assert_eq!(check(&fine), Ok(()));
        // The shipped traces pass.
        for t in [
            "gpt2-train",
            "gpt2-train-expandable",
            "llama1b-serve",
            "streams-train-0",
        ] {
            let gz = std::fs::read(format!("tests/data/{t}.pickle.gz")).unwrap();
            let mut raw = Vec::new();
            std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut raw)
                .unwrap();
            assert_eq!(check(&raw), Ok(()), "{t}");
        }
    }

    #[test]
    fn a_list_filled_after_it_is_memoised_counts_in_full_when_fetched() {
        // Python's pickler memoises a list before its items: 20,000 fetches of a list of
        // 20,000 items are 4 * 10^8 values, from 80 KB.
        let n = 20_000;
        let mut body = b"]\x94(".to_vec();
        body.extend(b"K\x01".repeat(n));
        body.extend(b"e0(");
        body.extend(b"h\x00".repeat(n));
        body.push(b'l');
        assert!(matches!(
            check(&pickle(&body)),
            Err(Refusal::TooMany { .. })
        ));
        // Memoising a reference copies the value: 255 copies of a list of 20,000 items.
        let mut body = b"]\x94(".to_vec();
        body.extend(b"K\x01".repeat(n));
        body.push(b'e');
        for i in 1..=255u8 {
            body.extend([b'q', i]);
        }
        assert!(matches!(
            check(&pickle(&body)),
            Err(Refusal::TooMany { .. })
        ));
    }

    #[test]
    fn integers_are_bounded_in_text_and_in_binary() {
        let text =
            |digits: usize| pickle(&[b"L".as_slice(), &b"9".repeat(digits), b"L\n"].concat());
        assert_eq!(check(&text(MAX_INT_DIGITS)), Ok(()));
        assert_eq!(check(&text(MAX_INT_DIGITS + 1)), Err(Refusal::HugeInteger));
        let binary = |len: u32| {
            let body = [&[0x8b][..], &len.to_le_bytes(), &vec![7; len as usize]].concat();
            pickle(&body)
        };
        assert_eq!(check(&binary(MAX_INT_BYTES as u32)), Ok(()));
        assert_eq!(
            check(&binary(MAX_INT_BYTES as u32 + 1)),
            Err(Refusal::HugeInteger)
        );
        // A two's-complement integer of n bytes has up to 8n - 1 bits of magnitude.
        let digits = |bytes: u64| ((bytes * 8 - 1) as f64 * 2f64.log10()).ceil() as usize;
        assert!(digits(MAX_INT_BYTES) <= MAX_INT_DIGITS);
        assert!(digits(MAX_INT_BYTES + 1) > MAX_INT_DIGITS);
    }

    #[test]
    fn nesting_is_bounded_through_the_stack_the_marks_and_the_memo() {
        let deep = |n: usize| pickle(&[b"]".repeat(n), b"a".repeat(n - 1)].concat());
        assert_eq!(check(&deep(MAX_DEPTH as usize)), Ok(()));
        assert_eq!(check(&deep(MAX_DEPTH as usize + 1)), Err(Refusal::TooDeep));
        assert_eq!(check(&deep(300_000)), Err(Refusal::TooDeep));
        // Lists closed by LIST, each inside the next.
        let marks = |n: usize| pickle(&[b"(".repeat(n), b"l".repeat(n)].concat());
        assert_eq!(check(&marks(MAX_DEPTH as usize)), Ok(()));
        assert_eq!(
            check(&marks(MAX_DEPTH as usize + 1)),
            Err(Refusal::TooManyMarks)
        );
        // Each list holds a reference to the one before: the depth is carried by the memo.
        let mut chain = b"]q\x00".to_vec();
        for i in 1..=200u8 {
            chain.extend([b'h', i - 1, 0x85, b'q', i]);
        }
        assert_eq!(check(&pickle(&chain)), Err(Refusal::TooDeep));
        // Empty lists memoised, then each appended to the one before through its reference:
        // a change behind references already fetched.
        let mut linked = Vec::new();
        for i in 0..200u8 {
            linked.extend([b']', b'q', i, b'0']);
        }
        for i in 0..199u8 {
            linked.extend([b'h', i, b'h', i + 1, b'a', b'0']);
        }
        linked.extend(b"h\x00");
        assert_eq!(check(&pickle(&linked)), Err(Refusal::ChangedAfterFetch(0)));
        assert_eq!(
            check(&pickle(b"]q\x00]q\x00")),
            Err(Refusal::MemoRewritten(0))
        );
    }

    #[test]
    fn a_set_is_refused_beside_a_float_and_passes_without_one() {
        let float = b"G\x3f\xe0\x00\x00\x00\x00\x00\x00".as_slice(); // 0.5
        let set_of = |items: &[u8]| pickle(&[b"\x8f(".as_slice(), items, b"\x90"].concat());
        // A set of integers, and a float outside any set, as snapshots hold it: both pass.
        assert_eq!(check(&set_of(b"K\x01K\x02")), Ok(()));
        assert_eq!(
            check(&pickle(&[b"}(K\x01".as_slice(), float, b"u"].concat())),
            Ok(())
        );
        // A float in the set, or anywhere beside one, in either order: refused.
        assert_eq!(
            check(&set_of(&[b"K\x01".as_slice(), float].concat())),
            Err(Refusal::SetBesideFloat)
        );
        assert_eq!(
            check(&pickle(&[b"(".as_slice(), float, b"\x8f", b"t"].concat())),
            Err(Refusal::SetBesideFloat)
        );
    }
}
