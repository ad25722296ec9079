//! Maps and sets keyed by identifiers the broker makes itself (lease, session and waiter
//! ids, tickets), hashed with foldhash (seeded per process) rather than the standard
//! library's SipHash. A client can look such a key up but never chooses one that goes in,
//! so SipHash's defence against chosen colliding keys buys nothing here, and a lookup
//! costs a fraction of SipHash's (a pooled acquire and release make about a dozen).
//! Maps keyed by names (tenants) keep the standard hasher.

/// A hash map keyed by a broker-made id.
pub type IdMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A hash set of broker-made ids.
pub type IdSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_go_in_and_come_out() {
        let ids: Vec<uuid::Uuid> = (0..1000).map(|_| uuid::Uuid::new_v4()).collect();
        let mut m: IdMap<uuid::Uuid, usize> = IdMap::default();
        let mut s: IdSet<uuid::Uuid> = IdSet::default();
        for (i, id) in ids.iter().enumerate() {
            m.insert(*id, i);
            s.insert(*id);
        }
        assert_eq!(m.len(), 1000);
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(m.get(id), Some(&i));
            assert!(s.remove(id));
        }
        assert!(s.is_empty());
        assert!(!m.contains_key(&uuid::Uuid::new_v4()));
    }
}
