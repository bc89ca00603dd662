//! Put phase 3, without the lock: encode each planned block's header page, build one
//! vectored write per block (payload straight from caller memory when page-aligned, else via
//! a bounce buffer), run them on the devices, and fdatasync the touched devices when the
//! durability mode asks for it. In the same device round, the header page of each dedup
//! candidate (`Plan::Confirm`) is read: it confirms the candidate only when it is whole, is the
//! indexed write (seq) and names this block's full content hash. Returns each written or
//! confirmed item's outcome.

use std::collections::HashMap;

use super::{extra_of, Encoded, Plan, PutExtra};
use crate::format::header::{BlockHeader, FLAG_COMPRESSED};
use crate::format::journal::Location;
use crate::format::{round_up_to_page, PAGE};
use crate::index::ContentId;
use crate::io::aligned::{is_aligned, AlignedBuf};
use crate::io::{iovec, IoOp};
use crate::store::{Durability, Shared};
use crate::tier::batch::RawBuf;

/// Per written item: its write's outcome; per `Confirm` item: Ok when confirmed.
pub(super) type Outcomes = HashMap<usize, Result<(), String>>;

/// What the device round found: the outcomes, and the `Confirm` items whose candidate's header
/// page is not the indexed write's (unreadable, or another seq): damaged content to drop.
pub(super) struct Written {
    pub outcomes: Outcomes,
    pub damaged: Vec<(ContentId, Location)>,
}

pub(super) fn write(
    shared: &Shared,
    items: &[(Vec<u8>, RawBuf)],
    extras: &[PutExtra],
    encoded: &[Encoded],
    plans: &[Plan],
) -> Written {
    let cfg = &shared.cfg;
    let mut owned: Vec<AlignedBuf> = Vec::new();
    let mut ops: Vec<(usize, u16, IoOp)> = Vec::new();
    let mut candidates: Vec<(usize, AlignedBuf)> = Vec::new();
    for (i, plan) in plans.iter().enumerate() {
        if let Plan::Confirm { loc, .. } = plan {
            let page = AlignedBuf::zeroed(PAGE);
            ops.push((i, loc.dir, IoOp::new(loc.offset, vec![iovec(page.as_ptr(), PAGE)], false)));
            candidates.push((i, page));
            continue;
        }
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
    let mut touched: Vec<u16> =
        ops.iter().filter(|(i, _, _)| matches!(plans[*i], Plan::Write { .. })).map(|(_, d, _)| *d).collect();
    touched.sort_unstable();
    touched.dedup();
    let mut outcomes: Outcomes = shared
        .devices
        .run(ops)
        .into_iter()
        .map(|(i, r)| {
            let (verb, dir) = match plans.get(i) {
                Some(Plan::Write { loc, .. }) => ("write to", Some(loc.dir)),
                Some(Plan::Confirm { loc, .. }) => ("header read from", Some(loc.dir)),
                _ => ("I/O on", None),
            };
            let path = dir.map(|d| shared.devices.path(d).display().to_string()).unwrap_or_default();
            (i, r.map_err(|f| format!("{verb} {path}: {f}")))
        })
        .collect();
    // The header pages and bounce buffers were only needed until the devices were done.
    drop(owned);
    let mut damaged = Vec::new();
    for (i, page) in candidates {
        if let (Some(Ok(())), Plan::Confirm { hash, loc, content }) = (outcomes.get(&i), &plans[i]) {
            match BlockHeader::decode(page.as_slice()).ok().filter(|h| h.seq == loc.seq) {
                Some(h) if h.content_hash == *hash => {}
                // A true tag clash (~n/2^48): the other content is sound and stays.
                Some(_) => {
                    outcomes.insert(
                        i,
                        Err("a stored block has this block's content tag, not its content".into()),
                    );
                }
                // Not the indexed write's header: that content is damaged. Left indexed, it would
                // refuse every later put of these bytes until something read it.
                None => {
                    outcomes.insert(
                        i,
                        Err("the stored block with this content has a damaged header (dropped)".into()),
                    );
                    damaged.push((*content, loc.clone()));
                }
            }
        }
    }
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
    Written { outcomes, damaged }
}
