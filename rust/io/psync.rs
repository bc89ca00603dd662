//! pread/pwrite engine: the fallback where io_uring is unavailable (Docker's default seccomp
//! profile blocks it). A few threads each run one op at a time, so the device still sees a
//! queue; partial transfers are retried until done or EOF.

use std::os::fd::RawFd;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use super::{Completion, IoEngine, IoFailure, IoOp};

/// A pointer to an op owned by the device queue, valid until its completion is reaped.
struct OpRef(RawFd, *const IoOp, u64);

// SAFETY: the device queue keeps the op alive and unmoved until the completion comes back.
unsafe impl Send for OpRef {}

pub struct PsyncEngine {
    tx: Option<Sender<OpRef>>,
    done: Receiver<Completion>,
    threads: Vec<JoinHandle<()>>,
    inflight: usize,
}

impl PsyncEngine {
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<OpRef>();
        let (done_tx, done) = crossbeam_channel::unbounded::<Completion>();
        let threads = (0..threads.max(1))
            .map(|i| {
                let rx = rx.clone();
                let done_tx = done_tx.clone();
                std::thread::Builder::new().name(format!("flexkv-psync-{i}")).spawn(move || {
                    while let Ok(OpRef(fd, op, tag)) = rx.recv() {
                        // SAFETY: see OpRef.
                        let result = run_one(fd, unsafe { &*op });
                        if done_tx.send((tag, result)).is_err() {
                            return;
                        }
                    }
                })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(PsyncEngine { tx: Some(tx), done, threads, inflight: 0 })
    }
}

impl IoEngine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }

    fn capacity(&self) -> usize {
        self.threads.len()
    }

    fn push(&mut self, fd: RawFd, op: &IoOp, tag: u64) -> bool {
        let Some(tx) = &self.tx else { return false };
        if tx.send(OpRef(fd, op as *const IoOp, tag)).is_err() {
            return false;
        }
        self.inflight += 1;
        true
    }

    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) {
        self.reap_until(min, out, None)
    }

    fn reap_for(&mut self, min: usize, out: &mut Vec<Completion>, wait: std::time::Duration) {
        self.reap_until(min, out, Some(std::time::Instant::now() + wait))
    }
}

impl PsyncEngine {
    /// Wait for `min` completions (fewer past `deadline`), then take every one that is ready.
    fn reap_until(&mut self, min: usize, out: &mut Vec<Completion>, deadline: Option<std::time::Instant>) {
        let mut got = 0;
        while got < min.min(self.inflight) {
            let next = match deadline {
                Some(d) => self.done.recv_deadline(d).ok(),
                None => self.done.recv().ok(),
            };
            let Some(c) = next else { break };
            out.push(c);
            got += 1;
            self.inflight -= 1;
        }
        while let Ok(c) = self.done.try_recv() {
            out.push(c);
            self.inflight -= 1;
        }
    }
}

impl Drop for PsyncEngine {
    fn drop(&mut self) {
        self.tx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn run_one(fd: RawFd, op: &IoOp) -> Result<(), IoFailure> {
    let expected = op.expected_len();
    let mut offset = op.offset;
    let mut done_total = 0usize;
    for v in &op.iov {
        let mut done = 0usize;
        while done < v.iov_len {
            // SAFETY: iov_base is valid for iov_len bytes while the op is in flight.
            let ptr = unsafe { (v.iov_base as *mut u8).add(done) };
            let n = transfer(fd, op.write, ptr, v.iov_len - done, offset);
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
