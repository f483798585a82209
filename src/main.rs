//! The `vram-ledger` command-line tool.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use vram_ledger::allocator::rules;
use vram_ledger::driver::sim::{SimConfig, SimDriver};
use vram_ledger::driver::DriverCall;
use vram_ledger::replay;
use vram_ledger::units::{Bytes, GIB, MIB};
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

#[derive(clap::Args)]
struct ReplayArgs {
    /// The snapshot file.
    #[arg(required_unless_present = "list_modes")]
    file: Option<std::path::PathBuf>,
    /// Allocation policy; "all" (the default) replays every mode and compares them in one
    /// table; a mode's name shows that mode in detail.
    #[arg(long, default_value = "all")]
    mode: String,
    /// Simulated device memory in bytes (K/M/G suffixes allowed); default an H200's.
    #[arg(long)]
    capacity: Option<String>,
    /// Remap mode: the largest piece one map call covers (default 68M).
    #[arg(long, value_name = "BYTES")]
    remap_piece: Option<String>,
    /// What a wait for the device costs in the driver-time estimate when it drains the work
    /// the program queued on a stream (the first synchronisation of it, or of the device, or
    /// segment free, after that work), ours and PyTorch's alike, in microseconds (default 437.9,
    /// measured inside a training step; 0.2, the least, prices every wait as on an idle stream).
    #[arg(long, value_name = "MICROSECONDS")]
    sync_us: Option<f64>,
    /// Remap mode: unmap a moved piece's old mapping once the stream's earlier work has
    /// finished, instead of synchronising the stream first (`Config::unmap_later`).
    #[arg(long)]
    unmap_later: bool,
    /// Which device's trace to replay (default: the one with the most events).
    #[arg(long)]
    device: Option<usize>,
    /// The largest snapshot read, and the most its gzip stream may decompress to (K/M/G
    /// suffixes allowed; default 1G).
    #[arg(long, value_name = "BYTES")]
    max_input: Option<String>,
    /// Print one JSON object per mode instead of a table.
    #[arg(long)]
    json: bool,
    /// Draw a timeline picture (SVG) of the mode marked best (of the one asked for with --mode).
    #[arg(long, value_name = "OUT")]
    svg: Option<std::path::PathBuf>,
    /// List the modes and exit.
    #[arg(long)]
    list_modes: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot, pickle, gzipped or
    /// not) through vram-ledger on a simulated device, and compare with what PyTorch reserved.
    Replay(ReplayArgs),
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
        if n == 0 {
            // As PyTorch's allocator: 0 bytes is a null pointer, no block.
            println!("{:>16} {:>16}", 0, "none (null)");
            continue;
        }
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
        SegmentMode::Native
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

fn replay_cmd(args: &ReplayArgs) -> Result<(), String> {
    if args.list_modes {
        for m in SegmentMode::ALL {
            println!("{:<12} {}", m.name(), m.describe());
        }
        return Ok(());
    }
    let (mode, json) = (args.mode.as_str(), args.json);
    let file = args
        .file
        .as_deref()
        .expect("clap requires a file unless --list-modes");
    let modes: Vec<SegmentMode> = if mode == "all" {
        SegmentMode::ALL.to_vec()
    } else {
        vec![mode
            .parse::<SegmentMode>()
            .map_err(|e| format!("{e}, or all"))?]
    };
    let capacity = match &args.capacity {
        // Less than one page of device memory holds nothing: every figure would read 0.
        Some(c) => match parse_size(c)? {
            n if n < 2 * MIB => {
                return Err(format!(
                    "--capacity: {c} is less than the 2 MiB a simulated device needs"
                ))
            }
            n => n,
        },
        None => vram_ledger::replay::engine::H200_CAPACITY,
    };
    let remap_piece =
        match args.remap_piece.as_deref().map(parse_size).transpose()? {
            Some(0) => return Err(
                "--remap-piece: 0 is no piece (1 or more bytes, rounded up to whole 2 MiB pages)"
                    .into(),
            ),
            p => p,
        };
    let sync_ns = match args.sync_us {
        // Below an idle stream's price a wait would cost less than it does with nothing to drain.
        Some(us) if us.is_finite() && (0.2..=1e9).contains(&us) => Some((us * 1e3).round() as u64),
        Some(us) => {
            // `{:e}` keeps 1e300 one short word instead of 301 digits.
            return Err(format!(
                "--sync-us: {} is not a number of microseconds from 0.2 (an idle stream's \
                 synchronisation) to 10⁹",
                if us.abs() >= 1e9 {
                    format!("{us:e}")
                } else {
                    us.to_string()
                }
            ));
        }
        None => replay::ReplayOptions::default().sync_ns,
    };
    let limits = match &args.max_input {
        Some(m) => replay::Limits {
            max_bytes: parse_size(m)?,
        },
        None => replay::Limits::default(),
    };
    let trace = replay::read_file_with(file, args.device, limits).map_err(|e| e.to_string())?;
    let name = file.file_name().map_or_else(
        || file.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    if !json {
        println!(
            "{name}: {} events on device {}{}",
            trace.events.len(),
            trace.device,
            if trace.unknown_tags.is_empty() {
                String::new()
            } else {
                format!(
                    " (unknown tags, replayed as untracked: {:?})",
                    trace.unknown_tags
                )
            }
        );
        let b = trace.before;
        if !b.is_empty() {
            println!(
                "  the recording began with memory live: {} in {}, {} in {}; replayed as \
                 allocated before its first event",
                Bytes(b.block_bytes),
                count(b.blocks, "block"),
                Bytes(b.segment_bytes),
                count(b.segments, "segment")
            );
        }
    }
    let mut first = None;
    let mut all = Vec::new();
    let detail = modes.len() == 1;
    for m in modes {
        let opts = replay::ReplayOptions {
            mode: m,
            capacity,
            remap_piece,
            sync_ns,
            unmap_later: args.unmap_later,
            ..Default::default()
        };
        let bar = (!json
            && std::io::IsTerminal::is_terminal(&std::io::stderr())
            && trace.events.len() > 200_000)
            .then(|| indicatif::ProgressBar::new(trace.events.len() as u64));
        let mut r = replay::replay(&trace, &opts, |i| {
            if let Some(b) = &bar {
                b.set_position(i as u64);
            }
        })
        .map_err(|e| e.to_string())?;
        r.at_peak = replay::at_peak(&trace, &opts, &r).map_err(|e| e.to_string())?;
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        if json {
            println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
        } else if detail {
            print!("{}", replay_table(&r));
            print!("{}", peak_lines(&r));
        }
        if first.is_none() {
            first = Some(r.clone());
        }
        all.push(r);
    }
    if !json && !detail {
        print!("{}", compare_table(&all));
    }
    // The picture is of the best mode when every mode ran (of the one asked for otherwise).
    let pictured = best_mode(&all)
        .and_then(|m| all.iter().find(|r| r.mode == m).cloned())
        .or(first);
    if let (Some(out), Some(r)) = (&args.svg, pictured) {
        let title = format!(
            "{name}: {} mode, fragmentation {:.4} (PyTorch {:.4})",
            r.mode.name(),
            r.fragmentation_ratio,
            r.torch_fragmentation_ratio
        );
        std::fs::write(out, replay::svg::timeline(&r, &title))
            .map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    }
    Ok(())
}

/// `n` and `what`, plural unless one.
fn count(n: u64, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

/// The mode marked best: the lowest fragmentation among the modes within twice PyTorch's
/// estimated driver time (or among all, if none is), leaving out any that ran out of memory
/// (its figures leave allocations out).
fn best_mode(rs: &[replay::ReplayResult]) -> Option<SegmentMode> {
    let torch_s = rs.first()?.torch_driver_seconds;
    let by_ratio = |a: &&replay::ReplayResult, b: &&replay::ReplayResult| {
        a.fragmentation_ratio.total_cmp(&b.fragmentation_ratio)
    };
    let fit = || rs.iter().filter(|r| r.ooms == 0);
    fit()
        .filter(|r| r.driver_seconds <= 2.0 * torch_s)
        .min_by(by_ratio)
        .or_else(|| fit().min_by(by_ratio))
        .map(|r| r.mode)
}

/// Every mode in one table, beside what PyTorch recorded, the best mode ([`best_mode`]) marked.
fn compare_table(rs: &[replay::ReplayResult]) -> String {
    let Some(r0) = rs.first() else {
        return String::new();
    };
    let torch_s = r0.torch_driver_seconds;
    let best = best_mode(rs);
    // PyTorch's estimate is 0 when its segments were all made before the recording.
    let vs_torch = |secs: f64| {
        if torch_s > 0.0 {
            format!("{:.2}x", secs / torch_s)
        } else {
            "-".into()
        }
    };
    let mut s = format!(
        "\npeak live {} (until free_completed)\n  {:<20} {:>14} {:>10} {:>12} {:>16} {:>10}\n",
        Bytes(r0.peak_live),
        "",
        "peak reserved",
        "res/live",
        "driver calls",
        "est. driver time",
        "vs PyTorch"
    );
    // A trace with no segment events and no end state says nothing of PyTorch's reserved bytes.
    let (torch_reserved, torch_ratio) = if r0.torch_peak_reserved > 0 {
        (
            Bytes(r0.torch_peak_reserved).to_string(),
            format!("{:.4}", r0.torch_fragmentation_ratio),
        )
    } else {
        ("-".into(), "-".into())
    };
    s += &format!(
        "  {:<20} {:>14} {:>10} {:>12} {:>13.2} ms {:>10}\n",
        "PyTorch (recorded)",
        torch_reserved,
        torch_ratio,
        r0.torch_driver_calls.total(),
        torch_s * 1e3,
        vs_torch(torch_s)
    );
    let mut at_best = String::new();
    for r in rs {
        if Some(r.mode) == best {
            at_best = peak_lines(r);
        }
        let name = if Some(r.mode) == best {
            format!("{} (best)", r.mode.name())
        } else {
            r.mode.name().to_string()
        };
        s += &format!(
            "  {:<20} {:>14} {:>10.4} {:>12} {:>13.2} ms {:>10}\n",
            name,
            Bytes(r.peak_reserved),
            r.fragmentation_ratio,
            r.driver_calls.total(),
            r.driver_seconds * 1e3,
            vs_torch(r.driver_seconds)
        );
    }
    for r in rs.iter().filter(|r| r.ooms > 0) {
        s += &format!(
            "  {}: {} allocations did not fit in {} (--capacity); its figures leave them out\n",
            r.mode.name(),
            r.ooms,
            Bytes(r.capacity)
        );
    }
    s += &match r0.sync_us {
        Some(us) => format!(
            "  (driver time: a wait that drains the program's work costs {us} µs, --sync-us)\n"
        ),
        None => String::new(),
    };
    s + &at_best
}

/// Where the reserved bytes stood at `r`'s peak (`replay::at_peak`), for a user asking why a
/// workload fragments.
fn peak_lines(r: &replay::ReplayResult) -> String {
    let Some(p) = r.at_peak else {
        return String::new();
    };
    let g = Bytes;
    let mut s = format!(
        "\n{} at its peak (after event {}, an allocation on stream {}): {} reserved\n",
        r.mode.name(),
        p.event,
        p.stream,
        g(p.reserved)
    );
    for (what, bytes) in [
        ("requested by live blocks", p.requested),
        ("rounding of live blocks", p.rounding),
        ("freed, waiting for other streams", p.pending),
        ("free beside live blocks (pinned)", p.free_pinned),
        ("free on other streams", p.free_other_streams),
        ("free on the growing stream", p.free_same_stream),
        ("spare (held, unmapped)", p.spare),
    ] {
        s += &format!("  {what:<34} {:>14}\n", g(bytes));
    }
    s
}

fn replay_table(r: &replay::ReplayResult) -> String {
    let g = Bytes;
    let mut s = format!(
        "\nmode {}: {:.2} M events/s\n",
        r.mode.name(),
        r.events_per_second / 1e6
    );
    s += &format!("  {:<28} {:>14} {:>14}\n", "", "vram-ledger", "PyTorch");
    s += &format!(
        "  {:<28} {:>14} {:>14}\n",
        "peak live",
        g(r.peak_live),
        g(r.peak_live)
    );
    s += &format!(
        "  {:<28} {:>14} {:>14}\n",
        "peak reserved",
        g(r.peak_reserved),
        g(r.torch_peak_reserved)
    );
    s += &format!(
        "  {:<28} {:>14.4} {:>14.4}\n",
        "fragmentation (res/live)", r.fragmentation_ratio, r.torch_fragmentation_ratio
    );
    let (d, t) = (&r.driver_calls, &r.torch_driver_calls);
    let row =
        |name: &str, ours: u64, theirs: u64| format!("  {name:<28} {ours:>14} {theirs:>14}\n");
    s += &row(
        "memory allocations",
        d.memory_allocations(),
        t.memory_allocations(),
    );
    s += &row("maps", d[DriverCall::Map], t[DriverCall::Map]);
    s += &row("memory frees", d.memory_frees(), t.memory_frees());
    s += &row("unmaps", d[DriverCall::Unmap], t[DriverCall::Unmap]);
    s += &format!(
        "  {:<28} {:>11.2} ms {:>11.2} ms\n",
        "est. driver time",
        r.driver_seconds * 1e3,
        r.torch_driver_seconds * 1e3
    );
    if let Some(us) = r.sync_us {
        s += &row(
            &format!("waits draining ({us} µs)"),
            r.drains,
            r.torch_drains,
        );
    }
    // Where in the trace the driver time falls: the later tenths of a loop are its warm steps.
    let tenths = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{:.1}", x * 1e3))
            .collect::<Vec<_>>()
            .join(" ")
    };
    s += &format!(
        "  {:<28} {}\n  {:<28} {}\n",
        "  by tenth of the trace (ms)",
        tenths(&r.driver_seconds_by_tenth),
        "  PyTorch's",
        tenths(&r.torch_driver_seconds_by_tenth)
    );
    s += &format!("  {:<28} {:>14}\n", "out of memory", r.ooms);
    // Per tag the two columns are not the same measure: ours is the blocks handed out (sizes
    // rounded), the trace's what was asked for.
    if Tag::ALL.iter().any(|&t| r.per_tag[t].peak_live > 0) {
        s += "  per tag: the blocks handed out (rounded) | the bytes the trace asked for\n";
    }
    for t in Tag::ALL {
        let p = r.per_tag[t];
        if p.peak_live > 0 {
            s += &format!(
                "  {:<28} {:>14} {:>14}\n",
                format!("peak {}", t.name()),
                g(p.peak_allocated),
                g(p.peak_live)
            );
        }
    }
    s
}

fn main() -> ExitCode {
    // Rust ignores SIGPIPE, so printing to a reader that has gone (`replay FILE | head`) would
    // panic with a backtrace; a command-line tool stops quietly there instead, as `cat` does.
    // SAFETY: called before any thread starts; SIG_DFL is a valid disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Rules { sizes } => rules_cmd(&sizes),
        Command::Demo { expandable, json } => demo(expandable, json),
        Command::Replay(args) => replay_cmd(&args),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            // One line whatever the message quotes (a path, a decoder's text), for scripts.
            let line: String = msg
                .chars()
                .map(|c| match c.is_control() {
                    true => c.escape_default().to_string(),
                    false => c.to_string(),
                })
                .collect();
            eprintln!("vram-ledger: {line}");
            ExitCode::from(2)
        }
    }
}
