//! On-disk formats: the per-block header, the data-file superblock and the journal records.
//! Everything is little-endian and framed with CRCs so a torn or flipped byte is detected.

pub mod header;
pub mod journal;
pub mod layout;
pub mod superblock;

/// O_DIRECT alignment and allocation unit: every extent starts and ends on a 4 KiB boundary.
pub const PAGE: usize = 4096;

/// Longest logical key accepted (namespace + engine block hash fit easily).
pub const MAX_KEY_LEN: usize = 1024;

pub fn round_up_to_page(n: usize) -> usize {
    n.div_ceil(PAGE) * PAGE
}

/// Little-endian cursor used by the decoders; every read is bounds-checked.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    pub fn pos(&self) -> usize {
        self.pos
    }
    pub fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let out = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(out)
    }
    pub fn u8(&mut self) -> Option<u8> {
        self.bytes(1).map(|b| b[0])
    }
    pub fn u16(&mut self) -> Option<u16> {
        self.bytes(2).map(|b| u16::from_le_bytes([b[0], b[1]]))
    }
    pub fn u32(&mut self) -> Option<u32> {
        self.bytes(4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes)
    }
    pub fn u64(&mut self) -> Option<u64> {
        self.bytes(8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes)
    }
    pub fn hash(&mut self) -> Option<[u8; 16]> {
        self.bytes(16).and_then(|b| b.try_into().ok())
    }
}
