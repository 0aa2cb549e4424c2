//! From what the Service maps hold to what they should hold: the writes, in
//! an order the programs can follow, with ids that stay the same for as long
//! as what they name does (the sockets' sticky and affinity records name
//! backend ids: a backend that stays keeps its id, so a client stays on it).

use std::collections::BTreeMap;

use super::ServiceEntry;
use crate::abi::SvcAddr;

/// What one frontend should choose among.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Want {
    /// `SVC_AFFINITY` or 0.
    pub flags: u32,
    /// Seconds of ClientIP affinity.
    pub affinity_timeout: u32,
    /// Its ready backends (duplicates ignored).
    pub backends: Vec<SvcAddr>,
}

/// One write of a sync.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `Services::set_service(entry, old)`.
    Set {
        /// The new state.
        entry: ServiceEntry,
        /// What was written before, if anything.
        old: Option<ServiceEntry>,
    },
    /// `Services::remove_service`.
    Remove(ServiceEntry),
}

/// The next free service and backend ids: one past the highest in use.
/// Ids are not reused while any record may still name them; after 2^32
/// allocations the ids run out and a sync fails (`None`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ids {
    next_service: u32,
    next_backend: u32,
}

impl Ids {
    /// Past every id `written` holds.
    pub fn after(written: &BTreeMap<SvcAddr, ServiceEntry>) -> Self {
        let next =
            |ids: &mut dyn Iterator<Item = u32>| ids.max().map_or(1, |m| m.saturating_add(1));
        Self {
            next_service: next(&mut written.values().map(|e| e.id)),
            next_backend: next(
                &mut written
                    .values()
                    .flat_map(|e| e.backends.iter().map(|b| b.0)),
            ),
        }
    }

    fn take(next: &mut u32) -> Option<u32> {
        let id = *next;
        *next = next.checked_add(1)?;
        Some(id)
    }
}

/// The writes that take the maps from `written` to `want`: frontends that
/// are new or changed are set (their backends keeping their ids and slots
/// in their old order, new ones appended), frontends no longer wanted are
/// removed. `None` when the ids ran out.
pub fn plan(
    written: &BTreeMap<SvcAddr, ServiceEntry>,
    want: &BTreeMap<SvcAddr, Want>,
    ids: &mut Ids,
) -> Option<Vec<Op>> {
    let mut ops = Vec::new();
    for (fe, w) in want {
        let old = written.get(fe);
        let id = match old {
            Some(o) => o.id,
            None => Ids::take(&mut ids.next_service)?,
        };
        let mut backends: Vec<(u32, SvcAddr)> = old
            .map(|o| {
                o.backends
                    .iter()
                    .filter(|(_, b)| w.backends.contains(b))
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        for b in &w.backends {
            if !backends.iter().any(|(_, have)| have == b) {
                backends.push((Ids::take(&mut ids.next_backend)?, *b));
            }
        }
        let entry = ServiceEntry {
            frontend: *fe,
            id,
            flags: w.flags,
            affinity_timeout: w.affinity_timeout,
            backends,
        };
        if old != Some(&entry) {
            ops.push(Op::Set {
                entry,
                old: old.cloned(),
            });
        }
    }
    for (fe, o) in written {
        if !want.contains_key(fe) {
            ops.push(Op::Remove(o.clone()));
        }
    }
    Some(ops)
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;

    fn a(s: &str) -> SvcAddr {
        SvcAddr::new(s.parse::<SocketAddr>().expect("an address"), 6)
    }

    fn apply(written: &mut BTreeMap<SvcAddr, ServiceEntry>, ops: &[Op]) {
        for op in ops {
            match op {
                Op::Set { entry, .. } => {
                    written.insert(entry.frontend, entry.clone());
                }
                Op::Remove(e) => {
                    written.remove(&e.frontend);
                }
            }
        }
    }

    #[test]
    fn backends_that_stay_keep_their_ids_and_new_ones_get_fresh_ones() {
        let fe = a("10.96.0.10:80");
        let mut written = BTreeMap::new();
        let mut ids = Ids::after(&written);
        let want = |bs: &[&str]| {
            BTreeMap::from([(
                fe,
                Want {
                    backends: bs.iter().map(|b| a(b)).collect(),
                    ..Want::default()
                },
            )])
        };
        let ops = plan(
            &written,
            &want(&["10.0.0.1:8080", "10.0.0.2:8080"]),
            &mut ids,
        )
        .expect("ids");
        apply(&mut written, &ops);
        let first = written[&fe].clone();
        assert_eq!(first.backends.len(), 2);

        let ops = plan(
            &written,
            &want(&["10.0.0.2:8080", "10.0.0.3:8080"]),
            &mut ids,
        )
        .expect("ids");
        assert!(matches!(&ops[..], [Op::Set { old: Some(o), .. }] if *o == first));
        apply(&mut written, &ops);
        let now = &written[&fe];
        assert_eq!(now.id, first.id, "the service keeps its id");
        assert_eq!(
            now.backends[0], first.backends[1],
            "10.0.0.2 keeps its id, first slot now"
        );
        assert!(
            first
                .backends
                .iter()
                .all(|(id, _)| *id != now.backends[1].0),
            "10.0.0.3 gets an id never used: no record of 10.0.0.1 can name it"
        );

        // Nothing changed: nothing written.
        let same = want(&["10.0.0.2:8080", "10.0.0.3:8080"]);
        assert_eq!(plan(&written, &same, &mut ids), Some(vec![]));
    }

    #[test]
    fn ids_continue_past_the_written_ones_after_a_restart_and_removed_frontends_go() {
        let mut written = BTreeMap::new();
        let mut ids = Ids::after(&written);
        let two = BTreeMap::from([
            (
                a("10.96.0.10:80"),
                Want {
                    backends: vec![a("10.0.0.1:80")],
                    ..Want::default()
                },
            ),
            (
                a("10.96.0.11:80"),
                Want {
                    backends: vec![a("10.0.0.2:80")],
                    ..Want::default()
                },
            ),
        ]);
        let ops = plan(&written, &two, &mut ids).expect("ids");
        apply(&mut written, &ops);
        // A restarted agent reads the maps back and starts after their ids.
        let mut again = Ids::after(&written);
        assert_eq!(again, ids);
        let one = BTreeMap::from([(
            a("10.96.0.12:80"),
            Want {
                backends: vec![a("10.0.0.1:80")],
                ..Want::default()
            },
        )]);
        let ops = plan(&written, &one, &mut again).expect("ids");
        let removed: Vec<_> = ops
            .iter()
            .filter_map(|o| match o {
                Op::Remove(e) => Some(e.frontend),
                Op::Set { .. } => None,
            })
            .collect();
        assert_eq!(removed, vec![a("10.96.0.10:80"), a("10.96.0.11:80")]);
        let set = ops.iter().find_map(|o| match o {
            Op::Set { entry, .. } => Some(entry),
            Op::Remove(_) => None,
        });
        let set = set.expect("the new frontend");
        assert!(written
            .values()
            .all(|e| e.id != set.id && e.backends[0].0 != set.backends[0].0));
    }
}
