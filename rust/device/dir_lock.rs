//! One read-write opener per cache directory: an exclusive flock on `flexkv.lock`, which also
//! records the holder so the second opener's error can name it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::error::{Result, StoreError};

pub const LOCK_FILE: &str = "flexkv.lock";

pub struct DirLock {
    _file: File,
}

impl DirLock {
    pub fn acquire(dir: &Path) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        let mut file =
            OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(
                |e| StoreError::Config(format!("cache directory {} is not writable: {e}", dir.display())),
            )?;
        // SAFETY: flock on a file descriptor we own.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            return Err(StoreError::Locked(format!(
                "cache directory {} is in use by another process ({})",
                dir.display(),
                if holder.is_empty() { "holder unknown" } else { holder }
            )));
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let me = format!("pid {} on {}", std::process::id(), host.trim());
        // Best effort: the lock itself is the flock, the text only names the holder.
        let _ = file.set_len(0);
        let _ = file.seek(SeekFrom::Start(0));
        let _ = file.write_all(me.as_bytes());
        Ok(DirLock { _file: file })
    }
}
