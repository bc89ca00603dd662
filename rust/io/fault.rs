//! Fault injection for tests: an engine wrapper that fails every Nth read and/or write with a
//! chosen errno, so tests can prove that device faults become per-block errors, that a failed
//! put is never acknowledged, and that the store keeps serving. Off unless configured
//! (`fault_injection=` or the `FLEXKV_FAULT_INJECTION` environment variable).
//!
//! Slow mode (`DELAY<ms>` instead of an errno): every Nth matching op reaches the device only
//! after that many milliseconds, so tests can prove that a stuck device turns into bounded waits
//! (timeouts, recompute) and never into a hung step. `set_delays_enabled(false)` makes the device
//! fast again at run time (delayed ops are released at once), for "and then it recovers" tests.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{Completion, IoEngine, IoFailure, IoOp};
use crate::error::{Result, StoreError};

/// Process-wide: whether `DELAY` plans delay ops (tests flip it to make a slow device fast).
static DELAYS_ENABLED: AtomicBool = AtomicBool::new(true);

/// Turn the delays of every slow-mode store in this process on or off. Off releases the ops
/// already held back at once; errno faults are unaffected.
pub fn set_delays_enabled(on: bool) {
    DELAYS_ENABLED.store(on, Ordering::SeqCst);
}

/// How often a held-back op is checked while the real engine has nothing to wait for.
const DELAY_POLL: Duration = Duration::from_millis(2);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultPlan {
    pub reads: bool,
    pub writes: bool,
    /// Journal appends and rewrites (a failed append leaves half a record behind).
    pub journal: bool,
    pub errno: i32,
    /// Slow mode: delay the chosen ops by this long instead of failing them (0: errno mode).
    pub delay_ms: u64,
    /// Fail (or delay) one op out of every `every` matching ops (the 1st, the (every+1)th, ...).
    pub every: u64,
}

impl FaultPlan {
    /// What a plan can target and the errnos it can inject (exported to Python as
    /// `FAULT_TARGETS` / `FAULT_ERRNOS`; slow mode is `DELAY<ms>` in the errno's place).
    pub const TARGETS: &'static [&'static str] = &["read", "write", "any", "journal"];
    pub const ERRNOS: &'static [&'static str] = &["EIO", "ENOSPC"];

    /// `"<read|write|any|journal>:<EIO|ENOSPC|DELAY<ms>>:<every>"`, e.g. `"write:EIO:2"` or
    /// `"read:DELAY5000:1"`. `journal:DELAY<ms>:<N>` slows every Nth background compaction's
    /// write of the new journal instead (appends are never delayed).
    pub fn parse(spec: &str) -> Result<Self> {
        let bad = || {
            StoreError::Config(format!(
                "fault_injection: {spec:?} is not <read|write|any|journal>:<EIO|ENOSPC|DELAY<ms>>:<N>"
            ))
        };
        let mut parts = spec.split(':');
        let (reads, writes, journal) = match parts.next() {
            Some("read") => (true, false, false),
            Some("write") => (false, true, false),
            Some("any") => (true, true, false),
            Some("journal") => (false, false, true),
            _ => return Err(bad()),
        };
        let (errno, delay_ms) = match parts.next() {
            Some("EIO") => (libc::EIO, 0),
            Some("ENOSPC") => (libc::ENOSPC, 0),
            Some(d) if d.starts_with("DELAY") => {
                match d["DELAY".len()..].parse::<u64>().ok().filter(|ms| *ms > 0) {
                    Some(ms) => (0, ms),
                    None => return Err(bad()),
                }
            }
            _ => return Err(bad()),
        };
        let every = parts.next().and_then(|n| n.parse::<u64>().ok()).filter(|n| *n > 0).ok_or_else(bad)?;
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(FaultPlan { reads, writes, journal, errno, delay_ms, every })
    }
}

/// An op held back by slow mode: pushed to the real engine once `due` (or delays are off).
struct Held {
    due: Instant,
    fd: RawFd,
    op: *const IoOp,
    tag: u64,
}

// SAFETY: the device queue keeps every pushed op alive and in place until its completion is
// reaped (the `IoEngine::push` contract); a held op is always completed through the real engine.
unsafe impl Send for Held {}

pub struct FaultyEngine {
    inner: Box<dyn IoEngine>,
    plan: FaultPlan,
    seen: u64,
    injected: Vec<Completion>,
    held: Vec<Held>,
}

impl FaultyEngine {
    pub fn new(inner: Box<dyn IoEngine>, plan: FaultPlan) -> Self {
        tracing::warn!("fault injection is ON for this store: {plan:?}");
        FaultyEngine { inner, plan, seen: 0, injected: Vec::new(), held: Vec::new() }
    }

    /// Hand the held ops that are due (all, with delays off) to the real engine.
    fn release_due(&mut self) {
        let now = Instant::now();
        let all = !DELAYS_ENABLED.load(Ordering::SeqCst);
        let mut i = 0;
        while i < self.held.len() {
            let h = &self.held[i];
            if all || h.due <= now {
                // SAFETY: see `Held`: the op is alive and unmoved until it is reaped.
                let op = unsafe { &*h.op };
                if !self.inner.push(h.fd, op, h.tag) {
                    return; // the real engine is full: the rest waits for the next reap
                }
                self.held.remove(i);
            } else {
                i += 1;
            }
        }
    }
}

impl IoEngine for FaultyEngine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    fn push(&mut self, fd: RawFd, op: &IoOp, tag: u64) -> bool {
        if (op.write && self.plan.writes) || (!op.write && self.plan.reads) {
            self.seen += 1;
            if (self.seen - 1) % self.plan.every == 0 {
                if self.plan.delay_ms > 0 {
                    let due = Instant::now() + Duration::from_millis(self.plan.delay_ms);
                    self.held.push(Held { due, fd, op: op as *const IoOp, tag });
                    return true;
                }
                self.injected.push((tag, Err(IoFailure::Errno(self.plan.errno))));
                return true;
            }
        }
        self.inner.push(fd, op, tag)
    }

    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) {
        self.reap_until(min, out, None)
    }

    fn reap_for(&mut self, min: usize, out: &mut Vec<Completion>, wait: Duration) {
        self.reap_until(min, out, Some(Instant::now() + wait))
    }
}

impl FaultyEngine {
    fn reap_until(&mut self, min: usize, out: &mut Vec<Completion>, deadline: Option<Instant>) {
        let start = out.len();
        out.append(&mut self.injected);
        loop {
            self.release_due();
            // Never block on the real engine for completions we already produced.
            let need = min.saturating_sub(out.len() - start);
            if self.held.is_empty() || need == 0 {
                match deadline {
                    Some(d) => self.inner.reap_for(need, out, d.saturating_duration_since(Instant::now())),
                    None => self.inner.reap(need, out),
                }
                return;
            }
            // Ops are held back: poll the real engine, so a held op is released on time.
            self.inner.reap(0, out);
            if out.len() - start >= min || deadline.is_some_and(|d| Instant::now() >= d) {
                return;
            }
            std::thread::sleep(DELAY_POLL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        let p = FaultPlan::parse("write:EIO:3").unwrap();
        assert!(p.writes && !p.reads && p.errno == libc::EIO && p.every == 3);
        assert!(FaultPlan::parse("any:ENOSPC:1").unwrap().reads);
        let slow = FaultPlan::parse("read:DELAY250:2").unwrap();
        assert!(slow.reads && slow.delay_ms == 250 && slow.every == 2);
        for bad in [
            "",
            "write",
            "write:EBADF:1",
            "read:EIO:0",
            "read:EIO:x",
            "read:EIO:1:2",
            "read:DELAY:1",
            "read:DELAY0:1",
        ] {
            assert!(FaultPlan::parse(bad).is_err(), "{bad}");
        }
    }
}
