//! A global allocator that measures, per thread, the largest single
//! allocation and the peak of live bytes while a closure runs: what a
//! decoder of hostile bytes may allocate is asserted, not assumed.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

pub struct Meter;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn grew(size: usize) {
    let _ = LIVE.try_with(|live| {
        live.set(live.get() + size);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(live.get())));
    });
    let _ = LARGEST.try_with(|largest| largest.set(largest.get().max(size)));
}

fn shrank(size: usize) {
    let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(size)));
}

// SAFETY: every call is forwarded unchanged to `System`, which upholds the
// `GlobalAlloc` contract; the bookkeeping only touches const-initialised
// thread locals, which never allocate.
unsafe impl GlobalAlloc for Meter {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `layout` is passed on as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrank(layout.size());
        // SAFETY: `ptr` came from `System` with this `layout` (every
        // allocation goes through this forwarder).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`; `new_size` is the caller's to check.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        p
    }
}

/// What a closure allocated on this thread.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    /// The largest single allocation (or reallocation) requested.
    pub largest: usize,
    /// The most bytes it held at once, beyond what was live before.
    pub peak: usize,
}

/// Runs `f` and reports what it allocated.
pub fn measure<R>(f: impl FnOnce() -> R) -> (R, Usage) {
    let before = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(before));
    LARGEST.with(|l| l.set(0));
    let out = f();
    let usage = Usage {
        largest: LARGEST.with(Cell::get),
        peak: PEAK.with(Cell::get) - before,
    };
    (out, usage)
}
