//! A store written by another on-disk format version is set aside, not opened and not
//! refused: its files move into `<dir>/set-aside/v<old>-<unix secs>/` in every cache directory
//! (the directory itself stays: it may be a mount point, and it holds our lock), one WARNING
//! names the directory and both versions, and the store starts empty. A restart then finds
//! an empty directory, so an upgrade never turns into a crash loop. Deleting `set-aside/`
//! gives the space back (the old data file is as large as the old capacity).

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::journal_file::JOURNAL_FILE;
use crate::device::data_file::DATA_FILE;
use crate::error::{Result, StoreError};

pub const SET_ASIDE_DIR: &str = "set-aside";

/// Move the store files of `dirs` aside (see the module doc); returns where dir 0's went.
pub fn set_aside(dirs: &[PathBuf], found: u32, expected: u32) -> Result<PathBuf> {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let name = format!("v{found}-{secs}");
    let mut first = None;
    for dir in dirs {
        let target = dir.join(SET_ASIDE_DIR).join(&name);
        move_store_files(dir, &target)?;
        first.get_or_insert(target);
    }
    let target = first.unwrap_or_default();
    tracing::warn!(
        "the store in {} was written by flexkv format v{found}; this build reads v{expected}: its files \
         were moved to {} (delete it to reclaim the space) and the store starts empty",
        dirs.first().map_or(Path::new("?"), PathBuf::as_path).display(),
        target.display()
    );
    Ok(target)
}

fn move_store_files(dir: &Path, target: &Path) -> Result<()> {
    let names = [
        JOURNAL_FILE.to_string(),
        format!("{JOURNAL_FILE}.tmp"),
        format!("{JOURNAL_FILE}.compact"),
        DATA_FILE.into(),
        super::metas::DEDUP_METAS_FILE.into(),
    ];
    let present: Vec<&String> = names.iter().filter(|n| dir.join(n).exists()).collect();
    if present.is_empty() {
        return Ok(());
    }
    let ctx = |what: &str, e| {
        StoreError::io(format!("setting aside {}: {what} {}", dir.display(), target.display()), e)
    };
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(target).map_err(|e| ctx("creating", e))?;
    for n in present {
        std::fs::rename(dir.join(n), target.join(n)).map_err(|e| ctx("moving into", e))?;
    }
    Ok(())
}
