//! Page 0 of every data file: which store it belongs to and its position in the directory
//! list, so a reordered or foreign directory is refused instead of serving another's bytes.

use super::{Reader, PAGE};

const MAGIC: &[u8; 8] = b"FLXKVDAT";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub store_id: u64,
    pub dir_index: u16,
    pub dir_count: u16,
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        let mut page = vec![0u8; PAGE];
        let mut w = Vec::new();
        w.extend_from_slice(MAGIC);
        w.extend_from_slice(&self.store_id.to_le_bytes());
        w.extend_from_slice(&self.dir_index.to_le_bytes());
        w.extend_from_slice(&self.dir_count.to_le_bytes());
        let crc = crc32fast::hash(&w);
        w.extend_from_slice(&crc.to_le_bytes());
        page[..w.len()].copy_from_slice(&w);
        page
    }

    pub fn decode(page: &[u8]) -> Option<Self> {
        let mut r = Reader::new(page);
        if r.bytes(8)? != MAGIC {
            return None;
        }
        let store_id = r.u64()?;
        let dir_index = r.u16()?;
        let dir_count = r.u16()?;
        let body = r.pos();
        let crc = r.u32()?;
        (crc32fast::hash(&page[..body]) == crc).then_some(Superblock { store_id, dir_index, dir_count })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_corruption() {
        let sb = Superblock { store_id: 42, dir_index: 1, dir_count: 3 };
        let mut page = sb.encode();
        assert_eq!(Superblock::decode(&page), Some(sb));
        page[9] ^= 0xff;
        assert_eq!(Superblock::decode(&page), None);
    }
}
