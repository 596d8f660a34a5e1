//! Pods made and removed many at a time: CNI ADD and DEL are mostly exec and waiting.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use anyhow::Result;
use weir_tests::{Pod, TestNode};

/// Threads creating (and removing) pods.
pub const POD_WORKERS: usize = 8;

/// `count` pods made by [`POD_WORKERS`] threads at once.
pub fn make_pods(node: &TestNode, prefix: &str, count: usize) -> Result<Vec<Pod>> {
    let indexes: Vec<usize> = (0..count).collect();
    parallel(&indexes, POD_WORKERS, |i| {
        node.add_pod(&format!("{prefix}{i}"))
    })
}

/// `work` on every item from `workers` threads at once (each taking the next item); the results
/// in the items' order, or the first failure (the items after it are then left undone).
pub fn parallel<T: Sync, R: Send>(
    items: &[T],
    workers: usize,
    work: impl Fn(&T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let done = Mutex::new(Vec::with_capacity(items.len()));
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..workers.min(items.len()))
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    while !failed.load(Ordering::Relaxed) {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else {
                            return Ok(());
                        };
                        let result =
                            work(item).inspect_err(|_| failed.store(true, Ordering::Relaxed))?;
                        done.lock().expect("no panics holding it").push((i, result));
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|worker| worker.join().expect("worker panicked"))
    })?;
    let mut done = done.into_inner().expect("no panics holding it");
    done.sort_by_key(|(i, _)| *i);
    Ok(done.into_iter().map(|(_, result)| result).collect())
}

/// Drops (CNI DEL, netns removal) `pods` from [`POD_WORKERS`] threads at once.
pub fn remove_pods(pods: Vec<Pod>) {
    let queue = Mutex::new(pods);
    std::thread::scope(|scope| {
        for _ in 0..POD_WORKERS {
            scope.spawn(|| loop {
                let pod = queue.lock().expect("no panics holding it").pop();
                match pod {
                    Some(pod) => drop(pod),
                    None => return,
                }
            });
        }
    });
}
