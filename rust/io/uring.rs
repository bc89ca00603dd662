//! io_uring engine: up to `depth` vectored ops in flight, one submit syscall per refill, which
//! is what lets a single thread drive an NVMe at full speed.

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

    fn push(&mut self, op: &IoOp, tag: u64) -> bool {
        let fd = types::Fd(op.fd);
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
        loop {
            match self.ring.submit_and_wait(min) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => {
                    // The ring itself failed: fail everything in flight.
                    let errno = e.raw_os_error().unwrap_or(libc::EIO);
                    out.extend(self.expected.drain().map(|(tag, _)| (tag, Err(IoFailure::Errno(errno)))));
                    return;
                }
            }
        }
        for cqe in self.ring.completion() {
            let tag = cqe.user_data();
            let expected = self.expected.remove(&tag).unwrap_or(0);
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
