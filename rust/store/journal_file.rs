//! The journal file in the first cache directory: replayed on open, appended per batch,
//! rewritten (compacted) atomically through a temp file + rename.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::device::private::FILE_MODE;
use crate::error::{Result, StoreError};
use crate::format::journal::{
    count_puts, visit_all, FileHeader, Record, RecordRef, FILE_HEADER_LEN, FILE_VERSION, MIGRATES_FROM,
};

pub const JOURNAL_FILE: &str = "flexkv-journal.log";

/// A journal read whole; `visit` walks its records borrowing from the buffer.
pub struct Replayed {
    pub header: FileHeader,
    buf: Vec<u8>,
    /// (device, inode) of the file read: a compaction or rewrite replaces it (store/follow.rs).
    pub ident: Option<(u64, u64)>,
    /// The file is of the version this build migrates: rewrite it before appending.
    pub migrate: bool,
}

impl Replayed {
    /// Call `f` on every whole record with its frame's offset in the file; returns the bytes
    /// of torn tail after them.
    pub fn visit<'a>(&'a self, mut f: impl FnMut(u64, RecordRef<'a>)) -> u64 {
        let body = &self.buf[FILE_HEADER_LEN..];
        let valid = visit_all(body, |pos, r| f((FILE_HEADER_LEN + pos) as u64, r));
        (body.len() - valid) as u64
    }

    /// At most this many Put records (sizes the index; see `count_puts`).
    pub fn puts_upper_bound(&self) -> usize {
        count_puts(&self.buf[FILE_HEADER_LEN..])
    }

    /// Bytes of the whole file.
    pub fn file_bytes(&self) -> u64 {
        self.buf.len() as u64
    }
}

pub struct JournalFile {
    path: PathBuf,
    file: Option<File>,
    header: FileHeader,
    pub records: u64,
    pub bytes: u64,
}

/// Read a journal without modifying it. None when the file does not exist.
pub fn read(dir: &Path) -> Result<Option<Replayed>> {
    let path = dir.join(JOURNAL_FILE);
    let mut buf = Vec::new();
    let ident;
    match File::open(&path) {
        Ok(mut f) => {
            // One allocation of the file's size: read_to_end alone grows (and copies) its way up.
            let meta = f.metadata().ok();
            ident = meta.as_ref().map(|m| (m.dev(), m.ino()));
            buf.reserve_exact(meta.map_or(0, |m| m.len() as usize));
            f.read_to_end(&mut buf).map_err(|e| StoreError::io(path.display(), e))?
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StoreError::io(path.display(), e)),
    };
    let version = FileHeader::version_of(&buf);
    if let Some(found) = version.filter(|v| ![FILE_VERSION, MIGRATES_FROM].contains(v)) {
        return Err(StoreError::FormatVersion { path, found, expected: FILE_VERSION });
    }
    let header = buf.get(..FILE_HEADER_LEN).and_then(FileHeader::decode).ok_or_else(|| {
        StoreError::Foreign { path: path.clone(), kind: "journal", reason: "bad header".into() }
    })?;
    Ok(Some(Replayed { header, buf, ident, migrate: version == Some(MIGRATES_FROM) }))
}

/// A new journal written to a temp file and synced, not yet current: `install` makes it so.
/// Until then the old journal stays the current one (a crash leaves only a stray temp file).
pub struct Prepared {
    dir: PathBuf,
    tmp: PathBuf,
    /// Taken by `install`; a `Prepared` dropped without it removes its temp file.
    file: Option<File>,
    header: FileHeader,
    records: u64,
    bytes: u64,
}

impl Prepared {
    /// Write `header` and `records` to `<journal><tmp_suffix>` (a fresh 0600 file) and sync it.
    pub fn write(dir: &Path, tmp_suffix: &str, header: FileHeader, records: &[Record]) -> Result<Self> {
        let path = dir.join(JOURNAL_FILE);
        let tmp = dir.join(format!("{JOURNAL_FILE}{tmp_suffix}"));
        let mut buf = header.encode();
        for r in records {
            r.encode_into(&mut buf);
        }
        let prepared = (|| -> std::io::Result<File> {
            // A temp file left by a crash may predate private files: start from a new 0600 one
            // (create_new: the mode applies, and a planted file or link is never written).
            match std::fs::remove_file(&tmp) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
            let mut f = OpenOptions::new().write(true).create_new(true).mode(FILE_MODE).open(&tmp)?;
            f.write_all(&buf)?;
            f.sync_all()?;
            OpenOptions::new().append(true).open(&tmp)
        })();
        match prepared {
            Ok(file) => Ok(Prepared {
                dir: dir.to_path_buf(),
                tmp,
                file: Some(file),
                header,
                records: records.len() as u64,
                bytes: buf.len() as u64,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(StoreError::io(format!("rewriting {}", path.display()), e))
            }
        }
    }

    /// Append `catch_up` (records the current journal received since `write` began), sync,
    /// and rename over the current journal; from here on this file is the journal.
    pub fn install(mut self, catch_up: &[u8], catch_up_records: u64) -> Result<JournalFile> {
        let path = self.dir.join(JOURNAL_FILE);
        let tmp = self.tmp.clone();
        let Some(mut file) = self.file.take() else {
            return Err(StoreError::Device(format!("{} was already installed", tmp.display())));
        };
        let mut run = || -> std::io::Result<()> {
            if !catch_up.is_empty() {
                file.write_all(catch_up)?;
                file.sync_data()?;
            }
            std::fs::rename(&tmp, &path)
        };
        if let Err(e) = run() {
            let _ = std::fs::remove_file(&tmp);
            return Err(StoreError::io(format!("rewriting {}", path.display()), e));
        }
        if let Err(e) = sync_dir(&self.dir) {
            // The rename is visible to every process; only its survival of a power cut is open.
            tracing::warn!("fsync of {} after the journal rewrite failed: {e}", self.dir.display());
        }
        Ok(JournalFile {
            path,
            file: Some(file),
            header: self.header,
            records: self.records + catch_up_records,
            bytes: self.bytes + catch_up.len() as u64,
        })
    }
}

impl Drop for Prepared {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

impl JournalFile {
    /// Open the existing journal for appends (it replayed whole: no torn tail), cut to
    /// `bytes`, when rewriting it at open would only cost time.
    pub fn reopen(dir: &Path, header: FileHeader, records: u64, bytes: u64) -> Result<Self> {
        let path = dir.join(JOURNAL_FILE);
        let ctx = |e| StoreError::io(format!("reopening {}", path.display()), e);
        let file = OpenOptions::new().append(true).open(&path).map_err(ctx)?;
        file.set_len(bytes).map_err(ctx)?;
        Ok(JournalFile { path, file: Some(file), header, records, bytes })
    }

    /// Write a fresh journal holding `records` (atomically replacing any old one) and open it
    /// for appends.
    pub fn rewrite(dir: &Path, header: FileHeader, records: &[Record]) -> Result<Self> {
        Prepared::write(dir, ".tmp", header, records)?.install(&[], 0)
    }

    pub fn header(&self) -> FileHeader {
        self.header
    }

    /// Append encoded records with one write. On error nothing is acknowledged and whatever
    /// part of the write reached the file is cut off again: a torn record left in the middle
    /// would make replay drop every later (acknowledged) record.
    pub fn append(&mut self, encoded: &[u8], count: u64) -> Result<()> {
        let file = self.file.as_mut().ok_or_else(|| StoreError::Device("journal is closed".into()))?;
        if let Err(e) = file.write_all(encoded) {
            self.cut_back();
            return Err(StoreError::io(format!("appending to {}", self.path.display()), e));
        }
        self.records += count;
        self.bytes += encoded.len() as u64;
        Ok(())
    }

    /// Testing: fail like a disk that accepted only part of the write.
    pub fn append_torn(&mut self, encoded: &[u8], errno: i32) -> Result<()> {
        if let Some(f) = self.file.as_mut() {
            let _ = f.write_all(&encoded[..encoded.len() / 2]);
        }
        self.cut_back();
        let err = std::io::Error::from_raw_os_error(errno);
        Err(StoreError::io(format!("appending to {} (injected fault)", self.path.display()), err))
    }

    fn cut_back(&mut self) {
        if let Some(f) = &self.file {
            if let Err(e) = f.set_len(self.bytes) {
                tracing::error!("cannot cut a failed append off {}: {e}", self.path.display());
            }
        }
    }

    pub fn sync(&self) -> Result<()> {
        if let Some(f) = &self.file {
            f.sync_data().map_err(|e| StoreError::io(self.path.display(), e))?;
        }
        Ok(())
    }

    pub fn close(&mut self) {
        self.file.take();
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}
