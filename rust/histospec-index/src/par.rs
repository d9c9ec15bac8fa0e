//! Batch calls split across a few threads.
//!
//! A decode batch's requests are independent when drafting (a read-only walk of their groups), and
//! independent per group when appending accepted tokens. [`Par`] splits such a batch into
//! contiguous parts, runs the first on the calling thread and the others on a small rayon pool,
//! and waits for all of them. Results never depend on the number of threads: each request's draft
//! is the one it gets alone, and each group receives its appends in batch order.
//!
//! The pool is made on first use and again in a process that was forked after it was made (a fork
//! keeps only the forking thread, so the parent's pool would never run the child's jobs).

use std::sync::{Arc, Mutex};

/// Most threads one index may use for a batch call.
pub const MAX_THREADS: usize = 64;

/// Fewest requests worth handing to a thread of their own: waking a pool thread costs tens of
/// microseconds, a request's draft or update a few.
pub const MIN_PER_THREAD: usize = 16;

/// Thread count and lazily made pool of one index.
#[derive(Debug)]
pub struct Par {
    threads: usize,
    /// The pool (threads - 1 workers; the caller is the other one) and the process that made it.
    pool: Mutex<Option<(u32, Arc<rayon::ThreadPool>)>>,
}

impl Clone for Par {
    fn clone(&self) -> Self {
        Par::new(self.threads)
    }
}

impl Par {
    pub fn new(threads: usize) -> Self {
        Par {
            threads: threads.max(1),
            pool: Mutex::new(None),
        }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// How many parts a batch of `n` items is split into.
    pub fn parts(&self, n: usize) -> usize {
        self.threads.min(n / MIN_PER_THREAD).max(1)
    }

    fn pool(&self) -> std::io::Result<Arc<rayon::ThreadPool>> {
        let pid = std::process::id();
        let mut slot = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((p, pool)) = slot.as_ref() {
            if *p == pid {
                return Ok(pool.clone());
            }
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(self.threads - 1)
            .thread_name(|i| format!("histospec-{i}"))
            .build()
            .map_err(std::io::Error::other)?;
        let pool = Arc::new(pool);
        *slot = Some((pid, pool.clone()));
        Ok(pool)
    }

    /// Runs `f` on every task, the first on the calling thread and the rest on the pool, and
    /// returns the results in task order. Runs everything on the caller if the pool cannot be
    /// made (the results are the same, only slower).
    pub fn run<T: Send, R: Send>(&self, tasks: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
        let pool = match tasks.len() {
            0 | 1 => None,
            _ => self.pool().ok(),
        };
        let Some(pool) = pool else {
            return tasks.into_iter().map(f).collect();
        };
        let mut out: Vec<Option<R>> = tasks.iter().map(|_| None).collect();
        let mut tasks = tasks.into_iter();
        let first = tasks.next();
        let (head, rest) = out.split_first_mut().expect("at least two tasks");
        let f = &f;
        pool.in_place_scope(|s| {
            for (slot, t) in rest.iter_mut().zip(tasks) {
                s.spawn(move |_| *slot = Some(f(t)));
            }
            if let Some(t) = first {
                *head = Some(f(t));
            }
        });
        out.into_iter()
            .map(|r| r.expect("every task ran"))
            .collect()
    }
}

/// Splits `n` items into `parts` contiguous ranges of nearly equal size (the first ones larger).
pub fn split(n: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let parts = parts.clamp(1, n.max(1));
    let (q, r) = (n / parts, n % parts);
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let len = q + usize::from(i < r);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

/// Splits a buffer of `stride` elements per item along the item ranges `ranges` (consecutive,
/// starting at 0).
pub fn split_mut<'a, T>(
    mut buf: &'a mut [T],
    ranges: &[std::ops::Range<usize>],
    stride: usize,
) -> Vec<&'a mut [T]> {
    ranges
        .iter()
        .map(|r| {
            let (head, tail) = std::mem::take(&mut buf).split_at_mut(r.len() * stride);
            buf = tail;
            head
        })
        .collect()
}

/// [`split_mut`] for an optional buffer.
pub fn split_opt<'a, T>(
    buf: Option<&'a mut [T]>,
    ranges: &[std::ops::Range<usize>],
    stride: usize,
) -> Vec<Option<&'a mut [T]>> {
    match buf {
        Some(b) => split_mut(b, ranges, stride).into_iter().map(Some).collect(),
        None => ranges.iter().map(|_| None).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_every_item_once() {
        for n in 0..40 {
            for parts in 1..6 {
                let r = split(n, parts);
                assert_eq!(r.first().map_or(0, |x| x.start), 0);
                assert_eq!(r.last().map_or(0, |x| x.end), n);
                for w in r.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() >= w[1].len());
                }
            }
        }
    }

    #[test]
    fn run_returns_results_in_task_order_on_several_threads() {
        let par = Par::new(3);
        let names: Vec<Option<String>> = par.run((0..3).collect(), |_| {
            std::thread::current().name().map(str::to_owned)
        });
        // The first task runs on the caller (the test thread), the others on the pool.
        assert!(names[1..]
            .iter()
            .all(|n| n.as_deref().is_some_and(|n| n.starts_with("histospec-"))));
        let out = par.run((0..10u64).collect(), |x| x * x);
        assert_eq!(out, (0..10u64).map(|x| x * x).collect::<Vec<_>>());
    }

    #[test]
    fn parts_respect_the_minimum_per_thread() {
        let par = Par::new(4);
        assert_eq!(par.parts(10), 1);
        assert_eq!(par.parts(2 * MIN_PER_THREAD), 2);
        assert_eq!(par.parts(1000), 4);
        assert_eq!(Par::new(1).parts(1000), 1);
    }
}
