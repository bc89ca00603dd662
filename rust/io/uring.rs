//! io_uring engine: keeps up to `depth` vectored ops in flight with one submit syscall per
//! refill, which is what lets a single thread drive an NVMe at full speed.

use io_uring::{opcode, types, IoUring};

use super::{IoEngine, IoFailure, IoOp};

pub struct UringEngine {
    ring: IoUring,
    depth: usize,
}

impl UringEngine {
    pub fn new(depth: u32) -> std::io::Result<Self> {
        let depth = depth.clamp(1, 4096);
        Ok(UringEngine { ring: IoUring::new(depth)?, depth: depth as usize })
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn run(&mut self, ops: &mut [IoOp]) {
        let (mut next, mut inflight, mut completed) = (0usize, 0usize, 0usize);
        while completed < ops.len() {
            while next < ops.len() && inflight < self.depth {
                let op = &ops[next];
                let fd = types::Fd(op.fd);
                let entry = if op.write {
                    opcode::Writev::new(fd, op.iov.as_ptr(), op.iov.len() as u32).offset(op.offset).build()
                } else {
                    opcode::Readv::new(fd, op.iov.as_ptr(), op.iov.len() as u32).offset(op.offset).build()
                };
                // SAFETY: the iovec array and the buffers it names live in `ops`, which outlives
                // this call, and we reap every submitted entry before returning.
                if unsafe { self.ring.submission().push(&entry.user_data(next as u64)) }.is_err() {
                    break;
                }
                next += 1;
                inflight += 1;
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                // The ring itself failed: nothing more can complete; fail what is left.
                let errno = e.raw_os_error().unwrap_or(libc::EIO);
                for op in ops[completed..].iter_mut() {
                    op.result = Err(IoFailure::Errno(errno));
                }
                return;
            }
            for cqe in self.ring.completion() {
                let op = &mut ops[cqe.user_data() as usize];
                let res = cqe.result();
                let expected = op.expected_len();
                op.result = if res < 0 {
                    Err(IoFailure::Errno(-res))
                } else if res as usize != expected {
                    Err(IoFailure::Short { done: res as usize, expected })
                } else {
                    Ok(())
                };
                inflight -= 1;
                completed += 1;
            }
        }
    }
}
