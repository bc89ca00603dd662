//! The preallocated data file of one cache directory, opened with O_DIRECT when the
//! filesystem allows it (tmpfs does not: then buffered I/O, logged once).

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::device::private::FILE_MODE;
use crate::error::{Result, StoreError};
use crate::format::superblock::Superblock;
use crate::format::PAGE;
use crate::io::aligned::AlignedBuf;

pub const DATA_FILE: &str = "flexkv-blocks.dat";

pub struct DataFile {
    pub path: PathBuf,
    pub file: File,
    pub direct: bool,
    pub len: u64,
}

impl DataFile {
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Open an existing data file (`create == false`) or create and preallocate `len` bytes.
    pub fn open(dir: &Path, writable: bool) -> Result<Option<Self>> {
        let path = dir.join(DATA_FILE);
        if !path.exists() {
            return Ok(None);
        }
        let (file, direct) = open_maybe_direct(&path, writable, false)?;
        let len = file.metadata().map_err(|e| StoreError::io(path.display(), e))?.len();
        Ok(Some(DataFile { path, file, direct, len }))
    }

    pub fn create(dir: &Path, len: u64, superblock: Superblock) -> Result<Self> {
        let path = dir.join(DATA_FILE);
        let free = free_bytes(dir)?;
        if len > free {
            return Err(StoreError::Config(format!(
                "capacity: {} needs {} bytes in {}, but only {} are free",
                DATA_FILE,
                len,
                dir.display(),
                free
            )));
        }
        let (file, direct) = open_maybe_direct(&path, true, true)?;
        let mut data = DataFile { path, file, direct, len: 0 };
        data.resize(len)?;
        data.write_superblock(superblock)?;
        Ok(data)
    }

    /// Grow (fallocate: real blocks, so ENOSPC shows now, not mid-write) or shrink.
    pub fn resize(&mut self, len: u64) -> Result<()> {
        if len > self.len {
            // SAFETY: fallocate on our own descriptor.
            let rc = unsafe { libc::fallocate(self.fd(), 0, 0, len as libc::off_t) };
            if rc != 0 {
                let err = std::io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::ENOSPC) {
                    return Err(StoreError::Full(format!(
                        "capacity: cannot preallocate {len} bytes for {}: no space left on device",
                        self.path.display()
                    )));
                }
                // Filesystems without fallocate: extend sparsely instead.
                self.file.set_len(len).map_err(|e| StoreError::io(self.path.display(), e))?;
            }
        } else if len < self.len {
            self.file.set_len(len).map_err(|e| StoreError::io(self.path.display(), e))?;
        }
        self.len = len;
        Ok(())
    }

    pub fn write_superblock(&self, sb: Superblock) -> Result<()> {
        let mut page = AlignedBuf::zeroed(PAGE);
        page.as_mut_slice().copy_from_slice(&sb.encode());
        self.file
            .write_all_at(page.as_slice(), 0)
            .map_err(|e| StoreError::io(format!("writing superblock of {}", self.path.display()), e))?;
        self.file.sync_all().map_err(|e| StoreError::io(self.path.display(), e))
    }

    pub fn read_superblock(&self) -> Result<Option<Superblock>> {
        let mut page = AlignedBuf::zeroed(PAGE);
        match self.file.read_exact_at(page.as_mut_slice(), 0) {
            Ok(()) => Ok(Superblock::decode(page.as_slice())),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
            Err(e) => Err(StoreError::io(format!("reading superblock of {}", self.path.display()), e)),
        }
    }
}

fn open_maybe_direct(path: &Path, writable: bool, create: bool) -> Result<(File, bool)> {
    let open = |flags: i32| {
        OpenOptions::new()
            .read(true)
            .write(writable)
            .create(create)
            .truncate(false)
            .mode(FILE_MODE)
            .custom_flags(flags)
            .open(path)
    };
    match open(libc::O_DIRECT) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::warn!(path = %path.display(), "filesystem refuses O_DIRECT; using buffered I/O");
            open(0).map(|f| (f, false)).map_err(|e| StoreError::io(path.display(), e))
        }
        Err(e) => Err(StoreError::Config(format!("cannot open {}: {e}", path.display()))),
    }
}

pub fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| StoreError::Config(format!("invalid directory path {}", dir.display())))?;
    // SAFETY: statvfs writes into a zeroed struct we own.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(StoreError::io(dir.display(), std::io::Error::last_os_error()));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}
