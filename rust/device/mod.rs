//! A cache directory as a device: its lock, its preallocated data file, and the extent
//! allocator that hands out 4 KiB-aligned ranges of that file. Every file is private (0600).

pub mod allocator;
pub mod data_file;
pub mod dir_lock;
pub mod private;
