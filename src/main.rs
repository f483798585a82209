//! The `vram-ledger` command-line tool.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use vram_ledger::allocator::rules;
use vram_ledger::driver::sim::{SimConfig, SimDriver, GIB, MIB};
use vram_ledger::{report, Allocator, Config, SegmentMode, StreamId, Tag};

#[derive(Parser)]
#[command(
    name = "vram-ledger",
    version,
    about = "A caching GPU allocator with an exact, tagged ledger"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show how requests of these sizes (bytes; K/M/G suffixes allowed) are rounded, pooled and
    /// backed by segments.
    Rules {
        #[arg(required = true)]
        sizes: Vec<String>,
    },
    /// Run a small engine-like workload (weights, activations, KV cache) on a simulated device
    /// and print the ledger.
    Demo {
        /// Use expandable (virtual-memory) segments.
        #[arg(long)]
        expandable: bool,
        /// Print the ledger snapshot as JSON.
        #[arg(long)]
        json: bool,
    },
}

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let m = match t[i..].to_ascii_lowercase().as_str() {
                "b" => 1,
                "k" | "kb" | "kib" => 1 << 10,
                "m" | "mb" | "mib" => 1 << 20,
                "g" | "gb" | "gib" => 1 << 30,
                other => return Err(format!("unknown size suffix {other:?} in {s:?}")),
            };
            (&t[..i], m)
        }
        None => (t, 1),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a size"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

fn rules_cmd(sizes: &[String]) -> Result<(), String> {
    let sizes = sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(n) = sizes.iter().find(|&&n| n >= rules::ABSURD_SIZE) {
        return Err(format!(
            "{n} bytes is absurd (at least 2^60): it would be refused"
        ));
    }
    println!(
        "{:>16} {:>16} {:>6} {:>16} {:>18}",
        "request", "rounded", "pool", "new segment", "expandable page"
    );
    for n in sizes {
        let r = rules::round_size(n);
        let pool = rules::pool_for(r);
        println!(
            "{:>16} {:>16} {:>6} {:>16} {:>18}",
            n,
            r,
            format!("{pool:?}").to_lowercase(),
            rules::segment_size(r),
            rules::expandable_page(pool, 2 * MIB)
        );
    }
    Ok(())
}

fn demo(expandable: bool, json: bool) -> Result<(), String> {
    let drv = SimDriver::with_config(SimConfig {
        capacity: 80 * GIB,
        ..Default::default()
    });
    let mode = if expandable {
        SegmentMode::Expandable
    } else {
        SegmentMode::Plain
    };
    let a = Allocator::new(
        drv,
        Config {
            mode,
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let s = StreamId::DEFAULT;
    let e = |e: vram_ledger::Error| e.to_string();
    // Weights: 64 layers of a few tensors each.
    let mut weights = Vec::new();
    {
        let _t = vram_ledger::tag::scope(Tag::Weights);
        for layer in 0..64u64 {
            for m in [48u64, 48, 16, 130] {
                weights.push(a.allocate(m * MIB + layer * 4096, s).map_err(e)?);
            }
        }
    }
    // A forward pass: activations come and go.
    {
        let _t = vram_ledger::tag::scope(Tag::Activation);
        for _ in 0..64 {
            let x = a.allocate(96 * MIB, s).map_err(e)?;
            let y = a.allocate(24 * MIB + 512, s).map_err(e)?;
            let z = a.allocate(700 * 1024, s).map_err(e)?;
            for p in [x.ptr, z.ptr, y.ptr] {
                a.free(p).map_err(e)?;
            }
        }
    }
    // KV cache: one large block per layer.
    let kv: Vec<_> = (0..64)
        .map(|_| a.allocate_tagged(160 * MIB, s, Tag::KvCache))
        .collect::<Result<_, _>>()
        .map_err(e)?;
    let snap = a.snapshot();
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&snap).map_err(|e| e.to_string())?
        );
    } else {
        print!("{}", report::ledger_table(&snap));
    }
    drop(kv);
    drop(weights);
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Rules { sizes } => rules_cmd(&sizes),
        Command::Demo { expandable, json } => demo(expandable, json),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("vram-ledger: {msg}");
            ExitCode::from(2)
        }
    }
}
