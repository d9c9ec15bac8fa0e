//! A global allocator that can back large allocations with transparent huge pages (opt-in).
//!
//! Drafting and appending touch a few random cache lines in automata of hundreds of megabytes, so
//! most of their loads also miss the TLB, and under a virtual machine each miss walks two levels
//! of page tables. Most Linux distributions give huge pages only to memory that asks for them
//! (`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`), and glibc's allocator does not ask
//! unless told at process start (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`), which a Python
//! extension cannot do.
//!
//! With `HISTOSPEC_HUGE_PAGES=1` in the environment (read once, at the first allocation of at
//! least [`POOL_MIN`] bytes), [`HugePageAlloc`] maps every allocation of at least [`HUGE_MIN`]
//! bytes itself, from a huge-page boundary, and serves allocations from [`POOL_MIN`] up from
//! per-size pools cut out of huge pages; it advises the kernel to back both with huge pages.
//! Everything else, and everything when the variable is unset, goes to the system allocator.
//! Only whole 2 MiB pages inside a mapping become huge, so a mapping's partial last page costs
//! nothing extra. Where the kernel says no (`never`, or not Linux) the mappings are ordinary memory.
//!
//! Why opt-in: on the 2-core benchmark VM, huge pages cut the 256-request tree draft by 20-40%,
//! the update by 23-37% and made ingest into memory the process already holds 20-50% faster, but the
//! first touch of each fresh huge page costs milliseconds there (the host backs it 4 KiB at a
//! time), so ingest into fresh memory fell from 5.0 to 1.8 M tokens/s (`bench/RESULTS.md`,
//! `bench index`). A long-running engine mostly reuses memory; a short job mostly touches new memory.
//! The binaries that hold the index declare the allocator as their `#[global_allocator]`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

/// Size of a transparent huge page on x86-64 and most aarch64 kernels.
pub const HUGE_PAGE: usize = 2 << 20;

/// Allocations of at least this many bytes are mapped on their own, from a huge-page boundary.
pub const HUGE_MIN: usize = HUGE_PAGE;

/// Allocations from this size up to [`HUGE_MIN`] come from pools: each size class (a power of
/// two) cuts huge pages into equal blocks and keeps freed blocks for its next allocations.
pub const POOL_MIN: usize = 64 << 10;

/// Pool size classes: `POOL_MIN << c` for `c < CLASSES` (the last is a whole huge page).
const CLASSES: usize = (HUGE_MIN / POOL_MIN).trailing_zeros() as usize + 1;

/// Heads of the pools' free lists (addresses, 0 = empty); a free block's first word holds the
/// address of the next. Guarded by [`LOCK`].
static mut FREE: [usize; CLASSES] = [0; CLASSES];

/// A spin lock over [`FREE`]: held for a few instructions (or one `mmap`). Not a `Mutex`, so that
/// the fork handlers can hold it across `fork` (a child must not inherit it taken by a thread
/// that does not exist there).
static LOCK: AtomicBool = AtomicBool::new(false);

fn lock() {
    let mut spins = 0u32;
    while LOCK
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

fn unlock() {
    LOCK.store(false, Ordering::Release);
}

/// Runs `f` on the free lists under the lock.
fn with_free<R>(f: impl FnOnce(&mut [usize; CLASSES]) -> R) -> R {
    lock();
    // SAFETY: the lock gives this thread the only access to FREE until `unlock`.
    let r = f(unsafe { &mut *std::ptr::addr_of_mut!(FREE) });
    unlock();
    r
}

#[cfg(target_os = "linux")]
extern "C" fn unlock_after_fork() {
    unlock();
}

#[cfg(target_os = "linux")]
extern "C" fn lock_before_fork() {
    lock();
}

/// Whether large blocks go on huge pages: 0 = not decided yet, 1 = no, 2 = yes. Decided once,
/// so that every block is freed the way it was allocated.
static MODE: AtomicU8 = AtomicU8::new(0);

/// The environment variable that turns huge pages on (`1`).
pub const ENV: &CStr = c"HISTOSPEC_HUGE_PAGES";

/// Whether large blocks go on huge pages in this process; decides from [`ENV`] on first use.
pub fn enabled() -> bool {
    match MODE.load(Ordering::Relaxed) {
        0 => set_enabled(env_says_yes()),
        m => m == 2,
    }
}

/// Decides whether large blocks go on huge pages, unless that is already decided; returns the
/// decision in force. Call it before the first large allocation.
pub fn set_enabled(on: bool) -> bool {
    let want = if on && cfg!(target_os = "linux") {
        2
    } else {
        1
    };
    match MODE.compare_exchange(0, want, Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => {
            #[cfg(target_os = "linux")]
            if want == 2 {
                // SAFETY: plain functions that only take and release the pools' lock.
                unsafe {
                    libc::pthread_atfork(
                        Some(lock_before_fork),
                        Some(unlock_after_fork),
                        Some(unlock_after_fork),
                    )
                };
            }
            want == 2
        }
        Err(m) => m == 2,
    }
}

/// [`ENV`]`=1`, read without allocating (this runs inside the allocator).
fn env_says_yes() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a NUL-terminated name; the value is read before anything can change it.
        let v = unsafe { libc::getenv(ENV.as_ptr()) };
        // SAFETY: a non-null result is a NUL-terminated string, so its first two bytes exist.
        !v.is_null() && unsafe { *v == b'1' as libc::c_char && *v.add(1) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// The global allocator: with [`enabled`], large blocks on huge pages; the rest from [`System`].
pub struct HugePageAlloc;

/// Where a block of a layout lives.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    System,
    /// A block of pool class `c`.
    Pool(usize),
    Mapped,
}

#[inline]
fn kind(size: usize, align: usize) -> Kind {
    if size < POOL_MIN || align > 4096 || !enabled() {
        Kind::System
    } else if size < HUGE_MIN {
        Kind::Pool((size.next_power_of_two() / POOL_MIN).trailing_zeros() as usize)
    } else {
        Kind::Mapped
    }
}

/// Whole 4 KiB pages covering `size` bytes.
#[inline]
fn pages(size: usize) -> usize {
    (size + 4095) & !4095
}

/// A block of pool class `c`; null when a new huge page cannot be mapped.
fn pool_alloc(c: usize) -> *mut u8 {
    with_free(|free| {
        if free[c] == 0 {
            let chunk = os::map(HUGE_PAGE);
            if chunk.is_null() {
                return chunk;
            }
            let block = POOL_MIN << c;
            for i in (0..HUGE_PAGE / block).rev() {
                let b = chunk as usize + i * block;
                // SAFETY: `b` starts a block inside the fresh chunk, aligned for a usize.
                unsafe { *(b as *mut usize) = free[c] };
                free[c] = b;
            }
        }
        let b = free[c];
        // SAFETY: `b` heads the free list, so its first word holds the next free block.
        free[c] = unsafe { *(b as *const usize) };
        b as *mut u8
    })
}

/// Returns a block of pool class `c` to its pool.
///
/// # Safety
/// `ptr` must be a live block of class `c` from [`pool_alloc`], not used afterwards.
unsafe fn pool_free(ptr: *mut u8, c: usize) {
    with_free(|free| {
        // SAFETY: the block is at least POOL_MIN bytes and aligned to its size.
        unsafe { *(ptr as *mut usize) = free[c] };
        free[c] = ptr as usize;
    })
}

#[cfg(target_os = "linux")]
mod os {
    use super::{pages, HUGE_PAGE};

    /// Maps `size` bytes (zeroed) starting at a huge-page boundary and asks for huge pages; null
    /// when the kernel refuses the mapping.
    pub fn map(size: usize) -> *mut u8 {
        let len = pages(size);
        let Some(span) = len.checked_add(HUGE_PAGE) else {
            return std::ptr::null_mut();
        };
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        let start = raw as usize;
        let aligned = (start + HUGE_PAGE - 1) & !(HUGE_PAGE - 1);
        // SAFETY: the head `[start, aligned)` and the tail `[aligned + len, start + span)` lie in
        // the mapping just made, are page-aligned, and nothing refers to them.
        unsafe {
            if aligned > start {
                libc::munmap(raw, aligned - start);
            }
            let end = aligned + len;
            if start + span > end {
                libc::munmap(end as *mut libc::c_void, start + span - end);
            }
            // Advice only: failure (THP off or unsupported) leaves ordinary pages.
            libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        aligned as *mut u8
    }

    /// Unmaps a block of `size` bytes made by [`map`].
    ///
    /// # Safety
    /// `ptr` must come from `map(size)` (or a successful [`resize_in_place`] to `size`) and not be
    /// used afterwards.
    pub unsafe fn unmap(ptr: *mut u8, size: usize) {
        // SAFETY: the caller passes a live mapping of `pages(size)` bytes.
        unsafe { libc::munmap(ptr as *mut libc::c_void, pages(size)) };
    }

    /// Grows or shrinks a block made by [`map`] without moving it; false when the address space
    /// after it is taken.
    ///
    /// # Safety
    /// `ptr` must be a live block of `old` bytes made by [`map`].
    pub unsafe fn resize_in_place(ptr: *mut u8, old: usize, new: usize) -> bool {
        if pages(old) == pages(new) {
            return true;
        }
        // SAFETY: without MREMAP_MAYMOVE the block stays where it is or the call fails.
        let r = unsafe { libc::mremap(ptr as *mut libc::c_void, pages(old), pages(new), 0) };
        r != libc::MAP_FAILED
    }
}

#[cfg(not(target_os = "linux"))]
mod os {
    pub fn map(_: usize) -> *mut u8 {
        unreachable!("large blocks are mapped only on Linux")
    }
    pub unsafe fn unmap(_: *mut u8, _: usize) {
        unreachable!("large blocks are mapped only on Linux")
    }
    pub unsafe fn resize_in_place(_: *mut u8, _: usize, _: usize) -> bool {
        unreachable!("large blocks are mapped only on Linux")
    }
}

// SAFETY: mapped blocks are fresh mappings aligned to a huge page, unmapped with the size they
// were mapped with; pool blocks are aligned to their class size (at least POOL_MIN) and hold at
// least the layout's size; both satisfy every alignment up to 4096, which is all `kind` admits.
// Everything else is `System`'s. `realloc` keeps the first `min(old, new)` bytes in every branch.
unsafe impl GlobalAlloc for HugePageAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match kind(layout.size(), layout.align()) {
            // SAFETY: forwarded with the caller's guarantees.
            Kind::System => unsafe { System.alloc(layout) },
            Kind::Pool(c) => pool_alloc(c),
            Kind::Mapped => os::map(layout.size()),
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match kind(layout.size(), layout.align()) {
            // SAFETY: forwarded with the caller's guarantees.
            Kind::System => unsafe { System.alloc_zeroed(layout) },
            Kind::Pool(c) => {
                // Pool blocks are reused: clear them.
                let p = pool_alloc(c);
                if !p.is_null() {
                    // SAFETY: the block holds at least `layout.size()` bytes.
                    unsafe { p.write_bytes(0, layout.size()) };
                }
                p
            }
            // Fresh anonymous mappings are zeroed.
            Kind::Mapped => os::map(layout.size()),
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        match kind(layout.size(), layout.align()) {
            // SAFETY (all three): `ptr` came from `alloc` with this layout.
            Kind::System => unsafe { System.dealloc(ptr, layout) },
            Kind::Pool(c) => unsafe { pool_free(ptr, c) },
            Kind::Mapped => unsafe { os::unmap(ptr, layout.size()) },
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let align = layout.align();
        match (kind(layout.size(), align), kind(new_size, align)) {
            // SAFETY: forwarded with the caller's guarantees.
            (Kind::System, Kind::System) => {
                return unsafe { System.realloc(ptr, layout, new_size) }
            }
            (a, b) if a == b && a != Kind::Mapped => return ptr,
            // SAFETY: `ptr` is a live mapped block of `layout.size()` bytes.
            (Kind::Mapped, Kind::Mapped)
                if unsafe { os::resize_in_place(ptr, layout.size(), new_size) } =>
            {
                return ptr
            }
            _ => {}
        }
        // SAFETY: `new_size` is non-zero and, rounded to `align`, does not overflow (the
        // caller's guarantees for `realloc`).
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, align) };
        // SAFETY: as `alloc`; the copy stays inside both blocks, which do not overlap.
        unsafe {
            let new = self.alloc(new_layout);
            if !new.is_null() {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            new
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fills `n` bytes at `p` with a pattern of `seed`.
    unsafe fn fill(p: *mut u8, n: usize, seed: u8) {
        for i in 0..n {
            // SAFETY: the caller's block holds `n` bytes.
            unsafe { *p.add(i) = (i as u8).wrapping_mul(31).wrapping_add(seed) };
        }
    }

    unsafe fn holds(p: *const u8, n: usize, seed: u8) -> bool {
        // SAFETY: the caller's block holds `n` bytes.
        (0..n).all(|i| unsafe { *p.add(i) } == (i as u8).wrapping_mul(31).wrapping_add(seed))
    }

    #[test]
    fn blocks_keep_their_bytes_through_every_kind_of_realloc() {
        assert!(set_enabled(true) || !cfg!(target_os = "linux"));
        let a = HugePageAlloc;
        // System -> pool -> larger pool class -> mapped -> larger mapped -> pool -> System.
        let sizes = [
            1000,
            100_000,
            700_000,
            3 * HUGE_PAGE + 123,
            5 * HUGE_PAGE,
            300_000,
            999,
        ];
        // SAFETY: every pointer is used within its block's size and freed with its layout.
        unsafe {
            let mut layout = Layout::from_size_align(sizes[0], 8).unwrap();
            let mut p = a.alloc(layout);
            fill(p, layout.size(), 1);
            for &n in &sizes[1..] {
                let kept = layout.size().min(n);
                p = a.realloc(p, layout, n);
                assert!(!p.is_null());
                assert!(
                    holds(p, kept, 1),
                    "the first {kept} bytes survive growing to {n}"
                );
                if cfg!(target_os = "linux") && n >= HUGE_MIN {
                    assert_eq!(
                        p as usize % HUGE_PAGE,
                        0,
                        "mapped blocks start on a huge page"
                    );
                }
                layout = Layout::from_size_align(n, 8).unwrap();
                fill(p, n, 1);
            }
            a.dealloc(p, layout);
            // Zeroed blocks are zero also when the pool hands back a dirty block.
            for n in [200_000, 3 * HUGE_PAGE] {
                let l = Layout::from_size_align(n, 8).unwrap();
                let d = a.alloc(l);
                fill(d, n, 3);
                a.dealloc(d, l);
                let z = a.alloc_zeroed(l);
                assert!((0..n).all(|i| *z.add(i) == 0));
                a.dealloc(z, l);
            }
        }
    }

    #[test]
    fn pools_serve_threads_without_sharing_blocks() {
        assert!(set_enabled(true) || !cfg!(target_os = "linux"));
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                std::thread::spawn(move || {
                    let a = HugePageAlloc;
                    for round in 0..50usize {
                        let n = POOL_MIN << (round % CLASSES);
                        let l = Layout::from_size_align(n - 8 * round, 8).unwrap();
                        // SAFETY: each block is written within its size and freed once.
                        unsafe {
                            let p = a.alloc(l);
                            fill(p, l.size(), t);
                            std::thread::yield_now();
                            assert!(holds(p, l.size(), t), "no other thread wrote this block");
                            a.dealloc(p, l);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
}
