//! The journal file in the first cache directory: replayed on open, appended per batch,
//! rewritten (compacted) atomically through a temp file + rename.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::device::private::FILE_MODE;
use crate::error::{Result, StoreError};
use crate::format::journal::{decode_all, FileHeader, Record, FILE_HEADER_LEN};

pub const JOURNAL_FILE: &str = "flexkv-journal.log";

pub struct Replayed {
    pub header: FileHeader,
    pub records: Vec<Record>,
    /// Bytes cut off the end (a torn append from a crash).
    pub torn_bytes: u64,
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
    match File::open(&path) {
        Ok(mut f) => f.read_to_end(&mut buf).map_err(|e| StoreError::io(path.display(), e))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StoreError::io(path.display(), e)),
    };
    let header = buf.get(..FILE_HEADER_LEN).and_then(FileHeader::decode).ok_or_else(|| {
        StoreError::Foreign { path: path.clone(), kind: "journal", reason: "bad header".into() }
    })?;
    let body = &buf[FILE_HEADER_LEN..];
    let decoded = decode_all(body);
    Ok(Some(Replayed {
        header,
        records: decoded.records,
        torn_bytes: (body.len() - decoded.valid_len) as u64,
    }))
}

impl JournalFile {
    /// Write a fresh journal holding `records` (atomically replacing any old one) and open it
    /// for appends.
    pub fn rewrite(dir: &Path, header: FileHeader, records: &[Record]) -> Result<Self> {
        let path = dir.join(JOURNAL_FILE);
        let tmp = dir.join(format!("{JOURNAL_FILE}.tmp"));
        let mut buf = header.encode();
        for r in records {
            r.encode_into(&mut buf);
        }
        let ctx = |e| StoreError::io(format!("rewriting {}", path.display()), e);
        // Everything that can fail happens before the rename: until it, the old journal stays
        // the current one; after it, this handle already points at the new file.
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
        let file = match prepared.and_then(|file| std::fs::rename(&tmp, &path).map(|_| file)) {
            Ok(file) => file,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(ctx(e));
            }
        };
        if let Err(e) = sync_dir(dir) {
            // The rename is visible to every process; only its survival of a power cut is open.
            tracing::warn!("fsync of {} after the journal rewrite failed: {e}", dir.display());
        }
        Ok(JournalFile {
            path,
            file: Some(file),
            header,
            records: records.len() as u64,
            bytes: buf.len() as u64,
        })
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
