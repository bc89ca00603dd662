//! Where bytes live: a cache directory as a device — its lock, its preallocated data file, the
//! extent allocator that hands out 4 KiB-aligned ranges of that file, and the device set that
//! runs (device, offset) I/O for the store on each device's queue. Every file is private (0600).

pub mod allocator;
pub mod data_file;
pub mod dir_lock;
pub mod private;
pub mod set;
