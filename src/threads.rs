//! Work spread over a few scoped threads, for the slow paths that wait on the kernel (pinning
//! and freeing host memory): a thread that cannot be started leaves its part to the caller's,
//! so nothing panics for want of threads while the allocator's shards are locked.

/// At most this many threads at once.
pub(crate) const THREADS: usize = 8;

/// `f` over `items` on up to [`THREADS`] threads; the results in the items' order.
pub(crate) fn on_threads<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    if items.len() <= 1 {
        return items.iter().map(f).collect();
    }
    let per = items.len().div_ceil(THREADS);
    let f = &f;
    std::thread::scope(|s| {
        // A thread that cannot be started leaves its part to this one (no panic while every
        // shard is locked).
        let handles: Vec<_> = items
            .chunks(per)
            .map(|part| {
                std::thread::Builder::new()
                    .spawn_scoped(s, move || part.iter().map(f).collect::<Vec<R>>())
                    .map_err(|_| part)
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| match h {
                Ok(h) => h.join().expect("a worker thread panicked"),
                Err(part) => part.iter().map(f).collect(),
            })
            .collect()
    })
}
