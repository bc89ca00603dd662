//! io_uring engine: up to `depth` vectored ops in flight, one submit syscall per refill, which
//! is what lets a single thread drive an NVMe at full speed.

use std::os::fd::RawFd;

use io_uring::{opcode, types, IoUring};

use super::{Completion, IoEngine, IoFailure, IoOp};

pub struct UringEngine {
    ring: IoUring,
    depth: usize,
    /// Expected byte count per in-flight tag, to detect short transfers.
    expected: std::collections::HashMap<u64, usize>,
}

impl UringEngine {
    pub fn new(depth: u32) -> std::io::Result<Self> {
        let depth = depth.clamp(1, 4096);
        Ok(UringEngine { ring: IoUring::new(depth)?, depth: depth as usize, expected: Default::default() })
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn capacity(&self) -> usize {
        self.depth
    }

    fn push(&mut self, fd: RawFd, op: &IoOp, tag: u64) -> bool {
        let fd = types::Fd(fd);
        let entry = if op.write {
            opcode::Writev::new(fd, op.iov.as_ptr(), op.iov.len() as u32).offset(op.offset).build()
        } else {
            opcode::Readv::new(fd, op.iov.as_ptr(), op.iov.len() as u32).offset(op.offset).build()
        };
        // SAFETY: the iovec array and the buffers it names stay valid and unmoved until the
        // completion for `tag` is reaped (the device queue owns the op until then).
        let pushed = unsafe { self.ring.submission().push(&entry.user_data(tag)) }.is_ok();
        if pushed {
            self.expected.insert(tag, op.expected_len());
        }
        pushed
    }

    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) {
        self.reap_within(min, out, None)
    }

    fn reap_for(&mut self, min: usize, out: &mut Vec<Completion>, wait: std::time::Duration) {
        // Kernels before 5.11 cannot bound the wait: they block as `reap` does.
        let bounded = self.ring.params().is_feature_ext_arg();
        self.reap_within(min, out, bounded.then_some(wait))
    }
}

impl UringEngine {
    fn submit(&self, min: usize, wait: Option<std::time::Duration>) -> std::io::Result<usize> {
        match wait {
            None => self.ring.submit_and_wait(min),
            Some(w) => {
                let ts = types::Timespec::new().sec(w.as_secs()).nsec(w.subsec_nanos());
                let args = types::SubmitArgs::new().timespec(&ts);
                match self.ring.submitter().submit_with_args(min, &args) {
                    // Timed out: what is done is reaped below, the caller calls again.
                    Err(e) if e.raw_os_error() == Some(libc::ETIME) => Ok(0),
                    other => other,
                }
            }
        }
    }

    fn reap_within(&mut self, min: usize, out: &mut Vec<Completion>, wait: Option<std::time::Duration>) {
        let mut failures = 0u32;
        loop {
            match self.submit(min, wait) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // Out of kernel resources or a full completion queue: reap what is done now;
                // the device queue calls again for the rest.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => break,
                Err(e) => {
                    // Ops already handed to the kernel may still read or write their buffers,
                    // so they are not reported failed while the ring may still complete them:
                    // retry for a while. Handing them back from a ring that stays broken would let
                    // their buffers be reused while the kernel may still write into them (wrong
                    // KV); a crash instead keeps every acknowledged block (the journal).
                    failures += 1;
                    if failures < 1000 {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                        continue;
                    }
                    let msg = format!(
                        "flexkv: io_uring failed 1000 times in a row ({e}) with {} ops in flight; aborting",
                        self.expected.len()
                    );
                    tracing::error!("{msg}");
                    eprintln!("{msg}");
                    std::process::abort();
                }
            }
        }
        for cqe in self.ring.completion() {
            let tag = cqe.user_data();
            let Some(expected) = self.expected.remove(&tag) else {
                tracing::error!("io_uring completion for unknown tag {tag:#x} ignored");
                continue;
            };
            let res = cqe.result();
            let outcome = if res < 0 {
                Err(IoFailure::Errno(-res))
            } else if res as usize != expected {
                Err(IoFailure::Short { done: res as usize, expected })
            } else {
                Ok(())
            };
            out.push((tag, outcome));
        }
    }
}
