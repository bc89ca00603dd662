//! Optional per-block zstd. A block is stored compressed only when that saves at least one
//! 4 KiB page on disk; otherwise the raw bytes go straight to the device (zero-copy).

use crate::error::{Result, StoreError};
use crate::format::PAGE;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Zstd { level: i32 },
}

impl Compression {
    /// The names `parse` accepts (aliases aside), exported to Python as `COMPRESSIONS`.
    pub const NAMES: &'static [&'static str] = &["none", "zstd"];

    pub fn parse(name: &str, level: i32) -> Result<Self> {
        match name {
            "none" | "" | "off" => Ok(Compression::None),
            "zstd" => {
                if !(1..=22).contains(&level) {
                    return Err(StoreError::Config(format!("zstd_level: {level} is outside 1..=22")));
                }
                Ok(Compression::Zstd { level })
            }
            other => Err(StoreError::Config(format!(
                "compression: unknown codec {other:?} (expected \"none\" or \"zstd\")"
            ))),
        }
    }

    /// Compressed bytes, or None when compression is off or would not save a page.
    pub fn compress(self, data: &[u8]) -> Option<Vec<u8>> {
        let Compression::Zstd { level } = self else { return None };
        let packed = zstd::bulk::compress(data, level).ok()?;
        let saves_a_page = packed.len().div_ceil(PAGE) < data.len().div_ceil(PAGE);
        saves_a_page.then_some(packed)
    }
}

/// Decompress into `out`, which must be exactly the block's raw length.
pub fn decompress_into(packed: &[u8], out: &mut [u8]) -> Result<()> {
    let n = zstd::bulk::decompress_to_buffer(packed, out)
        .map_err(|e| StoreError::corrupt("zstd payload", format!("does not decode: {e}")))?;
    if n != out.len() {
        return Err(StoreError::corrupt(
            "zstd payload",
            format!("decoded to {n} bytes, expected {}", out.len()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compresses_only_when_it_saves_a_page() {
        let zeros = vec![0u8; 64 * 1024];
        let codec = Compression::parse("zstd", 3).unwrap();
        let packed = codec.compress(&zeros).expect("zeros compress");
        let mut out = vec![1u8; zeros.len()];
        decompress_into(&packed, &mut out).unwrap();
        assert_eq!(out, zeros);

        let noise: Vec<u8> = (0..64 * 1024u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        assert!(codec.compress(&noise).is_none() || codec.compress(&noise).unwrap().len() < noise.len());
        assert!(Compression::None.compress(&zeros).is_none());
        assert!(Compression::parse("lz4", 1).is_err());
        assert!(Compression::parse("zstd", 99).is_err());
    }

    #[test]
    fn garbage_is_reported_corrupt() {
        let mut out = vec![0u8; 4096];
        assert!(matches!(decompress_into(b"not zstd", &mut out), Err(StoreError::Corrupt { .. })));
    }
}
