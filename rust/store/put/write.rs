//! Put phase 3, without the lock: encode each planned block's header page, build one
//! vectored write per block (payload straight from caller memory when page-aligned, else via
//! a bounce buffer), run them on the devices, and fdatasync the touched devices when the
//! durability mode asks for it. Returns each written item's outcome.

use std::collections::HashMap;

use super::{extra_of, Encoded, Plan, PutExtra};
use crate::format::header::{BlockHeader, FLAG_COMPRESSED};
use crate::format::{round_up_to_page, PAGE};
use crate::io::aligned::{is_aligned, AlignedBuf};
use crate::io::{iovec, IoOp};
use crate::store::batch::RawBuf;
use crate::store::{Durability, Shared};

pub(super) type Outcomes = HashMap<usize, Result<(), String>>;

pub(super) fn write(
    shared: &Shared,
    items: &[(Vec<u8>, RawBuf)],
    extras: &[PutExtra],
    encoded: &[Encoded],
    plans: &[Plan],
) -> Outcomes {
    let cfg = &shared.cfg;
    let mut owned: Vec<AlignedBuf> = Vec::new();
    let mut ops: Vec<(usize, u16, IoOp)> = Vec::new();
    for (i, plan) in plans.iter().enumerate() {
        let Plan::Write { hash, loc } = plan else { continue };
        let (key, buf) = &items[i];
        let mut header_page = AlignedBuf::zeroed(PAGE);
        let meta = extra_of(extras, i).and_then(|x| x.meta.as_deref()).unwrap_or(&[]);
        BlockHeader {
            flags: if loc.compressed { FLAG_COMPRESSED } else { 0 },
            hash_algo: cfg.hash.code(),
            raw_len: loc.raw_len,
            stored_len: loc.stored_len,
            seq: loc.seq,
            content_hash: *hash,
            key: key.clone(),
        }
        .encode_with_meta(meta, header_page.as_mut_slice());
        let mut iov = vec![iovec(header_page.as_ptr(), PAGE)];
        if loc.stored_len > 0 {
            if !loc.compressed && is_aligned(buf.ptr as usize, buf.len) {
                iov.push(iovec(buf.ptr, buf.len));
            } else {
                let mut bounce = AlignedBuf::zeroed(round_up_to_page(loc.stored_len as usize));
                let src: &[u8] = match &encoded[i].packed {
                    Some(packed) => packed,
                    // SAFETY: readable until completion (see RawBuf).
                    None => unsafe { buf.as_slice() },
                };
                bounce.as_mut_slice()[..src.len()].copy_from_slice(src);
                iov.push(iovec(bounce.as_ptr(), bounce.len()));
                owned.push(bounce);
            }
        }
        owned.push(header_page);
        ops.push((i, loc.dir, IoOp::new(loc.offset, iov, true)));
    }
    let mut touched: Vec<u16> = ops.iter().map(|(_, d, _)| *d).collect();
    touched.sort_unstable();
    touched.dedup();
    let mut outcomes: Outcomes = shared
        .devices
        .run(ops)
        .into_iter()
        .map(|(i, r)| {
            let dir = plans.get(i).and_then(|p| match p {
                Plan::Write { loc, .. } => Some(loc.dir),
                _ => None,
            });
            let path = dir.map(|d| shared.devices.path(d).display().to_string()).unwrap_or_default();
            (i, r.map_err(|f| format!("write to {path}: {f}")))
        })
        .collect();
    // The header pages and bounce buffers were only needed until the devices were done.
    drop(owned);
    if cfg.durability == Durability::Power {
        for d in touched {
            if let Err(e) = shared.devices.sync_data(d) {
                tracing::error!(error = %e, "fdatasync of data file failed");
                for (i, plan) in plans.iter().enumerate() {
                    if matches!(plan, Plan::Write { loc, .. } if loc.dir == d) {
                        outcomes.insert(i, Err(e.to_string()));
                    }
                }
            }
        }
    }
    outcomes
}
