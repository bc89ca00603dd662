//! A read-only view follows the writer's journal: `follow` reads the records appended since the
//! view last looked (a stat and one read of the new bytes) and applies them to its index, so a
//! sibling engine's view stays current without replaying the whole journal. It answers which
//! keys appeared and which vanished. A journal that was replaced since (compaction, a rewrite,
//! a set-aside store) or that no longer ends with the bytes the view read last cannot be
//! followed: None, and the caller opens a new view (a full replay). No lock on the writer.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::journal_file::JOURNAL_FILE;
use super::{BlockStore, Shared};
use crate::error::{Result, StoreError};
use crate::format::journal::{visit_all, RecordRef};
use crate::format::PAGE;
use crate::index::extent_pages;

/// Bytes before the followed offset that must still be there (they prove the file was only
/// appended to: a writer that reopened cuts its clean-shutdown marks and appends from there).
const OVERLAP: u64 = 32;

pub struct Followed {
    path: PathBuf,
    ident: (u64, u64),
    offset: u64,
    overlap: Vec<u8>,
}

/// Keys that appeared and vanished since the last follow.
pub type Changes = (Vec<Vec<u8>>, Vec<Vec<u8>>);

impl Followed {
    /// Following from `offset` of the journal in `dir` whose identity was `ident` when read.
    pub fn at(dir: &Path, ident: Option<(u64, u64)>, offset: u64) -> Option<Self> {
        let path = dir.join(JOURNAL_FILE);
        let mut f = File::open(&path).ok()?;
        let meta = f.metadata().ok()?;
        if Some((meta.dev(), meta.ino())) != ident {
            return None; // replaced between the read and now: a follow reopens
        }
        let overlap = read_at(&mut f, offset.saturating_sub(OVERLAP), offset).ok()?;
        Some(Followed { path, ident: (meta.dev(), meta.ino()), offset, overlap })
    }
}

fn read_at(f: &mut File, from: u64, to: u64) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0; (to - from) as usize];
    f.seek(SeekFrom::Start(from))?;
    f.read_exact(&mut buf)?;
    Ok(buf)
}

impl BlockStore {
    /// A read-only view: apply the writer's journal records appended since the last call (or
    /// the open). Some((appeared, vanished)); None when the journal cannot be followed (see the
    /// module doc): open a new view then. An error for a store that is not read-only.
    pub fn follow(&self) -> Result<Option<Changes>> {
        if !self.shared.cfg.read_only {
            return Err(StoreError::Config("follow: only a read-only view follows a journal".into()));
        }
        let mut state = self.shared.state.lock();
        let Some(mut followed) = state.journal.follow.take() else { return Ok(None) };
        let Some(tail) = read_tail(&followed) else { return Ok(None) };
        // Each key a record names, with whether it was indexed before this call.
        let mut touched: HashMap<Vec<u8>, bool> = HashMap::new();
        let st = &mut *state;
        let valid = visit_all(&tail, |_, record| match record {
            RecordRef::Put { key, tag, loc, .. } => {
                let was = st.index.lookup(key).is_some();
                touched.entry(key.to_vec()).or_insert(was);
                let dir = loc.dir as usize;
                let allocators = &mut st.allocators;
                let admit = || {
                    dir < allocators.len()
                        && loc.offset % PAGE as u64 == 0
                        && allocators[dir].reserve(loc.offset / PAGE as u64, extent_pages(loc.stored_len))
                };
                match st.index.replay_put(key, tag, &loc, admit) {
                    Some(freed) => Shared::free_extent(st, freed),
                    None => {
                        // Not indexable in this view: an older mapping of the key is stale.
                        let freed = st.index.remove(key);
                        Shared::free_extent(st, freed);
                    }
                }
            }
            RecordRef::Delete { key } => {
                touched.entry(key.to_vec()).or_insert_with(|| st.index.lookup(key).is_some());
                let freed = st.index.remove(key);
                Shared::free_extent(st, freed);
            }
            RecordRef::CleanShutdown { .. } => {}
        });
        let consumed = &tail[..valid];
        followed.offset += valid as u64;
        followed.overlap.extend_from_slice(consumed);
        let cut = followed.overlap.len().saturating_sub(OVERLAP as usize);
        followed.overlap.drain(..cut);
        state.journal.follow = Some(followed);
        let (mut appeared, mut vanished) = (Vec::new(), Vec::new());
        for (key, was) in touched {
            match (was, state.index.lookup(&key).is_some()) {
                (false, true) => appeared.push(key),
                (true, false) => vanished.push(key),
                _ => {}
            }
        }
        Ok(Some((appeared, vanished)))
    }
}

/// The bytes appended since `followed`, or None when the file was replaced or rewritten.
fn read_tail(followed: &Followed) -> Option<Vec<u8>> {
    let mut f = File::open(&followed.path).ok()?;
    let meta = f.metadata().ok()?;
    if (meta.dev(), meta.ino()) != followed.ident || meta.len() < followed.offset {
        return None;
    }
    let from = followed.offset - followed.overlap.len() as u64;
    let bytes = read_at(&mut f, from, meta.len()).ok()?;
    let (before, tail) = bytes.split_at(followed.overlap.len());
    (before == followed.overlap.as_slice()).then(|| tail.to_vec())
}
