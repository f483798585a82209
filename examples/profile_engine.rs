//! A stand-in engine for profiling on a real GPU, in two roles:
//!
//!   profile_engine hold FRACTION SECONDS READY_FILE
//!       take FRACTION of the GPU with raw cuMemAlloc, write READY_FILE, hold it SECONDS.
//!   profile_engine engine UTILIZATION WEIGHTS_GIB ACTIVATION_GIB OUTSIDE_MIB OUT_JSON
//!       load tagged weights, run a dummy pass with kernels over activation buffers (and
//!       OUTSIDE_MIB of cuMemAlloc behind the allocator's back, as NCCL would), profile at
//!       UTILIZATION, allocate the KV budget, run the pass again, and record the budget, vLLM's
//!       device-wide budget and the process's peak usage (NVML) against what it requested.
//!       Exits 1 when that peak is past the request or NVML gives no reading.

use std::time::Duration;

use cudarc::driver::{sys, CudaContext, DevicePtrMut};
use vram_ledger::devices::{self, DeviceBuffer};
use vram_ledger::driver::cuda::probe;
use vram_ledger::driver::Driver;
use vram_ledger::kernels::PatternKernels;
use vram_ledger::profile::{ProfileOptions, Profiler};
use vram_ledger::units::{in_gib, GIB};
use vram_ledger::{tag, Tag};

fn arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> T {
    args.get(i).and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        eprintln!("profile_engine: argument {i} ({what}) missing or malformed");
        std::process::exit(2)
    })
}

fn hold(args: &[String]) -> Result<(), Box<dyn std::error::Error>> {
    let (fraction, seconds, ready): (f64, u64, String) = (
        arg(args, 2, "fraction"),
        arg(args, 3, "seconds"),
        arg(args, 4, "ready file"),
    );
    let _ctx = CudaContext::new(0)?;
    let (mut free, mut total) = (0usize, 0usize);
    unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total).result()? };
    let want = (total as f64 * fraction) as usize;
    let mut held = 0usize;
    let mut ptrs = Vec::new();
    while held < want {
        let n = (want - held).min(1 << 30);
        let mut p = 0;
        unsafe { sys::cuMemAlloc_v2(&mut p, n).result()? };
        ptrs.push(p);
        held += n;
    }
    std::fs::write(&ready, format!("{held}"))?;
    println!(
        "holding {:.2} GiB of {:.2} GiB",
        in_gib(held as u64),
        in_gib(total as u64)
    );
    std::thread::sleep(Duration::from_secs(seconds));
    Ok(())
}

fn engine(args: &[String]) -> Result<(), Box<dyn std::error::Error>> {
    let utilization: f64 = arg(args, 2, "utilization");
    let weights_gib: f64 = arg(args, 3, "weights GiB");
    let act_gib: f64 = arg(args, 4, "activation GiB");
    let outside_mib: u64 = arg(args, 5, "outside MiB");
    let out: String = arg(args, 6, "output file");
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let kernels = PatternKernels::load(&ctx)?;
    let alloc = devices::allocator(0)?;
    let profiler = Profiler::new(&alloc)?;
    let baseline = profiler.baseline().clone();

    let weights: Vec<DeviceBuffer<u64>> = {
        let _w = tag::scope(Tag::Weights);
        let words = ((weights_gib * GIB as f64) as usize / 8) / 16;
        (0..16)
            .map(|_| DeviceBuffer::new(&alloc, words, &stream))
            .collect::<Result<_, _>>()?
    };
    for (i, w) in weights.iter().enumerate() {
        kernels.fill(&stream, w.ptr(), w.len() as u64 * 8, i as u64)?;
    }
    let act_words = (act_gib * GIB as f64) as usize / 8;
    let mut outside = Vec::new();
    let mut pass = |with_outside: bool| -> Result<(), Box<dyn std::error::Error>> {
        // A forward pass: layer activations live together at the peak, then are freed.
        let _a = tag::scope(Tag::Activation);
        let mut acts = Vec::new();
        for layer in 0..8u64 {
            let mut a = DeviceBuffer::<u64>::new(&alloc, act_words / 8, &stream)?;
            let (p, _s) = a.device_ptr_mut(&stream);
            kernels.fill(&stream, p, (act_words / 8) as u64 * 8, 100 + layer)?;
            drop(_s);
            acts.push(a);
        }
        if with_outside && outside_mib > 0 {
            let mut p = 0;
            unsafe { sys::cuMemAlloc_v2(&mut p, (outside_mib << 20) as usize).result()? };
            outside.push(p);
        }
        stream.synchronize()?;
        Ok(())
    };
    let options = ProfileOptions {
        utilization,
        ..Default::default()
    };
    let scope = profiler.begin(options)?;
    pass(true)?;
    let result = scope.end()?;
    let kv =
        DeviceBuffer::<u8>::new_tagged(&alloc, result.kv_budget as usize, &stream, Tag::KvCache)?;
    kernels.fill(&stream, kv.ptr(), result.kv_budget / 8 * 8, 7)?;
    stream.synchronize()?;
    let driver = alloc.driver();
    // A reading NVML does not give is a failure: taken as 0 it would pass the mark below.
    let usage = || -> Result<u64, Box<dyn std::error::Error>> {
        driver
            .process_usage()?
            .ok_or_else(|| "NVML does not list this process: no usage to check".into())
    };
    let mut peak = usage()?;
    pass(false)?;
    peak = peak.max(usage()?);
    // The ground truth: the budget that would have filled the request exactly.
    let truth = result.kv_budget as i64 + result.requested as i64 - peak as i64;
    let rel = |b: i64| (b - truth) as f64 / truth as f64;
    let json = serde_json::json!({
        "utilization": utilization,
        "pid": std::process::id(),
        "requested": result.requested,
        "kv_budget": result.kv_budget,
        "device_wide_kv_budget": result.device_wide_kv_budget,
        "peak_usage_with_kv": peak,
        "within_request": peak <= result.requested,
        "ground_truth_budget": truth,
        "error_ours": rel(result.kv_budget as i64),
        "error_device_wide": rel(result.device_wide_kv_budget),
        "baseline_usage": baseline.process_usage,
        "result": result,
        "report": result.report_lines(),
    });
    std::fs::write(&out, serde_json::to_string_pretty(&json)?)?;
    println!("{}", result.report_lines().join("\n"));
    // The mark: this process stayed within what it requested, its KV cache allocated.
    if peak > result.requested {
        return Err(format!(
            "peak usage {peak} bytes is past the {} bytes requested",
            result.requested
        )
        .into());
    }
    for p in outside {
        unsafe { sys::cuMemFree_v2(p).result()? };
    }
    drop((kv, weights));
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match probe().skip_reason() {
        Ok(None) => {}
        Ok(Some(why)) => {
            println!("profile_engine: skipped: {why}");
            return;
        }
        Err(e) => {
            eprintln!("profile_engine: {e}");
            std::process::exit(1);
        }
    }
    let r = match args.get(1).map(String::as_str) {
        Some("hold") => hold(&args),
        Some("engine") => engine(&args),
        _ => {
            eprintln!("usage: profile_engine hold FRACTION SECONDS READY | engine UTIL WEIGHTS_GIB ACT_GIB OUTSIDE_MIB OUT");
            std::process::exit(2)
        }
    };
    if let Err(e) = r {
        eprintln!("profile_engine: {e}");
        std::process::exit(1);
    }
}
