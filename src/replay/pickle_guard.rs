//! A guard against pickles that expand without bound. Every memo fetch in a pickle copies the
//! fetched value, so a few hundred bytes can describe a value of billions of nodes (the fuzzer
//! found one). Before anything is decoded, this walks the opcodes keeping only each value's
//! size, and refuses a pickle that would build more nodes than a generous bound on its length.
//!
//! Invariant: it never rejects what it does not understand: an unknown opcode or a truncated
//! argument ends the walk, and the decoder reports the problem in its own words.

use std::collections::HashMap;

const NODES_PER_BYTE: u64 = 4;
const BASE_NODES: u64 = 1 << 20;

/// `Err(nodes)` when decoding `data` would build at least `nodes` values, past the bound.
pub(crate) fn check(data: &[u8]) -> Result<(), u64> {
    let mut ops = Opcodes { data, at: 0 };
    let mut stack = Stack::new(Budget::for_len(data.len()));
    let end = loop {
        if let Err(end) = step(&mut ops, &mut stack) {
            break end;
        }
    };
    match end {
        End::Stop => Ok(()),
        End::TooMany(nodes) => Err(nodes),
    }
}

/// One opcode: its argument read, then its effect on the stack.
fn step(ops: &mut Opcodes, stack: &mut Stack) -> Result<(), End> {
    let op = ops.next()?;
    let memo = ops.operand(op)?;
    stack.apply(op, memo)
}

/// Why the walk ends.
enum End {
    /// A `STOP`, the end of the data, an unknown opcode or a truncated argument: the decoder
    /// has the last word.
    Stop,
    /// The values built so far are past the bound.
    TooMany(u64),
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

    /// A length of `n` bytes, then that many bytes.
    fn counted(&mut self, n: usize) -> Result<u64, End> {
        let len = self.uint(n)? as usize;
        self.bytes(len).map(|_| 0)
    }

    /// A line up to its newline (not included).
    fn line(&mut self) -> Result<&'a [u8], End> {
        let rest = &self.data[self.at..];
        let end = rest.iter().position(|&c| c == b'\n').ok_or(End::Stop)?;
        self.at += end + 1;
        Ok(&rest[..end])
    }

    /// Reads `op`'s argument; returns the memo index it names (for the memo opcodes; 0 for the
    /// others).
    fn operand(&mut self, op: u8) -> Result<u64, End> {
        match op {
            b'K' | 0x82 | b'h' | b'q' | 0x80 => self.uint(1),
            b'M' | 0x83 => self.uint(2),
            b'J' | 0x84 | b'j' | b'r' => self.uint(4),
            b'G' | 0x95 => self.uint(8),
            b'U' | 0x8c | b'C' | 0x8a => self.counted(1),
            b'T' | b'X' | b'B' | 0x8b => self.counted(4),
            0x8d | 0x8e | 0x96 => self.counted(8),
            b'g' | b'p' => self.line().map(|line| {
                std::str::from_utf8(line)
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .unwrap_or(u64::MAX)
            }),
            b'I' | b'L' | b'F' | b'S' | b'V' | b'P' => self.line().map(|_| 0),
            b'c' | b'i' => self.line().and_then(|_| self.line()).map(|_| 0),
            _ => Ok(0),
        }
    }
}

/// The bound: how many values a pickle of its length may build.
struct Budget {
    limit: u64,
    built: u64,
}

impl Budget {
    fn for_len(len: usize) -> Budget {
        Budget {
            limit: BASE_NODES + NODES_PER_BYTE * len as u64,
            built: 0,
        }
    }

    /// `nodes` more values built.
    fn spend(&mut self, nodes: u64) -> Result<(), End> {
        self.built = self.built.saturating_add(nodes);
        if self.built > self.limit {
            return Err(End::TooMany(self.built));
        }
        Ok(())
    }
}

/// Stack bookkeeping: the size (in values) of everything on the pickle machine's stack, its
/// marks and its memo.
struct Stack {
    sizes: Vec<u64>,
    marks: Vec<usize>,
    memo: HashMap<u64, u64>,
    budget: Budget,
}

impl Stack {
    fn new(budget: Budget) -> Stack {
        Stack {
            sizes: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
            budget,
        }
    }

    /// A new value of `size` values.
    fn push(&mut self, size: u64) -> Result<(), End> {
        self.budget.spend(size)?;
        self.sizes.push(size);
        Ok(())
    }

    fn pop(&mut self) -> u64 {
        self.sizes.pop().unwrap_or(0)
    }

    fn top(&self) -> u64 {
        self.sizes.last().copied().unwrap_or(0)
    }

    /// Everything above the last mark, and the mark, taken off; returns their total size.
    fn pop_mark(&mut self) -> u64 {
        let m = self.marks.pop().unwrap_or(0).min(self.sizes.len());
        self.sizes.drain(m..).fold(0u64, |a, s| a.saturating_add(s))
    }

    /// `size` more values inside the value on top (appended items, a set state).
    fn grow_top(&mut self, size: u64) {
        if let Some(t) = self.sizes.last_mut() {
            *t = t.saturating_add(size);
        }
    }

    fn memo_put(&mut self, k: u64) {
        let top = self.top();
        self.memo.insert(k, top);
    }

    fn memo_get(&self, k: u64) -> u64 {
        self.memo.get(&k).copied().unwrap_or(1)
    }

    /// What `op` (its argument read, `memo` the index it names) does to the stack.
    fn apply(&mut self, op: u8, memo: u64) -> Result<(), End> {
        match op {
            b'.' => return Err(End::Stop),
            0x80 | 0x95 => {}
            b'(' => self.marks.push(self.sizes.len()),
            b'0' => {
                self.pop();
            }
            b'1' => {
                self.pop_mark();
            }
            b'2' => self.push(self.top())?,
            // One value each: constants and empty containers; numbers and strings with a
            // binary argument; the same in text; a global.
            b'N' | 0x88 | 0x89 | b']' | b'}' | b')' | 0x8f | 0x97 | 0x98 => self.push(1)?,
            b'K' | b'U' | 0x8c | b'C' | 0x8a | 0x82 | b'M' | 0x83 | b'J' | 0x84 => self.push(1)?,
            b'T' | b'X' | b'B' | 0x8b | b'G' | 0x8d | 0x8e | 0x96 => self.push(1)?,
            b'I' | b'L' | b'F' | b'S' | b'V' | b'P' | b'c' => self.push(1)?,
            b'g' | b'h' | b'j' => self.push(self.memo_get(memo))?,
            b'p' | b'q' | b'r' => self.memo_put(memo),
            0x94 => self.memo_put(self.memo.len() as u64),
            b'a' | b'b' => {
                let item = self.pop();
                self.grow_top(item);
            }
            b's' => {
                let item = self.pop().saturating_add(self.pop());
                self.grow_top(item);
            }
            b'e' | b'u' | 0x90 => {
                let items = self.pop_mark();
                self.grow_top(items);
            }
            b'l' | b'd' | b't' | 0x91 | b'o' | b'i' => {
                let items = self.pop_mark();
                self.push(items.saturating_add(1))?;
            }
            0x85..=0x87 => {
                let mut s = 1u64;
                for _ in 0..op - 0x84 {
                    s = s.saturating_add(self.pop());
                }
                self.push(s)?;
            }
            b'R' | 0x81 | 0x93 => {
                let s = self.pop().saturating_add(self.pop());
                self.push(s.saturating_add(1))?;
            }
            0x92 => {
                let s = self
                    .pop()
                    .saturating_add(self.pop())
                    .saturating_add(self.pop());
                self.push(s.saturating_add(1))?;
            }
            b'Q' => {
                self.pop();
                self.push(1)?;
            }
            _ => return Err(End::Stop),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memo_bomb_is_refused_and_real_pickles_pass() {
        // A list, then "duplicate the top and pair the two copies" forty times: 2^40 nodes in
        // 84 bytes (the shape the fuzzer found).
        let mut p = vec![0x80, 4, b']'];
        for _ in 0..40 {
            p.extend_from_slice(&[b'2', 0x86]);
        }
        p.push(b'.');
        assert!(check(&p).is_err(), "a bomb of {} bytes passed", p.len());
        // A length near 2^64 is a truncated argument, not an overflow (the fuzzer found this).
        let mut huge = vec![0x80, 4, 0x8d];
        huge.extend_from_slice(&(u64::MAX - 3).to_le_bytes());
        huge.extend_from_slice(b"abc.");
        assert_eq!(check(&huge), Ok(()));
        assert!(crate::replay::trace::read_bytes(&huge, None).is_err());
        let fine = serde_pickle::to_vec(&vec![vec![1u32; 1000]; 100], Default::default()).unwrap();
        assert_eq!(check(&fine), Ok(()));
        // The shipped traces pass.
        for t in ["gpt2-train", "llama1b-serve"] {
            let gz = std::fs::read(format!("tests/data/{t}.pickle.gz")).unwrap();
            let mut raw = Vec::new();
            std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut raw)
                .unwrap();
            assert_eq!(check(&raw), Ok(()), "{t}");
        }
    }
}
