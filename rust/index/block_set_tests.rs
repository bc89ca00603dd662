//! Unit tests of the presence set (`block_set.rs`): order, digests, spans, memory, and model
//! checks against a VecDeque (plain sets) and per-value links with two lists (chains).

use proptest::prelude::*;

use super::*;

fn d(n: u32) -> Digest {
    digest(b"head", &n.to_le_bytes())
}

fn order(s: &BlockSet) -> Vec<Digest> {
    s.iter().copied().collect()
}

#[test]
fn digest_of_parts_is_digest_of_concatenation() {
    for (head, hash) in
        [(&b""[..], &b""[..]), (&[7u8; 24][..], &[9u8; 32][..]), (&[1u8; 24][..], &[2u8; 300][..])]
    {
        let whole = [head, hash].concat();
        assert_eq!(digest(head, hash)[..], xxh3_128(&whole).to_le_bytes()[..8]);
        assert_eq!(digest(&whole, b""), digest(head, hash));
        assert_eq!(digest(b"", &whole), digest(head, hash));
    }
    // Both paths (stack copy, streaming) agree where they meet.
    let long = [3u8; STACK_KEY + 1];
    assert_eq!(digest(&long[..STACK_KEY], &long[STACK_KEY..])[..], xxh3_128(&long).to_le_bytes()[..8]);
    assert_ne!(digest(b"ab", b"c"), digest(b"a", b"bd"));
}

#[test]
fn lru_order_add_touch_pop() {
    let mut s = BlockSet::new();
    for n in 0..5 {
        assert_eq!(s.insert(d(n)), Ok(true));
    }
    assert_eq!(s.insert(d(2)), Ok(false), "re-adding keeps its place");
    assert!(s.touch(&d(1)));
    assert!(s.touch(&d(0)));
    assert!(!s.touch(&d(99)));
    assert_eq!(order(&s), [d(2), d(3), d(4), d(1), d(0)]);
    assert_eq!(s.pop_front(), Some(d(2)));
    assert_eq!(s.pop_front(), Some(d(3)));
    assert_eq!(s.len(), 3);
    assert!(!s.contains(&d(2)));
    assert_eq!(order(&s), [d(4), d(1), d(0)]);
}

#[test]
fn removal_anywhere_keeps_links_and_table_consistent() {
    let mut s = BlockSet::new();
    for n in 0..100 {
        s.insert(d(n)).unwrap();
    }
    // Front, back, middle, and the arena's last node (the one that gets moved).
    for n in [0, 99, 50, 98, 1] {
        assert!(s.remove(&d(n)));
        assert!(!s.remove(&d(n)));
    }
    let expect: Vec<Digest> = (2..98).filter(|&n| n != 50).map(d).collect();
    assert_eq!(order(&s), expect);
    for n in 0..100 {
        assert_eq!(s.contains(&d(n)), expect.contains(&d(n)), "{n}");
    }
    while s.pop_front().is_some() {}
    assert!(s.is_empty());
    assert_eq!(order(&s), Vec::<Digest>::new());
    assert_eq!(s.insert(d(7)), Ok(true));
    assert_eq!(order(&s), [d(7)]);
}

#[test]
fn retain_is_an_intersection_in_order() {
    // Big enough that the arena shrinks while retain walks it.
    let mut a = BlockSet::new();
    let mut b = BlockSet::new();
    for n in 0..10_000 {
        a.insert(d(n)).unwrap();
    }
    for n in (0..20_000).step_by(10) {
        b.insert(d(n)).unwrap();
    }
    a.touch(&d(0));
    let before = a.heap_bytes();
    a.retain(|x| b.contains(x));
    assert!(a.heap_bytes() < before / 2, "{} of {before}", a.heap_bytes());
    let mut expect: Vec<Digest> = (10..10_000).step_by(10).map(d).collect();
    expect.push(d(0));
    assert_eq!(order(&a), expect);
    assert_eq!(a.len(), expect.len());
    for n in 0..10_000 {
        assert_eq!(a.contains(&d(n)), n % 10 == 0, "{n}");
    }
}

/// A digest with a chosen tag (its first 4 bytes pick the home slot).
fn tagged(tag: u32, n: u8) -> Digest {
    let mut d = [n; 8];
    d[..4].copy_from_slice(&tag.to_le_bytes());
    d
}

#[test]
fn probe_chains_wrap_and_survive_removal() {
    // Homes at the last slot wrap to the front, where keys homed at slot 0 collide with them.
    let keys: Vec<Digest> =
        (0..10).map(|n| tagged(u32::MAX, n)).chain((10..14).map(|n| tagged(0, n))).collect();
    for first in 0..keys.len() {
        for stride in [1, 3, 5] {
            let mut s = BlockSet::new();
            for k in &keys {
                assert_eq!(s.insert(*k), Ok(true));
            }
            let mut gone = Vec::new();
            let mut at = first;
            for _ in 0..keys.len() {
                assert!(s.remove(&keys[at]), "{first} {stride} {at}");
                gone.push(at);
                for (i, k) in keys.iter().enumerate() {
                    assert_eq!(s.contains(k), !gone.contains(&i), "{first} {stride} after {gone:?}: {i}");
                }
                at = (at + stride) % keys.len();
                while gone.contains(&at) && gone.len() < keys.len() {
                    at = (at + 1) % keys.len();
                }
            }
            assert!(s.is_empty());
        }
    }
}

#[test]
fn memory_follows_the_set() {
    let mut s = BlockSet::new();
    assert_eq!(s.heap_bytes(), 0);
    for n in 0..100_000 {
        s.insert(d(n)).unwrap();
    }
    let full = s.heap_bytes();
    // 16-byte nodes (8-byte fingerprint + LRU links) and 4-byte slots at 64-80 % load.
    assert!(full >= 100_000 * 21, "{full}");
    assert!(full <= 100_000 * 40, "{full} bytes for 100k digests");
    for _ in 0..99_000 {
        s.pop_front();
    }
    assert!(s.heap_bytes() < full / 8, "shrinks after mass removal: {}", s.heap_bytes());
    assert_eq!(s.len(), 1000);
    assert_eq!(order(&s), (99_000..100_000).map(d).collect::<Vec<_>>());
    s.clear();
    assert_eq!((s.len(), s.heap_bytes()), (0, 0));
}

#[test]
fn prefix_run_and_mask_boundaries() {
    let mut s = BlockSet::new();
    let hashes: Vec<[u8; 4]> = (0u32..10).map(|n| n.to_le_bytes()).collect();
    let hs: Vec<&[u8]> = hashes.iter().map(|h| &h[..]).collect();
    assert_eq!(s.prefix_run(b"h", &hs), 0, "empty set");
    assert_eq!(s.present_mask(b"h", &[]), Vec::<u8>::new());
    for h in &hs[..4] {
        s.insert(digest(b"h", h)).unwrap();
    }
    s.insert(digest(b"h", hs[6])).unwrap();
    assert_eq!(s.prefix_run(b"h", &hs), 4);
    assert_eq!(s.prefix_run(b"h", &hs[..3]), 3, "all present");
    assert_eq!(s.prefix_run(b"h", &hs[4..]), 0, "absent first");
    assert_eq!(s.prefix_run(b"other", &hs), 0, "another head is another key");
    assert_eq!(s.present_mask(b"h", &hs), [1, 1, 1, 1, 0, 0, 1, 0, 0, 0]);
    // head || hash is the key: the split between them does not matter.
    assert_eq!(s.prefix_run(b"", &[b"h\0\0\0\0"]), 1);
}

#[test]
fn spans_are_checked_not_clamped() {
    assert_eq!(check_span(0, 0, 0), Ok(0..0));
    assert_eq!(check_span(3, 3, 3), Ok(3..3));
    assert_eq!(check_span(1, 4, 4), Ok(1..4));
    assert_eq!(check_span(2, 1, 4), Err(SpanError::Reversed(2, 1)));
    assert_eq!(check_span(0, 5, 4), Err(SpanError::PastEnd(5, 4)));
    assert_eq!(check_span(5, 5, 4), Err(SpanError::PastEnd(5, 4)));
    assert_eq!(check_span(-1, 2, 4), Err(SpanError::Negative(-1, 2)));
    assert_eq!(check_span(0, i64::MAX, 4), Err(SpanError::PastEnd(i64::MAX, 4)));
}

#[test]
fn reserve_then_fill_does_not_regrow() {
    let mut s = BlockSet::new();
    s.reserve(5000).unwrap();
    let before = s.heap_bytes();
    for n in 0..5000 {
        s.insert(d(n)).unwrap();
    }
    assert_eq!(s.heap_bytes(), before);
    assert_eq!(s.reserve(MAX_LEN), Err(SetError::Full));
    assert_eq!(s.reserve(MAX_LEN - 4999), Err(SetError::Full));
    assert_eq!(s.len(), 5000);
}

#[derive(Clone, Debug)]
enum Op {
    Insert(u8),
    Remove(u8),
    Touch(u8),
    Pop,
    /// Keep the values whose bit (value % 64) is set in the mask (an intersection).
    Retain(u64),
    Clear,
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..40).prop_map(Op::Insert),
        2 => (0u8..40).prop_map(Op::Remove),
        2 => (0u8..40).prop_map(Op::Touch),
        1 => Just(Op::Pop),
        1 => any::<u64>().prop_map(Op::Retain),
        1 => Just(Op::Clear),
    ]
}

proptest! {
    /// Every operation against a VecDeque of values in LRU order.
    #[test]
    fn matches_an_lru_model(ops in proptest::collection::vec(arb_op(), 0..200)) {
        let mut s = BlockSet::new();
        let mut model: std::collections::VecDeque<u8> = Default::default();
        let dv = |v: u8| d(u32::from(v));
        for op in ops {
            match op {
                Op::Insert(v) => {
                    let new = !model.contains(&v);
                    if new { model.push_back(v); }
                    prop_assert_eq!(s.insert(dv(v)), Ok(new));
                }
                Op::Remove(v) => {
                    let at = model.iter().position(|&x| x == v);
                    if let Some(i) = at { model.remove(i); }
                    prop_assert_eq!(s.remove(&dv(v)), at.is_some());
                }
                Op::Touch(v) => {
                    let at = model.iter().position(|&x| x == v);
                    if let Some(i) = at { model.remove(i); model.push_back(v); }
                    prop_assert_eq!(s.touch(&dv(v)), at.is_some());
                }
                Op::Pop => prop_assert_eq!(s.pop_front(), model.pop_front().map(dv)),
                Op::Retain(mask) => {
                    let keep = |v: u8| mask >> (v % 64) & 1 == 1;
                    model.retain(|&v| keep(v));
                    let kept: Vec<Digest> = model.iter().map(|&v| dv(v)).collect();
                    s.retain(|x| kept.contains(x));
                }
                Op::Clear => { model.clear(); s.clear(); }
            }
            prop_assert_eq!(order(&s), model.iter().map(|&v| dv(v)).collect::<Vec<_>>());
            prop_assert_eq!(s.len(), model.len());
            for v in 0u8..40 {
                prop_assert_eq!(s.contains(&dv(v)), model.contains(&v));
            }
        }
    }
}

#[derive(Clone, Debug)]
enum ChainOp {
    /// (value, parent value or none, the kids it comes with: an index into `KIDS`).
    Insert(u8, Option<u8>, usize),
    AddKid(u8),
    DropKid(u8),
    Take(u8),
    Touch(u8),
    PopTail,
}

/// Counts around the u16 a link holds, so that some cross into the side map and back.
const KIDS: [u32; 6] = [0, 1, 2, 65_534, 65_535, 70_000];

fn arb_chain_op() -> impl Strategy<Value = ChainOp> {
    prop_oneof![
        4 => (0u8..24, proptest::option::of(0u8..24), 0..KIDS.len())
            .prop_map(|(v, p, k)| ChainOp::Insert(v, p, k)),
        3 => (0u8..24).prop_map(ChainOp::AddKid),
        3 => (0u8..24).prop_map(ChainOp::DropKid),
        1 => (0u8..24).prop_map(ChainOp::Take),
        1 => (0u8..24).prop_map(ChainOp::Touch),
        2 => Just(ChainOp::PopTail),
    ]
}

/// The chain model: per value (parent, kids), and the two lists in LRU order.
#[derive(Default)]
struct ChainModel {
    links: std::collections::HashMap<u8, (Option<u8>, u32)>,
    tails: std::collections::VecDeque<u8>,
    inner: std::collections::VecDeque<u8>,
}

impl ChainModel {
    fn unlink(&mut self, v: u8) {
        self.tails.retain(|&x| x != v);
        self.inner.retain(|&x| x != v);
    }

    fn set_kids(&mut self, v: u8, kids: u32, front: bool) {
        let was = self.links[&v].1;
        if let Some(l) = self.links.get_mut(&v) {
            l.1 = kids;
        }
        if (was == 0) != (kids == 0) {
            self.unlink(v);
            let list = if kids == 0 { &mut self.tails } else { &mut self.inner };
            if front {
                list.push_front(v)
            } else {
                list.push_back(v)
            }
        }
    }

    /// True when a child was taken off `v` (it is here with one).
    fn drop_kid(&mut self, v: u8) -> bool {
        match self.links.get(&v) {
            Some(&(_, k)) if k > 0 => {
                self.set_kids(v, k - 1, true);
                true
            }
            _ => false,
        }
    }
}

proptest! {
    /// Chain links (parents, counts past a u16, the two lists) against a model.
    #[test]
    fn chains_match_a_model(ops in proptest::collection::vec(arb_chain_op(), 0..120)) {
        let mut s = BlockSet::with_chains();
        let mut m = ChainModel::default();
        let dv = |v: u8| d(u32::from(v));
        let name = |p: Option<u8>| p.map_or(NO_PARENT, |p| parent_name(&dv(p)));
        for op in ops {
            match op {
                ChainOp::Insert(v, p, k) => {
                    let new = !m.links.contains_key(&v);
                    if new {
                        m.links.insert(v, (p, KIDS[k]));
                        if KIDS[k] == 0 { m.tails.push_back(v) } else { m.inner.push_back(v) }
                    }
                    prop_assert_eq!(s.insert_chained(dv(v), name(p), KIDS[k]), Ok(new));
                }
                ChainOp::AddKid(v) => {
                    let here = m.links.get(&v).map(|l| l.1);
                    if let Some(k) = here { m.set_kids(v, k + 1, false); }
                    prop_assert_eq!(s.add_kid(&parent_name(&dv(v))), here.is_some());
                }
                ChainOp::DropKid(v) => prop_assert_eq!(s.drop_kid(&parent_name(&dv(v))), m.drop_kid(v)),
                ChainOp::Take(v) => {
                    let want = m.links.remove(&v).map(|(p, k)| (name(p), k));
                    m.unlink(v);
                    prop_assert_eq!(s.take_chained(&dv(v)), want);
                }
                ChainOp::Touch(v) => {
                    if let Some(&(_, k)) = m.links.get(&v) {
                        m.unlink(v);
                        if k == 0 { m.tails.push_back(v) } else { m.inner.push_back(v) }
                    }
                    prop_assert_eq!(s.touch(&dv(v)), m.links.contains_key(&v));
                }
                ChainOp::PopTail => {
                    let want = m.tails.pop_front().map(|v| {
                        let (p, _) = m.links.remove(&v).unwrap_or_default();
                        let here = p.is_some_and(|p| m.drop_kid(p));
                        (dv(v), name(p), here)
                    });
                    prop_assert_eq!(s.pop_tail(), want);
                }
            }
            let listed: Vec<Digest> = m.tails.iter().chain(&m.inner).map(|&v| dv(v)).collect();
            prop_assert_eq!(order(&s), listed);
            for v in 0u8..24 {
                prop_assert_eq!(s.kids(&dv(v)), m.links.get(&v).map(|l| l.1));
            }
            let big = m.links.values().filter(|l| l.1 >= 65_535).count();
            prop_assert_eq!(s.many_kids.len(), big, "the side map holds exactly the big counts");
        }
    }
}
