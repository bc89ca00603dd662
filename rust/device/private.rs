//! Cache files are private: KV blocks reveal the prompts they were computed from. Files are
//! created 0600 (the umask can only make that stricter); files of stores made before this
//! lose their group/other bits on a read-write open. Directories are the caller's: the store
//! never creates them (the Python tier creates its shard directories 0700).

use std::fs::{File, Permissions};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Mode passed to open(2) for every file the store creates.
pub const FILE_MODE: u32 = 0o600;
const GROUP_OTHER: u32 = 0o077;

/// Clear the group/other bits of a store file opened read-write. Only removes bits, so a
/// stricter mode the user chose stays. Returns "path 0644 -> 0600" when something changed.
/// A failure (say a file of another owner) is a warning: the store works regardless.
pub fn tighten(file: &File, path: &Path) -> Option<String> {
    let mode = match file.metadata() {
        Ok(m) => m.permissions().mode() & 0o7777,
        Err(e) => {
            tracing::warn!("cannot read the mode of {}: {e}", path.display());
            return None;
        }
    };
    if mode & GROUP_OTHER == 0 {
        return None;
    }
    let private = mode & !GROUP_OTHER;
    // fchmod on the open descriptor: no window for a swapped path.
    match file.set_permissions(Permissions::from_mode(private)) {
        Ok(()) => Some(format!("{} {mode:04o} -> {private:04o}", path.display())),
        Err(e) => {
            tracing::warn!(
                "{} is readable by others (mode {mode:04o}) and cannot be made private: {e}; chmod 600 it",
                path.display()
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::OpenOptionsExt;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).map(|m| m.permissions().mode() & 0o777).unwrap_or(0)
    }

    #[test]
    fn tighten_only_removes_group_and_other_bits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).unwrap();
        assert_eq!(mode(&path) & GROUP_OTHER, 0);
        assert_eq!(tighten(&file, &path), None);
        file.set_permissions(Permissions::from_mode(0o644)).unwrap();
        assert_eq!(tighten(&file, &path).unwrap(), format!("{} 0644 -> 0600", path.display()));
        assert_eq!(mode(&path), 0o600);
        // A stricter mode is kept, never widened to 0600.
        file.set_permissions(Permissions::from_mode(0o444)).unwrap();
        tighten(&file, &path);
        assert_eq!(mode(&path), 0o400);
    }
}
