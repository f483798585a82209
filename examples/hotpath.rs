use vram_ledger::driver::sim::SimDriver;
use vram_ledger::{Allocator, Config, StreamId, Tag};
fn main() {
    let a = Allocator::new(SimDriver::new(), Config::default()).unwrap();
    let s = StreamId::DEFAULT;
    let n: u64 = std::env::args()
        .nth(1)
        .map(|x| x.parse().unwrap())
        .unwrap_or(20_000_000);
    let t = std::time::Instant::now();
    for _ in 0..n {
        let x = a
            .allocate_tagged(std::hint::black_box(512), s, Tag::Activation)
            .unwrap();
        a.free_on(x.ptr, s).unwrap();
    }
    eprintln!("{:.1} ns/pair", t.elapsed().as_nanos() as f64 / n as f64);
}
