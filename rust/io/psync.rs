//! pread/pwrite engine: the fallback where io_uring is unavailable (Docker's default seccomp
//! profile blocks it). One op at a time; retries partial transfers until done or EOF.

use std::os::fd::RawFd;

use super::{Completion, IoEngine, IoFailure, IoOp};

#[derive(Default)]
pub struct PsyncEngine {
    done: Vec<Completion>,
}

impl IoEngine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }

    fn capacity(&self) -> usize {
        1
    }

    fn push(&mut self, op: &IoOp, tag: u64) -> bool {
        self.done.push((tag, run_one(op)));
        true
    }

    fn reap(&mut self, _min: usize, out: &mut Vec<Completion>) {
        out.append(&mut self.done);
    }
}

fn run_one(op: &IoOp) -> Result<(), IoFailure> {
    let expected = op.expected_len();
    let mut offset = op.offset;
    let mut done_total = 0usize;
    for v in &op.iov {
        let mut done = 0usize;
        while done < v.iov_len {
            // SAFETY: iov_base is valid for iov_len bytes while the op is in flight.
            let ptr = unsafe { (v.iov_base as *mut u8).add(done) };
            let n = transfer(op.fd, op.write, ptr, v.iov_len - done, offset);
            if n < 0 {
                let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
                if errno == libc::EINTR {
                    continue;
                }
                return Err(IoFailure::Errno(errno));
            }
            if n == 0 {
                return Err(IoFailure::Short { done: done_total + done, expected });
            }
            done += n as usize;
            offset += n as u64;
        }
        done_total += done;
    }
    Ok(())
}

fn transfer(fd: RawFd, write: bool, ptr: *mut u8, len: usize, offset: u64) -> isize {
    // SAFETY: ptr/len describe a live buffer (see IoOp); fd is an open data file.
    unsafe {
        if write {
            libc::pwrite(fd, ptr as *const libc::c_void, len, offset as libc::off_t)
        } else {
            libc::pread(fd, ptr as *mut libc::c_void, len, offset as libc::off_t)
        }
    }
}
