//! The batched counters of one rule shard: a slab of (key, counter) slots in insertion order and a
//! hash index of slot numbers. Per key: the 64-byte slot (a 24-byte inline key, the 40-byte counter),
//! written in order so only used pages are resident, plus a 4-byte index entry (and its control
//! byte) at the index's load factor: ~75 B, where a plain `HashMap` of the same slots costs 64 B per
//! bucket at a load factor that swings from 44 % to 87 % (up to ~150 B per key).

use std::hash::{BuildHasher, RandomState};

use compact_str::CompactString;
use hashbrown::HashTable;

use super::counter::Counter;

struct Slot {
    key: CompactString,
    counter: Counter,
}

/// Counters by client key. The hash is seeded per process: client-supplied keys cannot be crafted to
/// collide.
pub struct CounterMap {
    index: HashTable<u32>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    hasher: RandomState,
}

impl Default for CounterMap {
    fn default() -> Self {
        CounterMap {
            index: HashTable::new(),
            slots: Vec::new(),
            free: Vec::new(),
            hasher: RandomState::new(),
        }
    }
}

impl CounterMap {
    /// Keys held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The counter of `key`, if tracked.
    pub fn get_mut(&mut self, key: &str) -> Option<&mut Counter> {
        let hash = self.hash(key);
        let slots = &self.slots;
        let i = *self.index.find(hash, |&i| slots[i as usize].key == key)?;
        Some(&mut self.slots[i as usize].counter)
    }

    /// The counter of `key`, created empty if new; and whether it was new.
    pub fn get_or_insert(&mut self, key: &str) -> (&mut Counter, bool) {
        let hash = self.hash(key);
        let slots = &self.slots;
        if let Some(&i) = self.index.find(hash, |&i| slots[i as usize].key == key) {
            return (&mut self.slots[i as usize].counter, false);
        }
        let slot = Slot {
            key: CompactString::from(key),
            counter: Counter::default(),
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.index
            .insert_unique(hash, i, |&j| hasher.hash_one(slots[j as usize].key.as_str()));
        (&mut self.slots[i as usize].counter, true)
    }

    /// Keeps the counters `keep` says yes to; returns how many were dropped.
    pub fn retain(&mut self, mut keep: impl FnMut(&Counter) -> bool) -> usize {
        let before = self.index.len();
        let (slots, free) = (&mut self.slots, &mut self.free);
        self.index.retain(|&mut i| {
            let slot = &mut slots[i as usize];
            if keep(&slot.counter) {
                return true;
            }
            slot.key = CompactString::default();
            slot.counter = Counter::default();
            free.push(i);
            false
        });
        if self.is_empty() {
            // Give the memory back once a burst of keys is gone.
            self.slots = Vec::new();
            self.free = Vec::new();
            self.index = HashTable::new();
        }
        before - self.index.len()
    }

    /// Every (key, counter), in slot order. Free slots have an empty key, which no client key is
    /// (the protocol refuses empty keys; attribute keys carry a prefix).
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&str, &mut Counter)> {
        self.slots
            .iter_mut()
            .filter(|s| !s.key.is_empty())
            .map(|s| (s.key.as_str(), &mut s.counter))
    }

    /// Every counter.
    pub fn values(&self) -> impl Iterator<Item = &Counter> {
        self.index.iter().map(|&i| &self.slots[i as usize].counter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inserts_finds_and_reuses_slots() {
        let mut m = CounterMap::default();
        for i in 0..1_000 {
            let (c, new) = m.get_or_insert(&format!("user:{i}"));
            assert!(new);
            c.window = i;
        }
        assert_eq!(m.len(), 1_000);
        assert_eq!(m.get_mut("user:7").unwrap().window, 7);
        assert!(!m.get_or_insert("user:7").1);
        assert_eq!(m.retain(|c| c.window % 2 == 0), 500);
        assert!(m.get_mut("user:7").is_none());
        assert_eq!(m.get_mut("user:8").unwrap().window, 8);
        assert_eq!(m.iter_mut().count(), 500);
        // Freed slots are reused before the slab grows.
        let slab = m.slots.len();
        for i in 0..500 {
            m.get_or_insert(&format!("new:{i}"));
        }
        assert_eq!(m.slots.len(), slab);
        assert_eq!(m.values().count(), 1_000);
        m.retain(|_| false);
        assert!(m.is_empty());
    }
}
