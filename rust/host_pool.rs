//! An anonymous, page-aligned host memory region for the host tier. Pages are faulted in by
//! several threads at once (first touch dominates the cost of a large pool), optionally on
//! huge pages. The same region is registered with CUDA by Python and read/written with
//! O_DIRECT by the store, so no bounce copies are needed between the two.

use std::ptr::NonNull;

use crate::error::{Result, StoreError};

pub struct HostPool {
    ptr: NonNull<u8>,
    len: usize,
    huge_pages: bool,
}

// SAFETY: the region is plain memory owned by this value; callers coordinate access.
unsafe impl Send for HostPool {}
unsafe impl Sync for HostPool {}

const HUGE_PAGE: usize = 2 << 20;

impl HostPool {
    pub fn new(len: usize, huge_pages: bool, touch_threads: usize) -> Result<Self> {
        if len == 0 {
            return Err(StoreError::Config("host pool size must be > 0".into()));
        }
        let len = if huge_pages {
            len.div_ceil(HUGE_PAGE) * HUGE_PAGE
        } else {
            crate::format::round_up_to_page(len)
        };
        let (ptr, huge) = map(len, huge_pages)?;
        let pool = HostPool { ptr, len, huge_pages: huge };
        pool.first_touch(touch_threads);
        Ok(pool)
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    fn first_touch(&self, threads: usize) {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(4, |n| n.get()).min(16)
        } else {
            threads
        };
        let step = if self.huge_pages { HUGE_PAGE } else { crate::format::PAGE };
        let chunk = self.len.div_ceil(threads).div_ceil(step) * step;
        let base = self.ptr.as_ptr() as usize;
        std::thread::scope(|s| {
            for t in 0..threads {
                let start = t * chunk;
                let end = ((t + 1) * chunk).min(self.len);
                if start >= end {
                    continue;
                }
                s.spawn(move || {
                    let mut off = start;
                    while off < end {
                        // SAFETY: off < len, inside our mapping; a volatile write faults the page in.
                        unsafe { std::ptr::write_volatile((base + off) as *mut u8, 0) };
                        off += step;
                    }
                });
            }
        });
    }
}

fn map(len: usize, huge: bool) -> Result<(NonNull<u8>, bool)> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    if huge {
        // SAFETY: anonymous mapping, no fd.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags | libc::MAP_HUGETLB, -1, 0) };
        if p != libc::MAP_FAILED {
            if let Some(nn) = NonNull::new(p as *mut u8) {
                return Ok((nn, true));
            }
        }
        tracing::info!("no hugetlbfs pages reserved; using transparent huge pages");
    }
    // SAFETY: anonymous mapping, no fd.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
    if p == libc::MAP_FAILED {
        return Err(StoreError::Full(format!(
            "cannot map a {len}-byte host pool: {}",
            std::io::Error::last_os_error()
        )));
    }
    if huge {
        // SAFETY: advice on our own mapping.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
    }
    let nn = NonNull::new(p as *mut u8).ok_or_else(|| StoreError::Full("mmap returned null".into()))?;
    Ok((nn, false))
}

impl Drop for HostPool {
    fn drop(&mut self) {
        // SAFETY: unmapping the region we mapped.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let pool = HostPool::new(10 * 4096 + 1, false, 3).unwrap();
        assert_eq!(pool.as_ptr() as usize % 4096, 0);
        assert_eq!(pool.len(), 11 * 4096);
        // SAFETY: whole mapping is readable.
        let s = unsafe { std::slice::from_raw_parts(pool.as_ptr(), pool.len()) };
        assert!(s.iter().all(|b| *b == 0));
        assert!(HostPool::new(0, false, 1).is_err());
    }
}
