//! Which manifests of one GC pass live and which go, from bodies and listings alone (no I/O):
//! the live closure, the byte budget's cut, and the manifests a lookup could trust but a load
//! could not serve (dangling).

use std::collections::{HashMap, HashSet};

use object_store::ObjectMeta;

use super::manifest::Manifest;

pub fn hex(key: &[u8]) -> String {
    super::hex_name(key)
}

fn parent_name(m: &Manifest) -> Option<String> {
    (!m.parent.is_empty()).then(|| hex(&m.parent))
}

/// Manifests that name a block or a parent manifest that is gone, and every descendant of
/// them. A writer that reuses a stored block (a conditional create that finds it, a key it
/// knows) can write a manifest over it just after a pass judged it unreferenced and before that
/// pass deletes it; a lookup would then trust the manifest and every load through it would
/// fail. Only manifests older than `grace` are judged, so a segment whose blocks or parent are
/// still going up (or a listing taken before them) never looks broken; their descendants go
/// with them whatever their age (a lookup reaches them through the broken one).
pub fn dangling(
    bodies: &HashMap<String, Manifest>,
    manifests: &HashMap<String, ObjectMeta>,
    blocks: &HashMap<String, ObjectMeta>,
    now_ms: i64,
    grace_ms: i64,
) -> HashSet<String> {
    let old =
        |n: &str| manifests.get(n).is_some_and(|m| now_ms - m.last_modified.timestamp_millis() > grace_ms);
    let mut broken: Vec<String> = bodies
        .iter()
        .filter(|(n, _)| old(n))
        .filter(|(_, m)| {
            let parent_gone = parent_name(m).is_some_and(|p| !manifests.contains_key(&p));
            parent_gone || m.keys.iter().any(|k| !blocks.contains_key(&hex(k)))
        })
        .map(|(n, _)| n.clone())
        .collect();
    let mut children: HashMap<String, Vec<&String>> = HashMap::new();
    for (n, m) in bodies {
        if let Some(p) = parent_name(m) {
            children.entry(p).or_default().push(n);
        }
    }
    let mut out = HashSet::new();
    while let Some(n) = broken.pop() {
        if out.insert(n.clone()) {
            broken.extend(children.get(&n).into_iter().flatten().map(|c| (*c).clone()));
        }
    }
    out
}

/// `roots` and every ancestor of them reachable through parent links.
pub fn closure(bodies: &HashMap<String, Manifest>, roots: Vec<String>) -> HashSet<String> {
    let mut live = HashSet::new();
    for root in roots {
        let mut at = Some(root);
        while let Some(name) = at.take() {
            if !live.insert(name.clone()) {
                break;
            }
            at = bodies.get(&name).and_then(parent_name);
        }
    }
    live
}

/// Drop live manifests, least recently used chain tails first, until the blocks they list fit.
pub fn fit_budget(
    bodies: &HashMap<String, Manifest>,
    live: &mut HashSet<String>,
    uses: &HashMap<String, i64>,
    blocks: &HashMap<String, ObjectMeta>,
    budget: u64,
) {
    let size = |k: &String| blocks.get(k).map_or(0, |m| m.size);
    let mut refs: HashMap<String, u32> = HashMap::new();
    for m in live.iter().filter_map(|n| bodies.get(n)) {
        for k in &m.keys {
            *refs.entry(hex(k)).or_default() += 1;
        }
    }
    let mut bytes: u64 = refs.keys().map(size).sum();
    if bytes <= budget {
        return;
    }
    // A manifest's effective use: its own or any live descendant's, whichever is later.
    let mut eff: HashMap<String, i64> = uses.clone();
    for (name, &t) in uses {
        let mut at = bodies.get(name).and_then(parent_name);
        while let Some(p) = at.take() {
            let e = eff.entry(p.clone()).or_insert(t);
            *e = (*e).max(t);
            at = bodies.get(&p).and_then(parent_name);
        }
    }
    let mut order: Vec<(i64, std::cmp::Reverse<u64>, String)> = live
        .iter()
        .filter_map(|n| {
            bodies.get(n).map(|m| (eff.get(n).copied().unwrap_or(0), std::cmp::Reverse(m.start), n.clone()))
        })
        .collect();
    order.sort();
    for (_, _, name) in order {
        if bytes <= budget {
            break;
        }
        live.remove(&name);
        for k in bodies.get(&name).map(|m| &m.keys[..]).unwrap_or(&[]) {
            let key = hex(k);
            if let Some(r) = refs.get_mut(&key) {
                *r -= 1;
                if *r == 0 {
                    bytes = bytes.saturating_sub(size(&key));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::path::Path;
    use std::time::{Duration, UNIX_EPOCH};

    fn meta(at_ms: i64) -> ObjectMeta {
        ObjectMeta {
            location: Path::from("x"),
            last_modified: (UNIX_EPOCH + Duration::from_millis(at_ms as u64)).into(),
            size: 1,
            e_tag: None,
            version: None,
        }
    }

    fn seg(start: u64, parent: &[u8], keys: &[&[u8]]) -> Manifest {
        Manifest { start, parent: parent.to_vec(), keys: keys.iter().map(|k| k.to_vec()).collect() }
    }

    #[test]
    fn a_manifest_naming_a_gone_block_goes_with_its_descendants_once_past_grace() {
        let bodies: HashMap<String, Manifest> = [
            (hex(b"a1"), seg(0, b"", &[b"a0", b"a1"])),
            (hex(b"a3"), seg(2, b"a1", &[b"a2", b"a3"])),
            (hex(b"b1"), seg(0, b"", &[b"b0", b"b1"])),
            (hex(b"c3"), seg(2, b"c1", &[b"c2", b"c3"])), // its parent is gone
        ]
        .into_iter()
        .collect();
        let manifests: HashMap<String, ObjectMeta> =
            [(hex(b"a1"), meta(0)), (hex(b"a3"), meta(9_000)), (hex(b"b1"), meta(0)), (hex(b"c3"), meta(0))]
                .into_iter()
                .collect();
        // a0 is gone; every other block is there.
        let blocks: HashMap<String, ObjectMeta> =
            [b"a1", b"a2", b"a3", b"b0", b"b1", b"c2", b"c3"].iter().map(|k| (hex(*k), meta(0))).collect();
        let broken = dangling(&bodies, &manifests, &blocks, 10_000, 5_000);
        let want: HashSet<String> = [hex(b"a1"), hex(b"a3"), hex(b"c3")].into_iter().collect();
        assert_eq!(broken, want); // a3 is young but goes with its broken parent
                                  // Within grace nothing is judged: its blocks may still be going up.
        assert!(dangling(&bodies, &manifests, &blocks, 10_000, 20_000).is_empty());
    }
}
