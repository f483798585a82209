//! A Rust engine on cudarc using vram-ledger: tagged buffers as kernel arguments, and the
//! ledger afterwards. Runs on device 0; says so and exits when there is no GPU; exits 1 when a
//! word the kernels wrote reads back wrong.

use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut};
use vram_ledger::devices::{self, DeviceBuffer};
use vram_ledger::driver::cuda::probe;
use vram_ledger::kernels::PatternKernels;
use vram_ledger::{report, tag, Tag};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let Some(why) = probe().skip_reason()? {
        println!("cudarc_engine: skipped: {why}");
        return Ok(());
    }
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let kernels = PatternKernels::load(&ctx)?;
    let alloc = devices::allocator(0)?;

    // Weights, tagged by a scope.
    let weights: Vec<DeviceBuffer<f32>> = {
        let _w = tag::scope(Tag::Weights);
        (0..8)
            .map(|_| DeviceBuffer::new(&alloc, 16 << 20, &stream))
            .collect::<Result<_, _>>()?
    };
    // Activations come and go; each is written by a kernel through DevicePtrMut.
    for step in 0..16u64 {
        let mut act = DeviceBuffer::<u64>::new_tagged(&alloc, 4 << 20, &stream, Tag::Activation)?;
        let (ptr, _sync) = act.device_ptr_mut(&stream);
        kernels.fill(&stream, ptr, (4 << 20) * 8, step)?;
    }
    // A KV cache read by a kernel through DevicePtr.
    let kv = DeviceBuffer::<u64>::new_tagged(&alloc, 64 << 20, &stream, Tag::KvCache)?;
    let mut errors = stream.alloc_zeros::<u64>(1)?;
    {
        let (p, _sync) = kv.device_ptr(&stream);
        kernels.fill(&stream, p, (64 << 20) * 8, 7)?;
        kernels.verify(&stream, p, (64 << 20) * 8, 7, &mut errors)?;
    }
    let bad = stream.clone_dtoh(&errors)?[0];
    println!("KV cache verified: {bad} mismatched words");
    print!("{}", report::ledger_table(&alloc.snapshot()));
    drop((weights, kv));
    if bad != 0 {
        return Err(format!("{bad} mismatched words in the KV cache").into());
    }
    Ok(())
}
