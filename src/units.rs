//! Byte units and the one way bytes are written for people.
//!
//! Every report, error and picture formats sizes through [`Bytes`], so that the same number
//! reads the same everywhere: two decimals of GiB or MiB, exact bytes below a MiB.

use std::fmt;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// A byte count that displays itself in GiB or MiB (two decimals), or in bytes below 1 MiB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        // Through `pad`, so that table widths (`{:>14}`) apply.
        f.pad(&if b >= GIB {
            format!("{:.2} GiB", b as f64 / GIB as f64)
        } else if b >= MIB {
            format!("{:.2} MiB", b as f64 / MIB as f64)
        } else {
            format!("{b} bytes")
        })
    }
}

/// A byte count in GiB as a number, for tables and axes that share one unit.
pub fn in_gib(bytes: u64) -> f64 {
    bytes as f64 / GIB as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_pick_their_unit() {
        assert_eq!(Bytes(0).to_string(), "0 bytes");
        assert_eq!(Bytes(MIB - 1).to_string(), "1048575 bytes");
        assert_eq!(Bytes(MIB).to_string(), "1.00 MiB");
        assert_eq!(Bytes(3 * GIB / 2).to_string(), "1.50 GiB");
        assert_eq!(in_gib(GIB / 4), 0.25);
        assert_eq!(format!("{:>9}", Bytes(MIB)), " 1.00 MiB");
    }
}
