//! A guard against pickles that expand without bound. Every memo fetch in a pickle copies the
//! fetched value, so a few hundred bytes can describe a value of billions of nodes (the fuzzer
//! found one). Before anything is decoded, this walks the opcodes keeping only each value's
//! size, and refuses a pickle that would build more nodes than a generous bound on its length.
//!
//! Invariant: it never rejects what it does not understand: an unknown opcode or a truncated
//! argument ends the walk, and the decoder reports the problem in its own words.

const NODES_PER_BYTE: u64 = 4;
const BASE_NODES: u64 = 1 << 20;

/// `Err(nodes)` when decoding `data` would build at least `nodes` values, past the bound.
pub(crate) fn check(data: &[u8]) -> Result<(), u64> {
    let limit = BASE_NODES + NODES_PER_BYTE * data.len() as u64;
    let mut stack: Vec<u64> = Vec::new();
    let mut marks: Vec<usize> = Vec::new();
    let mut memo: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
    let mut built: u64 = 0;
    let mut i = 0usize;
    let le = |b: &[u8]| b.iter().rev().fold(0u64, |a, &x| (a << 8) | u64::from(x));
    macro_rules! arg {
        ($n:expr) => {{
            let n = $n;
            if n > data.len() - i {
                return Ok(());
            }
            let v = &data[i..i + n];
            i += n;
            v
        }};
    }
    macro_rules! push {
        ($size:expr) => {{
            let s: u64 = $size;
            built = built.saturating_add(s);
            if built > limit {
                return Err(built);
            }
            stack.push(s);
        }};
    }
    let pop = |stack: &mut Vec<u64>| stack.pop().unwrap_or(0);
    let pop_mark = |stack: &mut Vec<u64>, marks: &mut Vec<usize>| -> u64 {
        let m = marks.pop().unwrap_or(0).min(stack.len());
        stack.drain(m..).fold(0u64, |a, s| a.saturating_add(s))
    };
    while i < data.len() {
        let op = data[i];
        i += 1;
        match op {
            b'.' => return Ok(()),
            b'(' => marks.push(stack.len()),
            b'0' => {
                pop(&mut stack);
            }
            b'1' => {
                pop_mark(&mut stack, &mut marks);
            }
            b'2' => {
                let top = stack.last().copied().unwrap_or(0);
                push!(top)
            }
            b'N' | 0x88 | 0x89 | b']' | b'}' | b')' | 0x8f => push!(1),
            b'K' | b'U' | 0x8c | b'C' | 0x8a => {
                let n = arg!(1)[0] as usize;
                if op != b'K' {
                    arg!(n);
                }
                push!(1)
            }
            0x82 => {
                arg!(1);
                push!(1)
            }
            b'M' | 0x83 => {
                arg!(2);
                push!(1)
            }
            b'J' | 0x84 => {
                arg!(4);
                push!(1)
            }
            b'T' | b'X' | b'B' | 0x8b => {
                let n = le(arg!(4)) as usize;
                arg!(n);
                push!(1)
            }
            b'G' => {
                arg!(8);
                push!(1)
            }
            0x8d | 0x8e | 0x96 => {
                let n = le(arg!(8)) as usize;
                arg!(n);
                push!(1)
            }
            0x95 => {
                arg!(8);
            }
            0x80 => {
                arg!(1);
            }
            b'I' | b'L' | b'F' | b'S' | b'V' | b'P' | b'g' | b'p' | b'c' | b'i' => {
                let lines = if matches!(op, b'c' | b'i') { 2 } else { 1 };
                let mut line = Vec::new();
                for _ in 0..lines {
                    let end = match data[i..].iter().position(|&c| c == b'\n') {
                        Some(e) => i + e,
                        None => return Ok(()),
                    };
                    line = data[i..end].to_vec();
                    i = end + 1;
                }
                match op {
                    b'g' => {
                        let k = std::str::from_utf8(&line)
                            .ok()
                            .and_then(|s| s.trim().parse().ok())
                            .unwrap_or(u64::MAX);
                        push!(memo.get(&k).copied().unwrap_or(1))
                    }
                    b'p' => {
                        let k = std::str::from_utf8(&line)
                            .ok()
                            .and_then(|s| s.trim().parse().ok())
                            .unwrap_or(u64::MAX);
                        memo.insert(k, stack.last().copied().unwrap_or(0));
                    }
                    b'i' => {
                        let inner = pop_mark(&mut stack, &mut marks);
                        push!(inner.saturating_add(1))
                    }
                    _ => push!(1),
                }
            }
            b'h' | b'j' => {
                let k = if op == b'h' {
                    u64::from(arg!(1)[0])
                } else {
                    le(arg!(4))
                };
                push!(memo.get(&k).copied().unwrap_or(1))
            }
            b'q' | b'r' => {
                let k = if op == b'q' {
                    u64::from(arg!(1)[0])
                } else {
                    le(arg!(4))
                };
                memo.insert(k, stack.last().copied().unwrap_or(0));
            }
            0x94 => {
                let k = memo.len() as u64;
                memo.insert(k, stack.last().copied().unwrap_or(0));
            }
            b'a' => {
                let item = pop(&mut stack);
                if let Some(t) = stack.last_mut() {
                    *t = t.saturating_add(item);
                }
            }
            b's' => {
                let item = pop(&mut stack).saturating_add(pop(&mut stack));
                if let Some(t) = stack.last_mut() {
                    *t = t.saturating_add(item);
                }
            }
            b'e' | b'u' | 0x90 => {
                let items = pop_mark(&mut stack, &mut marks);
                if let Some(t) = stack.last_mut() {
                    *t = t.saturating_add(items);
                }
            }
            b'l' | b'd' | b't' | 0x91 | b'o' => {
                let items = pop_mark(&mut stack, &mut marks);
                push!(items.saturating_add(1))
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let mut s = 1u64;
                for _ in 0..n {
                    s = s.saturating_add(pop(&mut stack));
                }
                push!(s)
            }
            b'b' => {
                let state = pop(&mut stack);
                if let Some(t) = stack.last_mut() {
                    *t = t.saturating_add(state);
                }
            }
            b'R' | 0x81 | 0x93 => {
                let s = pop(&mut stack).saturating_add(pop(&mut stack));
                push!(s.saturating_add(1))
            }
            0x92 => {
                let s = pop(&mut stack)
                    .saturating_add(pop(&mut stack))
                    .saturating_add(pop(&mut stack));
                push!(s.saturating_add(1))
            }
            b'Q' => {
                pop(&mut stack);
                push!(1)
            }
            0x97 | 0x98 => push!(1),
            _ => return Ok(()),
        }
    }
    Ok(())
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
