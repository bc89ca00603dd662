use super::*;

fn loc(offset: u64, len: u64) -> Location {
    Location { dir: 0, offset, stored_len: len, raw_len: len, compressed: false, seq: 1 }
}

/// A key shaped like the connector's: 28-byte head `h`, 32-byte block hash from `i`.
fn packed_key(h: u8, i: u32) -> Vec<u8> {
    let mut k = vec![h; keys::HEAD_LEN];
    k.extend_from_slice(&[0xAB; 28]);
    k.extend_from_slice(&i.to_le_bytes());
    k
}

#[test]
fn dedup_refcounts_free_at_zero() {
    let mut ix = Index::new();
    assert_eq!(ix.insert(b"a", 1, &loc(4096, 8192)), None);
    // A second key shares the content only at its location (a confirmed duplicate).
    assert_eq!(ix.share(b"b", 1, &loc(4096, 8192)), Some(None));
    assert_eq!(ix.share(b"c", 1, &loc(999, 8192)), None);
    assert_eq!(ix.content_count(), 1);
    assert_eq!(ix.logical_bytes(), 16384);
    assert_eq!(ix.physical_bytes(), 3 * 4096);
    assert_eq!(ix.remove(b"a"), None);
    let f = ix.remove(b"b").expect("last ref frees");
    assert_eq!(f, FreedExtent { dir: 0, first_page: 1, pages: 3 });
    assert_eq!(ix.physical_bytes(), 0);
}

#[test]
fn pinned_content_is_freed_by_the_last_reader() {
    let mut ix = Index::new();
    ix.insert(b"a", 2, &loc(8192, 4096));
    let (id, _) = ix.lookup(b"a").unwrap();
    ix.pin(id);
    assert_eq!(ix.remove(b"a"), None);
    assert!(ix.unpin(id).is_some());
}

#[test]
fn remap_releases_old_content() {
    let mut ix = Index::new();
    ix.insert(b"k", 1, &loc(4096, 4096));
    let f = ix.insert(b"k", 2, &loc(12288, 4096));
    assert_eq!(f.map(|f| f.first_page), Some(1));
    assert_eq!(ix.len(), 1);
    assert_eq!(ix.lookup(b"k").unwrap().1.tag, 2);
}

#[test]
fn packed_and_spilled_keys_come_back_whole_in_write_order() {
    let mut ix = Index::new();
    let mut expect: Vec<Vec<u8>> = Vec::new();
    for i in 0..300u32 {
        // Connector-shaped keys under two heads, a short tail, and keys of no such shape.
        let key = match i % 4 {
            0 => packed_key(1, i),
            1 => packed_key(2, i),
            2 => [&[1; keys::HEAD_LEN][..], &i.to_le_bytes()].concat(),
            _ => format!("odd-{i}").into_bytes(),
        };
        ix.insert(&key, i as u64, &loc_seq(4096 * (1 + 2 * i as u64), i as u64 + 1));
        expect.push(key);
    }
    // Take every third key out: freed records are reused below.
    for (i, key) in expect.clone().iter().enumerate() {
        if i % 3 == 0 {
            assert!(ix.remove(key).is_some());
        }
    }
    expect = expect.into_iter().enumerate().filter(|(i, _)| i % 3 != 0).map(|(_, k)| k).collect();
    let again = packed_key(3, 9999);
    ix.insert(&again, 0xEE, &loc_seq(4096 * 1000, 1000));
    expect.push(again);
    let got: Vec<Vec<u8>> = ix.keys_in_order().map(|(k, _)| k).collect();
    assert_eq!(got, expect);
    for key in &expect {
        assert!(ix.contains(key), "{key:?}");
    }
    assert!(!ix.contains(&packed_key(1, 0)));
    assert!(ix.victim().is_some_and(|v| expect.contains(&v)));
}

#[test]
fn wide_locations_round_trip() {
    let mut ix = Index::new();
    let far = Location {
        dir: 3,
        offset: 1 << 46,
        stored_len: 5 << 32,
        raw_len: 6 << 32,
        compressed: true,
        seq: 1 << 40,
    };
    ix.insert(b"far", 9, &far);
    assert_eq!(ix.lookup(b"far").unwrap().1.loc, far);
    let late =
        Location { dir: 300, offset: 8192, stored_len: 10, raw_len: 10, compressed: false, seq: 1 << 50 };
    ix.insert(b"late", 8, &late);
    assert_eq!(ix.lookup(b"late").unwrap().1.loc, late);
    let near = Location {
        dir: 255,
        offset: 4096,
        stored_len: 10,
        raw_len: 10,
        compressed: false,
        seq: (1 << 48) - 1,
    };
    ix.insert(b"near", 7, &near);
    assert_eq!(ix.lookup(b"near").unwrap().1.loc, near);
    assert_eq!(ix.remove(b"late").map(|f| f.dir), Some(300));
    assert_eq!(ix.remove(b"far").map(|f| f.first_page), Some((1 << 46) / PAGE as u64));
}

#[test]
fn raw_lengths_round_trip_through_the_length_table_and_past_it() {
    // Compressed blocks name their raw length by a u8 into a table of 255; the 256th distinct
    // length and later ones go wide. Every location reads back exactly, and freeing one works.
    let mut ix = Index::new();
    let at = |i: u64, raw: u64| Location {
        dir: 1,
        offset: 4096 * (1 + 4 * i),
        stored_len: 1000 + i,
        raw_len: raw,
        compressed: raw != 1000 + i,
        seq: i + 1,
    };
    let mut all = Vec::new();
    for i in 0..300u64 {
        // 300 distinct raw lengths, then the first ones again; every 7th uncompressed.
        let raw = if i % 7 == 0 { 1000 + i } else { 65536 + i % 290 };
        let key = i.to_le_bytes();
        ix.insert(&key, i, &at(i, raw));
        all.push((key, at(i, raw)));
    }
    for (key, loc) in &all {
        assert_eq!(ix.lookup(key).unwrap().1.loc, *loc);
    }
    let (key, loc) = &all[299];
    assert_eq!(ix.remove(key).map(|f| f.first_page), Some(loc.offset / PAGE as u64));
    assert_eq!(ix.logical_bytes(), all[..299].iter().map(|(_, l)| l.raw_len).sum::<u64>());
}

#[test]
fn connector_keys_cost_under_100_bytes_each() {
    let mut ix = Index::new();
    let n = 50_000u32;
    ix.reserve(n as usize);
    for i in 0..n {
        ix.insert(&packed_key(1, i), i as u64, &loc(4096 * (1 + 2 * i as u64), 100));
    }
    let per_key = ix.nbytes() as f64 / n as f64;
    assert!(per_key < 100.0, "{per_key:.1} bytes per key");
}

#[test]
fn contents_sharing_a_tag_stay_apart_and_are_found_by_location() {
    // Two different blocks with one tag (a ~2^-48 clash, forced here): each keeps its own
    // content, found by tag and location; removing one leaves the other whole.
    let mut ix = Index::new();
    ix.insert(b"a", 5, &loc(4096, 4096));
    ix.insert(b"b", 5, &loc(12288, 4096));
    assert_eq!(ix.content_count(), 2);
    assert_eq!(ix.lookup(b"a").unwrap().1.loc, loc(4096, 4096));
    assert_eq!(ix.lookup(b"b").unwrap().1.loc, loc(12288, 4096));
    assert_eq!(ix.remove(b"a").map(|f| f.first_page), Some(1));
    assert_eq!(ix.candidate(5).map(|(_, c)| c.loc), Some(loc(12288, 4096)));
    assert_eq!(ix.share(b"c", 5, &loc(12288, 4096)), Some(None));
    assert_eq!(ix.content_count(), 1);
}

fn loc_seq(offset: u64, seq: u64) -> Location {
    Location { dir: 0, offset, stored_len: 100, raw_len: 100, compressed: false, seq }
}

#[test]
fn lists_by_write_and_sweeps_like_a_clock() {
    let mut owner = Index::new();
    let n = 1000u32;
    owner.reserve(n as usize);
    // Inserted out of write order: the listing follows the writes' seqs, not the arena.
    let seq_of = |i: u32| ((i * 7919) % n) as u64 + 1;
    for i in 0..n {
        let at = loc_seq(4096 * (1 + 2 * i as u64), seq_of(i));
        owner.insert(&packed_key(1, i), i as u64, &at);
    }
    let listed: Vec<u64> = owner.keys_in_order().map(|(_, c)| owner.content(c).unwrap().loc.seq).collect();
    assert_eq!(listed, (1..=n as u64).collect::<Vec<_>>());
    // The sweep visits every key once before it comes back, skipping removed ones.
    assert!(owner.remove(&packed_key(1, 1)).is_some());
    let mut seen = std::collections::HashSet::new();
    for _ in 0..n - 1 {
        let v = owner.victim().unwrap();
        assert!(seen.insert(v.clone()), "{v:?} twice");
        assert_ne!(v, packed_key(1, 1));
    }
    assert_eq!(owner.victim(), Some(packed_key(1, 0)));
    // Evicting by sweep empties the index.
    while let Some(v) = owner.victim() {
        assert!(owner.remove(&v).is_some());
    }
    assert!(owner.is_empty());
    assert_eq!(owner.physical_bytes(), 0);
}

#[test]
fn a_shared_content_outlives_its_first_key_and_its_slot_is_reused_only_when_free() {
    // Slot ids are content ids: the first key's slot holds the content the second key shares.
    let mut ix = Index::new();
    ix.insert(&packed_key(1, 0), 7, &loc(4096, 4096));
    let (owner, _) = ix.lookup(&packed_key(1, 0)).unwrap();
    assert_eq!(ix.share(&packed_key(1, 1), 7, &loc(4096, 4096)), Some(None));
    assert_eq!(ix.lookup(&packed_key(1, 1)).unwrap().0, owner);
    ix.set_parent(&packed_key(1, 1), Some(&packed_key(1, 0)));
    assert_eq!(ix.parent(&packed_key(1, 1)), Some(packed_key(1, 0)));
    assert_eq!(ix.remove(&packed_key(1, 0)), None);
    // The content stays in the first key's slot; the key is gone (no parent any more).
    assert_eq!(ix.parent(&packed_key(1, 1)), None);
    assert_eq!(
        ix.lookup(&packed_key(1, 1)).map(|(c, e)| (c, e.loc, e.refs)),
        Some((owner, loc(4096, 4096), 1))
    );
    for i in 2..40 {
        ix.insert(&packed_key(1, i), 100 + i as u64, &loc(4096 * (10 + 2 * i as u64), 4096));
        assert_ne!(ix.lookup(&packed_key(1, i)).unwrap().0, owner, "a held slot was reused");
    }
    assert_eq!(ix.content(owner).map(|c| c.loc), Some(loc(4096, 4096)));
    let freed = ix.remove(&packed_key(1, 1)).expect("its last key frees it");
    assert_eq!(freed.first_page, 1);
    assert!(ix.content(owner).is_none());
    // Both slots of the shared content are free now: the next two keys take them.
    let ids: Vec<u32> = (0..2u32)
        .map(|i| {
            ix.insert(&packed_key(2, i), 9 + i as u64, &loc(4096 * (200 + 2 * i as u64), 4096));
            ix.lookup(&packed_key(2, i)).unwrap().0
        })
        .collect();
    assert!(ids.contains(&owner), "{ids:?} vs {owner}");
    assert_eq!((ix.len(), ix.content_count()), (40, 40));
}

#[test]
fn a_pinned_content_keeps_its_slot_after_its_key_goes() {
    let mut ix = Index::new();
    ix.insert(b"a", 1, &loc(4096, 4096));
    let (id, _) = ix.lookup(b"a").unwrap();
    ix.pin(id);
    assert_eq!(ix.remove(b"a"), None);
    assert!(!ix.contains(b"a"));
    // New keys (one of them the same key again, same content and place) take other slots.
    ix.insert(b"b", 2, &loc(12288, 4096));
    assert_ne!(ix.lookup(b"b").unwrap().0, id);
    assert_eq!(ix.insert(b"a", 1, &loc(4096, 4096)), None);
    assert_eq!(ix.lookup(b"a").unwrap().0, id, "the same write is found where it is held");
    assert_eq!(ix.content(id).map(|c| (c.refs, c.readers)), Some((1, 1)));
    assert_eq!(ix.unpin(id), None, "a key maps to it again");
    assert_eq!(ix.remove(b"a").map(|f| f.first_page), Some(1));
    assert_eq!(ix.content_count(), 1);
}

mod model {
    //! The index against a plain model: keys map to writes, a write's content lives while
    //! keys or readers hold it, and every extent is freed exactly once, when the last goes.
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Clone, Debug)]
    enum Op {
        Put(u8),
        Share(u8, usize),
        Remove(u8),
        Pin(u8),
        Unpin(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => any::<u8>().prop_map(|k| Op::Put(k % 12)),
            3 => (any::<u8>(), any::<usize>()).prop_map(|(k, j)| Op::Share(k % 12, j)),
            2 => any::<u8>().prop_map(|k| Op::Remove(k % 12)),
            1 => any::<u8>().prop_map(|k| Op::Pin(k % 12)),
            1 => any::<usize>().prop_map(Op::Unpin),
        ]
    }

    fn key(k: u8) -> Vec<u8> {
        // Connector-shaped keys and, for every third, a key of no such shape (spilled).
        if k % 3 == 0 {
            format!("odd-{k}").into_bytes()
        } else {
            packed_key(1, k as u32)
        }
    }

    /// Write `w`'s tag (three tags for all: contents are told apart by location) and place.
    fn write(w: u64) -> (ContentTag, Location) {
        let at = Location {
            dir: 0,
            offset: 4096 * (1 + 8 * w),
            stored_len: 100 + w,
            raw_len: 100 + w,
            compressed: false,
            seq: w + 1,
        };
        (w % 3, at)
    }

    #[derive(Default)]
    struct Model {
        keys: HashMap<u8, u64>,
        refs: HashMap<u64, u32>,
        readers: HashMap<u64, u32>,
        pins: Vec<(ContentId, u64)>,
    }

    impl Model {
        fn live(&self) -> Vec<u64> {
            let mut all: Vec<u64> = self
                .refs
                .keys()
                .chain(self.readers.keys())
                .copied()
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            all.sort_unstable();
            all
        }

        fn count(map: &mut HashMap<u64, u32>, w: u64, up: bool) {
            let n = map.entry(w).or_insert(0);
            if up {
                *n += 1;
            } else {
                *n -= 1;
            }
            if *n == 0 {
                map.remove(&w);
            }
        }

        /// The extent freed if write `w` just lost a holder.
        fn freed_if_gone(&self, w: u64) -> Option<FreedExtent> {
            let gone = !self.refs.contains_key(&w) && !self.readers.contains_key(&w);
            gone.then(|| freed(&write(w).1))
        }

        /// Unmap `k`; what is freed.
        fn unmap(&mut self, k: u8) -> Option<FreedExtent> {
            let w = self.keys.remove(&k)?;
            Self::count(&mut self.refs, w, false);
            self.freed_if_gone(w)
        }
    }

    fn check(ix: &Index, m: &Model) {
        for k in 0..12u8 {
            let got = ix.lookup(&key(k)).map(|(_, e)| (e.tag, e.loc, e.refs, e.readers));
            let want = m.keys.get(&k).map(|&w| {
                let (tag, at) = write(w);
                (tag, at, m.refs[&w], m.readers.get(&w).copied().unwrap_or(0))
            });
            assert_eq!(got, want, "key {k}");
        }
        for &(id, w) in &m.pins {
            assert_eq!(ix.content(id).map(|c| c.loc), Some(write(w).1), "pinned {id}");
        }
        let live = m.live();
        assert_eq!(ix.content_count(), live.len());
        assert_eq!(ix.len(), m.keys.len());
        let pages: u64 = live.iter().map(|&w| extent_pages(write(w).1.stored_len)).sum();
        assert_eq!(ix.physical_bytes(), pages * PAGE as u64);
    }

    proptest! {
        #[test]
        fn index_matches_a_model_of_keys_writes_and_readers(ops in prop::collection::vec(op(), 1..120)) {
            let mut ix = Index::new();
            let mut m = Model::default();
            let mut next = 0u64;
            for op in ops {
                match op {
                    Op::Put(k) => {
                        let w = next;
                        next += 1;
                        let (tag, at) = write(w);
                        let want = m.unmap(k);
                        m.keys.insert(k, w);
                        Model::count(&mut m.refs, w, true);
                        prop_assert_eq!(ix.insert(&key(k), tag, &at), want);
                    }
                    Op::Share(k, j) => {
                        let live = m.live();
                        if live.is_empty() {
                            continue;
                        }
                        let w = live[j % live.len()];
                        let (tag, at) = write(w);
                        let want = if m.keys.get(&k) == Some(&w) {
                            None
                        } else {
                            // Count the new holder first: the old mapping may be this write's.
                            Model::count(&mut m.refs, w, true);
                            let freed = m.unmap(k);
                            m.keys.insert(k, w);
                            freed
                        };
                        prop_assert_eq!(ix.share(&key(k), tag, &at), Some(want));
                    }
                    Op::Remove(k) => {
                        let want = m.unmap(k);
                        prop_assert_eq!(ix.remove(&key(k)), want);
                    }
                    Op::Pin(k) => {
                        let Some(&w) = m.keys.get(&k) else { continue };
                        let (id, _) = ix.lookup(&key(k)).unwrap();
                        ix.pin(id);
                        Model::count(&mut m.readers, w, true);
                        m.pins.push((id, w));
                    }
                    Op::Unpin(j) => {
                        if m.pins.is_empty() {
                            continue;
                        }
                        let (id, w) = m.pins.swap_remove(j % m.pins.len());
                        Model::count(&mut m.readers, w, false);
                        prop_assert_eq!(ix.unpin(id), m.freed_if_gone(w));
                    }
                }
                check(&ix, &m);
            }
        }
    }
}

#[test]
fn tags_count_six_bytes_so_a_v3_journals_eight_byte_tags_match() {
    // A v3 journal's tags carry 8 bytes of the content hash; the index (and v4) keep 6.
    let mut ix = Index::new();
    ix.insert(b"a", 0xABCD_1111_2222_3333, &loc(4096, 4096));
    assert_eq!(ix.lookup(b"a").unwrap().1.tag, 0x1111_2222_3333);
    assert_eq!(ix.candidate(0x1111_2222_3333).map(|(_, c)| c.loc), Some(loc(4096, 4096)));
    assert_eq!(ix.share(b"b", 0xFFFF_1111_2222_3333, &loc(4096, 4096)), Some(None));
    assert_eq!(ix.content_count(), 1);
    // Another 6-byte tag is another content, even at the same place.
    assert!(ix.candidate(0x1111_2222_3334).is_none());
    assert_eq!(ix.share(b"c", 0x1111_2222_3334, &loc(4096, 4096)), None);
}
