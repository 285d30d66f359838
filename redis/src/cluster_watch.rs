//! A Redis Cluster's failovers, as the agent sees them: every [`WATCH_EVERY`] it reads a node's
//! `CLUSTER NODES` and notes each slot whose master changed to one of that master's replicas (a
//! failover; a slot moved to another master is a reshard, which loses nothing). The agent then writes
//! what it admitted lately for keys on those slots into their new master, which may lack what the old
//! one had not replicated (docs/accuracy.md, "Cluster failover"). A node's view may lag the others':
//! a slot changes owner only for a higher config epoch, as Redis itself decides.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::cluster_async::ClusterConnection;

/// How often the slot map is read: a failover is noticed within this much of the node that
/// answers learning it.
pub const WATCH_EVERY: Duration = Duration::from_millis(250);

/// Slots in a Redis Cluster.
pub const SLOTS: usize = 16_384;

/// The watch's findings, shared with the store.
#[derive(Default)]
pub struct ClusterWatch {
    /// Whether this connection's owner wants failovers watched (the store does; the events' writer
    /// does not).
    wanted: AtomicBool,
    started: AtomicBool,
    failovers: AtomicU64,
    /// Slots failed over since the store last took them, one bit each.
    failed: Mutex<Vec<u64>>,
}

impl ClusterWatch {
    /// Asks for the watch: [`start`](Self::start) starts it.
    pub fn want(&self) {
        self.wanted.store(true, Ordering::Relaxed);
    }

    /// Starts watching through `conn` if it is wanted (once; the task ends when the watch is
    /// dropped).
    pub fn start(self: &Arc<Self>, conn: ClusterConnection) {
        if self.wanted.load(Ordering::Relaxed) && !self.started.swap(true, Ordering::Relaxed) {
            tokio::spawn(watch(Arc::downgrade(self), conn));
        }
    }

    /// Failovers seen so far (a slot map in which some slot's master is its old master's replica).
    pub fn failovers(&self) -> u64 {
        self.failovers.load(Ordering::Relaxed)
    }

    /// The slots failed over since the last call (one bit each, [`SLOTS`] bits), cleared.
    pub fn take_failed(&self) -> Vec<u64> {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::replace(&mut *failed, vec![0; SLOTS / 64])
    }

    fn note(&self, slots: &[u16]) {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        failed.resize(SLOTS / 64, 0);
        for &s in slots {
            failed[usize::from(s) / 64] |= 1 << (s % 64);
        }
        drop(failed);
        self.failovers.fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether `slot` is set in a [`ClusterWatch::take_failed`] set.
pub fn has_slot(set: &[u64], slot: u16) -> bool {
    set.get(usize::from(slot) / 64)
        .is_some_and(|w| w & (1 << (slot % 64)) != 0)
}

/// A key's Cluster slot: CRC16 (XMODEM) of its hash tag, or of the whole key if it has none.
pub fn slot_of(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &bytes[open + 1..];
        rest.iter()
            .position(|&b| b == b'}')
            .filter(|&close| close > 0)
            .map(|close| &rest[..close])
    });
    crc16::State::<crc16::XMODEM>::calculate(tagged.unwrap_or(bytes)) % SLOTS as u16
}

/// Each slot's master as one node's `CLUSTER NODES` has it: (node id, its config epoch), and each
/// node's master (for a replica).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SlotMap {
    owner: Vec<Option<(Arc<str>, u64)>>,
    replica_of: std::collections::HashMap<Arc<str>, Arc<str>>,
}

impl SlotMap {
    /// Reads `CLUSTER NODES`' text; lines it does not understand are skipped.
    pub fn parse(text: &str) -> Self {
        let mut map = SlotMap {
            owner: vec![None; SLOTS],
            replica_of: Default::default(),
        };
        for line in text.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [id, _addr, flags, master, _ping, _pong, epoch, _link, slots @ ..] = fields.as_slice() else {
                continue;
            };
            let id: Arc<str> = Arc::from(*id);
            if (flags.split(',').any(|f| f == "slave" || f == "replica")) && *master != "-" {
                map.replica_of.insert(id.clone(), Arc::from(*master));
            }
            let flag = |name: &str| flags.split(',').any(|f| f == name);
            if !flag("master") || flag("fail") || flag("fail?") {
                continue;
            }
            let Ok(epoch) = epoch.parse::<u64>() else { continue };
            for range in slots {
                // `[slot->-id]` and `[slot-<-id]`: a slot moving; its owner is on another line.
                if range.starts_with('[') {
                    continue;
                }
                let (from, to) = range.split_once('-').unwrap_or((range, range));
                let (Ok(from), Ok(to)) = (from.parse::<usize>(), to.parse::<usize>()) else {
                    continue;
                };
                for s in from..=to.min(SLOTS - 1) {
                    map.owner[s] = Some((id.clone(), epoch));
                }
            }
        }
        map
    }

    /// Takes `next` in where it is newer (per slot, a higher config epoch), and returns the slots
    /// whose new master was a replica of the old one: failed over.
    pub fn update(&mut self, next: &SlotMap) -> Vec<u16> {
        let mut failed = Vec::new();
        if self.owner.len() != SLOTS {
            *self = next.clone();
            return failed;
        }
        for (s, new) in next.owner.iter().enumerate() {
            let Some((new_id, new_epoch)) = new else { continue };
            match &self.owner[s] {
                Some((old_id, old_epoch)) if old_id == new_id || old_epoch >= new_epoch => continue,
                // Only a replica of the old master as the previous map had it: a master emptied by a
                // reshard turns replica of the node that took its last slot, which must not read
                // as a failover (it lost nothing).
                Some((old_id, _)) if self.replica_of.get(new_id).is_some_and(|m| m == old_id) => {
                    failed.push(s as u16);
                }
                Some(_) | None => {}
            }
            self.owner[s] = Some((new_id.clone(), *new_epoch));
        }
        for (replica, master) in &next.replica_of {
            self.replica_of.insert(replica.clone(), master.clone());
        }
        failed
    }
}

/// Reads the slot map every [`WATCH_EVERY`]; a failover's slots are noted for the store.
async fn watch(watch: Weak<ClusterWatch>, mut conn: ClusterConnection) {
    let mut map = SlotMap::default();
    let mut last = String::new();
    let mut tick = tokio::time::interval(WATCH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if watch.strong_count() == 0 {
            return;
        }
        let asked = tokio::time::timeout(
            Duration::from_millis(500),
            redis::cmd("CLUSTER")
                .arg("NODES")
                .query_async::<String>(&mut conn),
        )
        .await;
        let Ok(Ok(text)) = asked else { continue };
        // Most reads find the map as it was (only the ping and pong times move): nothing to parse.
        let now = shape(&text);
        if now == last {
            continue;
        }
        last = now;
        let failed = map.update(&SlotMap::parse(&text));
        if failed.is_empty() {
            continue;
        }
        let Some(w) = watch.upgrade() else { return };
        tracing::warn!(
            slots = failed.len(),
            "a Redis Cluster replica took over its master's slots: writing this agent's recent admissions on them again"
        );
        w.note(&failed);
    }
}

/// `CLUSTER NODES` without what differs from read to read of one map (the ping and pong times, the
/// link state, which node answered: its `myself` flag and its order of lines): each node's id,
/// flags, master, config epoch and slots.
fn shape(text: &str) -> String {
    let mut lines: Vec<String> = text
        .lines()
        .map(|line| {
            let mut out = String::with_capacity(line.len());
            for (i, field) in line.split_whitespace().enumerate() {
                match i {
                    1 | 4 | 5 | 7 => continue,
                    2 => out.push_str(field.trim_start_matches("myself,")),
                    _ => out.push_str(field),
                }
                out.push(' ');
            }
            out
        })
        .collect();
    lines.sort_unstable();
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = "\
a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
b1 127.0.0.1:7001@17001 master - 0 0 2 connected 5461-10922
c1 127.0.0.1:7002@17002 master - 0 0 3 connected 10923-16383
a2 127.0.0.1:7003@17003 slave a1 0 0 1 connected
b2 127.0.0.1:7004@17004 slave b1 0 0 2 connected
";

    #[test]
    fn a_replica_taking_its_masters_slots_is_a_failover_and_a_reshard_is_not() {
        let mut map = SlotMap::default();
        assert!(
            map.update(&SlotMap::parse(BEFORE)).is_empty(),
            "the first map is only learned"
        );
        // b2 takes over b1's slots (epoch 7); c1 takes slots 0-99 from a1 (a reshard, epoch 8).
        let after = "\
a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 100-5460
b1 127.0.0.1:7001@17001 slave b2 0 0 2 connected
c1 127.0.0.1:7002@17002 master - 0 0 8 connected 0-99 10923-16383
a2 127.0.0.1:7003@17003 slave a1 0 0 1 connected
b2 127.0.0.1:7004@17004 master - 0 0 7 connected 5461-10922
";
        let failed = map.update(&SlotMap::parse(after));
        assert_eq!(failed.len(), 5462);
        assert_eq!((failed[0], failed[failed.len() - 1]), (5461, 10922));
        // A node that has not heard of it yet (b1 master again at its old epoch) changes nothing.
        assert!(map.update(&SlotMap::parse(BEFORE)).is_empty());
        // b1 failing back (a higher epoch) is a failover again.
        let back = after
            .replace(
                "b1 127.0.0.1:7001@17001 slave b2 0 0 2 connected",
                "b1 127.0.0.1:7001@17001 master - 0 0 9 connected 5461-10922",
            )
            .replace(
                "b2 127.0.0.1:7004@17004 master - 0 0 7 connected 5461-10922",
                "b2 127.0.0.1:7004@17004 slave b1 0 0 7 connected",
            );
        assert_eq!(map.update(&SlotMap::parse(&back)).len(), 5462);
    }

    #[test]
    fn a_master_emptied_by_a_reshard_is_no_failover() {
        let mut map = SlotMap::default();
        map.update(&SlotMap::parse(BEFORE));
        // c1's slots all moved to b1 (epoch 8); c1, empty, turned replica of b1.
        let after = BEFORE
            .replace("5461-10922", "5461-16383")
            .replace(" 0 0 2 connected 5461", " 0 0 8 connected 5461")
            .replace(
                "c1 127.0.0.1:7002@17002 master - 0 0 3 connected 10923-16383",
                "c1 127.0.0.1:7002@17002 slave b1 0 0 3 connected",
            );
        let failed = map.update(&SlotMap::parse(&after));
        assert!(failed.is_empty(), "{} slots", failed.len());
        assert_eq!(
            map.owner[16_383].as_ref().map(|(id, _)| &**id),
            Some("b1"),
            "the move is learned"
        );
    }

    #[test]
    fn a_read_that_changed_only_ping_times_has_the_same_shape() {
        let later = BEFORE.replace(" 0 0 2 connected", " 1733600000000 1733600000123 2 connected");
        assert_eq!(shape(BEFORE), shape(&later));
        // Another node's answer: its own `myself`, its lines in another order.
        let other: Vec<&str> = BEFORE.lines().rev().collect();
        let other =
            other
                .join("\n")
                .replace("myself,master", "master")
                .replacen(" master -", " myself,master -", 1);
        assert_eq!(shape(BEFORE), shape(&other));
        assert_ne!(shape(BEFORE), shape(&BEFORE.replace("5461-10922", "5462-10922")));
        assert_ne!(shape(BEFORE), shape(&BEFORE.replace("slave b1", "slave a1")));
    }

    #[test]
    fn slots_are_redis_clusters() {
        // Redis's own answers (`CLUSTER KEYSLOT`).
        assert_eq!(slot_of("foo"), 12182);
        assert_eq!(slot_of("somekey"), 11058);
        assert_eq!(slot_of("fg:{7}:api/1543:w0"), slot_of("7"));
        assert_eq!(slot_of("{user1000}.following"), slot_of("user1000"));
        assert_ne!(
            slot_of("foo{}{bar}"),
            slot_of("bar"),
            "an empty first tag: the whole key"
        );
        let watch = ClusterWatch::default();
        watch.note(&[0, 63, 64, 16_383]);
        let set = watch.take_failed();
        assert!([0, 63, 64, 16_383].iter().all(|&s| has_slot(&set, s)));
        assert!(!has_slot(&set, 1) && !has_slot(&watch.take_failed(), 0));
        assert_eq!(watch.failovers(), 1);
    }
}
