//! One read-write opener per cache directory: an exclusive flock on `flexkv.lock`, which also
//! records the holder so the second opener's error can name it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::device::private::FILE_MODE;
use crate::error::{Result, StoreError};

pub const LOCK_FILE: &str = "flexkv.lock";

pub struct DirLock {
    file: File,
}

impl DirLock {
    pub fn acquire(dir: &Path) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(FILE_MODE)
            .open(&path)
            .map_err(|e| {
                StoreError::Config(format!("cache directory {} is not writable: {e}", dir.display()))
            })?;
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
        Ok(DirLock { file })
    }

    /// See `private::tighten`; only called by the holder of the lock.
    pub fn make_private(&self, dir: &Path) -> Option<String> {
        crate::device::private::tighten(&self.file, &dir.join(LOCK_FILE))
    }
}
